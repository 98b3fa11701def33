"""The EPD gateway as a Gateway API Inference Extension endpoint picker (EPP).

A Gateway API gateway (Istio, agentgateway, NGINX Gateway Fabric, or Envoy on its own) routes an
HTTPRoute's requests to an ``InferencePool`` by asking the pool's endpoint picker, per request,
which of the pool's endpoints serves it: Envoy's external processing protocol
(``envoy.service.ext_proc.v3.ExternalProcessor/Process``, a bidirectional gRPC stream per
request), as GAIE's proposal 004 specifies it. The EPD gateway answers it with the same
placement it gives its own HTTP clients (``UnitsView.rank``): the unit whose EC store holds the
request's pictures, within the bounded load; then the unit's EPD proxy primes what it lacks.

Per stream, in ``FULL_DUPLEX_STREAMED`` body mode (what the protocol requires):

1. ``request_headers``: kept; nothing is answered yet (the pick needs the body). A request
   without a body (``end_of_stream``) is picked at once, by its session header alone.
2. ``request_body`` chunks: buffered within the proxy's bounds (``--max-request-bytes``, and the
   memory budget the gateway's own requests share: none left is a 429, shedding). At the end of
   the body it is read as the proxy reads it (``read_plan``: a body the units would refuse is
   refused here, in vLLM's error shape), and placed.
3. The answer to the headers: ``x-gateway-destination-endpoint: ip:port[,ip:port...]`` (the
   pick, then ``--epp-fallbacks`` more units in the key's rendezvous order, for gateways that go
   down the list) in a header and in the ``envoy.lb`` dynamic metadata, the model's
   weights version as ``X-EPD-Weights-Version`` unless the client sent one, and the route cache
   cleared; then the body back unchanged, in chunks of at most 62,000 bytes.
4. The response's headers, body chunks and trailers are passed back as they come. The unit holds
   the request in its in-flight count until the stream ends.

A gateway's subset hint (``envoy.lb.subset_hint``/``x-gateway-destination-endpoint-subset``, a
list of ``ip`` or ``ip:port``, or one comma-separated string) limits the pick to those endpoints;
none ready among them is a 503. Its report of the endpoint that served
(``envoy.lb``/``x-gateway-destination-endpoint-served``) is counted when it differs from the
pick, and not needed (Envoy on its own sends none). A stream that breaks the protocol (a body
before the headers, a second request) ends with INVALID_ARGUMENT; one that ends mid-body picks
nothing. Either way, what it held is given back.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import json
import logging
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from epd_client import NoReadyUnitError, Unit, affinity_key
from epd_operator.proxy_limits import raise_it, request_cost, reservation

from .budget import Reservation
from .core import EPD_PRIME, PASSED_THROUGH, REFUSED, BadRequest, ProxyError, error_body, refusal, route
from .gateway import PRIME_REFUSAL, Gateway, UnitsView, no_unit, placement_key
from .keys import SESSION_HEADER, WEIGHTS_VERSION_HEADER, header
from .media_urls import screen
from .server import read_plan, too_large

logger = logging.getLogger("epd_dataplane")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# GAIE's names (pkg/epp/metadata in gateway-api-inference-extension).
DESTINATION = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
# Envoy takes streamed body chunks of up to 64 KiB; GAIE's pickers send 62,000 bytes at most.
MAX_CHUNK_BYTES = 62_000
# GAIE's health services: the reference picker's (liveness, readiness, its pool's) and Envoy's
# check of the ext_proc cluster.
HEALTH_SERVICES = ("", "liveness", "readiness", "inference-extension", EXT_PROC_SERVICE)
# How often the health services look whether the gateway knows its units yet (GAIE's: 100 ms).
READY_POLL_SECONDS = 0.1
# gRPC messages from a gateway are body chunks of 64 KiB at most (or headers): more is no gateway.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class ProtocolError(Exception):
    """The gateway broke the ext_proc protocol: the stream ends with INVALID_ARGUMENT."""


def endpoint(unit: Unit) -> str:
    """``ip:port`` of the unit's EPD proxy (``[ip]:port`` for IPv6), as the gateway dials it."""
    assert unit.front_url is not None
    return urlsplit(unit.front_url).netloc


def subset_hint(metadata: Mapping[str, Mapping[str, Any]]) -> frozenset[str] | None:
    """The endpoints a gateway allows (``ip:port``, or ``ip`` for any port), from its filter
    metadata; None when it gives no hint. A list, or one comma-separated string."""
    given = metadata.get(SUBSET_NAMESPACE, {}).get(SUBSET_KEY)
    if given is None:
        return None
    items = given if isinstance(given, list) else [given]
    return frozenset(
        part.strip() for item in items if isinstance(item, str) for part in item.split(",") if part.strip()
    )


def allows(subset: frozenset[str], unit: Unit) -> bool:
    at = endpoint(unit)
    host = at.rsplit(":", 1)[0].strip("[]")
    return at in subset or host in subset


def served(metadata: Mapping[str, Mapping[str, Any]]) -> str | None:
    value = metadata.get(DESTINATION_NAMESPACE, {}).get(SERVED_KEY)
    return value if isinstance(value, str) else None


class EPPMetrics:
    """The picker's own metrics, in the gateway's registry (its picks count as the gateway's
    routed requests too)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._answered = Counter(
            "epd_epp_requests_total",
            "Requests the endpoint picker answered, by the HTTP status the gateway was told: 200 for a pick, else "
            "its immediate response (400 a body the units refuse, 413 too large, 429 shedding, 503 no unit).",
            ["code"],
            registry=registry,
        )
        self._protocol = Counter(
            "epd_epp_protocol_errors_total",
            "ext_proc streams ended with INVALID_ARGUMENT: the gateway broke the protocol.",
            registry=registry,
        )
        self._elsewhere = Counter(
            "epd_epp_served_elsewhere_total",
            "Responses the gateway reported served by another endpoint than the pick (a fallback).",
            registry=registry,
        )
        self.streams = Gauge("epd_epp_streams", "ext_proc streams open now.", registry=registry)

    def answered(self, code: int) -> None:
        self._answered.labels(str(code)).inc()

    def protocol_error(self) -> None:
        self._protocol.inc()

    def served_elsewhere(self) -> None:
        self._elsewhere.inc()


@dataclass
class Picker:
    """What every stream shares: the gateway it picks for (its units, bounds, memory budget,
    metrics and media policy, so a request through the picker and one through the gateway's own
    port are placed alike) and the picker's own metrics."""

    gateway: Gateway
    metrics: EPPMetrics
    fallbacks: int = 0
    """Units named after the pick, where a gateway that takes the list goes when the pick
    refuses connections (Istio's override_host); a standalone Envoy's ORIGINAL_DST cluster
    takes one endpoint only, so none by default."""


def picker_of(gateway: Gateway, fallbacks: int = 0) -> Picker:
    return Picker(gateway, EPPMetrics(gateway.metrics.registry), fallbacks)


class ExternalProcessor(ext_proc_grpc.ExternalProcessorServicer):
    """``envoy.service.ext_proc.v3.ExternalProcessor``: one ``_Stream`` per request."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    async def Process(
        self, request_iterator: AsyncIterator[ext_proc.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> None:
        stream = _Stream(self.picker)
        self.picker.metrics.streams.inc()
        try:
            while True:
                message = await context.read()
                if message is grpc.aio.EOF:
                    return
                for answer in await stream.on(message):
                    await context.write(answer)
                if stream.ended:
                    return
        except ProtocolError as error:
            self.picker.metrics.protocol_error()
            logger.warning("ext_proc stream refused: %s", error)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        finally:
            stream.close()
            self.picker.metrics.streams.dec()


class _Stream:
    """One request's ext_proc stream: what it was sent so far, and what it holds."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.headers: list[tuple[str, str]] | None = None
        self.metadata: dict[str, dict[str, Any]] = {}
        self.chunks: list[bytes] = []
        self.size = 0
        self.held: Reservation | None = None
        self.unit: str | None = None
        self.picked: str | None = None
        self.body_done = False
        self.ended = False

    async def on(self, message: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        if message.HasField("metadata_context"):
            for namespace, values in message.metadata_context.filter_metadata.items():
                self.metadata.setdefault(namespace, {}).update(MessageToDict(values))
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(message.request_headers)
        if kind == "request_body":
            return await self._request_body(message.request_body)
        if kind == "request_trailers":
            if self.headers is None or self.body_done:
                raise ProtocolError("request trailers came before the request headers or after the whole body")
            answers = await self._picked(body=True, end_of_stream=False)
            if self.ended:
                return answers
            return [*answers, ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())]
        if kind == "response_headers":
            if self.picked is None:
                raise ProtocolError("response headers came before the request was picked")
            seen = served(self.metadata)
            if seen is not None and seen != self.picked.split(",")[0]:
                self.picker.metrics.served_elsewhere()
            if message.response_headers.end_of_stream:
                self.close()
            return [ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse())]
        if kind == "response_body":
            body = message.response_body
            if body.end_of_stream:
                self.close()
            return [_streamed(chunk, last, "response_body") for chunk, last in _chunks(body.body, body.end_of_stream)]
        if kind == "response_trailers":
            self.close()
            return [ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())]
        raise ProtocolError(f"a ProcessingRequest without a request or response phase ({kind})")

    async def _request_headers(self, headers: ext_proc.HttpHeaders) -> list[ext_proc.ProcessingResponse]:
        if self.headers is not None:
            raise ProtocolError("a second request's headers on one stream: one stream is one request")
        self.headers = [
            (h.key.lower(), (h.raw_value or h.value.encode()).decode("latin-1")) for h in headers.headers.headers
        ]
        if headers.end_of_stream:
            return await self._picked(body=False, end_of_stream=True)
        limits = self.picker.gateway.limits
        declared = header(self.headers, "content-length")
        length = int(declared) if declared is not None and declared.isdigit() else None
        if length is not None and length > limits.max_request_bytes:
            return self._refuse(too_large(limits))
        self.held = self.picker.gateway.budget.try_reserve(
            reservation(limits.max_request_bytes if length is None else length, limits)
        )
        if self.held is None:
            message = (
                f"the endpoint picker is holding other requests' bodies and has no room for this one's (its "
                f"{self.picker.gateway.budget.total // 2**20} MiB for all of them, {raise_it('max_buffered_bytes')}); retry "
                "later"
            )
            return self._refuse(ProxyError(429, message))
        return []

    async def _request_body(self, body: ext_proc.HttpBody) -> list[ext_proc.ProcessingResponse]:
        if self.headers is None or self.body_done:
            raise ProtocolError("a request body chunk before the request headers or after the end of the body")
        self.size += len(body.body)
        limits = self.picker.gateway.limits
        if self.size > limits.max_request_bytes:
            return self._refuse(too_large(limits))
        self.chunks.append(body.body)
        if not body.end_of_stream:
            return []
        return await self._picked(body=True, end_of_stream=True)

    async def _picked(self, *, body: bool, end_of_stream: bool) -> list[ext_proc.ProcessingResponse]:
        """The whole request is here (``body``: it has one, even empty): read it and place it; the
        answer to the headers, then the body back, its last chunk ``end_of_stream`` unless
        trailers follow."""
        self.body_done = True
        assert self.headers is not None
        raw = b"".join(self.chunks)
        self.chunks = []
        gateway = self.picker.gateway
        path = (header(self.headers, ":path") or "/").split("?")[0]
        name = route(header(self.headers, ":method") or "GET", path)
        if name in REFUSED:
            return self._refuse(ProxyError(400, refusal(name)))
        if name == EPD_PRIME:
            return self._refuse(ProxyError(400, PRIME_REFUSAL))
        key = affinity_key((), session=header(self.headers, SESSION_HEADER))
        if name not in PASSED_THROUGH:
            cost = request_cost(raw)
            if self.held is not None and cost > self.held.size and not self.held.resize(cost):
                return self._refuse(ProxyError(429, "the endpoint picker has no room to read this body now; retry"))
            try:
                found = read_plan(name, raw, gateway.limits)
                key = placement_key(found, self.headers, gateway.units.weights_version)
            except BadRequest as error:
                return self._refuse(ProxyError(400, str(error), error.param))
            refused = await screen(found.parts, gateway.config.media, gateway.resolve)
            if refused is not None:
                return self._refuse(refused)
        subset = subset_hint(self.metadata)
        try:
            units, own = gateway.units.rank(
                key, None if subset is None else (lambda u: allows(subset, u)), fallbacks=self.picker.fallbacks
            )
        except NoReadyUnitError as error:
            return self._refuse(no_unit(error))
        destination = ",".join(endpoint(u) for u in units)
        self.unit, self.picked = units[0].name, destination
        gateway.units.loads[self.unit] += 1
        gateway.gateway_metrics.observe(self.unit, key, own)
        self.picker.metrics.answered(200)
        if self.held is not None:
            self.held.release()
            self.held = None
        answers = [self._headers_answer(destination, len(raw) if body else None)]
        if body:
            answers += [_streamed(chunk, last, "request_body") for chunk, last in _chunks(raw, end_of_stream)]
        return answers

    def _headers_answer(self, destination: str, length: int | None) -> ext_proc.ProcessingResponse:
        """The pick (and its fallbacks, ``destination``) in the header and the metadata."""
        assert self.headers is not None
        mutation = ext_proc.HeaderMutation(set_headers=[_set(DESTINATION, destination)])
        version = self.picker.gateway.units.weights_version
        if version is not None and header(self.headers, WEIGHTS_VERSION_HEADER) is None:
            mutation.set_headers.append(_set(WEIGHTS_VERSION_HEADER, version))
        if length is not None:  # the body goes back unchanged: so does its length
            mutation.set_headers.append(_set("content-length", str(length)))
        metadata = struct_pb2.Struct()
        metadata.update({DESTINATION_NAMESPACE: {DESTINATION: destination}})
        return ext_proc.ProcessingResponse(
            request_headers=ext_proc.HeadersResponse(
                response=ext_proc.CommonResponse(header_mutation=mutation, clear_route_cache=True)
            ),
            dynamic_metadata=metadata,
        )

    def _refuse(self, error: ProxyError) -> list[ext_proc.ProcessingResponse]:
        """The gateway answers the client ``error`` itself (in vLLM's error shape); the stream ends."""
        self.picker.metrics.answered(error.status)
        self.ended = True
        self.close()
        path = (header(self.headers or [], ":path") or "").split("?")[0]
        body = json.dumps(error_body(error, path)).encode()
        headers = [_set("content-type", "application/json")]
        if error.status == 429:
            headers.append(_set("retry-after", "1"))
        return [
            ext_proc.ProcessingResponse(
                immediate_response=ext_proc.ImmediateResponse(
                    status=http_status_pb2.HttpStatus(code=error.status),
                    headers=ext_proc.HeaderMutation(set_headers=headers),
                    body=body,
                    details=f"epd_epp_{error.status}",
                )
            )
        ]

    def close(self) -> None:
        """Give back what the stream holds: its body's room, its unit's in-flight count. Once."""
        if self.held is not None:
            self.held.release()
            self.held = None
        if self.unit is not None:
            self.picker.gateway.units.loads[self.unit] -= 1
            self.unit = None
        self.chunks = []


def _set(name: str, value: str) -> base_pb2.HeaderValueOption:
    # raw_value: Envoy reads it (value and raw_value both set is refused).
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=name, raw_value=value.encode()))


def _chunks(data: bytes, end_of_stream: bool) -> Iterable[tuple[bytes, bool]]:
    """``data`` in chunks Envoy takes, the last one marked ``end_of_stream`` (one empty chunk for
    no data)."""
    if not data:
        yield b"", end_of_stream
        return
    for start in range(0, len(data), MAX_CHUNK_BYTES):
        yield data[start : start + MAX_CHUNK_BYTES], end_of_stream and start + MAX_CHUNK_BYTES >= len(data)


def _streamed(chunk: bytes, last: bool, phase: str) -> ext_proc.ProcessingResponse:
    streamed = ext_proc.StreamedBodyResponse(body=chunk, end_of_stream=last)
    answer = ext_proc.BodyResponse(
        response=ext_proc.CommonResponse(body_mutation=ext_proc.BodyMutation(streamed_response=streamed))
    )
    return ext_proc.ProcessingResponse(**{phase: answer})


# --------------------------------------------------------------------------- serving


@dataclass(frozen=True)
class EPPConfig:
    port: int
    """The ext_proc port (GAIE's 9002); 0: a free one (tests)."""
    health_port: int
    """The gRPC health port (GAIE's 9003)."""
    secure: bool = True
    """TLS (the reference picker's default), with cert_path's or a self-signed certificate."""
    cert_path: str | None = None
    """A folder with tls.crt and tls.key (a mounted Secret); none: a self-signed one."""
    host: str = "0.0.0.0"
    fallbacks: int = 0
    """Picker.fallbacks."""


def self_signed(names: Sequence[str]) -> tuple[bytes, bytes]:
    """A key and a certificate for ``names``, valid for ten years, as GAIE's picker makes one when
    it is given none (gateways point at it without verifying: Envoy's empty validation context)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "EPD endpoint picker")])
    now = dt.datetime.now(dt.UTC)
    alternative: list[x509.GeneralName] = []
    for name in names:
        try:
            alternative.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alternative.append(x509.DNSName(name))
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName(alternative), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return pem_key, certificate.public_bytes(serialization.Encoding.PEM)


def credentials(config: EPPConfig, names: Sequence[str]) -> grpc.ServerCredentials | None:
    if not config.secure:
        return None
    if config.cert_path:
        folder = Path(config.cert_path)
        key, cert = (folder / "tls.key").read_bytes(), (folder / "tls.crt").read_bytes()
    else:
        key, cert = self_signed(names)
    return grpc.ssl_server_credentials([(key, cert)])


class EPPServer:
    """The picker's gRPC servers: ext_proc (with Envoy's health check) on ``port``, GAIE's health
    services on ``health_port``. Ready (SERVING) once the gateway knows its units."""

    def __init__(self, picker: Picker, config: EPPConfig, names: Sequence[str] = ("localhost",)) -> None:
        self.picker = picker
        self.config = config
        self.health = health.aio.HealthServicer()
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ]
        self._main = grpc.aio.server(options=options)
        self._health = grpc.aio.server(options=options)
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(picker), self._main)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._main)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health)
        address = f"{config.host}:{config.port}"
        tls = credentials(config, names)
        self.port = self._main.add_secure_port(address, tls) if tls else self._main.add_insecure_port(address)
        self.health_port = self._health.add_insecure_port(f"{config.host}:{config.health_port}")

    async def start(self) -> None:
        for service in HEALTH_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self._main.start()
        await self._health.start()

    async def ready_once(self, units: UnitsView) -> None:
        """SERVING once the gateway knows its units (its watches answered), as GAIE's picker once
        its pool synced."""
        while not units.synced:
            await asyncio.sleep(READY_POLL_SECONDS)
        for service in HEALTH_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self._main.stop(grace)
        await self._health.stop(0)
