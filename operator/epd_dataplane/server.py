"""The EPD proxy's shell: in front of the unit's router (or its only consumer), it primes the
media of every request that takes media into a generation (chat completions, Responses,
Anthropic Messages, ...: core.PRIMED_ROUTES) on the encoders, then forwards every request
unchanged and streams the answer back as it comes.

HTTP is aiohttp's, both ways: its low-level server (llhttp, strict) takes the clients'
requests, and one pooled ClientSession forwards them. The decisions are core.py's, the bounds
limits.py's; this module puts them together: the client's request in, within its bounds; the
primes out (epd_client's Primer: its retry policy and round-robin); the request to the
upstream; the answer back (SSE events are written as they arrive, never buffered). aiohttp
serves the admin port (/health, /metrics) too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Self
from urllib.parse import urlsplit

from aiohttp import (
    ClientConnectorError,
    ClientError,
    ClientOSError,
    ClientResponse,
    ClientSession,
    ClientTimeout,
    DummyCookieJar,
    HttpVersion11,
    ServerDisconnectedError,
    TCPConnector,
    web,
)
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from multidict import CIMultiDict
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from yarl import URL

from epd_client import MEDIA_KINDS, MediaFailure, MediaItem, PrimeError, Primer
from epd_operator.ec.leases import RENEW_SECONDS, Leases
from epd_operator.proxy_limits import Limits, nested_deeper, raise_it, request_cost, reservation

from .budget import Budget, Reservation
from .core import (
    ANSWER_DROPPED,
    EPD_PRIME,
    HEALTH,
    KEYED,
    PASSED_THROUGH,
    REFUSED,
    REQUEST_DROPPED,
    BadRequest,
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
from .encoders import Encoders, Resolve, resolve_addresses
from .keys import in_body, key_parts, own_key, requested_lease, requested_version
from .media_urls import MediaURLPolicy, screen
from .metrics import ProxyMetrics
from .store import Flights, Grants, StoreView

logger = logging.getLogger("epd_dataplane")

MiB = 1024 * 1024
# Answers up to this size (a whole chat completion, a model list) are read whole and written
# once, so an upstream that drops one halfway gives the client a 502, not a cut body.
HELD_ANSWER_BYTES = 1 * MiB
# Connections waiting to be accepted: a burst of new clients is not refused or delayed.
LISTEN_BACKLOG = 1024
# Pooled upstream connections idle longer than this are closed (Go's net/http keeps them 90 s).
# A server may close an idle one sooner (vLLM's uvicorn after 5 s): a request whose connection
# closed before any answer is sent once more on a new one.
UPSTREAM_IDLE_SECONDS = 60.0
# A client socket's read buffer (aiohttp's read_bufsize): a body waiting for its turn holds at
# most twice this before the socket is paused.
READ_BUFFER_BYTES = 64 * 1024
# After an answer that leaves a body unread (a refusal), what still comes of it is read and
# dropped for this long before the connection closes, so the client reads the answer rather
# than a reset (nginx's lingering close, aiohttp's lingering_time).
LINGER_SECONDS = 5.0
# The headers aiohttp's client would add: the proxy adds none the client did not send.
_NOT_ADDED = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
# POST /epd/v1/prime: how long its keys stay leased for the client's render and generate (a
# request that names the lease keeps it while it runs: a queued generate is covered anyway).
GRANT_SECONDS = 30.0
MAX_GRANT_SECONDS = 600.0
# Keys leased to clients at once (Grants): each keeps the janitor from evicting an entry.
MAX_GRANTED_KEYS = 10_000


@dataclass(frozen=True)
class ProxyConfig:
    upstream: str
    """Base URL of the router (or the unit's only consumer) on the pod's loopback."""
    request_timeout_seconds: float = 1800.0
    """Whole-request limit upstream, streaming included: vllm-router's own default."""
    pooled: bool = False
    """Placement Pools: primes must announce ec_transfer_params, which the forwarded body carries."""
    limits: Limits = field(default_factory=Limits)
    media: MediaURLPolicy = field(default_factory=MediaURLPolicy)
    """Which media URLs may reach the encoders (spec.proxy.media)."""
    ec_store: str | None = None
    """Placement Unit with ECExampleConnector: the unit's EC store, where the proxy looks before
    priming (a part the store holds is not primed again) and leases what it relies on."""
    require_weights_version: bool = False
    """The model's weights are versioned: a media request without X-EPD-Weights-Version is refused."""


@dataclass(frozen=True)
class Primed:
    params: dict[str, Any]
    """A Pools model's ec_transfer_params."""
    leased: list[str]
    """Keys leased until the request is done."""
    keyed: bool
    """Keys were written into the body's parts: it is serialised again."""
    stored: int = 0
    """Parts the store held: not primed."""


class _CutShort(Exception):
    """The answer's status went out, and its body cannot be finished: the connection is dropped."""


class _TooLarge(Exception):
    pass


class Proxy:
    """One proxy: its upstream connections, encoders, primer, memory budget and metrics.
    ``async with`` it, then ``serve`` it."""

    def __init__(
        self,
        config: ProxyConfig,
        encoders: Encoders,
        primer: Primer,
        metrics: ProxyMetrics,
        resolve: Resolve = resolve_addresses,
    ) -> None:
        parts = urlsplit(config.upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the upstream must be an http:// URL, not {config.upstream!r}")
        self.config = config
        self.limits = config.limits
        self.encoders = encoders
        self.primer = primer
        self.metrics = metrics
        self.resolve = resolve  # media URLs' host names (media_urls.screen)
        self.budget = Budget(config.limits.max_buffered_bytes)
        self._upstream = config.upstream.rstrip("/")
        self._session: ClientSession | None = None
        # Round-robin across requests: each request's first part goes to the encoder after the
        # previous request's last, so single-image requests do not all land on encoders[0].
        self._rotation = 0
        self.store: StoreView | None = None
        self.flights: Flights | None = None
        self.grants: Grants | None = None

    async def __aenter__(self) -> Self:
        # No pool limit: each client request holds one connection, so the clients' own
        # concurrency bounds them, as it bounds the router's. No cookie jar: no client's cookies
        # reach another's requests.
        self._session = ClientSession(
            connector=TCPConnector(limit=0, keepalive_timeout=UPSTREAM_IDLE_SECONDS),
            cookie_jar=DummyCookieJar(),
            auto_decompress=False,
            skip_auto_headers=_NOT_ADDED,
            timeout=ClientTimeout(total=None),
        )
        if self.config.ec_store and not self.config.pooled:
            holder = f"{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
            self.store = StoreView(self.config.ec_store, Leases(self.config.ec_store, holder))
            self.flights = Flights(self.store, self.metrics.observe_prime)
            self.grants = Grants(self.store, MAX_GRANTED_KEYS)
            self.metrics.watch_store(self.store.leases.held, lambda: self.store is not None and self.store.verified)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self.grants is not None:
            self.grants.close()
        if self.store is not None:
            self.store.leases.close()
        if self._session is not None:
            await self._session.close()

    def admin_app(self) -> web.Application:
        """/health and /metrics of the proxy itself, on their own port: the main port passes those
        paths through to the upstream."""
        app = web.Application()
        app.router.add_get("/health", _healthy)
        app.router.add_get("/metrics", self._metrics_page)
        return app

    def server(self) -> web.Server:
        """The main port's aiohttp server, within the limits."""
        limits = self.limits
        return _Server(
            self.handle,
            limits,
            # The client leaving cancels its request: primes and the upstream request with it.
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=limits.keepalive_timeout_seconds,
            max_line_size=limits.max_header_bytes,
            max_field_size=limits.max_header_bytes,
            max_headers=limits.max_headers,
            read_bufsize=READ_BUFFER_BYTES,
            lingering_time=LINGER_SECONDS,
        )

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """Serve one request, counted under its route (and in flight, but the readiness probes)."""
        name = route(request.method, request.path)
        in_flight = self.metrics.requests_in_flight if name != HEALTH else None
        if in_flight is not None:
            in_flight.inc()
        try:
            response = await self._serve(request, name)
        except _CutShort:
            self.metrics.observe_request(name, 200)
            raise
        finally:
            if in_flight is not None:
                in_flight.dec()
        self.metrics.observe_request(name, response.status)
        return response

    async def _serve(self, request: web.BaseRequest, name: str) -> web.StreamResponse:
        if request.method == "CONNECT":
            return _error(request, ProxyError(405, "the EPD proxy is not a forward proxy: CONNECT is refused"), True)
        if not request.raw_path.startswith("/"):
            message = (
                f"the request target {request.raw_path[:200]!r} is not a path: the EPD proxy is not a forward proxy, "
                "send the path alone (origin-form, e.g. /v1/chat/completions)"
            )
            return _error(request, ProxyError(400, message), True)
        if name in PASSED_THROUGH:
            return await self.forward(request, None)
        if name in REFUSED:  # answered unread: the connection closes if a body is left
            return _error(request, ProxyError(400, refusal(name)), True)
        return await self._primed(request)

    async def _primed(self, request: web.BaseRequest) -> web.StreamResponse:
        """A primed route's request: its body read whole within its bounds and the memory
        budget, its media primed, then forwarded."""
        limits = self.limits
        declared = request.content_length
        if declared is not None and declared > limits.max_request_bytes:
            return self._too_large(request)
        if (refused := _expectation(request)) is not None:
            return refused
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.body_timeout_seconds
        # Before a byte is read, room for what the body will cost once parsed (an ASCII body of
        # its declared length; a chunked one may be as large as allowed).
        estimate = reservation(limits.max_request_bytes if declared is None else declared, limits)
        held = self.budget.try_reserve(estimate)  # at once, without a timer, when it fits
        if held is None:
            try:
                async with asyncio.timeout_at(deadline):
                    held = await self.budget.reserve(estimate)
            except TimeoutError:
                return _error(request, self._busy(estimate), True)
        try:
            return await self._primed_within(request, held, deadline)
        finally:
            held.release()

    async def _primed_within(
        self, request: web.BaseRequest, reservation: Reservation, deadline: float
    ) -> web.StreamResponse:
        limits = self.limits
        _continue(request)
        try:
            if request.content.is_eof():  # came whole with its head: no timer to set
                raw = await _read(request, limits.max_request_bytes)
            else:
                async with asyncio.timeout_at(deadline):
                    raw = await _read(request, limits.max_request_bytes)
        except _TooLarge:
            return self._too_large(request)
        except TimeoutError:
            message = (
                f"the request body did not arrive whole within {limits.body_timeout_seconds:g} s; "
                f"{raise_it('body_timeout_seconds')} for slower clients"
            )
            return _error(request, ProxyError(408, message), True)
        except HttpProcessingError as error:  # a malformed chunked body
            return _error(request, ProxyError(400, f"malformed request body: {error.message}"), True)
        cost = request_cost(raw)
        if cost > self.budget.total:
            message = (
                f"the request body would take about {cost // MiB} MiB of the proxy's memory while parsed, over its "
                f"limit of {self.budget.total // MiB} MiB for all requests; send fewer JSON values or {raise_it('max_buffered_bytes')}"
            )
            return _error(request, ProxyError(413, message), True)
        # More than reserved (a body denser or wider than ASCII with few values): grown now, or
        # refused; never grown by waiting, which could deadlock with other growing requests.
        if cost > reservation.size and not reservation.resize(cost):
            return _error(request, self._busy(cost), True)
        try:
            found = self._plan(request, raw)
        except BadRequest as error:
            return _error(request, ProxyError(400, str(error), error.param))
        name = route(request.method, request.path)
        leased: list[str] = []
        if found.parts or found.embeds:
            cost = request_cost(raw, len(found.parts))
            if cost > reservation.size and not reservation.resize(cost):
                return _error(request, self._busy(cost), True)
            refused = await screen(found.parts, self.config.media, self.resolve)
            if refused is not None:
                return _error(request, refused)
            primed = await self._prime(request, found)
            if isinstance(primed, web.StreamResponse):
                return primed
            leased = primed.leased
            if name == EPD_PRIME:
                return self._granted(request, found, primed)
            if self.config.pooled:
                raw = json.dumps(with_transfer_params(found.body, primed.params)).encode()
            elif primed.keyed:
                raw = json.dumps(found.body).encode()
        elif name == EPD_PRIME:
            return web.json_response({"keys": [], "stored": 0, "primed": 0, "lease": None})
        del found  # only the bytes are forwarded: the parsed body is not held while it is
        reservation.resize(len(raw))
        try:
            return await self.forward(request, raw, reservation)
        finally:
            if leased and self.store is not None:
                self.store.release(leased)

    def _plan(self, request: web.BaseRequest, raw: bytes) -> Plan:
        """What to prime; BadRequest for a body the proxy will not forward."""
        return read_plan(route(request.method, request.path), raw, self.limits, pooled=self.config.pooled)

    def _too_large(self, request: web.BaseRequest) -> web.Response:
        return _error(request, too_large(self.limits), True)

    def _busy(self, size: int) -> ProxyError:
        message = (
            f"the proxy is holding other requests' bodies and has no room for this one's (about {size // MiB + 1} MiB "
            f"of its {self.budget.total // MiB} MiB for all requests, {raise_it('max_buffered_bytes')} and the proxy's "
            "memory limit with it); retry later"
        )
        return ProxyError(503, message)

    async def _prime(self, request: web.BaseRequest, found: Plan) -> Primed | web.StreamResponse:
        """Key the request's parts and prime what its unit does not hold (a keyed route's: none):
        the outcome (transfer params, the keys leased until the request is done), or the error
        answer."""
        headers = _lowered(request.headers.items())
        name = route(request.method, request.path)
        # Only parts of the body itself can carry a key to the engines; any other is primed as it is.
        body_parts = in_body(found.body)
        items = [part.item for part in found.parts]
        keyable = [p.item for p in (*found.parts, *found.embeds) if id(p.item.part) in body_parts]
        try:
            version = requested_version(headers)
            replaced = key_parts(name, keyable, version, required=self.config.require_weights_version)
        except BadRequest as error:
            return _error(request, ProxyError(400, str(error), error.param))
        keyed = replaced is not None
        if replaced:
            self.metrics.observe_replaced_uuids(name, len(replaced))
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug(
                    "%s %s: the client's uuids replaced by their parts' keys: %s",
                    request.method,
                    request.path,
                    ", ".join(f"{uuid[:128]!r} -> {item.part['uuid']}" for item, uuid in replaced),
                )
        if name in KEYED or not items:
            return Primed({}, [], keyed)
        encoders = self.encoders.usable()
        if not encoders:
            self.metrics.observe_prime_failure("no_encoder")
            return _error(request, no_encoder(found.parts))
        extra = found.prime_fields
        # Looked up in the store: parts keyed by us, of a request without hash factors (vLLM then
        # names the entry by the key itself). The others are primed as they are, every time.
        flights = self.flights if keyed and not extra else None
        looked_up = {
            i: key
            for i, item in enumerate(items)
            if flights is not None and id(item.part) in body_parts and (key := own_key(item))
        }
        plain = [i for i in range(len(items)) if i not in looked_up]
        with_primes = prime_headers(headers)
        slots = asyncio.Semaphore(self.limits.prime_concurrency_per_request)

        in_flight = self.metrics.primes_in_flight

        async def prime_one(item: MediaItem) -> None:
            async with slots:
                first, self._rotation = self._rotation, self._rotation + 1
                in_flight.inc()
                try:
                    await self.primer.prime(
                        [item], encoders, model=found.model, headers=with_primes, first=first, extra_body=extra
                    )
                finally:
                    in_flight.dec()

        async def prime_plain() -> dict[str, Any]:
            if not plain:
                return {}
            first, self._rotation = self._rotation, self._rotation + len(plain)
            in_flight.inc(len(plain))
            try:
                params = await self.primer.prime(
                    [items[i] for i in plain],
                    encoders,
                    model=found.model,
                    pooled=self.config.pooled,
                    headers=with_primes,
                    first=first,
                    max_concurrency=self.limits.prime_concurrency_per_request,
                    extra_body=extra,
                )
            finally:
                in_flight.dec(len(plain))
            self.metrics.observe_primed([MEDIA_KINDS[items[i].kind] for i in plain])
            return params

        async def look_up() -> Any:
            if flights is None or not looked_up:
                return None
            return await flights.resolve([(key, items[i]) for i, key in looked_up.items()], prime_one, "encoders")

        started = time.monotonic()
        outcome, params = await asyncio.gather(look_up(), prime_plain(), return_exceptions=True)
        failures = [
            MediaFailure(order[f.index], f.url, f.encoders, f.error, f.kind)
            for result, order in ((outcome, list(looked_up)), (params, plain))
            if isinstance(result, PrimeError)
            for f in result.failures
        ]
        leased = [] if outcome is None or isinstance(outcome, BaseException) else outcome.leased
        for result in (outcome, params):
            if isinstance(result, BaseException) and not isinstance(result, PrimeError):
                if leased and self.store is not None:
                    self.store.release(leased)
                raise result
        if failures:
            if leased and self.store is not None:
                self.store.release(leased)
            failed = PrimeError("encoders", len(items), sorted(failures, key=lambda f: f.index))
            failure = prime_failure(failed, found.parts)
            self.metrics.observe_prime_failure("client_error" if failure.status < 500 else "encoder_error")
            logger.warning("%s %s answered %d, not forwarded: %s", request.method, request.path, failure.status, failed)
            return _error(request, failure)
        stored = 0
        if outcome is not None:
            for index, name in zip(looked_up, outcome.names, strict=True):
                items[index].part["uuid"] = name  # type: ignore[index]  # the store name it is read under
            stored = len(outcome.stored)
            self.metrics.observe_found([MEDIA_KINDS[kind] for kind in outcome.stored], outcome.waited)
        self.metrics.observe_prime_seconds(time.monotonic() - started)
        assert isinstance(params, dict)
        return Primed(params, leased, keyed, stored)

    def _granted(self, request: web.BaseRequest, found: Plan, primed: Primed) -> web.StreamResponse:
        """POST /epd/v1/prime's answer: each part's key (its uuid to render with), what was
        primed, and a grant of the leases for the client's render and generate."""
        lease = None
        seconds = found.body.get("lease_seconds", GRANT_SECONDS)
        if not isinstance(seconds, int | float) or isinstance(seconds, bool) or not 0 < seconds <= MAX_GRANT_SECONDS:
            if primed.leased and self.store is not None:
                self.store.release(primed.leased)
            message = f"'lease_seconds' must be a number of seconds above 0 and at most {MAX_GRANT_SECONDS:g}"
            return _error(request, ProxyError(400, message, "lease_seconds"))
        if primed.leased:
            assert self.grants is not None
            if not self.grants.room(len(primed.leased)):
                assert self.store is not None
                self.store.release(primed.leased)
                message = (
                    f"the proxy already leases {MAX_GRANTED_KEYS} keys to clients that prime through it (each keeps "
                    "the janitor from evicting an entry); retry later"
                )
                return _error(request, ProxyError(503, message))
            lease = self.grants.grant(primed.leased, float(seconds))
        keys = [part.item.part.get("uuid") for part in found.parts]
        answer: dict[str, Any] = {
            "keys": keys,
            "stored": primed.stored,
            "primed": len(keys) - primed.stored,
            "lease": lease,
            "lease_seconds": seconds if lease else None,
        }
        if self.config.pooled:
            answer["ec_transfer_params"] = primed.params
        return web.json_response(answer)

    async def forward(
        self, request: web.BaseRequest, body: bytes | None, reservation: Reservation | None = None
    ) -> web.StreamResponse:
        """Send the request upstream (``body``: the bytes read, or None to stream the client's
        own, if any) and pass its answer on, all within the request timeout. ``reservation``
        (the bytes of ``body``) is given back once the upstream answered."""
        session = self._session
        assert session is not None, "serve the proxy inside `async with`"
        headers = forwarded(_lowered(request.headers.items()), REQUEST_DROPPED)
        data: bytes | AsyncIterator[bytes] | None = body
        if body is None and request.body_exists:
            if (refused := _expectation(request)) is not None:
                return refused
            _continue(request)
            data = request.content.iter_any()
            if request.content_length is not None:  # else aiohttp sends it on chunked
                headers.append(("content-length", str(request.content_length)))
        headers += self.added_headers(request, headers)
        upstream = self.upstream_for(request)
        url = URL(upstream + request.raw_path, encoded=True)
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_seconds
        if self.grants is not None and (lease := requested_lease(headers)) is not None:
            with self.grants.carry(lease):  # what it primed stays leased while this runs
                return await self._forward(request, session, upstream, url, headers, data, deadline, reservation)
        return await self._forward(request, session, upstream, url, headers, data, deadline, reservation)

    def upstream_for(self, request: web.BaseRequest) -> str:
        """Where ``request`` goes: the unit's router or consumer (the gateway's: a unit)."""
        return self._upstream

    def added_headers(self, request: web.BaseRequest, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """Headers the proxy adds to what it forwards (the gateway's: the weights version)."""
        return []

    async def _forward(
        self,
        request: web.BaseRequest,
        session: ClientSession,
        upstream: str,
        url: URL,
        headers: list[tuple[str, str]],
        data: bytes | AsyncIterator[bytes] | None,
        deadline: float,
        reservation: Reservation | None,
    ) -> web.StreamResponse:
        try:
            async with asyncio.timeout_at(deadline):
                answer = await self._send(session, request.method, url, headers, data)
        except TimeoutError:
            seconds = self.config.request_timeout_seconds
            return _error(request, ProxyError(504, f"the upstream {upstream} did not answer within {seconds:g} s"))
        except ClientConnectorError as error:
            return _error(request, ProxyError(502, f"the upstream {upstream} is unreachable: {error}"))
        except ClientError as error:
            return _error(request, ProxyError(502, f"the upstream's answer broke off: {error}"))
        finally:
            if reservation is not None:
                reservation.release()
        # Released whole (its request sent whole and its answer read whole) it goes back to
        # the pool; aiohttp closes it otherwise: an upstream that answered early, before it
        # read the whole body, never gets the next request on the rest of this one's.
        try:
            return await self._relay(request, answer, deadline, upstream)
        finally:
            answer.release()

    async def _send(
        self,
        session: ClientSession,
        method: str,
        url: URL,
        headers: list[tuple[str, str]],
        data: bytes | AsyncIterator[bytes] | None,
    ) -> ClientResponse:
        """The upstream's answer (its head). A request whose connection closed before any answer
        (a server closing an idle connection as it was reused: vLLM's uvicorn does after 5 s) is
        sent once more, if its body can be (bytes, or none)."""
        for attempt in (1, 2):
            try:
                return await session.request(
                    method, url, data=data, headers=headers, allow_redirects=False, auto_decompress=False
                )
            except (ServerDisconnectedError, ClientOSError):
                if attempt == 2 or not (data is None or isinstance(data, bytes)):
                    raise
        raise AssertionError("unreachable")

    async def _relay(
        self, request: web.BaseRequest, answer: ClientResponse, deadline: float, upstream: str
    ) -> web.StreamResponse:
        """Pass the upstream's answer on: whole when small, else chunk by chunk as it comes
        (pausing the upstream while the client reads slower)."""
        headers = CIMultiDict(forwarded(_decoded(answer.raw_headers), ANSWER_DROPPED))
        length = answer.content_length
        event_stream = answer.headers.get("content-type", "").startswith("text/event-stream")
        if request.method != "HEAD" and length is not None and length <= HELD_ANSWER_BYTES and not event_stream:
            try:
                async with asyncio.timeout_at(deadline):
                    body = await answer.read()
            except TimeoutError:
                seconds = self.config.request_timeout_seconds
                return _error(request, ProxyError(504, f"the upstream {upstream} did not answer within {seconds:g} s"))
            except ClientError as error:
                return _error(request, ProxyError(502, f"the upstream's answer broke off: {error}"))
            return web.Response(status=answer.status, reason=answer.reason, body=body, headers=headers)
        response = web.StreamResponse(status=answer.status, reason=answer.reason, headers=headers)
        if length is not None:
            response.content_length = length
        await response.prepare(request)
        try:
            async with asyncio.timeout_at(deadline):
                async for chunk in answer.content.iter_any():
                    await response.write(chunk)
        except TimeoutError:
            seconds = self.config.request_timeout_seconds
            logger.warning("%s %s: the answer took longer than %g s, cut short", request.method, request.path, seconds)
            raise _CutShort from None
        except ClientError as error:
            logger.warning("%s %s: the upstream's answer broke off: %s", request.method, request.path, error)
            raise _CutShort from None
        await response.write_eof()
        return response

    async def _metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def _lowered(headers: Any) -> list[tuple[str, str]]:
    """Header names lower-cased (HTTP/2's form: every later lookup is a compare)."""
    return [(name.lower(), value) for name, value in headers]


def _decoded(raw: Sequence[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    return [(name.decode("latin-1").lower(), value.decode("latin-1")) for name, value in raw]


async def _read(request: web.BaseRequest, limit: int) -> bytes:
    """The whole body; _TooLarge past ``limit`` bytes (a chunked one, counted as it comes)."""
    chunks, size = [], 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(limits: Limits) -> ProxyError:
    """413: a body over ``limits``' bound, wherever it was read (the proxy, the picker)."""
    return ProxyError(
        413,
        f"the request body is larger than the proxy's limit of {limits.max_request_bytes} bytes; "
        f"{raise_it('max_request_bytes')}",
    )


def read_plan(name: str, raw: bytes, limits: Limits, *, pooled: bool = False) -> Plan:
    """A body of route ``name`` read as the proxy reads it (core.plan), within ``limits``' depth
    and media parts; BadRequest for one it will not forward."""
    try:
        found = plan(name, raw, pooled=pooled)
    except RecursionError:  # deeper than Python's parser goes
        raise BadRequest(_too_deep(limits)) from None
    # No deeper than it has brackets: most bodies need no walk.
    if raw.count(b"[") + raw.count(b"{") > limits.max_json_depth and nested_deeper(found.body, limits.max_json_depth):
        raise BadRequest(_too_deep(limits))
    if len(found.parts) > limits.max_media_parts:
        raise BadRequest(
            f"the request has {len(found.parts)} media parts, over the proxy's limit of {limits.max_media_parts} "
            f"a request (each is a request to an encoder); send them in several requests or "
            f"{raise_it('max_media_parts')}",
            found.parts[limits.max_media_parts].param,
        )
    return found


def _too_deep(limits: Limits) -> str:
    depth = limits.max_json_depth
    return f"the request body nests JSON deeper than the proxy's limit of {depth} levels; {raise_it('max_json_depth')}"


def _expectation(request: web.BaseRequest) -> web.Response | None:
    """The answer to an Expect the proxy cannot meet (RFC 9110 §10.1.1: 417), else None."""
    expect = request.headers.get("Expect")
    if expect is None or expect.lower() == "100-continue":
        return None
    return _error(
        request, ProxyError(417, f"the EPD proxy meets no expectation but 100-continue, not {expect!r}"), True
    )


def _continue(request: web.BaseRequest) -> None:
    """Let a client that waits for it send its body (curl does above 1 MiB), as aiohttp's docs
    tell an Expect handler that accepts to do."""
    if request.version == HttpVersion11 and request.headers.get("Expect", "").lower() == "100-continue":
        assert request.transport is not None
        request.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")


def _error(request: web.BaseRequest, error: ProxyError, close: bool = False) -> web.Response:
    """The proxy's own answer, in the route's error shape; ``close``: the connection ends after
    it (a body may be left unread, or the client is not to be trusted with another request)."""
    body = json.dumps(error_body(error, request.path)).encode()
    response = web.Response(status=error.status, body=body, content_type="application/json")
    if close:
        response.force_close()
    return response


async def _healthy(request: web.Request) -> web.Response:
    # Alive is all it says: the pod's readiness already requires the router's and every
    # encoder's (docs/proxy.md).
    return web.Response(text="ok")


class _Server(web.Server):
    """aiohttp's low-level server, whose connections answer malformed requests in vLLM's error
    shape (_Connection)."""

    def __init__(self, handler: Any, limits: Limits, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.limits = limits
        self.connection_args = {k: v for k, v in kwargs.items() if k != "handler_cancellation"}

    def __call__(self) -> web.RequestHandler:
        return _Connection(self, self.limits, loop=asyncio.get_running_loop(), **self.connection_args)


class _Connection(web.RequestHandler):
    """One client connection of aiohttp's server; only its error answers are the proxy's: in
    vLLM's shape, naming the limit a request went over, and without a traceback in the log for
    a client's malformed request."""

    def __init__(self, manager: web.Server, limits: Limits, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.limits = limits

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp's own: the connection is dropped
            raise ConnectionError("the answer was under way: the connection is dropped to cut it short")
        if isinstance(exc, HttpProcessingError):
            limits = self.limits
            bounds = (
                f"(the proxy's limits: {limits.max_header_bytes} bytes a request line or header field, "
                f"{raise_it('max_header_bytes')}; {limits.max_headers} header and trailer fields, "
                f"{raise_it('max_headers')})"
            )
            logger.debug("refused a malformed request from %s: %s", request.remote, exc)
            if isinstance(exc, LineTooLong):
                error = ProxyError(431, f"a request line or header field is too long: {exc.message} {bounds}")
            else:
                error = ProxyError(400, f"malformed HTTP request: {exc.message} {bounds}")
        else:
            logger.error("the proxy failed on a request", exc_info=exc)
            error = ProxyError(status, "the proxy failed on this request; its log says why")
        return _error(request, error, True)


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
    tasks: Sequence[Coroutine[Any, Any, None]] = (),
) -> None:
    """Serve until ``stop`` is set, then finish the requests in flight (up to
    ``shutdown_timeout`` seconds) before closing. ``ready`` gets the ports listened on (the
    bound ones for port 0) once both listen. ``tasks`` run meanwhile (the gateway's watches)."""
    main = web.ServerRunner(proxy.server(), shutdown_timeout=shutdown_timeout)
    admin = web.AppRunner(proxy.admin_app(), access_log=None)
    background = []
    if proxy.encoders.dns:
        await proxy.encoders.refresh()  # the first requests must not find the list empty
        background.append(asyncio.create_task(proxy.encoders.run()))
    if proxy.store is not None:
        background.append(asyncio.create_task(_renew(proxy.store.leases)))
    background += [asyncio.create_task(task) for task in tasks]
    try:
        await main.setup()
        await web.TCPSite(main, host, port, backlog=LISTEN_BACKLOG).start()
        await admin.setup()
        await web.TCPSite(admin, host, metrics_port).start()
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
        for task in background:
            task.cancel()
        # Stops listening, closes idle connections, waits for the requests in flight.
        await main.cleanup()
        await admin.cleanup()


async def _renew(leases: Leases) -> None:
    """Touch the leases held every RENEW_SECONDS (the janitor trusts fresh ones only), forever."""
    while True:
        await asyncio.sleep(RENEW_SECONDS)
        try:
            leases.renew()
        except OSError as error:
            logger.warning("renewing the EC store leases failed: %s", error)
