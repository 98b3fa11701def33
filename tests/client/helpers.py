"""Shared pieces of the client tests."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from epd_client import RetryPolicy, Unit

from .httpkit import BackgroundServer, read_request, response_bytes
from .standin_server import StandinServer

# Quick retries so failure paths take milliseconds.
FAST = RetryPolicy(max_attempts=4, backoff=0.01, max_backoff=0.05, attempt_timeout=2, deadline=10)


def image_messages(count: int) -> list[dict[str, Any]]:
    """A system text, then ``count`` images spread over two user messages, with parts the
    client must ignore (text, embeddings given inline, media without a string URL)."""
    images = [
        {"type": "image_url", "image_url": {"url": f"https://images.test/{i}.png"}}
        for i in range(count)
    ]
    half = count // 2
    return [
        {"role": "system", "content": "You describe pictures."},
        {"role": "user", "content": [{"type": "text", "text": "first"}, *images[:half]]},
        {
            "role": "user",
            "content": [
                {"type": "image_embeds", "image_embeds": "AAAA"},
                {"type": "image_url", "image_url": {"url": None}},
                {"type": "video_url", "video_url": {"url": 7}},
                {"type": "input_audio", "input_audio": {"data": "AAAA"}},
                *images[half:],
            ],
        },
    ]


def image_urls(server: StandinServer) -> list[str]:
    """Image URLs of the prime requests a stand-in received, in arrival order."""
    return [
        r.body["messages"][0]["content"][0]["image_url"]["url"]
        for r in server.requests("/v1/chat/completions")
    ]


@dataclass
class UnitServers:
    """Stand-ins for one EPD unit: encoders and a consumer sharing one EC store."""

    name: str
    encoders: list[StandinServer]
    consumer: StandinServer

    def unit(self, *, ready: bool = True) -> Unit:
        return Unit(
            name=self.name,
            encoder_urls=tuple(e.url for e in self.encoders),
            consumer_urls=(self.consumer.url,),
            ready=ready,
        )

    @property
    def prime_count(self) -> int:
        return sum(len(e.requests("/v1/chat/completions")) for e in self.encoders)


@dataclass
class ControlCall:
    method: str
    target: str  # path and query
    started: float  # time.monotonic()
    finished: float | None = None  # when the answer was ready


@dataclass
class EngineControl:
    """A STAND-IN for vLLM 0.32's weight-update endpoints (vllm/entrypoints/rl/online):
    ``POST /pause?mode=..&clear_cache=..``, ``POST /resume``, ``GET /is_paused``, answered
    after ``delay`` seconds. With ``dev_mode=False`` every path is a 404, as vLLM without
    VLLM_SERVER_DEV_MODE=1. Use as a context manager."""

    delay: float = 0.0
    dev_mode: bool = True
    paused: bool = False
    calls: list[ControlCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._server = BackgroundServer(self._handle)

    @property
    def url(self) -> str:
        return self._server.url

    def __enter__(self) -> EngineControl:
        self._server.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.stop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (request := await read_request(reader)) is not None:
                call = ControlCall(request.method, request.target, time.monotonic())
                self.calls.append(call)
                await asyncio.sleep(self.delay)
                status, payload = self._answer(request.method, request.target)
                call.finished = time.monotonic()  # before the client can see the answer
                writer.write(response_bytes(status, json.dumps(payload).encode()))
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    def _answer(self, method: str, target: str) -> tuple[int, Any]:
        path = target.split("?", 1)[0]
        if self.dev_mode and (method, path) == ("POST", "/pause"):
            self.paused = True
            return 200, {"status": "paused"}
        if self.dev_mode and (method, path) == ("POST", "/resume"):
            self.paused = False
            return 200, {"status": "resumed"}
        if self.dev_mode and (method, path) == ("GET", "/is_paused"):
            return 200, {"is_paused": self.paused}
        return 404, {"detail": "Not Found"}
