"""The retry policy and the tenacity machinery built from it."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import httpx
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    stop_before_delay,
    wait_random_exponential,
)

# 408 and 429 ask the client to come back later; every 5xx may be a restarting engine.
RETRYABLE_STATUS = frozenset({408, 429})


@dataclass(frozen=True)
class RetryPolicy:
    """How one HTTP request (one image prime, one render, one generate) is retried.

    Sleeps between attempts are "full jitter": uniform in
    ``[0, min(max_backoff, backoff * 2 ** (attempt - 1))]``, so many clients that failed
    together do not retry together. Connection errors, timeouts, 5xx, 408 and 429 are
    retried; any other 4xx fails at once. A request that is not idempotent (generate) is
    retried only when it never reached the server (its connection could not be opened). The
    defaults sleep about a minute in all before giving up, like Vime's 60 tries 1 s apart,
    and cap every request at ten minutes.
    """

    max_attempts: int = 20
    backoff: float = 0.25
    """Upper bound of the first sleep, in seconds; doubles with each attempt."""
    max_backoff: float = 8.0
    attempt_timeout: float = 300.0
    """Wall-clock limit of one attempt (connect, send, wait, read), in seconds."""
    connect_timeout: float = 5.0
    """Limit for opening a connection: a dead pod IP often drops packets silently."""
    deadline: float = 600.0
    """Limit for the whole request including retries and waiting for a free slot."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        for name in ("backoff", "max_backoff"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        for name in ("attempt_timeout", "connect_timeout", "deadline"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


class RetryableStatus(Exception):
    """An HTTP answer worth another attempt (5xx, 408, 429)."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        super().__init__(response.status_code)


# Transient transport failures. Not all of httpx.TransportError: a bad URL scheme
# (UnsupportedProtocol) will not fix itself.
RETRYABLE_ERRORS = (
    httpx.TimeoutException,
    httpx.NetworkError,
    httpx.RemoteProtocolError,
    TimeoutError,  # asyncio.timeout around one attempt
    RetryableStatus,
)

# Failures that prove the request never reached the server: the only ones a request that is
# not idempotent (generate) is retried on. A timeout or a lost answer may hide a request that
# runs, and a second one would generate twice.
UNSENT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def retrying(policy: RetryPolicy, retry_on: tuple[type[BaseException], ...] = RETRYABLE_ERRORS) -> AsyncRetrying:
    """A fresh controller for one request (AsyncRetrying keeps per-iteration state)."""
    return AsyncRetrying(
        stop=stop_after_attempt(policy.max_attempts) | stop_before_delay(policy.deadline),
        wait=wait_random_exponential(multiplier=policy.backoff, max=policy.max_backoff),
        retry=retry_if_exception(lambda exc: isinstance(exc, retry_on) and not _certificate_refused(exc)),
        reraise=True,
    )


def _certificate_refused(exc: BaseException) -> bool:
    """A TLS certificate that failed verification (httpx raises ConnectError): it will fail
    the same way on every attempt."""
    while exc is not None:
        if isinstance(exc, ssl.SSLCertVerificationError):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]  # the chain ends in None, which ends the loop
    return False
