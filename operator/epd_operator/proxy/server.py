"""The EPD proxy's shell: in front of the unit's router (or its only consumer), it primes the
media of chat completions and Responses requests on the encoders, then forwards every request
unchanged and streams the answer back as it comes.

The decisions are core.py's and the HTTP/1.1 plumbing is http1.py's; this module puts them
together: the client's request in, the primes out (epd_client's Primer: its retry policy and
round-robin), the request to the upstream, the answer back (SSE events are written as they
arrive, never buffered). aiohttp serves the admin port (/health, /metrics).
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

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from epd_client import MEDIA_KINDS, PrimeError, Primer, RetryPolicy

from ..loop import event_loop
from .core import (
    ANSWER_DROPPED,
    PASSED_THROUGH,
    REQUEST_DROPPED,
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
from .http1 import (
    JSON_HEADERS,
    Answer,
    Body,
    BrokeOff,
    ClientConnection,
    Exchange,
    TooLarge,
    Unreachable,
    Upstream,
    close_idle,
)
from .metrics import ProxyMetrics

logger = logging.getLogger("epd_operator.proxy")

MiB = 1024 * 1024
# Answers up to this size (a whole chat completion, a model list) are read whole and written
# once, so an upstream that drops one halfway gives the client a 502, not a cut body.
HELD_ANSWER_BYTES = 1 * MiB
# Connections waiting to be accepted: a burst of new clients is not refused or delayed.
LISTEN_BACKLOG = 1024


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
    """One proxy: its upstream connections, encoders, primer and metrics. ``async with`` it, then
    ``serve`` it."""

    def __init__(self, config: ProxyConfig, encoders: Encoders, primer: Primer, metrics: ProxyMetrics) -> None:
        self.config = config
        self.encoders = encoders
        self.primer = primer
        self.metrics = metrics
        self._upstream = Upstream(config.upstream)
        # Round-robin across requests: each request's first part goes to the encoder after the
        # previous request's last, so single-image requests do not all land on encoders[0].
        self._rotation = 0

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._upstream.close()

    def admin_app(self) -> web.Application:
        """/health and /metrics of the proxy itself, on their own port: the main port passes those
        paths through to the upstream."""
        app = web.Application()
        app.router.add_get("/health", _healthy)
        app.router.add_get("/metrics", self._metrics_page)
        return app

    def connection(self, connections: set[ClientConnection]) -> ClientConnection:
        """A client connection of the main port (the listener's protocol factory)."""
        return ClientConnection(self.handle, _error_json, connections)

    async def handle(self, exchange: Exchange) -> None:
        head = exchange.head
        name = route(head.method, head.path)
        if name in PASSED_THROUGH:
            body = exchange.body
            await self._forward(exchange, None if not head.framed else body.take() if body.complete else body)
        else:
            await self._primed(exchange, name)
        if exchange.status is not None:
            self.metrics.observe_request(name, exchange.status)

    async def _primed(self, exchange: Exchange, name: str) -> None:
        try:
            raw = await exchange.body.read(self.config.max_request_bytes)
        except TooLarge:
            limit = self.config.max_request_bytes
            return _error(exchange, 413, f"the request body is larger than the proxy's limit of {limit} bytes")
        try:
            found = plan(name, raw)
        except BadRequest as error:
            return _error(exchange, 400, str(error), error.param)
        if found.parts:
            params = await self._prime(exchange, found)
            if params is None:
                return
            if self.config.pooled:
                raw = json.dumps(with_transfer_params(found.body, params)).encode()
        await self._forward(exchange, raw)

    async def _prime(self, exchange: Exchange, found: Plan) -> dict[str, Any] | None:
        """Prime the request's parts: the encoders' transfer params, or None when the request was
        answered with the failure instead."""
        encoders = self.encoders.urls
        if not encoders:
            self.metrics.observe_prime_failure("no_encoder")
            _json(exchange, *no_encoder(found.parts))
            return None
        first, self._rotation = self._rotation, self._rotation + len(found.parts)
        started = time.monotonic()
        head = exchange.head
        try:
            params = await self.primer.prime(
                [part.item for part in found.parts],
                encoders,
                model=found.model,
                pooled=self.config.pooled,
                headers=prime_headers(head.headers),
                first=first,
            )
        except PrimeError as error:
            status, body = prime_failure(error, found.parts)
            self.metrics.observe_prime_failure("client_error" if status < 500 else "encoder_error")
            logger.warning("%s %s answered %d, not forwarded: %s", head.method, head.path, status, error)
            _json(exchange, status, body)
            return None
        self.metrics.observe_primed([MEDIA_KINDS[p.item.kind] for p in found.parts], time.monotonic() - started)
        return params

    async def _forward(self, exchange: Exchange, body: bytes | Body | None) -> None:
        head = exchange.head
        upstream = self._upstream.url
        try:
            async with asyncio.timeout(self.config.request_timeout_seconds):
                answer = await self._upstream.request(head, forwarded(head.headers, REQUEST_DROPPED), body)
                try:
                    await self._answer(exchange, answer)
                finally:
                    answer.release()
        except TimeoutError:
            seconds = self.config.request_timeout_seconds
            if not exchange.started:
                return _error(exchange, 504, f"the upstream {upstream} did not answer within {seconds:g} s")
            logger.warning("%s %s: the answer took longer than %g s, cut short", head.method, head.path, seconds)
            exchange.abort()
        except Unreachable as error:
            _error(exchange, 502, f"the upstream {upstream} is unreachable: {error}")
        except BrokeOff as error:
            if not exchange.started:
                return _error(exchange, 502, f"the upstream's answer broke off: {error}")
            # The status went out already: all the client can still learn is that the body is
            # cut short, so the connection is dropped rather than the body ended.
            logger.warning("%s %s: the upstream's answer broke off: %s", head.method, head.path, error)
            exchange.abort()

    async def _answer(self, exchange: Exchange, answer: Answer) -> None:
        assert answer.status is not None
        headers = forwarded(answer.headers, ANSWER_DROPPED)
        if answer.length is not None and answer.length <= HELD_ANSWER_BYTES and not answer.event_stream:
            body = await answer.read()
            return exchange.respond(answer.status, headers, body, answer.reason)
        exchange.start(answer.status, answer.reason, headers, answer.length)
        await answer.relay(exchange)
        exchange.end()

    async def _metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _healthy(request: web.Request) -> web.Response:
    # Alive is all it says: the pod's readiness already requires the router's and every
    # encoder's (docs/proxy.md).
    return web.Response(text="ok")


def _error_json(status: int, message: str, param: str | None = None) -> bytes:
    return json.dumps(error_body(status, message, param)).encode()


def _json(exchange: Exchange, status: int, body: dict[str, Any]) -> None:
    exchange.respond(status, JSON_HEADERS, json.dumps(body).encode())


def _error(exchange: Exchange, status: int, message: str, param: str | None = None) -> None:
    exchange.respond(status, JSON_HEADERS, _error_json(status, message, param))


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
    loop = asyncio.get_running_loop()
    connections: set[ClientConnection] = set()
    admin = web.AppRunner(proxy.admin_app(), access_log=None)
    refresh = None
    if proxy.encoders.dns:
        await proxy.encoders.refresh()  # the first requests must not find the list empty
        refresh = asyncio.create_task(proxy.encoders.run())
    listener = None
    sweep = asyncio.create_task(close_idle(connections))
    try:
        listener = await loop.create_server(lambda: proxy.connection(connections), host, port, backlog=LISTEN_BACKLOG)
        await admin.setup()
        await web.TCPSite(admin, host, metrics_port).start()
        ports = (listener.sockets[0].getsockname()[1], admin.addresses[0][1])
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
        sweep.cancel()
        if refresh is not None:
            refresh.cancel()
        if listener is not None:
            listener.close()
            await _drain(connections, shutdown_timeout)
        await admin.cleanup()


async def _drain(connections: set[ClientConnection], timeout: float) -> None:
    """Close idle connections as they become idle, until none is left or ``timeout`` passed;
    then drop the rest."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while connections and loop.time() < deadline:
        for connection in list(connections):
            if not connection.busy:
                connection.close()
        await asyncio.sleep(0.05)
    for connection in list(connections):
        connection.abort()


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
