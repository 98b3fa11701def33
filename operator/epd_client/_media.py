"""The media parts of chat messages that encoders compute, and their weight-version keys."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

Message = Mapping[str, Any]

# Part type -> the noun error messages use. input_image is the Responses API's image part;
# vLLM parses it as an image in chat messages too (MM_PARSER_MAP, vllm/renderers/chat_utils.py).
KINDS = {
    "image_url": "image",
    "input_image": "image",
    "video_url": "video",
    "audio_url": "audio",
    "input_audio": "audio",
}

# Keys this library writes (and the EPD proxy's later generations of them, ``<key>-<n>``):
# recognised so that a reused message gets the key of the current version, while a uuid the
# caller chose is left alone.
_OWN_KEY = re.compile(r"(epd-[0-9a-f]{32})(?:-[1-9][0-9]*)?")


@dataclass(frozen=True)
class MediaItem:
    part: Message
    kind: str
    """The part's type: image_url, input_image, video_url, audio_url or input_audio."""
    source: str
    """The URL, or for input_audio the data URL vLLM builds from it."""
    message: int = 0
    """Index of the part's message in the messages given."""
    position: int = 0
    """Index of the part in that message's ``content``."""


def media_items(messages: Iterable[Message]) -> list[MediaItem]:
    """Vime's image rule for every kind: a content part of that type whose ``<type>.url`` is a
    string (input_audio: string ``data`` and ``format``; input_image: a string ``image_url``),
    in message order. Messages are mappings with a ``content`` list; others are skipped, so the
    items of a Responses API ``input`` list are found the same way."""
    items: list[MediaItem] = []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            if isinstance(part, Mapping) and (source := _source(part)) is not None:
                items.append(MediaItem(part, part["type"], source, m, p))
    return items


def _source(part: Message) -> str | None:
    kind = part.get("type")
    if kind not in KINDS:
        return None
    if kind == "input_image":
        url = part.get("image_url")
        return url if isinstance(url, str) else None
    value = part.get(kind)
    if not isinstance(value, Mapping):
        return None
    if kind == "input_audio":
        data, fmt = value.get("data"), value.get("format")
        if isinstance(data, str) and isinstance(fmt, str):
            return f"data:audio/{fmt};base64,{data}"
        return None
    url = value.get("url")
    return url if isinstance(url, str) else None


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


def write_keys(items: Iterable[MediaItem], weights_version: str) -> None:
    """Set each part's ``uuid`` in place to its key for ``weights_version``; a uuid that is
    not one of ours (the caller's own) is kept."""
    for item in items:
        current = item.part.get("uuid")
        if current is not None and not _OWN_KEY.fullmatch(str(current)):
            continue
        if not isinstance(item.part, MutableMapping):
            raise TypeError(
                f"cannot write the weights-version key into a {type(item.part).__name__} "
                "content part: pass the messages as plain dicts"
            )
        item.part["uuid"] = media_key(item, weights_version)


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
