"""The encoders the proxy primes on: fixed URLs (a unit's own encoders, on the pod's loopback),
or a DNS name re-resolved periodically (a Pools model's encoder pool behind its headless
Service, whose A/AAAA records are the pool's ready pods)."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence

from .core import DNSTarget, encoder_urls
from .metrics import ProxyMetrics

logger = logging.getLogger("epd_operator.proxy")

Resolve = Callable[[str], Awaitable[list[str]]]
# getaddrinfo's "the name has no address": a headless Service without ready pods has no
# records at all (NXDOMAIN), so the pool has no encoder. Anything else may pass.
_NO_ADDRESS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


async def resolve_addresses(host: str) -> list[str]:
    """Every address of ``host`` (the resolver's order: it may rotate them)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return [str(sockaddr[0]) for *_, sockaddr in infos]


class Encoders:
    """The current list of encoder base URLs (``urls``); with a DNS target, ``run`` refreshes it
    every ``refresh_seconds`` until cancelled."""

    def __init__(
        self,
        metrics: ProxyMetrics,
        urls: Sequence[str] = (),
        dns: DNSTarget | None = None,
        *,
        refresh_seconds: float = 5.0,
        resolve: Resolve = resolve_addresses,
    ) -> None:
        self.urls = tuple(u.rstrip("/") for u in urls)
        self.dns = dns
        self.refresh_seconds = refresh_seconds
        self._metrics = metrics
        self._resolve = resolve
        metrics.set_encoders(len(self.urls))

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
        self.urls = urls
        self._metrics.set_encoders(len(urls))

    async def run(self) -> None:
        """Refresh every ``refresh_seconds``, forever: the proxy runs it as a task, after a
        first ``refresh`` before it serves."""
        while True:
            await asyncio.sleep(self.refresh_seconds)
            await self.refresh()
