"""What the EPD proxy decides, as pure functions: which requests are primed and what in them,
which headers go where, the errors clients get, and the encoders a DNS answer names.

The shell (server.py) does the I/O around these.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from epd_client import MEDIA_KINDS, MediaItem, PrimeError, media_items

# Paths whose media the proxy primes, by the route label metrics use. Only POSTs: a GET of
# /v1/responses/{id} or anything else passes through, as do the scale-out paths
# (/v1/chat/completions/render, /inference/v1/generate) of clients that prime themselves.
PRIMED_ROUTES = {"/v1/chat/completions": "chat_completions", "/v1/responses": "responses"}
OTHER = "other"
# GET /health passes through too, under a label of its own: the kubelet's readiness probe asks
# it every few seconds through the front port, and its 502s while the router starts would
# otherwise read as clients' failed requests.
HEALTH = "health"
PASSED_THROUGH = frozenset({OTHER, HEALTH})

# RFC 9110 §7.6.1: meant for one connection only, never forwarded; so are the fields the
# Connection header names.
HOP_BY_HOP = frozenset({"connection", "proxy-connection", "keep-alive", "te", "transfer-encoding", "upgrade"})
# Also dropped from a request: Host is the upstream's, Expect was the client's exchange with the
# proxy, and the body's framing is the proxy's own (a Pools body is re-serialised; a streamed
# one keeps the client's length, or goes chunked): http1.py sets Host and Content-Length.
REQUEST_DROPPED = HOP_BY_HOP | {"host", "expect", "content-length"}
# Dropped from an answer: its framing is the proxy's to the client, set by http1.py.
ANSWER_DROPPED = HOP_BY_HOP | {"content-length"}

# Client headers that also go with each prime: credentials (engines run with --api-key check
# every request) and trace context. x-request-id becomes the primes' id prefix (epd_client).
PRIME_HEADERS = ("authorization", "x-request-id", "traceparent", "tracestate")


def route(method: str, path: str) -> str:
    """The request's route label: a primed one, or ``health`` or ``other`` (passed through
    untouched)."""
    if method == "POST":
        return PRIMED_ROUTES.get(path, OTHER)
    return HEALTH if path == "/health" else OTHER


class BadRequest(Exception):
    """A primed route's body the proxy cannot read: answered 400, nothing forwarded."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class MediaPart:
    item: MediaItem
    param: str
    """Where the part is in the request, e.g. ``messages[1].content[0]``."""


@dataclass(frozen=True)
class Plan:
    """What to prime for one request of a primed route."""

    body: dict[str, Any]
    parts: tuple[MediaPart, ...]
    model: str | None
    """The request's ``model``: the primes name the same (None: the engines' default)."""


def plan(route_name: str, raw: bytes) -> Plan:
    """Parse a chat completions or Responses request and find its media parts (epd_client's
    definition). Chat: ``messages``. Responses: the ``input`` items (a string input has none)
    and vLLM's ``previous_input_messages``, which it renders before them. Raises BadRequest."""
    try:
        body = json.loads(raw)
    except ValueError as error:  # UnicodeDecodeError is one
        raise BadRequest(f"the request body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if route_name == "chat_completions":
        lists = [("messages", _list_field(body, "messages", "a list of messages"))]
    else:
        given = body.get("input")
        if not isinstance(given, str):
            given = _list_field(body, "input", "a string or a list of input items")
        previous = body.get("previous_input_messages")
        if previous is not None and not isinstance(previous, list):
            raise BadRequest("'previous_input_messages' must be a list of messages", "previous_input_messages")
        lists = [("previous_input_messages", previous or []), ("input", given if isinstance(given, list) else [])]
    parts = tuple(
        MediaPart(item, f"{field}[{item.message}].content[{item.position}]")
        for field, messages in lists
        for item in media_items(messages)
    )
    model = body.get("model")
    return Plan(body, parts, model if isinstance(model, str) else None)


def _list_field(body: Mapping[str, Any], name: str, what: str) -> list[Any]:
    value = body.get(name)
    if not isinstance(value, list):
        raise BadRequest(f"'{name}' must be {what}", name)
    return value


def with_transfer_params(body: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The body a Pools model's consumer needs: the encoders' ``ec_transfer_params`` (where it
    pulls each embedding), under any the client sent itself, which win."""
    return {**body, "ec_transfer_params": {**params, **(body.get("ec_transfer_params") or {})}}


def forwarded(headers: Sequence[tuple[str, str]], drop: frozenset[str] = HOP_BY_HOP) -> list[tuple[str, str]]:
    """End-to-end headers only, repeated ones kept in order: none of ``drop`` (REQUEST_DROPPED or
    ANSWER_DROPPED, each with every hop-by-hop header), nor one the Connection header names.
    Names are lower-case, as the proxy's parsers give them (and as HTTP/2 sends them)."""
    named = [value for name, value in headers if name == "connection"]
    if named:
        drop = drop | {token.strip().lower() for value in named for token in value.split(",")}
    return [(name, value) for name, value in headers if name not in drop]


def prime_headers(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The client's headers that go with its primes (PRIME_HEADERS), first value of each. Names
    are lower-case, as the proxy's parsers give them."""
    found: dict[str, str] = {}
    for name, value in headers:
        if name in PRIME_HEADERS and name not in found:
            found[name] = value
    return found


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's error shape (OpenAI's, with the status as an integer ``code``), so clients parse the
    proxy's errors as the engines' own: the type is the status' name, as vLLM's BadRequestError."""
    phrase = HTTPStatus(status).phrase.title().replace(" ", "").replace("-", "")
    kind = phrase if phrase.endswith("Error") else f"{phrase}Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def prime_failure(error: PrimeError, parts: Sequence[MediaPart]) -> tuple[int, dict[str, Any]]:
    """The answer to a request whose priming failed: an encoder's 4xx (a bad request stays bad:
    an unreachable media URL, an unknown model, bad credentials) is the client's, with that
    status; anything else (5xx, 408 and 429 retried to the end, timeouts, connection errors,
    or a Pools encoder announcing no transfer params) is a 502. Names every failed part."""
    codes = [f.error.status_code for f in error.failures]
    status = next((c for c in codes if c is not None and _is_clients(c)), HTTPStatus.BAD_GATEWAY)
    details = "; ".join(
        f"{MEDIA_KINDS.get(f.kind, f.kind)} {parts[f.index].param} ({f.url}) via {', '.join(f.encoders)}: "
        f"{f.error.reason}"
        for f in error.failures
    )
    message = (
        f"{len(error.failures)} of {len(parts)} media part(s) could not be encoded by the encoders, so the "
        f"request was not forwarded (its consumer would encode them itself): {details}"
    )
    return int(status), error_body(int(status), message, parts[error.failures[0].index].param)


def _is_clients(status: int) -> bool:
    # 408 and 429 are the encoders' trouble, retried as epd_client retries them.
    return 400 <= status < 500 and status not in (408, 429)


def no_encoder(parts: Sequence[MediaPart]) -> tuple[int, dict[str, Any]]:
    """The answer while the proxy knows no encoder (a Pools model's pool has no ready one)."""
    message = (
        f"no encoder is available to encode the request's {len(parts)} media part(s); the request was not "
        "forwarded (its consumer would encode them itself). Retry later."
    )
    return int(HTTPStatus.SERVICE_UNAVAILABLE), error_body(HTTPStatus.SERVICE_UNAVAILABLE, message, parts[0].param)


# --------------------------------------------------------------------------- encoders by DNS


@dataclass(frozen=True)
class DNSTarget:
    """``--encoders-dns HOST:PORT[,PORT...]``: a name whose addresses are encoder pods (a headless
    Service lists its ready pods' IPs), each serving an encoder engine on every port."""

    host: str
    ports: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> DNSTarget:
        host, sep, ports = text.rpartition(":")
        try:
            numbers = tuple(int(p) for p in ports.split(","))
        except ValueError:
            numbers = ()
        if not sep or not host or not numbers or not all(0 < p < 65536 for p in numbers):
            raise ValueError(f"expected HOST:PORT[,PORT...], e.g. demo-default-encoders.team-a.svc:8100, not {text!r}")
        return cls(host, numbers)


def encoder_urls(addresses: Iterable[str], ports: Sequence[int]) -> tuple[str, ...]:
    """One base URL per address and port, sorted so every refresh orders them alike (and the
    round-robin does not jump); IPv6 addresses in brackets."""
    hosts = sorted({ipaddress.ip_address(a) for a in addresses}, key=lambda a: (a.version, int(a)))
    return tuple(f"http://{f'[{a}]' if a.version == 6 else a}:{port}" for a in hosts for port in ports)
