"""The keys the proxy writes into the media parts it forwards (pure).

A part's key is ``epd_client``'s (``media_key``: the weights version, the part's kind and its
content), written as the part's ``uuid``, which vLLM uses as the item's name in its caches and
in the EC store, whatever the content. So every part that reaches an engine is
named by its own content: a uuid the client chose is replaced (two pictures sent with one uuid
get one embedding each), and after a weight update a new version makes new names, so no request
is served an embedding of the old weights (vLLM 0.32 to 0.34 never clear the EC store
themselves). The version is the request's ``X-EPD-Weights-Version`` header: the EPD gateway
stamps the EPDDeployment's (``spec.models[].weightsVersion``) on what it forwards, unless the
client sent one; without either, keys are content-only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from epd_client import MediaItem, MediaPartError, is_key, key_of, write_keys

from .core import BadRequest

WEIGHTS_VERSION_HEADER = "x-epd-weights-version"
# Names a conversation for the gateway's placement (else the OpenAI ``user`` field).
SESSION_HEADER = "x-epd-session"
# Names the grant of POST /epd/v1/prime on the render and generate that read what it primed.
LEASE_HEADER = "x-epd-lease"
# A version is a name (a step, a checkpoint's hash), not data: printable ASCII, bounded.
VERSION = re.compile(r"[\x21-\x7e]{0,128}")
LEASE = re.compile(r"[0-9a-f]{24}")
# Routes whose parts vLLM reads without their uuid: it converts Anthropic image blocks into
# image_url parts of its own (AnthropicServingMessages), so no key reaches the engines.
UNKEYED_ROUTES = frozenset({"messages"})


def header(headers: Sequence[tuple[str, str]], name: str) -> str | None:
    """The first value of ``name`` (lower-case) in ``headers`` (names lower-cased), None without one."""
    return next((v for n, v in headers if n == name), None)


def requested_version(headers: Sequence[tuple[str, str]]) -> str | None:
    """The request's weights version (its first X-EPD-Weights-Version), None without one."""
    value = header(headers, WEIGHTS_VERSION_HEADER)
    if value is None:
        return None
    value = value.strip()
    if not VERSION.fullmatch(value):
        raise BadRequest(
            "the X-EPD-Weights-Version header must be at most 128 printable ASCII characters without spaces "
            "(e.g. step-42 or a checkpoint's hash)"
        )
    return value


def requested_lease(headers: Sequence[tuple[str, str]]) -> str | None:
    value = header(headers, LEASE_HEADER)
    return value if value is not None and LEASE.fullmatch(value) else None


def in_body(body: object) -> set[int]:
    """The identities of every JSON object in ``body``: a media part the proxy keys must be one of
    them, or its key would never reach the engines (a part a planner made of another shape, as
    vLLM does of an Anthropic image block). Iterative: the body's depth is bounded already."""
    found, stack = set(), [body]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            found.add(id(node))
            stack.extend(v for v in node.values() if isinstance(v, dict | list))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, dict | list))
    return found


def key_parts(
    route: str, items: Sequence[MediaItem], version: str | None, *, required: bool
) -> list[tuple[MediaItem, str]] | None:
    """Bind each part's uuid to its content and ``version`` (content-only when None), in place
    (``write_keys``: a uuid that is the part's key already is kept, any other replaced). Returns
    the parts whose client-chosen uuid was replaced, each with that uuid (for the log and the
    metrics); None (nothing written) for a route whose uuids vLLM drops. BadRequest where a
    version is wanted there, or required and not given."""
    if route in UNKEYED_ROUTES:
        if version is not None or required:
            raise BadRequest(
                "vLLM drops the uuid of Anthropic image blocks, so the proxy cannot key them by the weights "
                "version: send the images to /v1/chat/completions instead"
                + ("" if version is not None else " (this model's weights are versioned: spec.models[].weightsVersion)")
            )
        return None
    if not version and required and items:
        raise BadRequest(
            "this model's weights are versioned (spec.models[].weightsVersion), so media requests carry their "
            "version: send them through the model's front Service (its EPD gateway stamps it), or send the "
            "X-EPD-Weights-Version header"
        )
    try:
        return write_keys(items, version or "")
    except MediaPartError as error:  # a part vLLM would read otherwise once it has a uuid
        raise BadRequest(f"media part not keyed: {error.reason}") from None


def own_key(item: MediaItem) -> str | None:
    """The key the part's uuid belongs to (any generation of it), None when it has none of ours."""
    uuid = item.part.get("uuid")
    key = key_of(uuid) if isinstance(uuid, str) else None
    return key if is_key(key) else None


def set_names(items: Sequence[MediaItem], names: Mapping[int, str]) -> None:
    """Write the store name each part is read under (index -> name) as its uuid."""
    for index, name in names.items():
        part: Any = items[index].part
        part["uuid"] = name
