"""Requests sent to the tiny model's engines (tests, `make demo`): images, chat messages, and
reading engines' answers, metrics and EC store."""

from __future__ import annotations

import base64
import re
import struct
import urllib.request
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import tiny_model

EMBEDDING_FILE = "encoder_cache.safetensors"


def png(width: int, height: int, pixel: Callable[[int, int], tuple[int, int, int]]) -> bytes:
    """An RGB PNG whose pixel (x, y) is `pixel(x, y)` (standard library only)."""
    raw = b"".join(
        b"\x00" + b"".join(bytes(pixel(x, y)) for x in range(width))  # filter byte + row
        for y in range(height)
    )

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def data_url(png_bytes: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes).decode()


def png_data_url(rgb: tuple[int, int, int], size: int = tiny_model.IMAGE_SIZE) -> str:
    """A solid-colour square PNG as a data URL."""
    return data_url(png(size, size, lambda x, y: rgb))


def image_part(rgb: tuple[int, int, int]) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": png_data_url(rgb)}}


def messages(*parts: dict[str, Any], text: str = "describe") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def greedy(msgs: list[dict[str, Any]], max_tokens: int = 6) -> dict[str, Any]:
    """A render request whose generation is deterministic and of fixed length, with logprobs."""
    return {
        "model": tiny_model.SERVED_NAME,
        "messages": msgs,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
    }


def output(generated: dict[str, Any]) -> tuple[list[int], list[float]]:
    """Token ids and their logprobs from an /inference/v1/generate response."""
    choice = generated["choices"][0]
    return choice["token_ids"], [lp["logprob"] for lp in choice["logprobs"]["content"]]


def image_hashes(rendered: dict[str, Any]) -> list[str]:
    """The mm_hash of each image of a /v1/chat/completions/render response, in prompt order:
    the name of its folder in the EC store."""
    hashes: list[str] = rendered["features"]["mm_hashes"]["image"]
    return hashes


def ec_entries(store: Path) -> dict[str, list[str]]:
    """`<mm_hash>` folder -> the files in it."""
    if not store.is_dir():
        return {}
    return {d.name: sorted(f.name for f in d.iterdir()) for d in store.iterdir() if d.is_dir()}


_HTTP_REQUESTS = re.compile(
    r'^http_requests_total\{handler="([^"]+)",method="[A-Z]+",status="[^"]+"\} (\S+)$', re.MULTILINE
)
_HTTP_SECONDS = re.compile(
    r'^http_request_duration_seconds_sum\{handler="([^"]+)",method="[A-Z]+"\} (\S+)$', re.MULTILINE
)
# Probes and scrapes: not requests anyone sent.
_NOT_SERVED = ("/health", "/metrics")


def _scrape(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        text: bytes = resp.read()
        return text.decode()


def _by_handler(pattern: re.Pattern[str], text: str) -> dict[str, float]:
    sums: dict[str, float] = {}
    for handler, value in pattern.findall(text):
        if handler not in _NOT_SERVED:
            sums[handler] = sums.get(handler, 0.0) + float(value)
    return sums


def served_requests(base_url: str) -> dict[str, int]:
    """Requests an engine has answered, by path, from its /metrics (probes and scrapes left out)."""
    return {h: int(n) for h, n in _by_handler(_HTTP_REQUESTS, _scrape(base_url)).items()}


_FINISHED = re.compile(r"^vllm:request_success_total\{[^}]*\} (\S+)$", re.MULTILINE)


def finished_requests(base_url: str) -> int:
    """Requests the engine ran to the end (vLLM's vllm:request_success_total, every reason)."""
    return int(sum(float(n) for n in _FINISHED.findall(_scrape(base_url))))


def served_seconds(base_url: str) -> dict[str, tuple[int, float]]:
    """Requests an engine has answered and the seconds it spent on them, by path."""
    text = _scrape(base_url)
    seconds = _by_handler(_HTTP_SECONDS, text)
    return {h: (int(n), seconds.get(h, 0.0)) for h, n in _by_handler(_HTTP_REQUESTS, text).items()}
