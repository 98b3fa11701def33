"""A fault-injecting HTTP reverse proxy for tests: put it in front of any HTTP upstream
(a real vLLM engine or router, or the stand-in server) and make chosen requests fail.

    with FaultProxy("http://127.0.0.1:8000") as proxy:
        proxy.add(http_status(503), times=2)          # the next two requests get a 503
        proxy.add(delay(5.0), path="/v1/chat/completions")
        proxy.add(reset(), times=None)                 # every later request: TCP reset
        proxy.add(cut_off(), path="/inference/v1/generate")  # a 200 whose body stops short
        proxy.go_away_after("/v1/chat/completions/render")   # later connections are refused
        ... point the client at proxy.url ...
        assert [e.fault for e in proxy.log] == [...]

Rules are tried in the order added; the first that matches the request's path and has
uses left is used up by it; with none, the request goes to the upstream unchanged. A
request that is forwarded is answered with ``connection: close``, so the response is
piped as it comes (streaming included) without parsing its framing. Stdlib only; plain
``http://`` upstreams; request bodies need Content-Length.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

from .httpkit import BackgroundServer, Request, Served, head_bytes, read_request, response_bytes


@dataclass(frozen=True)
class Fault:
    kind: str  # "status", "delay", "reset", "cut_off" or "not_json"
    value: float = 0.0


def http_status(code: int) -> Fault:
    """Answer with this status at once; the upstream never sees the request."""
    return Fault("status", code)


def delay(seconds: float) -> Fault:
    """Wait, then forward (a slow engine; a client timeout shorter than this fires)."""
    return Fault("delay", seconds)


def reset() -> Fault:
    """Read the request, then drop the connection with a TCP reset, answering nothing."""
    return Fault("reset")


def cut_off() -> Fault:
    """Answer 200 with a Content-Length the body never reaches, then close: an answer lost
    half-way (the upstream never sees the request)."""
    return Fault("cut_off")


def not_json() -> Fault:
    """Answer 200 with an HTML page, as a misconfigured ingress or captive proxy does."""
    return Fault("not_json")


@dataclass
class _Rule:
    fault: Fault
    path: str | None
    left: int | None  # None: forever


@dataclass
class LogEntry:
    path: str
    fault: Fault | None  # None: forwarded untouched
    status: int | None = None  # for forwarded requests: the status passed back


class FaultProxy(Served):
    def __init__(self, upstream: str, *, port: int = 0) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"need an http:// upstream, got {upstream!r}")
        self.upstream_host = parts.hostname
        self.upstream_port = parts.port or 80
        self.log: list[LogEntry] = []
        self._rules: list[_Rule] = []
        self._last_path: str | None = None
        self._lock = threading.Lock()  # rules are added from the test's thread
        self._server = BackgroundServer(self._handle, port=port)

    def add(self, fault: Fault, *, path: str | None = None, times: int | None = 1) -> None:
        """Apply ``fault`` to the next ``times`` requests to ``path`` (None: any path;
        ``times=None``: forever)."""
        with self._lock:
            self._rules.append(_Rule(fault, path, times))

    def go_away_after(self, path: str) -> None:
        """Once a request to ``path`` was answered, refuse every new connection (a pod that
        went away): what follows fails to connect, so it was never sent."""
        self._last_path = path

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def faults(self) -> list[str]:
        """What happened to each request so far: a fault kind or "forward"."""
        return [e.fault.kind if e.fault else "forward" for e in self.log]

    def _take(self, path: str) -> Fault | None:
        with self._lock:
            for rule in self._rules:
                if rule.left != 0 and rule.path in (None, path):
                    if rule.left is not None:
                        rule.left -= 1
                    return rule.fault
        return None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (request := await read_request(reader)) is not None:
                fault = self._take(request.target)
                entry = LogEntry(request.target, fault)
                self.log.append(entry)
                if fault is None or fault.kind == "delay":
                    if fault:
                        await asyncio.sleep(fault.value)
                    if request.target == self._last_path:
                        # Before the answer goes back, so no later request can connect.
                        self._server.stop_listening()
                    entry.status = await self._forward(request, writer)
                    return  # forwarded answers close the connection
                if fault.kind == "reset":
                    # SO_LINGER with a zero timeout turns close() into a RST.
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                if fault.kind == "cut_off":
                    writer.write(head_bytes(200, "application/json", [], length=100) + b'{"token_ids": [1, 2')
                    await writer.drain()
                    return
                if fault.kind == "not_json":
                    writer.write(response_bytes(200, b"<html>Bad gateway</html>", content_type="text/html"))
                    await writer.drain()
                    continue
                body = json.dumps({"error": f"injected HTTP {int(fault.value)}"}).encode()
                writer.write(response_bytes(int(fault.value), body))
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _forward(self, request: Request, writer: asyncio.StreamWriter) -> int:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        except OSError:
            # What a router answers when its engine is down.
            writer.write(response_bytes(502, b'{"error": "upstream unreachable"}', close=True))
            await writer.drain()
            return 502
        try:
            headers = [(k, v) for k, v in request.headers if k.lower() not in ("host", "connection")]
            headers += [
                ("host", f"{self.upstream_host}:{self.upstream_port}"),
                ("connection", "close"),
            ]
            head = f"{request.method} {request.target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
            up_writer.write(head.encode("latin-1") + b"\r\n" + request.body)
            await up_writer.drain()

            response_head = await up_reader.readuntil(b"\r\n\r\n")
            status_line, *lines = response_head.decode("latin-1").split("\r\n")
            kept = [
                line
                for line in lines
                if line and line.split(":", 1)[0].strip().lower() not in ("connection", "keep-alive")
            ]
            writer.write(("\r\n".join([status_line, *kept, "connection: close"]) + "\r\n\r\n").encode("latin-1"))
            while chunk := await up_reader.read(65536):
                writer.write(chunk)
                await writer.drain()
            return int(status_line.split(" ", 2)[1])
        finally:
            up_writer.close()
