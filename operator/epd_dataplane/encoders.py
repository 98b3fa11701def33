"""The encoders the proxy primes on: fixed URLs (a unit's own encoders, on the pod's loopback),
or a DNS name re-resolved periodically (a Pools model's encoder pool behind its headless
Service, whose A/AAAA records are the pool's ready pods); and which of them are left out for
failing (outlier detection)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from .core import DNSTarget, encoder_urls
from .metrics import ProxyMetrics

logger = logging.getLogger("epd_dataplane")

Resolve = Callable[[str], Awaitable[list[str]]]
# getaddrinfo's "the name has no address": a headless Service without ready pods has no
# records at all (NXDOMAIN), so the pool has no encoder. Anything else may pass.
_NO_ADDRESS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


async def resolve_addresses(host: str) -> list[str]:
    """Every address of ``host`` (the resolver's order: it may rotate them)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return [str(sockaddr[0]) for *_, sockaddr in infos]


@dataclass(frozen=True)
class Ejection:
    """When an encoder is left out: after ``consecutive_failures`` failed prime requests in a
    row (0: never), for ``base_seconds`` times the number of times in a row it was, at most
    ``max_seconds`` (or ``base_seconds`` if longer). Envoy's outlier detection (consecutive
    gateway failures) and its defaults."""

    consecutive_failures: int = 5
    base_seconds: float = 30.0
    max_seconds: float = 300.0

    @classmethod
    def given(cls, consecutive_failures: int | None, base_seconds: float | None, max_seconds: float | None) -> Ejection:
        """The values given, the defaults for those that are None (flags not set)."""
        default = cls()
        return cls(
            default.consecutive_failures if consecutive_failures is None else consecutive_failures,
            default.base_seconds if base_seconds is None else base_seconds,
            default.max_seconds if max_seconds is None else max_seconds,
        )


class _Record:
    __slots__ = ("ejections", "failures", "until")

    def __init__(self) -> None:
        self.failures = 0
        self.ejections = 0
        self.until = 0.0


class Outliers:
    """Passive health of the encoders, from the prime requests themselves: vLLM's /health says
    whether an engine died, not whether it answers, so an encoder whose engine hangs stays
    Ready. One answered request clears an encoder's record. ``usable`` never leaves out every
    encoder: a prime on a doubtful one beats refusing the request unprimed."""

    def __init__(self, metrics: ProxyMetrics, ejection: Ejection, clock: Callable[[], float] = time.monotonic) -> None:
        self.ejection = ejection
        self._metrics = metrics
        self._clock = clock
        self._records: dict[str, _Record] = {}
        metrics.count_ejected(self.ejected)

    def observe(self, url: str, failed: bool) -> None:
        """One prime request to ``url`` ended (``Primer``'s ``on_attempt``)."""
        record = self._records.get(url)
        if not failed:
            if record is not None:
                del self._records[url]
            return
        if record is None:
            record = self._records[url] = _Record()
        now = self._clock()
        if record.until > now:
            return  # requests sent before it was left out, failing late: they do not lengthen it
        record.failures += 1
        if self.ejection.consecutive_failures and record.failures >= self.ejection.consecutive_failures:
            record.failures = 0
            record.ejections += 1
            longest = max(self.ejection.max_seconds, self.ejection.base_seconds)  # Envoy's: the larger
            seconds = min(self.ejection.base_seconds * record.ejections, longest)
            record.until = now + seconds
            self._metrics.observe_ejection()
            failures = self.ejection.consecutive_failures
            logger.warning("encoder %s left out for %g s: its last %d prime requests failed", url, seconds, failures)

    def usable(self, urls: tuple[str, ...]) -> tuple[str, ...]:
        """``urls`` without the encoders left out now; all of them if that would leave none."""
        if not self._records:
            return urls
        now = self._clock()
        kept = tuple(u for u in urls if (r := self._records.get(u)) is None or r.until <= now)
        return kept or urls

    def ejected(self) -> int:
        now = self._clock()
        return sum(r.until > now for r in self._records.values())

    def keep_only(self, urls: Iterable[str]) -> None:
        """Forget encoders no longer listed (a pool's pods come and go): the records stay bounded."""
        listed = set(urls)
        for url in [u for u in self._records if u not in listed]:
            del self._records[url]


class Encoders:
    """The current list of encoder base URLs (``urls``); with a DNS target, ``run`` refreshes it
    every ``refresh_seconds`` until cancelled. ``usable()`` is the list without the encoders
    ``outliers`` leaves out."""

    def __init__(
        self,
        metrics: ProxyMetrics,
        urls: Sequence[str] = (),
        dns: DNSTarget | None = None,
        *,
        refresh_seconds: float = 5.0,
        resolve: Resolve = resolve_addresses,
        ejection: Ejection | None = None,
    ) -> None:
        self.urls = tuple(u.rstrip("/") for u in urls)
        self.dns = dns
        self.refresh_seconds = refresh_seconds
        self.outliers = Outliers(metrics, ejection or Ejection())
        self._metrics = metrics
        self._resolve = resolve
        metrics.set_encoders(len(self.urls))

    def usable(self) -> tuple[str, ...]:
        return self.outliers.usable(self.urls)

    async def refresh(self) -> None:
        """Resolve the DNS target once: its answer replaces the list; no such name empties it (no
        ready pod); any other failure keeps the last answer (a resolver hiccup is no reason to
        stop priming on pods that were there a moment ago)."""
        assert self.dns is not None
        try:
            addresses = await self._resolve(self.dns.host)
        except socket.gaierror as error:
            if error.errno not in _NO_ADDRESS:
                self._metrics.observe_dns_error()
                logger.warning("resolving %s failed (%s); keeping %d encoders", self.dns.host, error, len(self.urls))
                return
            addresses = []
        urls = encoder_urls(addresses, self.dns.ports)
        if urls != self.urls:
            logger.info("encoders of %s: %s", self.dns.host, ", ".join(urls) or "none")
            self.outliers.keep_only(urls)
        self.urls = urls
        self._metrics.set_encoders(len(urls))

    async def run(self) -> None:
        """Refresh every ``refresh_seconds``, forever: the proxy runs it as a task, after a
        first ``refresh`` before it serves."""
        while True:
            await asyncio.sleep(self.refresh_seconds)
            await self.refresh()
