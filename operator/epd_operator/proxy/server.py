"""The EPD proxy's shell: an aiohttp server in front of the unit's router (or its only consumer)
that primes the media of chat completions and Responses requests on the encoders, then forwards
every request unchanged and streams the answer back as it comes.

The decisions are core.py's; this module only moves bytes: the client's request in, the primes
out (epd_client's Primer: its retry policy and round-robin), the request to the upstream, the
answer back chunk by chunk (SSE events are written as they arrive, never buffered).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from yarl import URL

from epd_client import MEDIA_KINDS, PrimeError, Primer, RetryPolicy

from ..loop import event_loop
from .core import (
    HELD_BODY,
    PASSED_THROUGH,
    STREAMED_BODY,
    BadRequest,
    DNSTarget,
    Plan,
    error_body,
    forwarded,
    no_encoder,
    plan,
    prime_failure,
    prime_headers,
    route,
    with_transfer_params,
)
from .encoders import Encoders
from .metrics import ProxyMetrics

logger = logging.getLogger("epd_operator.proxy")

MiB = 1024 * 1024
# Answers up to this size (a whole chat completion, a model list) are read whole and written
# once: a third of the proxy's time went to writing headers, body and end apart.
HELD_ANSWER_BYTES = 1 * MiB
# The client's headers that aiohttp would otherwise add to the forwarded request when absent:
# the upstream sees exactly what the client sent.
_NO_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")


@dataclass(frozen=True)
class ProxyConfig:
    upstream: str
    """Base URL of the router (or the unit's only consumer) on the pod's loopback."""
    request_timeout_seconds: float = 1800.0
    """Whole-request limit upstream, streaming included: vllm-router's own default."""
    max_request_bytes: int = 64 * MiB
    """Largest body of a primed route (the proxy holds and parses it); others are streamed."""
    pooled: bool = False
    """Placement Pools: primes must announce ec_transfer_params, which the forwarded body carries."""


class Proxy:
    """One proxy: its upstream session, encoders, primer and metrics. ``async with`` it (the
    upstream session needs the running loop), then serve ``app()``."""

    def __init__(self, config: ProxyConfig, encoders: Encoders, primer: Primer, metrics: ProxyMetrics) -> None:
        self.config = config
        self.encoders = encoders
        self.primer = primer
        self.metrics = metrics
        self._upstream = config.upstream.rstrip("/")
        self._session: aiohttp.ClientSession | None = None
        # Round-robin across requests: each request's first part goes to the encoder after the
        # previous request's last, so single-image requests do not all land on encoders[0].
        self._rotation = 0

    async def __aenter__(self) -> Self:
        self._session = aiohttp.ClientSession(
            # No pool limit: each client request holds one upstream connection, so the clients'
            # own concurrency bounds them, as it bounds the router's.
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_seconds),
            auto_decompress=False,  # bodies pass as they are, with their Content-Encoding
            cookie_jar=aiohttp.DummyCookieJar(),  # never mix one client's cookies into another's requests
            skip_auto_headers=_NO_AUTO_HEADERS,
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_request_bytes)
        app.router.add_route("*", "/{path:.*}", self.handle)
        return app

    def admin_app(self) -> web.Application:
        """/health and /metrics of the proxy itself, on their own port: the main port passes those
        paths through to the upstream."""
        app = web.Application()
        app.router.add_get("/health", _healthy)
        app.router.add_get("/metrics", self._metrics_page)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        name = route(request.method, request.path)
        if name in PASSED_THROUGH:
            response = await self._forward(request, request.content if request.body_exists else None, STREAMED_BODY)
        else:
            response = await self._primed(request, name)
        self.metrics.observe_request(name, response.status)
        return response

    async def _primed(self, request: web.Request, name: str) -> web.StreamResponse:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            limit = self.config.max_request_bytes
            return _error(413, f"the request body is larger than the proxy's limit of {limit} bytes")
        try:
            found = plan(name, raw)
        except BadRequest as error:
            return _error(400, str(error), error.param)
        if found.parts:
            failure, params = await self._prime(request, found)
            if failure is not None:
                return failure
            if self.config.pooled:
                raw = json.dumps(with_transfer_params(found.body, params)).encode()
        return await self._forward(request, raw, HELD_BODY)

    async def _prime(self, request: web.Request, found: Plan) -> tuple[web.Response | None, dict[str, Any]]:
        encoders = self.encoders.urls
        if not encoders:
            self.metrics.observe_prime_failure("no_encoder")
            return _json(*no_encoder(found.parts)), {}
        first, self._rotation = self._rotation, self._rotation + len(found.parts)
        started = time.monotonic()
        try:
            params = await self.primer.prime(
                [part.item for part in found.parts],
                encoders,
                model=found.model,
                pooled=self.config.pooled,
                headers=prime_headers(request.headers.items()),
                first=first,
            )
        except PrimeError as error:
            status, body = prime_failure(error, found.parts)
            self.metrics.observe_prime_failure("client_error" if status < 500 else "encoder_error")
            logger.warning("%s %s answered %d, not forwarded: %s", request.method, request.path, status, error)
            return _json(status, body), {}
        self.metrics.observe_primed([MEDIA_KINDS[p.item.kind] for p in found.parts], time.monotonic() - started)
        return None, params

    async def _forward(self, request: web.Request, data: Any, drop: frozenset[str]) -> web.StreamResponse:
        assert self._session is not None, "use the Proxy as an async context manager"
        try:
            upstream = await self._session.request(
                request.method,
                URL(self._upstream + request.raw_path, encoded=True),
                headers=forwarded(request.headers.items(), drop),
                data=data,
                allow_redirects=False,
            )
        except TimeoutError:
            seconds = self.config.request_timeout_seconds
            return _error(504, f"the upstream {self._upstream} did not answer within {seconds:g} s")
        except aiohttp.ClientError as error:
            return _error(502, f"the upstream {self._upstream} is unreachable: {error}")
        async with upstream:
            if _held(upstream):
                try:
                    body = await upstream.read()
                except (aiohttp.ClientError, TimeoutError) as error:
                    return _error(502, f"the upstream's answer broke off: {error!r}")
                return web.Response(
                    status=upstream.status,
                    reason=upstream.reason,
                    headers=CIMultiDict(forwarded(upstream.headers.items())),
                    body=body,
                )
            response = web.StreamResponse(
                status=upstream.status,
                reason=upstream.reason,
                headers=CIMultiDict(forwarded(upstream.headers.items())),
            )
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except (aiohttp.ClientError, TimeoutError) as error:
                # The status went out already: all the client can still learn is that the body
                # is cut short, so the connection is dropped rather than the body ended.
                logger.warning("%s %s: the upstream's answer broke off: %r", request.method, request.path, error)
                if request.transport is not None:
                    request.transport.abort()
                return response
            await response.write_eof()
        return response

    async def _metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def _held(upstream: aiohttp.ClientResponse) -> bool:
    """Whether to read the upstream's answer whole and send it in one write: a small one of known
    length that is not an event stream (SSE is written event by event as it comes)."""
    length = upstream.content_length
    return length is not None and length <= HELD_ANSWER_BYTES and upstream.content_type != "text/event-stream"


async def _healthy(request: web.Request) -> web.Response:
    # Alive is all it says: the pod's readiness already requires the router's and every
    # encoder's (docs/proxy.md).
    return web.Response(text="ok")


def _json(status: int, body: dict[str, Any]) -> web.Response:
    return web.json_response(body, status=status)


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    return _json(status, error_body(status, message, param))


# --------------------------------------------------------------------------- the process


async def serve(
    proxy: Proxy,
    *,
    host: str,
    port: int,
    metrics_port: int,
    shutdown_timeout: float,
    stop: asyncio.Event,
    ready: asyncio.Future[tuple[int, int]] | None = None,
) -> None:
    """Serve until ``stop`` is set, then finish the requests in flight (up to
    ``shutdown_timeout`` seconds) before closing. ``ready`` gets the ports listened on (the
    bound ones for port 0) once both listen."""
    # handler_cancellation: a client that goes away cancels its handler, which closes the
    # upstream connection, so vLLM aborts the request instead of generating for nobody.
    main = web.AppRunner(proxy.app(), access_log=None, handler_cancellation=True, shutdown_timeout=shutdown_timeout)
    admin = web.AppRunner(proxy.admin_app(), access_log=None)
    refresh = None
    if proxy.encoders.dns:
        await proxy.encoders.refresh()  # the first requests must not find the list empty
        refresh = asyncio.create_task(proxy.encoders.run())
    try:
        for runner, listen in ((main, port), (admin, metrics_port)):
            await runner.setup()
            await web.TCPSite(runner, host, listen).start()
        ports = (main.addresses[0][1], admin.addresses[0][1])
        logger.info(
            "serving on %s:%d (metrics on %d) in front of %s, priming on %s",
            host,
            *ports,
            proxy.config.upstream,
            f"{proxy.encoders.dns.host} (DNS)" if proxy.encoders.dns else ", ".join(proxy.encoders.urls),
        )
        if ready is not None:
            ready.set_result(ports)
        await stop.wait()
    finally:
        if refresh is not None:
            refresh.cancel()
        await main.cleanup()
        await admin.cleanup()


def run_proxy(
    *,
    host: str,
    port: int,
    upstream: str,
    encoder_urls: Sequence[str],
    encoders_dns: str | None,
    dns_refresh_seconds: float,
    metrics_port: int,
    request_timeout_seconds: float,
    prime_timeout_seconds: float,
    prime_max_attempts: int,
    prime_concurrency: int,
    max_request_bytes: int,
    pooled: bool,
    shutdown_timeout_seconds: float,
    log_level: str,
) -> None:
    """`epd-operator proxy`: build the proxy from its flags and serve until SIGTERM or SIGINT."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if log_level != "DEBUG":
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per prime at INFO
    config = ProxyConfig(upstream, request_timeout_seconds, max_request_bytes, pooled)
    retry = RetryPolicy(
        max_attempts=prime_max_attempts,
        deadline=prime_timeout_seconds,
        attempt_timeout=min(RetryPolicy.attempt_timeout, prime_timeout_seconds),
    )
    dns = DNSTarget.parse(encoders_dns) if encoders_dns else None

    async def main() -> None:
        metrics = ProxyMetrics()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        encoders = Encoders(metrics, encoder_urls, dns, refresh_seconds=dns_refresh_seconds)
        primer = Primer(retry=retry, max_concurrency=prime_concurrency)
        async with primer, Proxy(config, encoders, primer, metrics) as proxy:
            await serve(
                proxy,
                host=host,
                port=port,
                metrics_port=metrics_port,
                shutdown_timeout=shutdown_timeout_seconds,
                stop=stop,
            )

    with event_loop() as runner:
        runner.run(main())
