"""The media parts of chat messages that encoders compute, and their weight-version keys.

What a media part is follows vLLM's own reading of a chat content part (0.32 and 0.33:
``_parse_chat_message_content_mm_part`` and its dispatch, vllm/renderers/chat_utils), so that
every item a consumer would hand to its multimodal processor is primed on the encoders first.
tests/render/test_media_parts_contract.py runs vLLM's parsing on a corpus of part shapes and
holds this module to it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from ._errors import EPDClientError

Message = Mapping[str, Any]

# Part type -> the noun error messages use. input_image is the Responses API's image part;
# vLLM parses it as an image in chat messages too.
KINDS = {
    "image_url": "image",
    "input_image": "image",
    "video_url": "video",
    "audio_url": "audio",
    "input_audio": "audio",
}

# Embeddings the client computed (vLLM takes them only with --enable-mm-embeds): no encoder runs
# on them, yet vLLM names each by its uuid, when it has one, in its caches and the EC store, as
# any media item. So they are keyed as media are, and never primed.
EMBEDS_KINDS = {
    "image_embeds": "image embeddings",
    "audio_embeds": "audio embeddings",
    "video_embeds": "video embeddings",
}
_NOUNS = {**KINDS, **EMBEDS_KINDS}

# vLLM's content part types (its MM_PARSER_MAP) that carry no media for an encoder: text, the
# client's embeddings (EMBEDS_KINDS) and prompt embeddings (vLLM names those by no uuid).
_NOT_ENCODED = frozenset(
    {
        "text",
        "thinking",
        "input_text",
        "output_text",
        "refusal",
        "tool_reference",
        "image_embeds",
        "audio_embeds",
        "video_embeds",
        "prompt_embeds",
    }
)
# vLLM also reads a PIL image (its offline LLM API's part): a JSON body cannot hold one, only
# the key with a uuid, a reference to an image vLLM processed before.
_PIL = "image_pil"
_TYPES = frozenset(KINDS) | _NOT_ENCODED | {_PIL}
# A part without a type, or with a uuid, is read by the first of these keys it holds, whatever
# its type says (vLLM 0.33 skips audio_embeds in a video_embeds part: embeddings either way).
_KEY_ORDER = (
    "image_url",
    _PIL,
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
    "tool_reference",
)

# Keys this library writes (and the EPD proxy's later generations of them, ``<key>-<n>``):
# recognised so that a part whose key is its content's already keeps it (and its generation).
_OWN_KEY = re.compile(r"(epd-[0-9a-f]{32})(?:-[1-9][0-9]*)?")


@dataclass(frozen=True)
class MediaItem:
    part: Message
    kind: str
    """The part's type as vLLM reads it: image_url, input_image, video_url, audio_url or
    input_audio (a part without ``type`` is read by the media key it holds); for the client's
    own embeddings (``keyed_items`` only) image_embeds, audio_embeds or video_embeds."""
    source: str
    """The URL, or for input_audio the data URL vLLM builds from it; for embeddings their data
    (a dict of them as canonical JSON)."""
    message: int = 0
    """Index of the part's message in the messages given."""
    position: int = 0
    """Index of the part in that message's ``content``."""


class MediaPartError(EPDClientError, ValueError):
    """A content part vLLM would read as media, but which cannot be primed: a consumer given
    it would encode it itself (or look it up in its own cache), so it is refused instead."""

    def __init__(self, reason: str, *, message: int, position: int) -> None:
        self.reason = reason
        self.message = message
        self.position = position
        super().__init__(f"messages[{message}].content[{position}]: {reason}")


def media_items(messages: Iterable[Message]) -> list[MediaItem]:
    """The media parts of ``messages`` in order: every content part vLLM would load as an
    image, a video or audio, spelled with or without ``type`` (``{"image_url": "https://..."}``
    is an image to vLLM), read as vLLM reads it (a part with a ``uuid`` is read by the media
    key it holds, whatever its type). Messages are mappings with a ``content`` list; others are
    skipped, so the items of a Responses API ``input`` list are found the same way.

    Raises MediaPartError for a part vLLM would read as media that no prime can stand for: a
    reference without data (a ``uuid`` with no URL, an empty URL, ``image_pil``). Parts vLLM
    refuses itself (a typed part whose URL is not a string, an unknown type) are left to it."""
    return [item for item in keyed_items(messages) if item.kind in KINDS]


def keyed_items(messages: Iterable[Message]) -> list[MediaItem]:
    """Every part of ``messages`` that vLLM names by its ``uuid`` when it has one, in order: the
    media parts (``media_items``) and the client's own embeddings (image_embeds, audio_embeds,
    video_embeds), which no encoder computes. ``write_keys`` binds each one's uuid to its
    content. Raises MediaPartError as media_items does, and for embeddings without data (a
    ``uuid`` alone asks vLLM for what it cached under that name)."""
    items: list[MediaItem] = []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            if not isinstance(part, Mapping):
                continue
            reading = read_part(part)
            if reading is None:
                continue
            kind, source = reading
            if kind == _PIL:
                raise MediaPartError(
                    "an image_pil part is a reference to an image vLLM processed before, which no encoder can be "
                    "primed with: send the image itself as an image_url part",
                    message=m,
                    position=p,
                )
            if not source and kind in EMBEDS_KINDS and part.get("uuid") is None:
                continue  # names nothing: vLLM takes it as it is (and refuses it later)
            if not source:
                raise MediaPartError(
                    f"this {_NOUNS[kind]} part has no data (no URL, or a uuid alone refers to an item vLLM "
                    "processed before, which would answer with whatever vLLM holds under that name), so it is "
                    f"refused: send its {_data_field(kind)}",
                    message=m,
                    position=p,
                )
            items.append(MediaItem(part, kind, source, m, p))
    return items


def read_part(part: Message) -> tuple[str, str | None] | None:
    """How vLLM reads a content part: (its media type or embeddings kind, its source or None
    when it carries no data), or None when vLLM names no item by it (text, prompt embeddings, a
    part it refuses)."""
    kind = part.get("type")
    if isinstance(kind, str) and kind in _TYPES and part.get("uuid") is None:
        return _typed(part, kind)
    if kind is not None and part.get("uuid") is None:
        return None  # not a type vLLM knows: it refuses the part
    key = next((key for key in _KEY_ORDER if key in part), None)
    if key in EMBEDS_KINDS:
        return key, _embeds(part[key])
    if key is None or key in _NOT_ENCODED:
        return None
    if key == _PIL:
        return _PIL, None
    value = part[key]
    if key == "input_audio":
        return key, _audio_url(value)
    if isinstance(value, Mapping):
        value = value.get("url")
    return key, _text(value)


def _typed(part: Message, kind: str) -> tuple[str, str | None] | None:
    """A part read by its type: vLLM checks the url objects of image_url, audio_url and
    video_url (a part whose URL is not a string is refused, not loaded)."""
    if kind in EMBEDS_KINDS:
        return kind, _embeds(part.get(kind))
    if kind in _NOT_ENCODED:
        return None
    if kind == _PIL:
        return _PIL, None
    if kind == "input_image":
        return kind, _text(part.get("image_url"))
    value = part.get(kind)
    if kind == "input_audio":
        return kind, _audio_url(value)
    if not isinstance(value, Mapping) or not isinstance(value.get("url"), str):
        return None
    return kind, value["url"] or None


def _audio_url(value: Any) -> str | None:
    """The data URL vLLM builds of an input_audio object (None: no data)."""
    if not isinstance(value, Mapping):
        return None
    data, fmt = value.get("data"), value.get("format", "")
    if not data or not isinstance(data, str) or not isinstance(fmt, str):
        return None
    return f"data:audio/{fmt};base64,{data}"


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _embeds(value: Any) -> str | None:
    """Embeddings' data as one string: vLLM takes a base64 tensor or a dict of them (canonical
    JSON, so equal dicts give equal keys); None: no data."""
    if isinstance(value, Mapping) and value:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return _text(value)


def _data_field(kind: str) -> str:
    if kind in EMBEDS_KINDS:
        return f"{kind} data"
    if kind == "input_audio":
        return "input_audio.data and input_audio.format"
    if kind == "input_image":
        return "image_url"
    return f"{kind}.url"


def prime_part(item: MediaItem) -> dict[str, Any]:
    """The content part a prime request carries for ``item``: the part itself when vLLM reads it
    as its type says (Vime's prime body), else the typed part vLLM reads as the same item (same
    media and uuid, so the same key): vLLM's validation of a lone untyped part (or input_audio
    without a format) differs from that of one among other parts, and with a uuid vLLM reads a
    part by the media key it holds, not by its type."""
    audio = item.part.get("input_audio")
    formatless = item.kind == "input_audio" and not (
        isinstance(audio, Mapping) and isinstance(audio.get("format"), str)
    )
    if item.part.get("type") == item.kind and not formatless:
        return dict(item.part)
    kind = "audio_url" if item.kind == "input_audio" else "image_url" if item.kind == "input_image" else item.kind
    part: dict[str, Any] = {"type": kind, kind: {"url": item.source}}
    if item.part.get("uuid") is not None:
        part["uuid"] = item.part["uuid"]
    return part


def media_key(item: MediaItem, weights_version: str) -> str:
    """A store key stable for (content, kind, version) and different for any other: vLLM keys
    the EC store and its caches by a part's ``uuid`` when one is given, instead of by the
    content alone, which stays the same when the weights change."""
    digest = hashlib.blake2b(digest_size=16)
    for field in (weights_version, item.kind, item.source):
        data = field.encode()
        digest.update(len(data).to_bytes(8, "little") + data)  # unambiguous concatenation
    return f"epd-{digest.hexdigest()}"


def key_generation(key: str, generation: int) -> str:
    """The store name of a key's ``generation``: the key itself, then ``<key>-1``, ``<key>-2``...
    The EPD proxy moves a part to its next generation when its encoder answered a prime of the
    key but wrote no embedding (it still held the key's embedding in memory after the janitor
    evicted the file: vLLM's encoder cache is asked before the EC store)."""
    return key if generation == 0 else f"{key}-{generation}"


def is_key(name: object) -> bool:
    """Whether ``name`` is a key of ours, first generation (what ``write_keys`` writes)."""
    found = _OWN_KEY.fullmatch(name) if isinstance(name, str) else None
    return found is not None and found.group(1) == name


def key_of(name: str) -> str:
    """The key a store name belongs to: ``<key>`` for any generation of one of our keys, else
    the name itself (a caller's own uuid, or vLLM's content hash)."""
    found = _OWN_KEY.fullmatch(name)
    return found.group(1) if found else name


def write_keys(items: Iterable[MediaItem], weights_version: str | None) -> list[tuple[MediaItem, str]]:
    """Bind each part's ``uuid`` to its content, in place: vLLM names a part that has a uuid by
    the uuid alone in its caches and the EC store, so a uuid that is not the part's key would
    answer the part with whatever embedding was stored under that name (another picture's, or
    another weights version's). Each part gets its key for ``weights_version`` (``media_key``);
    a uuid that is that key already is kept (with the EPD proxy's generation of it), and one
    the caller chose is replaced, never trusted to name the content. With ``weights_version``
    None, a part without a uuid is left to vLLM's own content hash.

    Returns the parts whose uuid was replaced, each with the uuid it had (the caller's own id:
    for logs and metrics). Raises MediaPartError for a part that vLLM would read differently
    once it has a uuid (with a uuid, vLLM reads a part by the first media key it holds, not by
    its type)."""
    replaced = []
    for item in items:
        current = item.part.get("uuid")
        if current is None and weights_version is None:
            continue
        key = media_key(item, weights_version or "")
        if current is not None and key_of(str(current)) == key:
            continue
        if not isinstance(item.part, MutableMapping):
            raise TypeError(
                f"cannot write the weights-version key into a {type(item.part).__name__} "
                "content part: pass the messages as plain dicts"
            )
        kind, source = read_part({**item.part, "uuid": key}) or (None, None)
        if (_NOUNS.get(kind or ""), source) != (_NOUNS[item.kind], item.source):
            raise MediaPartError(
                f"this {item.kind} part holds several media fields, and vLLM reads a keyed part by the first of "
                "them, not by its type: keep one media field per part",
                message=item.message,
                position=item.position,
            )
        item.part["uuid"] = key
        if current is not None:
            replaced.append((item, str(current)))
    return replaced


def copy_messages(messages: Iterable[Message]) -> list[dict[str, Any]]:
    """Copies of the messages and of their content parts, so keys can be written into the
    copy (the nested url/data objects are shared: keys never touch them)."""
    copied = []
    for message in messages:
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = [dict(p) if isinstance(p, Mapping) else p for p in content]
        copied.append(message)
    return copied
