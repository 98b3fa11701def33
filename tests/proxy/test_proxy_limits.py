"""proxy_limits and budget: the cost a body is reserved for bounds what parsing and priming it
really takes (measured with tracemalloc on the shapes that cost the most), and the budget
hands out its bytes first come, first served."""

from __future__ import annotations

import asyncio
import json
import tracemalloc

import pytest

from epd_client._prime import prime_body
from epd_dataplane.budget import Budget
from epd_dataplane.core import plan, with_transfer_params
from epd_operator.proxy_limits import Limits, nested_deeper, request_cost

MiB = 1024 * 1024
SIZE = 1 * MiB


def body_of(shape: str) -> bytes:
    """A chat body of about SIZE bytes whose messages (or one image part) take the given shape."""
    if shape == "one big image":
        url = "data:image/png;base64," + "A" * SIZE
        return json.dumps(chat([{"type": "image_url", "image_url": {"url": url}}])).encode()
    if shape == "one big image, one emoji in it":
        url = "data:image/png;base64," + "A" * SIZE + "\U0001f600"
        return json.dumps(chat([{"type": "image_url", "image_url": {"url": url}}]), ensure_ascii=False).encode()
    if shape == "an emoji escaped":
        return json.dumps(chat([{"type": "text", "text": "a" * SIZE + "\U0001f600"}])).encode()
    if shape == "many images":
        parts = [{"type": "image_url", "image_url": {"url": f"data:,{'A' * 60_000}{i}"}} for i in range(32)]
        return json.dumps(chat(parts)).encode()
    fill = {"{}": b"{}", "[]": b"[]", "one-key objects": b'{"a":1}', "short strings": b'"ab"', "numbers": b"1000"}
    items = fill[shape]
    return b'{"model": "m", "messages": [' + b",".join([items] * (SIZE // (len(items) + 1))) + b"]}"


def chat(content: list) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


@pytest.mark.parametrize(
    "shape",
    [
        "{}",
        "[]",
        "one-key objects",
        "short strings",
        "numbers",
        "one big image",
        "one big image, one emoji in it",
        "an emoji escaped",
        "many images",
    ],
)
def test_what_a_body_is_reserved_for_bounds_what_parsing_and_priming_it_takes(shape):
    raw = body_of(shape)
    tracemalloc.start()
    try:
        found = plan("chat_completions", raw)
        # Each prime's body as httpx sends it, and the Pools body, all held at once.
        primes = [
            json.dumps(prime_body(p.item, "m"), ensure_ascii=False, separators=(",", ":")).encode() for p in found.parts
        ]
        pooled = json.dumps(with_transfer_params(found.body, {"h": {}})).encode()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del primes, pooled
    assert len(raw) + peak <= request_cost(raw, len(found.parts)), (len(raw), peak, request_cost(raw))


def test_depth_is_measured_without_recursion():
    deep: list = []
    node = deep
    for _ in range(100_000):
        node.append([])
        node = node[0]
    assert nested_deeper(deep, 64)
    assert not nested_deeper({"a": [{"b": [1, 2]}]}, 4) and nested_deeper({"a": [{"b": [1, 2]}]}, 3)


def test_the_default_budget_holds_one_largest_body():
    limits = Limits()
    assert limits.max_buffered_bytes >= request_cost(b"a" * limits.max_request_bytes)
    with pytest.raises(ValueError, match="maxBufferedBytes"):
        Limits(max_request_bytes=64 * MiB, max_buffered_bytes=64 * MiB)


async def test_the_budget_is_first_come_first_served_and_resizes_without_waiting():
    budget = Budget(100)
    first = await budget.reserve(60)
    large = asyncio.create_task(budget.reserve(80))
    await asyncio.sleep(0)
    small = asyncio.create_task(budget.reserve(10))  # would fit, but the large one came first
    await asyncio.sleep(0)
    assert not large.done() and not small.done()
    assert not first.resize(70)  # growing while others wait: refused, not waited for
    assert first.resize(5)  # shrinking always works: 95 free, the large one (80) fits
    await asyncio.sleep(0)
    assert large.done() and small.done() and budget.free == 5
    first.release()
    (await large).release()
    (await small).release()
    assert budget.free == 100
    waiting = asyncio.create_task(budget.reserve(100))
    blocker = await budget.reserve(1) if not waiting.done() else None
    waiting.cancel()
    await asyncio.sleep(0)
    if blocker is not None:
        blocker.release()
    assert budget.free == 100  # a cancelled wait takes nothing
