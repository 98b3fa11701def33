"""Just enough HTTP/1.1 on asyncio streams for the stand-in server and the fault proxy
(stdlib only, so neither adds a dependency and both run as plain scripts)."""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Self

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

REASONS = {
    200: "OK",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    408: "Request Timeout",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


@dataclass
class Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]  # original case and order, for forwarding
    body: bytes

    def header(self, name: str, default: str = "") -> str:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), default)

    @property
    def keep_alive(self) -> bool:
        return self.header("connection").lower() != "close"


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """The next request on a connection, or None once the peer closed it. Bodies must
    carry Content-Length (httpx and vLLM clients send it; chunked uploads are unsupported)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, target, version = lines[0].split(" ", 2)
    headers = [tuple(s.strip() for s in line.split(":", 1)) for line in lines[1:] if line]
    request = Request(method, target, version, headers, b"")  # type: ignore[arg-type]  # headers are 2-tuples: split(':', 1) of a header line
    request.body = await reader.readexactly(int(request.header("content-length", "0")))
    return request


def response_bytes(
    status: int,
    body: bytes,
    *,
    content_type: str = "application/json",
    close: bool = False,
    headers: list[tuple[str, str]] | None = None,
) -> bytes:
    return head_bytes(status, content_type, headers or [], length=len(body), close=close) + body


def head_bytes(
    status: int, content_type: str, headers: list[tuple[str, str]], *, length: int | None, close: bool = False
) -> bytes:
    """A response's status line and headers; without ``length`` the body is sent chunked
    (``chunk_bytes``), as a server streaming SSE does."""
    head = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}", f"content-type: {content_type}"]
    head.append(f"content-length: {length}" if length is not None else "transfer-encoding: chunked")
    if close:
        head.append("connection: close")
    head += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")


def chunk_bytes(data: bytes) -> bytes:
    """One chunk of a chunked body; ``b""`` gives the last one."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


class BackgroundServer:
    """An asyncio TCP server on its own event loop in a daemon thread, so it keeps
    answering while the code under test blocks or runs its own loop."""

    def __init__(
        self, handler: Handler, host: str = "127.0.0.1", port: int = 0, tls: ssl.SSLContext | None = None
    ) -> None:
        self._handler = handler
        self.host = host
        self.port = port
        self._tls = tls
        self._listener: asyncio.Server | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Future[None] | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self._tls else 'http'}://{self.host}:{self.port}"

    def start(self) -> None:
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("server did not start")

    def stop(self) -> None:
        if self._loop and self._stopping:
            self._loop.call_soon_threadsafe(self._stopping.set_result, None)
        if self._thread:
            self._thread.join(10)

    def stop_listening(self) -> None:
        """From a handler: refuse new connections from now on; open ones keep going."""
        if self._listener is not None:
            self._listener.close()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = self._loop.create_future()
        server = self._listener = await asyncio.start_server(self._handler, self.host, self.port, ssl=self._tls)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        await self._stopping
        # Not `async with server`: from 3.12 it waits for idle keep-alive connections.
        # asyncio.run cancels the connection handlers still running.
        server.close()


class Served:
    """Base of the stand-ins: their BackgroundServer (`self._server`), run for a `with` block."""

    _server: BackgroundServer

    @property
    def url(self) -> str:
        return self._server.url

    def __enter__(self) -> Self:
        self._server.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.stop()
