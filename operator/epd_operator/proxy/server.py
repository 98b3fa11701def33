"""The EPD proxy's shell: in front of the unit's router (or its only consumer), it primes the
media of every request that takes media into a generation (chat completions, Responses,
Anthropic Messages, ...: core.PRIMED_ROUTES) on the encoders, then forwards every request
unchanged and streams the answer back as it comes.

The decisions are core.py's and the HTTP/1.1 plumbing is http1.py's; this module puts them
together: the client's request in, the primes out (epd_client's Primer: its retry policy and
round-robin), the request to the upstream, the answer back (SSE events are written as they
arrive, never buffered). aiohttp serves the admin port (/health, /metrics).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from epd_client import MEDIA_KINDS, PrimeError, Primer, RetryPolicy

from ..loop import event_loop
from .core import (
    ANSWER_DROPPED,
    PASSED_THROUGH,
    REFUSED,
    REQUEST_DROPPED,
    BadRequest,
    DNSTarget,
    Plan,
    ProxyError,
    error_body,
    forwarded,
    no_encoder,
    plan,
    prime_failure,
    prime_headers,
    refusal,
    route,
    with_transfer_params,
)
from .encoders import Ejection, Encoders, Resolve, resolve_addresses
from .http1 import (
    JSON_HEADERS,
    Answer,
    Body,
    ClientConnection,
    Exchange,
    TooLarge,
    Unreachable,
    Upstream,
    UpstreamError,
    close_idle,
)
from .media_urls import MediaURLPolicy, screen
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
    media: MediaURLPolicy = field(default_factory=MediaURLPolicy)
    """Which media URLs may reach the encoders (spec.proxy.media)."""


class Proxy:
    """One proxy: its upstream connections, encoders, primer and metrics. ``async with`` it, then
    ``serve`` it."""

    def __init__(
        self,
        config: ProxyConfig,
        encoders: Encoders,
        primer: Primer,
        metrics: ProxyMetrics,
        resolve: Resolve = resolve_addresses,
    ) -> None:
        self.config = config
        self.encoders = encoders
        self.primer = primer
        self.metrics = metrics
        self._resolve = resolve  # media URLs' host names (media_urls.screen)
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

    def handle(self, exchange: Exchange) -> Coroutine[Any, Any, None] | None:
        """Serve one request. One whose body came whole with its head, that needs no prime and
        finds an idle upstream connection (the common case) is served from callbacks alone, with
        no task: most of what the proxy adds to a request's latency is turns of the event loop."""
        head, body = exchange.head, exchange.body
        name = route(head.method, head.path)
        if name in PASSED_THROUGH:
            if head.framed and not body.complete:  # streamed upstream as it arrives
                return self.counted(exchange, name, self.forward(exchange, body))
            return self._forward_now(exchange, name, body.take() if head.framed else None)
        if name in REFUSED:  # answered unread: the connection closes if a body is left
            _error(exchange, ProxyError(400, refusal(name)))
            self.done(exchange, name)
            return None
        if not body.complete:
            return self.counted(exchange, name, self._read_primed(exchange, name))
        try:
            raw = body.whole(self.config.max_request_bytes)
        except TooLarge:
            self._too_large(exchange)
            self.done(exchange, name)
            return None
        found = self._plan(exchange, name, raw)
        if found is None:
            self.done(exchange, name)
            return None
        if found.parts:
            return self.counted(exchange, name, self._primed(exchange, found, raw))
        return self._forward_now(exchange, name, raw)

    async def _read_primed(self, exchange: Exchange, name: str) -> None:
        """A primed route's request whose body arrives after its head."""
        try:
            raw = await exchange.body.read(self.config.max_request_bytes)
        except TooLarge:
            return self._too_large(exchange)
        found = self._plan(exchange, name, raw)
        if found is None:
            return
        if found.parts:
            await self._primed(exchange, found, raw)
        else:
            await self.forward(exchange, raw)

    def _plan(self, exchange: Exchange, name: str, raw: bytes) -> Plan | None:
        """What to prime (None: the request was answered 400)."""
        try:
            return plan(name, raw, pooled=self.config.pooled)
        except BadRequest as error:
            _error(exchange, ProxyError(400, str(error), error.param))
            return None

    def _too_large(self, exchange: Exchange) -> None:
        limit = self.config.max_request_bytes
        _error(exchange, ProxyError(413, f"the request body is larger than the proxy's limit of {limit} bytes"))

    async def _primed(self, exchange: Exchange, found: Plan, raw: bytes) -> None:
        refused = await screen(found.parts, self.config.media, self._resolve)
        if refused is not None:
            return _error(exchange, refused)
        params = await self._prime(exchange, found)
        if params is None:
            return
        if self.config.pooled:
            raw = json.dumps(with_transfer_params(found.body, params)).encode()
        await self.forward(exchange, raw)

    async def counted(self, exchange: Exchange, name: str, serving: Coroutine[Any, Any, None]) -> None:
        """Serve a request from a task (``serving``), then count it under route ``name``."""
        await serving
        self._observe(exchange, name)

    def done(self, exchange: Exchange, name: str) -> None:
        """A request served from callbacks is over: counted, and its connection goes on."""
        self._observe(exchange, name)
        exchange.finish()

    def _observe(self, exchange: Exchange, name: str) -> None:
        if exchange.status is not None:
            self.metrics.observe_request(name, exchange.status)

    async def _prime(self, exchange: Exchange, found: Plan) -> dict[str, Any] | None:
        """Prime the request's parts: the encoders' transfer params, or None when the request was
        answered with the failure instead."""
        encoders = self.encoders.usable()
        if not encoders:
            self.metrics.observe_prime_failure("no_encoder")
            _error(exchange, no_encoder(found.parts))
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
                extra_body=found.prime_fields,
            )
        except PrimeError as error:
            failure = prime_failure(error, found.parts)
            self.metrics.observe_prime_failure("client_error" if failure.status < 500 else "encoder_error")
            logger.warning("%s %s answered %d, not forwarded: %s", head.method, head.path, failure.status, error)
            _error(exchange, failure)
            return None
        self.metrics.observe_primed([MEDIA_KINDS[p.item.kind] for p in found.parts], time.monotonic() - started)
        return params

    def _forward_now(self, exchange: Exchange, name: str, body: bytes | None) -> Coroutine[Any, Any, None] | None:
        """Forward a whole request on an idle upstream connection and follow its answer from
        callbacks; with none idle, from a task that connects."""
        head = exchange.head
        sent = self._upstream.send(head, forwarded(head.headers, REQUEST_DROPPED), body)
        if sent is None:
            return self.counted(exchange, name, self.forward(exchange, body))
        _Followed(self, exchange, name, *sent, body)
        return None

    async def forward(self, exchange: Exchange, body: bytes | Body | None, deadline: float | None = None) -> None:
        """Send the request upstream, connecting if need be, and pass its answer on, all before
        ``deadline`` (by default the request timeout from now)."""
        head = exchange.head
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + self.config.request_timeout_seconds
        try:
            async with asyncio.timeout_at(deadline):
                answer = await self._upstream.request(head, forwarded(head.headers, REQUEST_DROPPED), body)
        except (TimeoutError, UpstreamError) as error:
            return self.upstream_failed(exchange, error)
        await self.relay(exchange, answer, deadline)

    async def relay(self, exchange: Exchange, answer: Answer, deadline: float) -> None:
        """Pass the answer on, whole or as it comes, until ``deadline`` (the request's timeout)."""
        try:
            async with asyncio.timeout_at(deadline):
                try:
                    assert answer.status is not None
                    if held(answer):
                        await answer.read()
                        return respond_whole(exchange, answer)
                    exchange.start(
                        answer.status, answer.reason, forwarded(answer.headers, ANSWER_DROPPED), answer.length
                    )
                    await answer.relay(exchange)
                    exchange.end()
                finally:
                    answer.release()
        except (TimeoutError, UpstreamError) as error:
            self.upstream_failed(exchange, error)

    def upstream_failed(self, exchange: Exchange, error: TimeoutError | UpstreamError) -> None:
        """What the client gets when the upstream did not answer in time, or could not."""
        head = exchange.head
        upstream = self._upstream.url
        seconds = self.config.request_timeout_seconds
        if isinstance(error, Unreachable):
            return _error(exchange, ProxyError(502, f"the upstream {upstream} is unreachable: {error}"))
        if not exchange.started:
            if isinstance(error, TimeoutError):
                return _error(exchange, ProxyError(504, f"the upstream {upstream} did not answer within {seconds:g} s"))
            return _error(exchange, ProxyError(502, f"the upstream's answer broke off: {error}"))
        # The status went out already: all the client can still learn is that the body is cut
        # short, so the connection is dropped rather than the body ended.
        if isinstance(error, TimeoutError):
            logger.warning("%s %s: the answer took longer than %g s, cut short", head.method, head.path, seconds)
        else:
            logger.warning("%s %s: the upstream's answer broke off: %s", head.method, head.path, error)
        exchange.abort()

    async def _metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def held(answer: Answer) -> bool:
    """Whether an answer is read whole before it is passed on (HELD_ANSWER_BYTES)."""
    return answer.length is not None and answer.length <= HELD_ANSWER_BYTES and not answer.event_stream


def respond_whole(exchange: Exchange, answer: Answer) -> None:
    """Pass on a held answer, once complete, in one write."""
    assert answer.status is not None
    exchange.respond(answer.status, forwarded(answer.headers, ANSWER_DROPPED), answer.whole(), answer.reason)


class _Followed:
    """A whole request sent upstream with no task awaiting it: the answer's callbacks pass it on
    once it is whole, or hand it to a task (Proxy.relay) when it must stream or be sent again.
    The request timeout is one timer."""

    __slots__ = ("_answer", "_body", "_deadline", "_exchange", "_name", "_proxy", "_reused", "_timer")

    def __init__(
        self, proxy: Proxy, exchange: Exchange, name: str, answer: Answer, reused: bool, body: bytes | None
    ) -> None:
        self._proxy, self._exchange, self._name, self._answer = proxy, exchange, name, answer
        self._reused, self._body = reused, body
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + proxy.config.request_timeout_seconds
        self._timer = loop.call_at(self._deadline, self._timed_out)
        answer.notify = self._step
        exchange.cancel = self._detach  # the client left: the upstream request is aborted

    def _step(self) -> None:
        answer, exchange, proxy = self._answer, self._exchange, self._proxy
        try:
            if answer.error is not None:
                self._detach()
                if self._reused and not answer.received:  # a kept-alive connection the upstream had closed
                    again = proxy.forward(exchange, self._body, self._deadline)
                    exchange.connection.run(exchange, proxy.counted(exchange, self._name, again))
                    return
                proxy.upstream_failed(exchange, answer.error)
            elif answer.status is None or (held(answer) and not answer.complete):
                return
            elif held(answer):
                self._detach()
                respond_whole(exchange, answer)
            else:  # streamed: a task relays it, pausing the upstream while the client is slow
                self._timer.cancel()  # the task's own from now on
                answer.notify = None  # the client leaving still releases it, until the task runs
                exchange.connection.run(
                    exchange, proxy.counted(exchange, self._name, proxy.relay(exchange, answer, self._deadline))
                )
                return
        except Exception:  # noqa: BLE001 - logged by failed(); not the upstream's parser's to handle
            self._detach()
            exchange.connection.failed(exchange)
            return
        proxy.done(exchange, self._name)

    def _timed_out(self) -> None:
        self._detach()
        self._proxy.upstream_failed(self._exchange, TimeoutError())
        self._proxy.done(self._exchange, self._name)

    def _detach(self) -> None:
        self._timer.cancel()
        self._answer.notify = None
        self._exchange.cancel = None
        self._answer.release()


async def _healthy(request: web.Request) -> web.Response:
    # Alive is all it says: the pod's readiness already requires the router's and every
    # encoder's (docs/proxy.md).
    return web.Response(text="ok")


def _error_json(status: int, message: str) -> bytes:
    """The answer to a request that could not be parsed (no path to shape it by)."""
    return json.dumps(error_body(ProxyError(status, message))).encode()


def _error(exchange: Exchange, error: ProxyError) -> None:
    body = json.dumps(error_body(error, exchange.head.path)).encode()
    exchange.respond(error.status, JSON_HEADERS, body)


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
    prime_attempt_timeout_seconds: float | None,
    prime_max_attempts: int,
    prime_concurrency: int,
    ejection: Ejection,
    max_request_bytes: int,
    pooled: bool,
    shutdown_timeout_seconds: float,
    log_level: str,
    media: MediaURLPolicy,
) -> None:
    """`epd-operator proxy`: build the proxy from its flags and serve until SIGTERM or SIGINT."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if log_level != "DEBUG":
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per prime at INFO
    config = ProxyConfig(upstream, request_timeout_seconds, max_request_bytes, pooled, media)
    retry = RetryPolicy(
        max_attempts=prime_max_attempts,
        deadline=prime_timeout_seconds,
        attempt_timeout=min(prime_attempt_timeout_seconds or RetryPolicy.attempt_timeout, prime_timeout_seconds),
    )
    dns = DNSTarget.parse(encoders_dns) if encoders_dns else None

    async def main() -> None:
        metrics = ProxyMetrics()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        encoders = Encoders(metrics, encoder_urls, dns, refresh_seconds=dns_refresh_seconds, ejection=ejection)
        primer = Primer(retry=retry, max_concurrency=prime_concurrency, on_attempt=encoders.outliers.observe)
        async with primer, Proxy(config, encoders, primer, metrics) as proxy:
            # What the process holds from here on (modules, the app) is never garbage: out of the
            # collector's reach, a full collection scans requests' objects only, not 50,000 more.
            gc.freeze()
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
