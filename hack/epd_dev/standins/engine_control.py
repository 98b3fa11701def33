"""A STAND-IN for vLLM's weight-sync endpoints, NOT vLLM: it answers them on demand, slowly or
with a 404, which a real engine cannot be made to do in a unit test."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from .httpkit import BackgroundServer, Served, read_request, response_bytes


@dataclass
class ControlCall:
    method: str
    target: str  # path and query
    started: float  # time.monotonic()
    finished: float | None = None  # when the answer was ready


@dataclass
class EngineControl(Served):
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
