"""What the EPD proxy decides, as pure functions: which requests are primed and what in them,
which headers go where, the errors clients get, and the encoders a DNS answer names.

The shell (server.py) does the I/O around these.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from epd_client import HASHED_FIELDS, MEDIA_KINDS, MediaItem, MediaPartError, PrimeError, keyed_items

# Paths whose media the proxy primes, by the route label metrics use: every route of vLLM 0.32
# and 0.33 that takes media into a generation. Only POSTs: a GET of /v1/responses/{id} or
# anything else passes through, as do /inference/v1/generate (of clients that primed and
# rendered through the proxy) and the routes that only tokenize (/tokenize,
# /v1/messages/count_tokens), which run no encoder. The renders are keyed, not primed (below).
PRIMED_ROUTES = {
    "/v1/chat/completions": "chat_completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",  # Anthropic's Messages API
    "/v1/chat/completions/batch": "chat_completions_batch",
    "/invocations": "invocations",  # SageMaker's: a body with messages is served as a chat completion
    "/cohere/v2/chat": "cohere_chat",
    "/v1/systemone": "structured_decisions",  # its media are refused (plan)
    # The proxy's own, not vLLM's: prime a chat request's media and answer their keys, without
    # forwarding (epd_client primes through it, then renders and generates itself).
    "/epd/v1/prime": "epd_prime",
}
EPD_PRIME = "epd_prime"
# Renders of clients that prime themselves (epd_client): no encoder runs, so nothing is primed,
# but the parts' uuids name what their generate reads from the EC store: bound to the parts'
# content as on a primed route. (vLLM drops the uuids of the Anthropic and Cohere renders.)
KEYED_ROUTES = {
    "/v1/chat/completions/render": "chat_completions_render",
    "/v1/responses/render": "responses_render",
}
KEYED = frozenset(KEYED_ROUTES.values())
# Routes whose media no prime can stand for, refused unread: their audio is uploaded as a file,
# cut and resampled for the model's feature extractor, not as a chat part.
REFUSED_ROUTES = {"/v1/audio/transcriptions": "transcriptions", "/v1/audio/translations": "translations"}
REFUSED = frozenset(REFUSED_ROUTES.values())
# The Anthropic Messages API's errors have a shape of their own (vLLM's AnthropicErrorResponse);
# its SDK reads the message from there.
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
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
# one keeps the client's length, or goes chunked): aiohttp's client sets Host and the framing.
REQUEST_DROPPED = HOP_BY_HOP | {"host", "expect", "content-length"}
# Dropped from an answer: its framing is the proxy's to the client, set by aiohttp's server.
ANSWER_DROPPED = HOP_BY_HOP | {"content-length"}

# Client headers that also go with each prime: credentials (engines run with --api-key check
# every request) and trace context. x-request-id becomes the primes' id prefix (epd_client).
PRIME_HEADERS = ("authorization", "x-request-id", "traceparent", "tracestate")


def route(method: str, path: str) -> str:
    """The request's route label: a primed, keyed or refused one, or ``health`` or ``other``
    (passed through untouched)."""
    if method == "POST":
        return PRIMED_ROUTES.get(path) or KEYED_ROUTES.get(path) or REFUSED_ROUTES.get(path, OTHER)
    return HEALTH if path == "/health" else OTHER


def refusal(route_name: str) -> str:
    """Why a request of a refused route is not forwarded, and what to send instead."""
    return (
        f"the EPD proxy does not forward {route_name}: the consumer would encode their audio itself, and no "
        "prime on the encoders can stand for it (vLLM cuts and resamples an uploaded file for this route). "
        "Send the audio as an input_audio part to /v1/chat/completions instead."
    )


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
    """The media parts: primed (on a primed route) and keyed."""
    model: str | None
    """The request's ``model``: the primes name the same (None: the engines' default)."""
    prime_fields: dict[str, Any] = field(default_factory=dict)
    """The request's fields every prime carries too: those vLLM keys a media item's embedding
    by (epd_client.HASHED_FIELDS), so the encoder stores it under the key the consumer looks up."""
    embeds: tuple[MediaPart, ...] = ()
    """The client's own embeddings parts: keyed, never primed."""


# Primed routes whose request vLLM reads without ``ec_transfer_params`` (its Cohere model has
# kv_transfer_params only): a Pools consumer could not pull their embeddings, so their media are
# refused there.
WITHOUT_TRANSFER_PARAMS = frozenset({"cohere_chat"})


def plan(route_name: str, raw: bytes, *, pooled: bool = False) -> Plan:
    """Parse a request of a primed or keyed route and find its media parts (epd_client's
    definition, on the messages vLLM makes of the request) and embeddings parts; ``pooled``: for
    a placement Pools model. Raises BadRequest."""
    try:
        body = json.loads(raw)
    except ValueError as error:  # UnicodeDecodeError is one
        raise BadRequest(f"the request body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if "ec_transfer_params" in body and route_name not in KEYED:  # a render's are its client's prime's
        raise BadRequest(
            "ec_transfer_params is the EPD proxy's to set: it tells a consumer the address to pull each embedding "
            "from, which the proxy takes from the encoders that computed them. Remove it (clients that prime "
            "themselves send it to /v1/chat/completions/render and /inference/v1/generate)",
            "ec_transfer_params",
        )
    found = _PLANNERS[route_name](body)
    parts = tuple(p for p in found if p.item.kind in MEDIA_KINDS)
    if parts and pooled and route_name in WITHOUT_TRANSFER_PARAMS:
        raise BadRequest(
            f"this model's encoders are a pool on other nodes, and vLLM reads {route_name} requests without the "
            "ec_transfer_params its consumers need to fetch the embeddings: send media through "
            "/v1/chat/completions instead",
            parts[0].param,
        )
    model = body.get("model")
    fields = {name: body[name] for name in HASHED_FIELDS if body.get(name) and route_name in HASHED_ROUTES}
    embeds = tuple(p for p in found if p.item.kind not in MEDIA_KINDS)
    return Plan(body, parts, model if isinstance(model, str) else None, fields, embeds)


# The routes whose requests carry epd_client.HASHED_FIELDS to vLLM's parsing (its Anthropic and
# Cohere requests have neither).
HASHED_ROUTES = frozenset({"chat_completions", "chat_completions_batch", "invocations", "responses"})


def _chat_parts(body: Mapping[str, Any]) -> list[MediaPart]:
    return _parts_of("messages", _list_field(body, "messages", "a list of messages"))


def _responses_parts(body: Mapping[str, Any]) -> list[MediaPart]:
    """The ``input`` items as vLLM turns them into chat messages (construct_input_messages, for
    every model but gpt-oss, which takes no media): an item with a role other than assistant is
    a message whose content vLLM parses (its input_image parts get ``detail: auto`` when they
    have none), an assistant's keeps its text only, and a function or custom tool call's output
    list is a tool message's content. A string input has no media; ``previous_input_messages``
    are read for gpt-oss only."""
    given = body.get("input")
    if isinstance(given, str):
        return []
    parts: list[MediaPart] = []
    for i, item in enumerate(_list_field(body, "input", "a string or a list of input items")):
        if not isinstance(item, Mapping):
            continue
        if item.get("type") in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            if isinstance(output, list):
                parts += _content_parts(f"input[{i}].output", output)
        elif "role" in item and item.get("role") != "assistant" and isinstance(item.get("content"), list):
            for part in item["content"]:
                _set_detail(part)
            parts += _content_parts(f"input[{i}].content", item["content"])
    return parts


def _set_detail(part: Any) -> None:
    """vLLM's default for a Responses message's input_image without ``detail``, which its chat
    parser (the encoders') otherwise refuses: set in the body's own part (vLLM reads it alike),
    so the part primed is the part forwarded, keyed."""
    if isinstance(part, dict) and part.get("type") == "input_image" and "detail" not in part:
        part["detail"] = "auto"


def _batch_parts(body: Mapping[str, Any]) -> list[MediaPart]:
    """/v1/chat/completions/batch: ``messages`` is a list of conversations, each served alone."""
    conversations = _list_field(body, "messages", "a list of conversations (lists of messages)")
    parts: list[MediaPart] = []
    for i, conversation in enumerate(conversations):
        if not isinstance(conversation, list):
            raise BadRequest(f"'messages[{i}]' must be a list of messages", f"messages[{i}]")
        parts += _parts_of(f"messages[{i}]", conversation)
    return parts


def _invocation_parts(body: Mapping[str, Any]) -> list[MediaPart]:
    """SageMaker's /invocations serves a body as the first request type it validates as, chat
    completions first: one with a ``messages`` list is a chat completion; any other has no media
    (a completion, or a pooling request to a pooling model)."""
    return _chat_parts(body) if isinstance(body.get("messages"), list) else []


def _anthropic_parts(body: Mapping[str, Any]) -> list[MediaPart]:
    """Anthropic image blocks, as vLLM turns them into ``image_url`` parts
    (``AnthropicServingMessages._convert_block`` and ``_convert_user_tool_result``): a block
    of a non-system message, and an image in a user's ``tool_result`` content."""
    parts: list[MediaPart] = []
    for m, message in enumerate(_list_field(body, "messages", "a list of messages")):
        if not isinstance(message, Mapping) or message.get("role") == "system":
            continue
        content = message.get("content")
        for b, block in enumerate(content if isinstance(content, list) else []):
            if not isinstance(block, Mapping):
                continue
            source = block.get("source")
            if block.get("type") == "image" and isinstance(source, Mapping) and source:
                parts.append(_anthropic_image(_anthropic_url(source), f"messages[{m}].content[{b}]", m, b))
            inner = block.get("content")
            if block.get("type") == "tool_result" and message.get("role") == "user" and isinstance(inner, list):
                for k, item in enumerate(inner):
                    source = (
                        item.get("source", {}) if isinstance(item, Mapping) and item.get("type") == "image" else None
                    )
                    if isinstance(source, Mapping) and (url := _anthropic_url(source)):
                        parts.append(_anthropic_image(url, f"messages[{m}].content[{b}].content[{k}]", m, b))
    return parts


def _anthropic_url(source: Mapping[str, Any]) -> str:
    """vLLM's ``_convert_image_source_to_url``: a URL source as it is, any other as a data URL."""
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _anthropic_image(url: str, param: str, message: int, position: int) -> MediaPart:
    part = {"type": "image_url", "image_url": {"url": url}}
    return MediaPart(MediaItem(part, "image_url", url, message, position), param)


def _cohere_parts(body: Mapping[str, Any]) -> list[MediaPart]:
    """Cohere image_url blocks, as vLLM turns them into chat parts (ServingCohere's
    ``_convert_user_message``): those of user messages only, with their url and detail."""
    parts: list[MediaPart] = []
    for m, message in enumerate(_list_field(body, "messages", "a list of messages")):
        if not isinstance(message, Mapping) or message.get("role") != "user":
            continue
        content = message.get("content")
        for b, block in enumerate(content if isinstance(content, list) else []):
            image = block.get("image_url") if isinstance(block, Mapping) and block.get("type") == "image_url" else None
            if isinstance(image, Mapping):
                url: dict[str, Any] = {"url": image.get("url")}
                if image.get("detail") is not None:
                    url["detail"] = image["detail"]
                parts += _content_parts(f"messages[{m}].content", [{"type": "image_url", "image_url": url}], b)
    return parts


def _refuse_media(body: Mapping[str, Any]) -> list[MediaPart]:
    """/v1/systemone fetches its ``images``, ``audio`` and ``videos`` and resizes them for the
    model's reads: a chat prime of the same URL is another embedding, so the consumer would
    encode them itself. Text-only requests go through."""
    for name in ("images", "audio", "videos"):
        if body.get(name):
            raise BadRequest(
                f"the EPD proxy does not forward /v1/systemone requests with '{name}': vLLM resizes them for "
                "this route, so no prime on the encoders can stand for them and the consumer would encode them "
                "itself. Ask about the media through /v1/chat/completions instead.",
                name,
            )
    return []


def _parts_of(field: str, messages: list[Any]) -> list[MediaPart]:
    """The media parts of a list of chat messages at ``field``."""
    return _located(messages, lambda message, position: f"{field}[{message}].content[{position}]")


def _content_parts(field: str, content: list[Any], first: int = 0) -> list[MediaPart]:
    """The media parts of one content list at ``field`` (``first``: the index of its first part)."""
    return _located([{"content": content}], lambda _, position: f"{field}[{position + first}]")


def _located(messages: list[Any], param: Callable[[int, int], str]) -> list[MediaPart]:
    """epd_client's keyed parts (the media vLLM loads and the client's embeddings), each with
    its place in the request."""
    try:
        items = keyed_items(messages)
    except MediaPartError as error:
        raise BadRequest(f"media part refused: {error.reason}", param(error.message, error.position)) from None
    return [MediaPart(item, param(item.message, item.position)) for item in items]


_PLANNERS: dict[str, Callable[[Mapping[str, Any]], list[MediaPart]]] = {
    "chat_completions": _chat_parts,
    "cohere_chat": _cohere_parts,
    "responses": _responses_parts,
    "chat_completions_batch": _batch_parts,
    "invocations": _invocation_parts,
    "messages": _anthropic_parts,
    "structured_decisions": _refuse_media,
    EPD_PRIME: _chat_parts,
    "chat_completions_render": _chat_parts,
    "responses_render": _responses_parts,
}


def _list_field(body: Mapping[str, Any], name: str, what: str) -> list[Any]:
    value = body.get(name)
    if not isinstance(value, list):
        raise BadRequest(f"'{name}' must be {what}", name)
    return value


def with_transfer_params(body: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The body a Pools model's consumer needs: the encoders' ``ec_transfer_params`` (where it
    pulls each embedding); plan() refused a body with params of its own."""
    return {**body, "ec_transfer_params": dict(params)}


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


@dataclass(frozen=True)
class ProxyError:
    """An answer of the proxy's own instead of the upstream's."""

    status: int
    message: str
    param: str | None = None


def error_body(error: ProxyError, path: str | None = None) -> dict[str, Any]:
    """vLLM's error shape for the request's path, so clients parse the proxy's errors as the
    engines' own: OpenAI's, with the status as an integer ``code`` and the status' name as the
    type (vLLM's BadRequestError), or on the Anthropic paths vLLM's AnthropicErrorResponse."""
    phrase = HTTPStatus(error.status).phrase.title().replace(" ", "").replace("-", "")
    kind = phrase if phrase.endswith("Error") else f"{phrase}Error"
    if path in ANTHROPIC_PATHS:
        return {"type": "error", "error": {"type": kind, "message": error.message}}
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.status}}


def prime_failure(error: PrimeError, parts: Sequence[MediaPart]) -> ProxyError:
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
    return ProxyError(int(status), message, parts[error.failures[0].index].param)


def _is_clients(status: int) -> bool:
    # 408 and 429 are the encoders' trouble, retried as epd_client retries them.
    return 400 <= status < 500 and status not in (408, 429)


def no_encoder(parts: Sequence[MediaPart]) -> ProxyError:
    """The answer while the proxy knows no encoder (a Pools model's pool has no ready one)."""
    message = (
        f"no encoder is available to encode the request's {len(parts)} media part(s); the request was not "
        "forwarded (its consumer would encode them itself). Retry later."
    )
    return ProxyError(int(HTTPStatus.SERVICE_UNAVAILABLE), message, parts[0].param)


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
