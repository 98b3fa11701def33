"""Pooled HTTP with bounded concurrency, and the retry loop around each request."""

from __future__ import annotations

import asyncio
import functools
import ssl
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from ._errors import InvalidResponseError, RequestError
from ._retry import RETRYABLE_ERRORS, RETRYABLE_STATUS, UNSENT_ERRORS, RetryableStatus, RetryPolicy, retrying

Verify = bool | str | ssl.SSLContext
"""TLS verification as httpx takes it: True (the system's CA bundle), False (none, for test
clusters only), a CA bundle's path, or an SSLContext (client certificates, pinned CAs)."""


@functools.cache
def _ssl_context(cafile: str | None = None) -> ssl.SSLContext:
    # httpx builds a new context per client by default, which costs 20-80 ms (it loads the
    # CA bundle); short-lived clients made by prime_encoder(args, ...) share this one.
    return ssl.create_default_context(cafile=cafile)


def _ssl_verify(verify: Verify) -> ssl.SSLContext | bool:
    if verify is True:
        return _ssl_context()
    if isinstance(verify, str):
        return _ssl_context(verify)
    return verify


@dataclass(frozen=True)
class Connection:
    """What every request of a client carries, and how its TLS is checked."""

    api_key: str | None = field(default=None, repr=False)
    headers: Mapping[str, str] | None = field(default=None, repr=False)
    verify: Verify = True

    def all_headers(self) -> dict[str, str] | None:
        if self.api_key is None:
            return dict(self.headers) if self.headers else None
        given = {k.lower() for k in self.headers or {}}
        auth = {} if "authorization" in given else {"Authorization": f"Bearer {self.api_key}"}
        return {**auth, **(self.headers or {})}

    def options(self) -> dict[str, Any]:
        """The keyword arguments that differ from EPDClient's defaults."""
        defaults = Connection()
        return {
            name: getattr(self, name)
            for name in ("api_key", "headers", "verify")
            if getattr(self, name) is not getattr(defaults, name)
        }


AttemptHook = Callable[[str, bool], None]
"""Told of each attempt's end: the server's base URL, and whether the server failed it (no
answer in time, a connection error, a 5xx, an answer cut off). Any other answer, a 4xx, 408
or 429 included, is the server answering."""

# httpcore scans every connection of a pool on each request and response, so one pool
# with 64 connections costs ~3x the CPU per request of pools of 8 (docs/performance.md).
_POOL_SIZE = 8


class _Pool:
    __slots__ = ("client", "load")

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.load = 0


class Transport:
    def __init__(
        self,
        policy: RetryPolicy,
        max_concurrency: int,
        connection: Connection | None = None,
        on_attempt: AttemptHook | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        connection = connection or Connection()
        self.policy = policy
        self._on_attempt = on_attempt
        self._headers = connection.all_headers()
        self._verify = _ssl_verify(connection.verify)
        # The semaphore bounds concurrency, not the pools: it is released during backoff
        # sleeps, and a waiting request counts against its deadline, not its attempt timeout.
        self._slots = asyncio.Semaphore(max_concurrency)
        # Small pools per base URL, added as load grows; never more than the semaphore
        # lets through, so a request never queues inside httpcore.
        self._pools: dict[str, list[_Pool]] = {}

    async def aclose(self) -> None:
        pools = [pool for pools in self._pools.values() for pool in pools]
        self._pools.clear()
        for pool in pools:
            await pool.client.aclose()

    def _pool(self, base_url: str) -> _Pool:
        pools = self._pools.setdefault(base_url, [])
        pool = min(pools, key=lambda p: p.load, default=None)
        if pool is None or pool.load >= _POOL_SIZE:
            pool = _Pool(
                httpx.AsyncClient(
                    headers=self._headers,
                    verify=self._verify,
                    timeout=httpx.Timeout(None, connect=self.policy.connect_timeout),
                    limits=httpx.Limits(max_connections=_POOL_SIZE, max_keepalive_connections=_POOL_SIZE),
                )
            )
            pools.append(pool)
        return pool

    async def post(
        self,
        urls: Sequence[str],
        path: str,
        body: Any,
        *,
        first: int = 0,
        headers: Mapping[str, str] | None = None,
        idempotent: bool = True,
    ) -> httpx.Response:
        """POST ``body`` as JSON to ``urls[first] + path``; each retry moves to the next URL.

        ``headers`` go with this request only. Each attempt has an ``x-request-id`` of its own
        (one that timed out may still run on the engine); an ``x-request-id`` among ``headers``
        is kept as its prefix, so the attempts can be traced to the request they serve. A
        request that is not ``idempotent`` is retried only when it was never sent.

        Raises RequestError once the request cannot succeed; InvalidResponseError when the
        answer's body was cut off.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.policy.deadline
        tried: list[str] = []
        retry_on = (*RETRYABLE_ERRORS, _CutOff) if idempotent else UNSENT_ERRORS
        try:
            async for attempt in retrying(self.policy, retry_on):
                with attempt:
                    url = urls[(first + attempt.retry_state.attempt_number - 1) % len(urls)]
                    tried.append(url)
                    try:
                        response = await self._attempt(url, path, body, deadline, headers)
                    except Exception as exc:
                        self._attempted(url, exc)
                        raise
                    self._attempted(url, None)
                    return response
        except (RetryableStatus, _FatalStatus) as exc:
            raise _request_error(path, tried, exc.response) from exc
        except _CutOff as exc:
            raise InvalidResponseError(
                path, tried, attempts=len(tried), reason=str(exc), status_code=exc.status_code
            ) from exc
        except _DeadlineExceeded as exc:
            raise RequestError(path, tried, attempts=len(tried), reason=str(exc)) from exc
        except TimeoutError as exc:
            raise RequestError(path, tried, attempts=len(tried), reason="timed out") from exc
        except httpx.HTTPError as exc:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise RequestError(path, tried, attempts=len(tried), reason=reason) from exc
        raise AssertionError("unreachable: tenacity either returns or reraises")

    def _attempted(self, url: str, error: Exception | None) -> None:
        if self._on_attempt is None or isinstance(error, _DeadlineExceeded):  # the server was never asked
            return
        if isinstance(error, RetryableStatus | _FatalStatus):
            failed = error.response.status_code >= 500
        else:
            failed = error is not None  # no answer: timed out, no connection, cut off
        self._on_attempt(url, failed)

    async def _attempt(
        self, base_url: str, path: str, body: Any, deadline: float, headers: Mapping[str, str] | None
    ) -> httpx.Response:
        try:
            # Waiting for a slot is bounded by the deadline too: the requests holding the slots
            # may have started later, with later deadlines, while this one backed off.
            async with asyncio.timeout_at(deadline):
                await self._slots.acquire()
        except TimeoutError:
            raise _DeadlineExceeded(f"deadline of {self.policy.deadline} s passed") from None
        try:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise _DeadlineExceeded(f"deadline of {self.policy.deadline} s passed")
            pool = self._pool(base_url)
            pool.load += 1
            try:
                async with asyncio.timeout(min(self.policy.attempt_timeout, remaining)):
                    request = pool.client.build_request(
                        "POST", base_url + path, json=body, headers=_with_request_id(headers)
                    )
                    # Streamed, so a body cut off after the status line is told apart from
                    # a request that failed before any answer.
                    response = await pool.client.send(request, stream=True)
                    try:
                        await response.aread()
                    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                        raise _CutOff(response.status_code, exc) from exc
                    finally:
                        await response.aclose()
            finally:
                pool.load -= 1
        finally:
            self._slots.release()
        if response.status_code >= 500 or response.status_code in RETRYABLE_STATUS:
            raise RetryableStatus(response)
        if response.is_error:
            raise _FatalStatus(response)
        return response


def _with_request_id(headers: Mapping[str, str] | None) -> dict[str, str]:
    fresh = uuid.uuid4().hex
    if not headers:
        return {"x-request-id": fresh}
    kept = {k: v for k, v in headers.items() if k.lower() != "x-request-id"}
    prefix = next((v for k, v in headers.items() if k.lower() == "x-request-id"), None)
    kept["x-request-id"] = f"{prefix}-{fresh[:12]}" if prefix else fresh
    return kept


class _FatalStatus(Exception):
    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        super().__init__(response.status_code)


class _DeadlineExceeded(Exception):
    pass


class _CutOff(Exception):
    def __init__(self, status_code: int, cause: httpx.HTTPError) -> None:
        self.status_code = status_code
        super().__init__(f"HTTP {status_code} answer cut off: {type(cause).__name__}: {cause}")


def json_body(response: httpx.Response, path: str) -> Any:
    """The answer's JSON; InvalidResponseError naming the server when it is not JSON."""
    try:
        return response.json()
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        excerpt = response.text[:120].strip()
        kind = response.headers.get("content-type", "no content-type")
        server = str(response.request.url).removesuffix(path)
        reason = f"HTTP {response.status_code} answer is not JSON ({kind}, {len(response.content)} bytes): {excerpt!r}"
        raise InvalidResponseError(
            path, (server,), attempts=1, reason=reason, status_code=response.status_code
        ) from exc


def _request_error(path: str, tried: list[str], response: httpx.Response) -> RequestError:
    # vLLM puts the reason in a short JSON body; keep enough of it to be useful.
    excerpt = response.text[:300].strip()
    reason = f"HTTP {response.status_code}" + (f": {excerpt}" if excerpt else "")
    return RequestError(path, tried, attempts=len(tried), reason=reason, status_code=response.status_code)
