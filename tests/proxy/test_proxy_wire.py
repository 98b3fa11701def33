"""The proxy's HTTP/1.1 on the wire (aiohttp's server and client): what clients and upstreams
send it as raw bytes, where a client library would hide the framing: pipelining, 100-continue,
chunked bodies both ways, limits, HTTP/1.0, HEAD, and an upstream that closes a kept-alive
connection."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest

from epd_dataplane.server import LINGER_SECONDS
from epd_operator.proxy_limits import Limits

from .conftest import answer_models, raw_upstream

CHAT = "/v1/chat/completions"
HEADER_BYTES = Limits().max_header_bytes


def chat_body(text: str = "hi") -> bytes:
    return json.dumps({"model": "served", "messages": [{"role": "user", "content": text}]}).encode()


def request(method: str, path: str, body: bytes = b"", *headers: str, version: str = "1.1") -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "host: proxy", *headers]
    if body:
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One answer off the wire: status, headers (lower-case names), body de-chunked."""
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    headers = {}
    while (line := await reader.readline()) != b"\r\n":
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while (size := int((await reader.readline()).strip(), 16)) != 0:
            body += await reader.readexactly(size)
            await reader.readline()
        await reader.readline()
        return status, headers, body
    return status, headers, await reader.read()  # the end of the connection ends it


@contextlib.asynccontextmanager
async def connected(url: str) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        yield reader, writer
    finally:
        writer.close()


async def test_pipelined_requests_are_answered_in_order_on_one_connection(server, start_proxy):
    upstream = server()
    proxy = await start_proxy(upstream.url, [server().url])
    async with connected(proxy.url) as (reader, writer):
        writer.write(
            request("POST", CHAT, chat_body("first"))
            + request("GET", "/v1/models")
            + request("POST", "/v1/completions", b'{"prompt": "third"}')
        )
        answers = [await read_answer(reader) for _ in range(3)]
    assert [json.loads(body)["object"] for _, _, body in answers] == ["chat.completion", "list", "text_completion"]
    assert [(r.method, r.path) for r in upstream.records] == [
        ("POST", CHAT),
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
    ]


async def test_a_client_expecting_100_continue_gets_it_before_sending_its_body(server, start_proxy):
    upstream = server()
    proxy = await start_proxy(upstream.url, [server().url])
    body = chat_body("x" * 4096)
    async with connected(proxy.url) as (reader, writer):
        head = request("POST", CHAT, body, "expect: 100-continue")
        writer.write(head[: -len(body)])  # the head alone, as curl sends it
        assert await asyncio.wait_for(reader.readline(), 5) == b"HTTP/1.1 100 Continue\r\n"
        assert await reader.readline() == b"\r\n"
        writer.write(body)
        status, _, answer = await read_answer(reader)
    assert status == 200 and json.loads(answer)["object"] == "chat.completion"
    assert "expect" not in upstream.records[0].headers  # the client's exchange with the proxy only


@contextlib.asynccontextmanager
async def upstream_reading_chunks() -> AsyncIterator[tuple[str, list[tuple[bytes, bytes]]]]:
    """An upstream that takes chunked request bodies (the stand-in engines take Content-Length
    only) and answers {}: yields its URL and the (head, de-chunked body) of each request."""
    seen: list[tuple[bytes, bytes]] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        body = b""
        while (size := int((await reader.readline()).strip(), 16)) != 0:
            body += await reader.readexactly(size)
            await reader.readline()
        await reader.readline()
        seen.append((head, body))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()

    async with raw_upstream(answer) as url:
        yield url, seen


async def test_a_chunked_primed_body_over_the_limit_is_refused_even_when_it_arrives_whole(server, start_proxy):
    """No Content-Length to refuse it by: its size, counted once it is whole, is."""
    upstream = server()
    proxy = await start_proxy(upstream.url, [server().url], max_request_bytes=1024)
    body = chat_body("x" * 4096)
    async with connected(proxy.url) as (reader, writer):
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: p\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
        )  # one write: the proxy reads the body whole with its head
        status, _, answer = await read_answer(reader)
    assert (status, json.loads(answer)["error"]["type"]) == (413, "RequestEntityTooLargeError")
    assert upstream.records == []


async def test_a_chunked_body_is_streamed_upstream_whole(server, start_proxy):
    payload = json.dumps({"prompt": "y" * (3 * 1024 * 1024)}).encode()  # over the read-ahead and the limit
    pieces = [payload[i : i + 65536] for i in range(0, len(payload), 65536)]
    async with upstream_reading_chunks() as (upstream, seen):
        proxy = await start_proxy(upstream, [server().url], max_request_bytes=1024)
        async with connected(proxy.url) as (reader, writer):
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: p\r\ntransfer-encoding: chunked\r\n\r\n")
            for piece in pieces:
                writer.write(b"%x\r\n%b\r\n" % (len(piece), piece))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            status, _, answer = await read_answer(reader)
    assert (status, answer) == (200, b"{}")
    ((head, body),) = seen
    assert b"transfer-encoding: chunked" in head.lower() and body == payload


@pytest.mark.parametrize(
    ("raw", "status", "kind"),
    [
        (b"GET /v1/models HTTP/1.1\r\nhost: p\r\nx-big: " + b"a" * (HEADER_BYTES + 1) + b"\r\n\r\n", 431, "Request"),
        (b"GET /" + b"a" * HEADER_BYTES + b" HTTP/1.1\r\nhost: p\r\n\r\n", 431, "Request"),
        (
            b"GET /v1/models HTTP/1.1\r\nhost: p\r\n" + b"".join(b"x-%d: 1\r\n" % i for i in range(300)) + b"\r\n",
            400,
            "BadRequestError",
        ),
        (b"GET /v1/models HTTP/1.1\r\ncontent-length: nope\r\n\r\n", 400, "BadRequestError"),
        (b"NOT HTTP AT ALL\r\n\r\n", 400, "BadRequestError"),
    ],
)
async def test_unparseable_or_oversized_heads_get_an_error_and_are_not_forwarded(
    server, start_proxy, raw, status, kind
):
    upstream = server()
    proxy = await start_proxy(upstream.url, [server().url])
    async with connected(proxy.url) as (reader, writer):
        writer.write(raw)
        got, _, body = await read_answer(reader)
        assert await reader.read() == b""  # and the connection closes
    error = json.loads(body)["error"]
    assert (got, error["code"]) == (status, status) and error["type"].startswith(kind)
    assert "--max-header-bytes" in error["message"] and "spec.proxy.maxHeaders" in error["message"]
    assert upstream.records == []


async def test_an_http_1_0_client_gets_a_streamed_answer_ended_by_the_close(server, start_proxy):
    upstream = server()
    proxy = await start_proxy(upstream.url, [server().url])
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
    async with connected(proxy.url) as (reader, writer):
        writer.write(request("POST", CHAT, body, version="1.0"))
        status, headers, answer = await read_answer(reader)
    assert status == 200 and "transfer-encoding" not in headers
    assert answer.rstrip().endswith(b"data: [DONE]")


async def test_a_head_request_gets_the_upstreams_head_and_no_body(server, start_proxy):
    upstream = server()
    proxy = await start_proxy(upstream.url, [server().url])
    async with connected(proxy.url) as (reader, writer):
        writer.write(request("HEAD", "/v1/models") + request("GET", "/v1/models"))
        status_line = await reader.readline()
        while await reader.readline() != b"\r\n":  # its headers
            pass
        second = await read_answer(reader)  # right after the first head: no body came between
    assert status_line.split()[1] == b"404"  # the stand-in's answer to any HEAD, with a Content-Length
    assert second[0] == 200 and json.loads(second[2])["object"] == "list"


@contextlib.asynccontextmanager
async def upstream_closing_kept_connections() -> AsyncIterator[tuple[str, list[int]]]:
    """An upstream that answers the first request of each connection with keep-alive, then
    closes the connection unanswered when a second one comes: the race of a server closing an
    idle connection as the proxy reuses it. Yields its URL and the requests per connection."""
    counts: list[int] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        counts.append(0)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                counts[-1] += 1
                if counts[-1] > 1:
                    writer.transport.abort()
                    return
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")

    async with raw_upstream(answer) as url:
        yield url, counts


async def test_a_request_on_a_kept_connection_the_upstream_closed_is_sent_again(start_proxy, server):
    async with upstream_closing_kept_connections() as (upstream, counts):
        proxy = await start_proxy(upstream, [server().url])
        async with connected(proxy.url) as (reader, writer):
            for _ in range(3):
                writer.write(request("POST", CHAT, chat_body()))
                assert (await read_answer(reader))[0] == 200
    assert counts == [2, 2, 1]  # each reuse was refused, and the request went again on a new one


async def test_a_deep_pipeline_is_read_in_turns_and_answered_whole(server, start_proxy):
    upstream = server()
    proxy = await start_proxy(upstream.url, [server().url])
    count = 200  # many times what aiohttp parses ahead of its turn (32) before it pauses the socket
    async with connected(proxy.url) as (reader, writer):
        writer.write(b"".join(request("GET", f"/v1/models?n={i}") for i in range(count)))
        answers = [await asyncio.wait_for(read_answer(reader), 10) for _ in range(count)]
    assert {status for status, _, _ in answers} == {200}
    assert [r.path for r in upstream.records] == [f"/v1/models?n={i}" for i in range(count)]


async def test_an_idle_or_stalled_client_connection_is_closed(server, start_proxy):
    proxy = await start_proxy(server().url, [server().url], keepalive_timeout_seconds=0.3, body_timeout_seconds=0.3)
    async with connected(proxy.url) as (reader, writer):
        assert await asyncio.wait_for(reader.read(), 5) == b""  # never sent a request
    async with connected(proxy.url) as (reader, writer):
        writer.write(request("GET", "/v1/models"))
        assert (await read_answer(reader))[0] == 200
        assert await asyncio.wait_for(reader.read(), 5) == b""  # idle after its answer
    async with connected(proxy.url) as (reader, writer):
        writer.write(b"GET /v1/models HTTP/1.1\r\nhost: p\r\n")  # a head that never ends
        assert await asyncio.wait_for(reader.read(), 5) == b""
    async with connected(proxy.url) as (reader, writer):
        writer.write(request("POST", CHAT, chat_body())[:-5])  # a body that never ends
        status, headers, body = await asyncio.wait_for(read_answer(reader), 5)
        assert (status, headers["connection"]) == (408, "close")
        assert "spec.proxy.bodyTimeoutSeconds" in json.loads(body)["error"]["message"]
        # closed once what is left of the body stopped coming for the lingering close's time
        assert await asyncio.wait_for(reader.read(), LINGER_SECONDS + 5) == b""


async def test_an_answer_still_streaming_at_the_request_timeout_is_cut_short(start_proxy, server, http, warm):
    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answer_models(reader, writer)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"d\r\ndata: first\n\n\r\n")
        await writer.drain()
        await asyncio.sleep(30)  # and never ends

    async with raw_upstream(stalls) as upstream:
        proxy = await start_proxy(upstream, [server().url], request_timeout_seconds=0.3)
        await warm(http, proxy.url)
        async with connected(proxy.url) as (reader, writer):
            writer.write(request("POST", "/v1/completions", b'{"prompt": "x", "stream": true}'))
            received = await asyncio.wait_for(reader.read(), 5)  # the proxy drops the connection
    assert received.startswith(b"HTTP/1.1 200") and b"data: first" in received
    assert not received.endswith(b"0\r\n\r\n")  # no last chunk: the client sees the answer cut


async def test_header_names_go_on_lower_cased_both_ways_values_and_order_kept(server, start_proxy):
    heads: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\nX-Upstream: Mixed Case\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\n")
        writer.write(b"Content-Length: 2\r\n\r\n{}")
        await writer.drain()

    async with raw_upstream(answer) as upstream:
        proxy = await start_proxy(upstream, [server().url])
        async with connected(proxy.url) as (reader, writer):
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: p\r\nX-Trace: One\r\nAccept: a\r\nACCEPT: b\r\n\r\n")
            answer_head = await reader.readuntil(b"\r\n\r\n")
            assert await reader.readexactly(2) == b"{}"
    (head,) = heads
    assert b"\r\nx-trace: One\r\naccept: a\r\naccept: b\r\n" in head
    assert b"X-Trace" not in head and b"ACCEPT" not in head
    assert answer_head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"\r\nx-upstream: Mixed Case\r\nset-cookie: a=1\r\nset-cookie: b=2\r\n" in answer_head
