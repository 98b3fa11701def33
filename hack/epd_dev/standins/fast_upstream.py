"""A fast STAND-IN upstream, NOT vLLM: answers every request with a canned chat completion, for
`make bench-proxy`, which measures what the EPD proxy adds in front of it.

Fast means it costs the machine as little as possible per request (an asyncio Protocol on
uvloop, no HTTP framework), so the benchmark measures the proxy, not this server. It knows
nothing of paths: any request gets the same answer, after the service time the request's
``x-standin-delay`` header asks for (seconds; none: at once), as an engine that takes that
long. A body with ``"stream": true`` gets Server-Sent Events, chunked: the headers at once, the
first event after the delay (an engine's time to first token), the others and ``[DONE]`` one
delay later, so a proxy that buffered the stream would show a first byte twice as late.
Requests need Content-Length; no pipelining.

    python -m epd_dev.standins.fast_upstream --port 0   # prints its URL on the first line
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import re
import threading
import time
from collections.abc import Callable
from typing import cast

_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)
_DELAY = re.compile(rb"\r\nx-standin-delay:\s*([0-9.]+)", re.IGNORECASE)
_STREAM = re.compile(rb'"stream"\s*:\s*true')

_BODY = json.dumps(
    {
        "id": "chatcmpl-standin",
        "object": "chat.completion",
        "created": 0,
        "model": "standin",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
    }
).encode()
_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(_BODY) + _BODY
_STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_CHUNK = {
    "id": "chatcmpl-standin",
    "object": "chat.completion.chunk",
    "choices": [{"index": 0, "delta": {"content": "x"}}],
}
_EVENT = b"data: " + json.dumps(_CHUNK).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_FIRST_EVENT = _chunk(_EVENT)
_REST = _chunk(_EVENT) * 3 + _chunk(b"data: [DONE]\n\n") + _chunk(b"")


class _Clock:
    """Service times to the microsecond. The event loop's timers are not: uvloop's (libuv's)
    count whole milliseconds from a cached loop time, so a 2.5 ms delay would end 2 to 3.5 ms
    later depending on where in the millisecond the request came, and the proxy's extra hop
    would move requests across those boundaries, adding up to a millisecond that is not the
    proxy's. One thread sleeps until the earliest deadline and hands the write to the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()  # ties in deadline keep their order
        self._changed = threading.Condition()
        threading.Thread(target=self._run, name="standin-clock", daemon=True).start()

    def call_later(self, seconds: float, callback: Callable[[], None]) -> None:
        with self._changed:
            heapq.heappush(self._due, (time.monotonic() + seconds, next(self._order), callback))
            self._changed.notify()

    def _run(self) -> None:
        with self._changed:
            while True:
                now = time.monotonic()
                while self._due and self._due[0][0] <= now:
                    self._loop.call_soon_threadsafe(heapq.heappop(self._due)[2])
                self._changed.wait(self._due[0][0] - now if self._due else None)


class _Connection(asyncio.Protocol):
    def __init__(self, clock: _Clock) -> None:
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._clock = clock

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while (end := self._buffer.find(b"\r\n\r\n")) >= 0:
            head = bytes(self._buffer[:end])
            length = _LENGTH.search(head)
            size = end + 4 + (int(length.group(1)) if length else 0)
            if len(self._buffer) < size:
                return
            stream = _STREAM.search(self._buffer, end, size) is not None
            del self._buffer[:size]
            delay = _DELAY.search(head)
            seconds = float(delay.group(1)) if delay else 0.0
            if stream:
                self._write(_STREAM_HEAD)
                self._later(seconds, _FIRST_EVENT)
                self._later(2 * seconds, _REST)
            else:
                self._later(seconds, _ANSWER)

    def _later(self, seconds: float, data: bytes) -> None:
        if seconds:
            self._clock.call_later(seconds, lambda: self._write(data))
        else:
            self._write(data)

    def _write(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)


async def _serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    clock = _Clock(loop)
    server = await loop.create_server(lambda: _Connection(clock), "127.0.0.1", port)
    print(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    import uvloop

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    uvloop.run(_serve(parser.parse_args().port))
