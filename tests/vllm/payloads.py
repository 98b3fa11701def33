"""Requests the tests send: images, chat messages, and reading engines' answers and metrics."""

from __future__ import annotations

import base64
import re
import struct
import urllib.request
import zlib
from pathlib import Path

from epd_dev.vllm import tiny_model

EMBEDDING_FILE = "encoder_cache.safetensors"


def png_data_url(rgb: tuple[int, int, int], size: int = tiny_model.IMAGE_SIZE) -> str:
    """A solid-colour RGB PNG as a data URL (standard library only)."""
    row = b"\x00" + bytes(rgb) * size  # filter byte + pixels

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    png = (b"\x89PNG\r\n\x1a\n"
           + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(row * size))
           + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


def image_part(rgb: tuple[int, int, int]) -> dict:
    return {"type": "image_url", "image_url": {"url": png_data_url(rgb)}}


def messages(*parts: dict, text: str = "describe") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def greedy(msgs: list[dict], max_tokens: int = 6) -> dict:
    """A render request whose generation is deterministic and of fixed length, with logprobs."""
    return {"model": tiny_model.SERVED_NAME, "messages": msgs, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "logprobs": True}


def output(generated: dict) -> tuple[list[int], list[float]]:
    """Token ids and their logprobs from an /inference/v1/generate response."""
    choice = generated["choices"][0]
    return choice["token_ids"], [lp["logprob"] for lp in choice["logprobs"]["content"]]


def image_hashes(rendered: dict) -> list[str]:
    """The mm_hash of each image of a /v1/chat/completions/render response, in prompt order:
    the name of its folder in the EC store."""
    return rendered["features"]["mm_hashes"]["image"]


def ec_entries(store: Path) -> dict[str, list[str]]:
    """`<mm_hash>` folder -> the files in it."""
    if not store.is_dir():
        return {}
    return {d.name: sorted(f.name for f in d.iterdir()) for d in store.iterdir() if d.is_dir()}


_HTTP_REQUESTS = re.compile(r'^http_requests_total\{handler="([^"]+)",method="[A-Z]+",status="[^"]+"\} (\S+)$', re.M)


def served_requests(base_url: str) -> dict[str, int]:
    """Requests an engine has answered, by path, from its /metrics (probes and scrapes left out)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    counts: dict[str, int] = {}
    for handler, value in _HTTP_REQUESTS.findall(text):
        if handler not in ("/health", "/metrics"):
            counts[handler] = counts.get(handler, 0) + int(float(value))
    return counts
