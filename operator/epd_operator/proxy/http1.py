"""HTTP/1.1 for the EPD proxy's main port, on asyncio Protocols and httptools (llhttp, the parser
uvicorn serves with): the clients' connections, and a keep-alive pool of connections to the
upstream. It frames and moves messages; what to do with a request is server.py's.

Why not aiohttp here: its server and client machinery cost the proxy 0.5 to 0.9 ms of CPU per
request on these cores, the whole of what it added to a request's latency; relaying parsed
messages costs a fifth of that (docs/proxy.md#cost). aiohttp still serves the admin port.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import unquote, urlsplit

import httptools

logger = logging.getLogger("epd_operator.proxy")

# A request's line and headers, together; a larger head is answered 431 (aiohttp's limits were
# 8 KiB a line, these are as generous for one long header and bound the whole).
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 256
# A body is read from the client's socket ahead of its use up to this much, then the socket is
# paused: pipelined requests and a slow upstream never pile up in memory.
READ_AHEAD_BYTES = 256 * 1024
# A body of a declared length up to this is awaited whole before its request is handed over:
# clients that write a request's head and body apart (httpx, so the openai SDK) are then served
# from callbacks, without a task, as those writing them together. The read-ahead holds it anyway.
AWAITED_BODY_BYTES = 64 * 1024
# Requests parsed ahead of their turn on one connection (pipelined) before its socket is paused.
PIPELINE_DEPTH = 16
# A client connection with no request in progress for this long is closed (aiohttp's and nginx's
# keep-alive timeout), and so is one whose request head (or awaited body) has not all arrived by
# then, counted from its first byte: idle or stalled clients do not hold sockets and memory for
# ever. One sweep does it, not a timer per request.
CLIENT_IDLE_SECONDS = 75.0
# Pooled upstream connections idle longer than this are closed (Go's net/http keeps them 90 s).
# Servers close idle ones sooner (vLLM's uvicorn after 5 s); a request whose reused connection
# closes before any byte of the answer is sent again on a new one, as net/http does.
UPSTREAM_IDLE_SECONDS = 60.0
# A body still arriving cannot be sent again: its request takes a connection used this recently,
# under every server's idle limit, or a new one.
STREAMED_IDLE_SECONDS = 2.0

Handler = Callable[["Exchange"], Coroutine[Any, Any, None] | None]
"""Serves one exchange: returns what to await (the connection runs it as its task), or None when
it serves the exchange from callbacks, which call ``Exchange.finish`` once it is over."""
# The proxy's own answers (errors in vLLM's shape) are JSON.
JSON_HEADERS = [("content-type", "application/json")]


class TooLarge(Exception):
    """A body over the limit its reader set."""


class ClientGone(Exception):
    """The client closed its connection before its request was read."""


class UpstreamError(Exception):
    """The upstream could not be reached, or its answer broke off or was malformed."""


class Unreachable(UpstreamError):
    pass


class BrokeOff(UpstreamError):
    pass


@dataclass(frozen=True, slots=True)
class RequestHead:
    method: str
    target: str
    """The request-target as sent, percent-encoding kept: forwarded exactly."""
    path: str
    """Its path, percent-decoded: what routes."""
    headers: list[tuple[str, str]]
    """In the order sent, names lower-cased (HTTP/2's form: every later lookup is a compare)."""
    version: str
    keep_alive: bool
    framed: bool
    """The client sent a Content-Length or chunked body (maybe empty): so is the forwarded one."""
    length: int | None
    """Content-Length, when given."""


class Body:
    """A request's body as it arrives from the client: read whole (``read``) or chunk by chunk."""

    __slots__ = ("_buffered", "_chunks", "_connection", "_continue", "awaited", "complete", "length")

    def __init__(self, connection: ClientConnection, head: RequestHead, expects_continue: bool) -> None:
        self._connection = connection
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self.complete = not head.framed
        self._continue = expects_continue
        self.length = head.length
        self.awaited = (
            not self.complete and not expects_continue and head.length is not None and head.length <= AWAITED_BODY_BYTES
        )
        """Its request is handed over only once it is whole (AWAITED_BODY_BYTES)."""

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > READ_AHEAD_BYTES:
            self._connection.pause_reading()
        self._connection.wake()

    def finish(self) -> None:
        self.complete = True
        self._connection.wake()

    @property
    def backlogged(self) -> bool:
        """More has arrived than the read-ahead allows: the socket stays paused."""
        return self._buffered > READ_AHEAD_BYTES

    def take(self) -> bytes:
        """What has arrived, at once: the whole body once ``complete``."""
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        self._connection.resume_reading()
        return data

    async def next_chunk(self) -> bytes | None:
        """The next chunk, or None at the end."""
        if self._continue:
            # The client waits for this before it sends the body (curl does above 1 MiB).
            self._continue = False
            self._connection.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        while not self._chunks:
            if self.complete:
                return None
            await self._connection.wait()
        chunk = self._chunks.popleft()
        self._buffered -= len(chunk)
        if self._buffered <= READ_AHEAD_BYTES:
            self._connection.resume_reading()
        return chunk

    def whole(self, limit: int) -> bytes:
        """The body, once ``complete``; TooLarge past ``limit`` bytes."""
        if self.length is not None and self.length > limit:
            raise TooLarge
        data = self.take()
        if len(data) > limit:  # a chunked one
            raise TooLarge
        return data

    async def read(self, limit: int) -> bytes:
        """The whole body; TooLarge past ``limit`` bytes (before reading any, for a declared one)."""
        if self.complete:
            return self.whole(limit)
        if self.length is not None and self.length > limit:
            raise TooLarge
        parts, size = [], 0
        while (chunk := await self.next_chunk()) is not None:
            size += len(chunk)
            if size > limit:
                raise TooLarge
            parts.append(chunk)
        return b"".join(parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        while (chunk := await self.next_chunk()) is not None:
            yield chunk


def _head(status: int, reason: str | None, headers: list[tuple[str, str]], framing: str) -> bytes:
    lines = [f"HTTP/1.1 {status} {reason if reason is not None else _phrase(status)}\r\n"]
    lines += [f"{name}: {value}\r\n" for name, value in headers]
    lines.append(framing)
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


class Exchange:
    """One request on a client connection, and the proxy's answer to it: whole (``respond``) or
    streamed (``start``, ``write``, ``end``)."""

    __slots__ = ("_bodyless", "_chunked", "body", "cancel", "connection", "ended", "head", "reusable", "status")

    def __init__(self, connection: ClientConnection, head: RequestHead, body: Body) -> None:
        self.connection = connection
        self.head = head
        self.body = body
        self.status: int | None = None
        self._chunked = False
        self._bodyless = head.method == "HEAD"
        self.ended = False
        self.reusable = head.keep_alive
        self.cancel: Callable[[], object] | None = None
        """Called if the client leaves while callbacks serve the exchange (a task is cancelled)."""

    def finish(self) -> None:
        """The exchange served from callbacks is over: the connection goes on to the next."""
        self.connection.finished(self)

    @property
    def started(self) -> bool:
        return self.status is not None

    def _framing(self, length: int | None) -> str:
        if length is not None:
            framing = f"content-length: {length}\r\n"
        elif self._bodyless:
            framing = ""
        elif self.head.version == "1.1":
            self._chunked = True
            framing = "transfer-encoding: chunked\r\n"
        else:  # an HTTP/1.0 client knows no chunks: the end of the connection ends the body
            self.reusable = False
            framing = ""
        if not self.body.complete:  # what is left of the body is not read: the connection ends
            self.reusable = False
        return framing if self.reusable else framing + "connection: close\r\n"

    def respond(self, status: int, headers: list[tuple[str, str]], body: bytes, reason: str | None = None) -> None:
        self.status = status
        head = _head(status, reason, headers, self._framing(len(body)))
        self.connection.write(head if self._bodyless else head + body)
        self.ended = True

    def start(self, status: int, reason: str | None, headers: list[tuple[str, str]], length: int | None) -> None:
        self.status = status
        self.connection.write(_head(status, reason, headers, self._framing(length)))

    def write(self, data: bytes) -> None:
        if self._bodyless or not data:
            return
        self.connection.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)

    def end(self) -> None:
        if self._chunked and not self._bodyless:
            self.connection.write(b"0\r\n\r\n")
        self.ended = True

    def abort(self) -> None:
        """Drop the client's connection: how a client learns that a streamed answer is cut short."""
        self.reusable = False
        self.connection.abort()


@dataclass(frozen=True, slots=True)
class _Rejection:
    """A request that could not be parsed: answered in its turn, then the connection closes."""

    status: int
    message: str


# A request-target that is its own path: no query, fragment or percent-encoding to take apart.
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9/._~-]*")


def _path(target: bytes) -> str:
    """The percent-decoded path of a request-target."""
    try:
        return unquote(httptools.parse_url(target).path.decode("latin-1"))
    except httptools.HttpParserInvalidURLError:
        return target.decode("latin-1")  # "*" of OPTIONS


class ClientConnection(asyncio.Protocol):
    """One client connection: requests parsed as they arrive and answered one after the other by
    ``handle`` (pipelined ones queue). The client leaving cancels the request in progress."""

    def __init__(self, handle: Handler, reject: Callable[[int, str], bytes], connections: set[ClientConnection]):
        self._handle = handle
        self._reject = reject
        self._connections = connections
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._queue: deque[Exchange | _Rejection] = deque()
        self._current: Exchange | None = None
        self._starting = False
        self._parsing: Body | None = None
        self._url = b""
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._in_head = False
        self._head_too_large = False
        self._read_all = False  # nothing more is parsed: a refused request, an upgrade
        self._waiter: asyncio.Future[None] | None = None
        self._reading_paused = False
        self.idle_since: float | None = time.monotonic()
        """Since when no request has been handed over (None: one is being served), restarted
        when the next request's first byte comes: a stalled head or awaited body is idle."""
        self.closed = False
        self.backpressure: Callable[[bool], None] | None = None
        """Called with True when the client reads slower than the proxy writes, False when it
        caught up: a streamed answer pauses its upstream meanwhile."""

    @property
    def busy(self) -> bool:
        return self._current is not None

    # ------------------------------------------------------------------ transport events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not its subclasses
        self._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._connections.discard(self)
        self.wake()
        current = self._current
        if current is not None and current.cancel is not None:
            current.cancel()  # the upstream request is aborted with it: vLLM stops generating

    def data_received(self, data: bytes) -> None:
        if self._read_all:
            return
        if self._in_head:
            # httptools holds a header until it is whole: a head that never ends is cut here.
            self._head_bytes += len(data)
            if self._head_bytes > 2 * MAX_HEAD_BYTES:
                self._head_too_large = True
                self._refuse(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, self._too_large_message())
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No protocol switch (docs/proxy.md#limits): the request was served plain; the bytes
            # after it belong to the other protocol, so the connection ends with its answer.
            self._stop_reading()
        except httptools.HttpParserError as error:
            if self._head_too_large:
                self._refuse(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, self._too_large_message())
                return
            if isinstance(error, httptools.HttpParserCallbackError):
                logger.error("the proxy failed on a request", exc_info=error.__context__)
            self._refuse(HTTPStatus.BAD_REQUEST, f"malformed HTTP request: {error}")
            return
        self._start_next()

    def pause_writing(self) -> None:
        if self.backpressure is not None:
            self.backpressure(True)

    def resume_writing(self) -> None:
        if self.backpressure is not None:
            self.backpressure(False)

    # ------------------------------------------------------------------ parser callbacks

    def on_message_begin(self) -> None:
        if self.idle_since is not None:  # a stalled head or awaited body is idle from its start
            self.idle_since = time.monotonic()
        self._url = b""
        self._raw_headers = []
        self._head_bytes = 0
        self._in_head = True

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > MAX_HEAD_BYTES:
            self._too_large_head()

    def on_header(self, name: bytes, value: bytes) -> None:
        raw_headers = self._raw_headers
        raw_headers.append((name, value))
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_HEAD_BYTES or len(raw_headers) > MAX_HEADERS:
            self._too_large_head()

    def on_headers_complete(self) -> None:
        self._in_head = False
        headers = []
        length, chunked, expects_continue = None, False, False
        for raw_name, raw_value in self._raw_headers:
            name, value = raw_name.lower().decode("latin-1"), raw_value.decode("latin-1")
            headers.append((name, value))
            if name == "content-length":
                length = int(value)  # llhttp accepts digits only
            elif name == "transfer-encoding":
                chunked = True  # llhttp refuses a body framed otherwise
            elif name == "expect":
                expects_continue = value.lower() == "100-continue"
        target = self._url.decode("latin-1")
        path = target if _PLAIN_PATH.fullmatch(target) else _path(self._url)
        parser = self._parser
        head = RequestHead(
            method=parser.get_method().decode("latin-1"),
            target=target,
            path=path,
            headers=headers,
            version=parser.get_http_version(),
            keep_alive=parser.should_keep_alive(),
            framed=chunked or length is not None,
            length=length,
        )
        body = Body(self, head, expects_continue and (chunked or bool(length)))
        self._parsing = body
        self._queue.append(Exchange(self, head, body))
        if len(self._queue) > PIPELINE_DEPTH:
            self.pause_reading()

    def on_body(self, data: bytes) -> None:
        assert self._parsing is not None
        self._parsing.feed(data)

    def on_message_complete(self) -> None:
        assert self._parsing is not None
        self._parsing.finish()

    def _too_large_head(self) -> None:
        self._head_too_large = True
        raise ValueError("request head too large")  # stops the parser: answered 431

    @staticmethod
    def _too_large_message() -> str:
        return (
            f"the request's line and headers exceed the proxy's limit of {MAX_HEAD_BYTES} bytes "
            f"or {MAX_HEADERS} headers"
        )

    # ------------------------------------------------------------------ serving

    def _start_next(self) -> None:
        """Serve the request whose turn it is, once what data_received brought is parsed: a body
        that arrived whole with its head is handed over whole, so the handler can answer from
        callbacks, without a task."""
        if self._starting:
            return  # an exchange finished within its handler: the loop below goes on
        self._starting = True
        try:
            while self._current is None and self._queue and not self.closed:
                item = self._queue[0]
                if isinstance(item, _Rejection):
                    self._refusal(item.status, item.message)
                    return
                if item.body.awaited and not item.body.complete:
                    return  # on_message_complete brings it back here
                self._current = item
                self.idle_since = None
                try:
                    pending = self._handle(item)
                except Exception:  # noqa: BLE001 - logged by failed()
                    self.failed(item)
                    return
                if pending is not None:
                    asyncio.get_running_loop().create_task(self._run(item, pending))
        finally:
            self._starting = False

    async def _run(self, exchange: Exchange, pending: Coroutine[Any, Any, None]) -> None:
        if self.closed:  # the client left before the task ran: what it held was released then
            pending.close()
            return
        task = asyncio.current_task()
        assert task is not None
        exchange.cancel = task.cancel
        try:
            await pending
        except ClientGone:
            return
        except Exception:  # noqa: BLE001 - logged by failed()
            self.failed(exchange)
            return
        exchange.cancel = None
        self.finished(exchange)

    def run(self, exchange: Exchange, pending: Coroutine[Any, Any, None]) -> None:
        """Go on serving ``exchange`` (served from callbacks until now) with a task."""
        asyncio.get_running_loop().create_task(self._run(exchange, pending))

    def finished(self, exchange: Exchange) -> None:
        if self._current is not exchange:
            return
        self._current = None
        self._queue.popleft()
        if not (exchange.ended and exchange.reusable):
            self.close()
            return
        self.idle_since = time.monotonic()
        if len(self._queue) <= PIPELINE_DEPTH and not (self._parsing and self._parsing.backlogged):
            self.resume_reading()
        self._start_next()

    def failed(self, exchange: Exchange) -> None:
        """The proxy failed serving ``exchange`` (called while handling the exception)."""
        logger.exception("%s %s: the proxy failed", exchange.head.method, exchange.head.target)
        exchange.cancel = None
        if exchange.started:
            exchange.abort()
        else:
            self._refusal(HTTPStatus.INTERNAL_SERVER_ERROR, "the proxy failed; see its log")

    def _refusal(self, status: int, message: str) -> None:
        """The answer to a request the proxy could not take, after which the connection closes."""
        body = self._reject(status, message)
        framing = f"content-length: {len(body)}\r\nconnection: close\r\n"
        self.write(_head(status, None, JSON_HEADERS, framing) + body)
        self.close()

    def _refuse(self, status: int, message: str) -> None:
        self._queue.append(_Rejection(status, message))
        self._stop_reading()
        self._start_next()

    # ------------------------------------------------------------------ I/O for Body and Exchange

    def write(self, data: bytes) -> None:
        if self._transport is not None and not self.closed:
            self._transport.write(data)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def pause_reading(self) -> None:
        if not self._reading_paused and self._transport is not None and not self.closed:
            self._reading_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and not self._read_all and self._transport is not None and not self.closed:
            self._reading_paused = False
            self._transport.resume_reading()

    def _stop_reading(self) -> None:
        self.pause_reading()
        self._read_all = True  # for good: resume_reading no longer does
        for item in self._queue:
            if isinstance(item, Exchange):
                item.reusable = False

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        """Until more of a body arrives; ClientGone once the client left."""
        if self.closed:
            raise ClientGone
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter
        if self.closed:
            raise ClientGone


async def close_idle(connections: set[ClientConnection]) -> None:
    """Close, for as long as it runs, client connections idle for CLIENT_IDLE_SECONDS."""
    while True:
        await asyncio.sleep(CLIENT_IDLE_SECONDS / 4)
        now = time.monotonic()
        for connection in list(connections):
            if connection.idle_since is not None and now - connection.idle_since >= CLIENT_IDLE_SECONDS:
                connection.close()


# --------------------------------------------------------------------------- the upstream


class Answer:
    """The upstream's answer to one request: its head (``await head()``), then its body, read
    whole (``read``) or relayed to the client as it comes (``relay``)."""

    __slots__ = (
        "_bodyless",
        "_chunks",
        "_connection",
        "_error",
        "_sink",
        "_waiter",
        "chunked",
        "complete",
        "event_stream",
        "headers",
        "length",
        "notify",
        "reason",
        "received",
        "sending",
        "status",
    )

    def __init__(self, connection: UpstreamConnection, bodyless: bool) -> None:
        self._connection = connection
        self.status: int | None = None
        self.reason = ""
        self.headers: list[tuple[str, str]] = []  # names lower-cased, as RequestHead's
        self.length: int | None = None
        self.chunked = False
        self.event_stream = False
        self.received = False
        self.complete = False
        self._bodyless = bodyless
        self._chunks: list[bytes] = []
        self._sink: Callable[[bytes], None] | None = None
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.sending: asyncio.Task[None] | None = None
        """The request's body still being sent, when it is streamed."""
        self.notify: Callable[[], None] | None = None
        """Called when the head arrives, when the body is complete and when the answer fails:
        how callbacks follow an answer that no task awaits."""

    @property
    def error(self) -> UpstreamError | None:
        return self._error

    async def head(self) -> None:
        while self.status is None:
            await self._wait()

    async def read(self) -> bytes:
        while not self.complete:
            await self._wait()
        return self.whole()

    def whole(self) -> bytes:
        """The body, once ``complete``."""
        return b"".join(self._chunks)

    async def relay(self, exchange: Exchange) -> None:
        """Write the body to the client as it arrives (chunk by chunk, never held), pausing the
        upstream while the client reads slower. Raises BrokeOff if it breaks off."""
        for chunk in self._chunks:
            exchange.write(chunk)
        self._chunks.clear()
        self._sink = exchange.write
        exchange.connection.backpressure = self._connection.backpressure
        try:
            while not self.complete:
                await self._wait()
        finally:
            exchange.connection.backpressure = None
            self._connection.backpressure(False)

    def release(self) -> None:
        """The request is over for the proxy: an answer not complete (the client left, a timeout)
        closes its connection, so the upstream aborts the request."""
        if self.sending is not None:
            self.sending.cancel()
        if not self.complete:
            self._connection.abort()

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter  # the caller checks again what it waits for, then an error

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if self.notify is not None:
            self.notify()

    # from the connection's parser

    def _begin(self, status: int, reason: str, headers: list[tuple[str, str]]) -> None:
        self.status, self.reason, self.headers = status, reason, headers
        for name, value in headers:
            if name == "content-length":
                self.length = int(value)
            elif name == "transfer-encoding":
                self.chunked = "chunked" in value.lower()
            elif name == "content-type":
                self.event_stream = value.startswith("text/event-stream")
        if self._bodyless:
            self.complete = True
        self._wake()

    def _body(self, data: bytes) -> None:
        if self._sink is not None:
            self._sink(data)
        else:
            self._chunks.append(data)

    def _finish(self) -> None:
        self.complete = True
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        self._error = error
        self._wake()


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to the upstream, one request at a time."""

    def __init__(self, pool: Upstream) -> None:
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._answer: Answer | None = None
        self._reason = b""
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._drained: asyncio.Future[None] | None = None
        self._reading_paused = False
        self.closed = False
        self.idle_since = 0.0

    def send(self, head: bytes, method: str) -> Answer:
        assert self._transport is not None
        self._answer = Answer(self, bodyless=method == "HEAD")
        self._transport.write(head)
        return self._answer

    def write(self, data: bytes) -> None:
        if self._transport is not None and not self.closed:
            self._transport.write(data)

    async def drain(self) -> None:
        if self._drained is not None:
            await self._drained

    def abort(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.abort()

    def backpressure(self, paused: bool) -> None:
        if self._transport is None or self.closed or paused == self._reading_paused:
            return
        self._reading_paused = paused
        if paused:
            self._transport.pause_reading()
        else:
            self._transport.resume_reading()

    # transport events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self)
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        answer = self._answer
        if answer is None or answer.complete:
            return
        if answer.status is not None and answer.length is None and not answer.chunked:
            answer._finish()  # a body that ends with the connection
        else:
            answer._fail(BrokeOff(f"the connection closed mid-answer ({exc or 'by the upstream'})"))

    def data_received(self, data: bytes) -> None:
        if self._answer is None:  # nothing was asked: a server talking out of turn
            self.abort()
            return
        self._answer.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            if self._answer is not None:
                self._answer._fail(BrokeOff(f"malformed answer: {error}"))
            self.abort()

    def pause_writing(self) -> None:
        self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    # parser callbacks

    def on_message_begin(self) -> None:
        self._reason = b""
        self._raw_headers = []

    def on_status(self, reason: bytes) -> None:
        self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self._answer is None:
            raise ValueError("an answer to no request")  # stops the parser: the connection is dropped
        headers = [(name.lower().decode("latin-1"), value.decode("latin-1")) for name, value in self._raw_headers]
        status = self._parser.get_status_code()
        if status < 200:  # an interim answer (103 Early Hints): the real one follows
            return
        self._answer._begin(status, self._reason.decode("latin-1"), headers)
        if self._answer.complete:  # a HEAD answer: its Content-Length announces no body here
            self._answer = None
            self.abort()  # llhttp would wait for that body: the connection is not reused

    def on_body(self, data: bytes) -> None:
        if self._answer is not None:
            self._answer._body(data)

    def on_message_complete(self) -> None:
        answer = self._answer
        if answer is None or answer.status is None:  # the end of an interim answer
            return
        self._answer = None
        reusable = self._parser.should_keep_alive() and not self.closed
        if reusable:  # before the answer is handed on, so that the next request can take it
            self._pool.put_back(self)
        else:
            self.abort()
        answer._finish()


class Upstream:
    """Keep-alive HTTP/1.1 connections to one upstream, reused one request at a time: the clients'
    own concurrency bounds them, as it bounds the router's."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the upstream must be an http:// URL, not {url!r}")
        self.url = url.rstrip("/")
        self._host = parts.hostname
        self._port = parts.port or 80
        self._authority = parts.netloc
        self._prefix = parts.path.rstrip("/")
        self._idle: list[UpstreamConnection] = []

    def send(self, head: RequestHead, headers: list[tuple[str, str]], body: bytes | None) -> tuple[Answer, bool] | None:
        """Send a request whose body is whole on an idle connection, if one is, without waiting:
        the answer, and whether the connection was reused (None: no connection is idle)."""
        connection, reused = self._take(UPSTREAM_IDLE_SECONDS)
        if connection is None:
            return None
        start = self._start(head, headers, body)
        return connection.send(start if body is None else start + body, head.method), reused

    async def request(self, head: RequestHead, headers: list[tuple[str, str]], body: bytes | Body | None) -> Answer:
        """Send a request; return once the answer's head arrived. ``body``: bytes (sent with their
        Content-Length), a Body still arriving (streamed, chunked unless its length is known),
        or None (the client framed none). A request on a reused connection that closed before
        answering is sent once more on a new one, if its body is bytes."""
        start = self._start(head, headers, body)
        chunked = isinstance(body, Body) and body.length is None
        while True:
            connection, reused = self._take(STREAMED_IDLE_SECONDS if isinstance(body, Body) else UPSTREAM_IDLE_SECONDS)
            if connection is None:
                connection = await self._connect()
            answer = connection.send(start + body if isinstance(body, bytes) else start, head.method)
            if isinstance(body, Body):
                answer.sending = asyncio.get_running_loop().create_task(_send_body(connection, body, chunked))
            try:
                await answer.head()
            except BrokeOff:
                answer.release()
                if reused and not answer.received and not isinstance(body, Body):
                    continue
                raise
            except BaseException:  # cancelled (the client left) or timed out: the upstream aborts
                answer.release()
                raise
            return answer

    def _start(self, head: RequestHead, headers: list[tuple[str, str]], body: bytes | Body | None) -> bytes:
        """The request line and headers, with the body's framing."""
        lines = [f"{head.method} {self._prefix}{head.target} HTTP/1.1\r\nhost: {self._authority}\r\n"]
        lines += [f"{name}: {value}\r\n" for name, value in headers]
        if isinstance(body, bytes):
            lines.append(f"content-length: {len(body)}\r\n")
        elif body is not None:
            if body.length is not None:
                lines.append(f"content-length: {body.length}\r\n")
            else:
                lines.append("transfer-encoding: chunked\r\n")
        lines.append("\r\n")
        return "".join(lines).encode("latin-1")

    def _take(self, max_idle: float) -> tuple[UpstreamConnection | None, bool]:
        """The most recently used idle connection, if it has been idle under ``max_idle``."""
        now = time.monotonic()
        while self._idle:
            connection = self._idle[-1]
            if connection.closed or now - connection.idle_since >= UPSTREAM_IDLE_SECONDS:
                self._idle.pop().abort()
            elif now - connection.idle_since >= max_idle:
                break
            else:
                return self._idle.pop(), True
        return None, False

    async def _connect(self) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        try:
            _, connection = await loop.create_connection(lambda: UpstreamConnection(self), self._host, self._port)
        except OSError as error:
            raise Unreachable(str(error) or type(error).__name__) from None
        return connection

    def put_back(self, connection: UpstreamConnection) -> None:
        connection.idle_since = now = time.monotonic()
        while self._idle and now - self._idle[0].idle_since >= UPSTREAM_IDLE_SECONDS:  # the oldest first
            self._idle.pop(0).abort()
        self._idle.append(connection)

    def forget(self, connection: UpstreamConnection) -> None:
        if connection in self._idle:
            self._idle.remove(connection)

    def close(self) -> None:
        for connection in self._idle:
            connection.abort()
        self._idle.clear()


async def _send_body(connection: UpstreamConnection, body: Body, chunked: bool) -> None:
    """A body that is still arriving, written upstream as it comes."""
    try:
        async for chunk in body.chunks():
            connection.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
            await connection.drain()
    except ClientGone:  # the request is cancelled with it
        return
    if chunked:
        connection.write(b"0\r\n\r\n")
