"""The EPD proxy under hostile and careless clients, as the process a unit runs (`epd-operator
proxy`, its own RSS), in front of stand-ins (epd_dev/standins, not vLLM) and raw upstreams
written here: request smuggling shapes, slow and never-reading clients, huge and deep bodies,
thousands of parts and connections, a low fd limit, an upstream that answers early.

Each test asserts the answer, that the proxy's RSS stays bounded, and that a well-behaved
client running alongside is served within its usual latency. Where a reference parser exists
(h11, on the same raw bytes), the proxy either refuses what it accepts or reads it the same."""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import h11
import pytest

from epd_dev.proxy_process import ProxyProcess
from epd_dev.standins.vllm_server import StandinServer

from .conftest import keyed

CHAT = "/v1/chat/completions"
MiB = 1024 * 1024
# What a well-behaved client alongside may wait for one answer at most, on this shared machine
# (alone it takes a few ms): an answer held behind a hostile client takes seconds.
ALONGSIDE_SECONDS = 1.0
# The hostile module's proxy: small limits, so each bound is reached in a fraction of a second.
FLAGS = [
    *("--keepalive-timeout-seconds", "2", "--body-timeout-seconds", "2"),
    *("--max-request-bytes", "8Mi", "--max-buffered-bytes", "64Mi"),
    *("--max-media-parts", "400", "--prime-concurrency-per-request", "4", "--prime-concurrency", "8"),
    *("--max-headers", "64", "--max-header-bytes", "8Ki", "--max-json-depth", "64"),
    # The pictures' host, allowed by name: the media URL check asks no DNS for it.
    *("--allowed-media-domains", "images.test"),
]


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) / 1024


def chat(*parts: dict, text: str = "hi") -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]}


def image(i: int) -> dict:
    return {"type": "image_url", "image_url": {"url": f"https://images.test/{i}.png"}}


def raw_request(method: str, target: str, body: bytes = b"", *headers: str) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "host: proxy", *headers]
    if body:
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@dataclass
class Unit:
    """The proxy process in front of a stand-in upstream and encoder, with the hostile FLAGS."""

    upstream: StandinServer
    encoder: StandinServer
    proxy: ProxyProcess

    @property
    def url(self) -> str:
        return self.proxy.url

    @property
    def port(self) -> int:
        return self.proxy.port

    @property
    def rss(self) -> float:
        assert self.proxy.proc is not None
        return rss_mib(self.proxy.proc.pid)


@pytest.fixture(scope="module")
def unit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Unit]:
    logs = tmp_path_factory.mktemp("hostile")
    with StandinServer() as upstream, StandinServer() as encoder:  # started: their URLs known
        proxy = ProxyProcess(upstream.url, [encoder.url], logs, args=FLAGS)
        with proxy:
            yield Unit(upstream, encoder, proxy)


@contextlib.asynccontextmanager
async def alongside(url: str) -> AsyncIterator[list[float]]:
    """A well-behaved client (the openai SDK's shape: a small chat completion with an image,
    on a kept-alive connection) asking every 50 ms while the block runs; afterwards every
    answer was a 200 within ALONGSIDE_SECONDS. Yields its latencies."""
    latencies: list[float] = []
    failures: list[str] = []
    stop = asyncio.Event()

    async def ask(http: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                async with http.post(url + CHAT, json=chat(image(0)), timeout=aiohttp.ClientTimeout(10)) as response:
                    await response.read()
                    if response.status != 200:
                        failures.append(f"HTTP {response.status}")
            except (aiohttp.ClientError, TimeoutError) as error:
                failures.append(repr(error))
            latencies.append(time.monotonic() - started)
            await asyncio.sleep(0.05)

    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(ask(http))
        try:
            yield latencies
        finally:
            stop.set()
            await task
    assert not failures, failures
    assert latencies and max(latencies) < ALONGSIDE_SECONDS, sorted(latencies)[-5:]


async def exchange(port: int, raw: bytes, *, timeout: float = 10) -> bytes:
    """Send raw bytes; everything the proxy sends back until it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def others(records: list) -> list:
    """What reached the upstream besides the alongside client's requests."""
    return [(r.method, r.path) for r in records if (r.path, r.body) != (CHAT, keyed(chat(image(0))))]


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def error_of(answer: bytes) -> dict:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]


# --------------------------------------------------------------------------- smuggling

SMUGGLING = {
    "CL+TE": b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n",
    "TE+CL": b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 40\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n",
    "duplicate CL": b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nContent-Length: 40\r\n\r\n{}GET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n",
    "CL list": b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2, 2\r\n\r\n{}",
    "obs-fold": b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nX-A: b\r\n Transfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n{}",
    "bad chunk size": b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "chunk size overflow": b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFFFFFF\r\n{}\r\n0\r\n\r\n",
    "bare LF request": b"GET /v1/models HTTP/1.1\nHost: a\n\n",
    "bare LF header": b"GET /v1/models HTTP/1.1\r\nHost: a\nX: y\r\n\r\n",
    "bare LF chunk": b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\n{}\n0\n\n",
    "TE xchunked": b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: xchunked\r\nContent-Length: 2\r\n\r\n{}",
    "TE chunked, identity": b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n",
    "space before colon": b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding : chunked\r\nContent-Length: 2\r\n\r\n{}",
    "missing Host": b"GET /v1/models HTTP/1.1\r\n\r\n",
    "doubled Host": b"GET /v1/models HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
}


def h11_reads(raw: bytes) -> list[tuple[str, str, bytes]] | None:
    """The reference: the requests h11 reads whole from the bytes (method, target, body), or
    None when it refuses them."""
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(raw)
    whole: list[tuple[str, str, bytes]] = []
    method, target, body = "", "", b""
    try:
        while (event := connection.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
            if isinstance(event, h11.Request):
                method, target, body = event.method.decode(), event.target.decode(), b""
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                whole.append((method, target, body))
    except h11.RemoteProtocolError:
        return None
    return whole


@pytest.mark.parametrize("shape", SMUGGLING, ids=list(SMUGGLING))
async def test_smuggling_shapes_are_refused_whole_and_nothing_reaches_the_upstream(unit, shape):
    raw = SMUGGLING[shape]
    before, rss = len(unit.upstream.records), unit.rss
    async with alongside(unit.url):
        answer = await exchange(unit.port, raw)
    assert status_of(answer) == 400, answer[:300]
    assert error_of(answer)["type"] == "BadRequestError"  # vLLM's shape, the connection closed after it
    assert others(unit.upstream.records[before:]) == []  # not a byte of it forwarded, nothing smuggled
    reference = h11_reads(raw)
    # The reference refuses it too, or reads something else than a clean single request: the
    # proxy is never more lenient than h11 on these bytes.
    assert reference is None or len(reference) != 1 or shape in H11_LENIENT, reference
    assert unit.rss - rss < 16


# Shapes h11 reads as one request where the proxy (llhttp, strict) refuses: RFC 9112 lets a
# server reject each (§6.1: CL with TE; §5.2: obs-fold; §2.2: a bare LF), and a proxy must not
# guess (a server behind it might read them otherwise).
H11_LENIENT = {"CL+TE", "obs-fold", "bare LF request", "bare LF header", "CL list", "TE+CL", "bare LF chunk"}


async def test_absolute_form_targets_and_connect_are_never_forwarded(unit):
    before = len(unit.upstream.records)
    async with alongside(unit.url):
        absolute = await exchange(unit.port, b"GET http://169.254.169.254/latest HTTP/1.1\r\nHost: x\r\n\r\n")
        connect = await exchange(unit.port, b"CONNECT internal:443 HTTP/1.1\r\nHost: internal:443\r\n\r\n")
    assert status_of(absolute) == 400 and "not a forward proxy" in error_of(absolute)["message"]
    assert status_of(connect) == 405 and "CONNECT is refused" in error_of(connect)["message"]
    assert others(unit.upstream.records[before:]) == []


# --------------------------------------------------------------------------- slow and careless clients


async def test_a_head_sent_a_byte_at_a_time_is_cut_off_at_the_keepalive_timeout(unit):
    """Slowloris: the head must be whole within --keepalive-timeout-seconds (2 s here)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", unit.port)
    started = time.monotonic()
    closed_after = None
    async with alongside(unit.url):
        for byte in b"GET /v1/models HTTP/1.1\r\nHost: a\r\nX-Slow: " + b"a" * 100:
            try:
                writer.write(bytes([byte]))
                await writer.drain()
            except ConnectionError:
                break
            if reader.at_eof() or (await _closed(reader)):
                closed_after = time.monotonic() - started
                break
            await asyncio.sleep(0.1)
    writer.close()
    assert closed_after is not None and 1.5 < closed_after < 4, closed_after


async def _closed(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), 0.01) == b""
    except TimeoutError:
        return False


async def test_a_body_that_stops_coming_gets_a_408_at_the_body_timeout(unit):
    body = json.dumps(chat(image(1))).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", unit.port)
    started = time.monotonic()
    async with alongside(unit.url):
        writer.write(raw_request("POST", CHAT, body)[:-10])  # the body never ends
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    writer.close()
    assert head.startswith(b"HTTP/1.1 408") and 1.5 < time.monotonic() - started < 5


async def test_pipelined_gets_from_a_client_that_never_reads_are_bounded(unit):
    """aiohttp parses at most 32 requests ahead of its answers, then stops reading the socket:
    a client that sends and never reads holds kernel buffers, not the proxy's memory."""
    sock = socket.create_connection(("127.0.0.1", unit.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and reads nothing
    sock.setblocking(False)
    rss = unit.rss
    sent = 0
    request = raw_request("GET", "/v1/models?" + "x" * 200)
    async with alongside(unit.url):
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                sent += sock.send(request * 50)
            except BlockingIOError:
                await asyncio.sleep(0.05)
    sock.close()
    assert sent > 20 * len(request) and unit.rss - rss < 16, (sent, unit.rss - rss)


async def test_a_half_closing_client_gets_its_answer_or_a_closed_connection_never_a_stuck_one(unit):
    reader, writer = await asyncio.open_connection("127.0.0.1", unit.port)
    async with alongside(unit.url):
        writer.write(raw_request("POST", CHAT, json.dumps(chat(image(2))).encode()))
        await writer.drain()
        writer.write_eof()  # shutdown(SHUT_WR): nothing more will come
        answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert answer == b"" or status_of(answer) == 200, answer[:200]


# --------------------------------------------------------------------------- huge and deep bodies


async def test_a_huge_declared_body_is_refused_before_it_is_read(unit):
    rss = unit.rss
    head = raw_request("POST", CHAT, b"", f"content-length: {10**12}")
    async with alongside(unit.url):
        reader, writer = await asyncio.open_connection("127.0.0.1", unit.port)
        writer.write(head)
        answer = await asyncio.wait_for(reader.readuntil(b"}}"), 10)
        writer.close()
    assert status_of(answer) == 413 and "spec.proxy.maxRequestBytes" in error_of(answer + b"")["message"]
    assert unit.rss - rss < 16


async def test_a_huge_chunked_body_is_cut_at_the_limit(unit):
    rss = unit.rss
    reader, writer = await asyncio.open_connection("127.0.0.1", unit.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = b"x" * 65536
    async with alongside(unit.url):
        with contextlib.suppress(ConnectionError):
            for _ in range(16 * 32):  # 32 MiB, four times the limit: what passes it is read and dropped
                writer.write(b"%x\r\n%b\r\n" % (len(piece), piece))
                await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    writer.close()
    assert head.startswith(b"HTTP/1.1 413")
    assert unit.rss - rss < 32


async def test_deep_json_is_a_400_not_a_traceback(unit):
    async with alongside(unit.url), aiohttp.ClientSession() as http:
        for depth in (65, 100_000):
            body = b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"
            async with http.post(unit.url + CHAT, data=body) as response:
                answer = await response.json()
            assert response.status == 400, depth
            assert "nests JSON deeper than the proxy's limit of 64" in answer["error"]["message"]
    assert "Traceback" not in unit.proxy.tail(200)


async def test_a_dense_body_is_refused_before_it_is_parsed(unit):
    """7 MiB of `{}` (under the 8 MiB limit) would take 170 MiB parsed: refused by the count of
    its values, the proxy's memory untouched."""
    body = b'{"messages": [' + b",".join([b"{}"] * (7 * MiB // 3)) + b"]}"
    rss = unit.rss
    async with alongside(unit.url), aiohttp.ClientSession() as http, http.post(unit.url + CHAT, data=body) as response:
        answer = await response.json()
    assert response.status == 413 and "spec.proxy.maxBufferedBytes" in answer["error"]["message"]
    assert unit.rss - rss < 40  # the 7 MiB body itself, read


async def test_bodies_beyond_the_memory_budget_wait_their_turn(unit):
    """Eight 6 MiB bodies at once (about 36 MiB each while parsed, 64 MiB for all): some wait or
    are answered 503 and none takes the proxy past its budget."""
    big = chat(image(3), text="y" * (6 * MiB))
    rss = unit.rss
    async with alongside(unit.url), aiohttp.ClientSession() as http:

        async def send() -> int:
            async with http.post(unit.url + CHAT, json=big) as response:
                await response.read()
                return response.status

        statuses = await asyncio.gather(*(send() for _ in range(8)))
    assert set(statuses) <= {200, 503} and 200 in statuses, statuses
    assert unit.rss - rss < 64 + 48  # the budget, and what aiohttp buffers besides


async def test_trailers_that_never_end_are_cut(unit):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n"
    rss = unit.rss
    async with alongside(unit.url):
        many = await exchange(unit.port, head + b"".join(b"X-T%d: 1\r\n" % i for i in range(5000)))
        long = await exchange(unit.port, head + b"X-T: " + b"a" * (1 << 20))
    assert status_of(many) in (400, 431) and status_of(long) in (400, 431), (many[:100], long[:100])
    assert unit.rss - rss < 16


# --------------------------------------------------------------------------- many parts, many connections


async def test_thousands_of_parts_are_refused_and_many_parts_do_not_starve_others(unit):
    async with alongside(unit.url), aiohttp.ClientSession() as http:
        async with http.post(unit.url + CHAT, json=chat(*(image(i) for i in range(5000)))) as response:
            answer = await response.json()
        assert response.status == 400 and "spec.proxy.maxMediaParts" in answer["error"]["message"]
        unit.encoder.delay = 0.1  # each prime takes 0.1 s
        try:
            hog = asyncio.create_task(http.post(unit.url + CHAT, json=chat(*(image(i) for i in range(160)))))
            await asyncio.sleep(0.3)
            started = time.monotonic()
            async with http.post(unit.url + CHAT, json=chat(image(10_000))) as response:
                assert response.status == 200
            single = time.monotonic() - started
            async with await hog as response:
                assert response.status == 200
        finally:
            unit.encoder.delay = 0
    # The hog's 160 primes take 4 s at 4 at a time (2 s ahead of it, were they not capped at 4 of the 8
    # slots); the single image waits for a free slot only.
    assert single < 1.0, single


async def test_a_thousand_idle_connections_cost_little_and_are_closed(unit):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    rss = unit.rss
    sockets = []
    try:
        async with alongside(unit.url):
            for _ in range(1000):
                sockets.append(socket.create_connection(("127.0.0.1", unit.port)))
            await asyncio.sleep(0.5)
            grown = unit.rss - rss
        await asyncio.sleep(3)  # the keep-alive timeout (2 s) closes every one of them
        for sock in sockets:
            sock.setblocking(False)
        closed = sum(1 for sock in sockets if _peer_closed(sock))
    finally:
        for sock in sockets:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert grown < 48, grown
    assert closed == 1000


def _peer_closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


class LowFdProxy(ProxyProcess):
    """The proxy process under `ulimit -n 128`."""

    @property
    def command(self) -> list[str]:
        return ["/bin/sh", "-c", 'ulimit -n 128 && exec "$@"', "sh", *super().command]


async def test_with_a_low_fd_limit_the_proxy_keeps_serving(tmp_path):
    """The proxy out of file descriptors stops accepting for a while; it neither crashes nor
    spins, a client kept alive from before is served throughout, and new clients again once
    the flood is gone."""
    flags = [*FLAGS, "--keepalive-timeout-seconds", "30"]
    with (
        StandinServer() as upstream,
        StandinServer() as encoder,
        LowFdProxy(upstream.url, [encoder.url], tmp_path, args=flags) as proxy,
    ):
        port = proxy.port
        sockets = []
        try:
            async with alongside(proxy.url):
                await asyncio.sleep(0.2)  # its connection made before the flood
                for _ in range(300):
                    with contextlib.suppress(OSError):
                        sockets.append(socket.create_connection(("127.0.0.1", port), timeout=1))
                await asyncio.sleep(1)
                assert proxy.proc is not None and proxy.proc.poll() is None
        finally:
            for sock in sockets:
                sock.close()
        await asyncio.sleep(1.5)  # asyncio retries accepting a second after running out
        async with aiohttp.ClientSession() as http, http.get(proxy.url + "/v1/models") as response:
            assert response.status == 200
        assert "Traceback" not in proxy.tail(400)


# --------------------------------------------------------------------------- an upstream that answers early


async def test_an_upstream_answering_before_it_read_the_body_never_desyncs_the_next_clients(tmp_path):
    """A body over 64 KiB to a path the upstream answers at once (vLLM's uvicorn answers an
    unknown path 404 before reading): that upstream connection is closed, not reused with the
    rest of the body still going, so the next clients' requests are read as their own."""
    seen: list[bytes] = []

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                seen.append(head.split(b"\r\n", 1)[0])
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                if head.startswith(b"POST /early"):
                    writer.write(
                        b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
                    )
                    await writer.drain()
                    await asyncio.sleep(1)  # then reads what is left of the body, as uvicorn does
                    await reader.readexactly(length)
                    continue
                await reader.readexactly(length)
                body = json.dumps({"object": "list", "path": head.split(b" ")[1].decode()}).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                    % (len(body), body)
                )
                await writer.drain()

    listener = await asyncio.start_server(upstream, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    with StandinServer() as encoder, ProxyProcess(url, [encoder.url], tmp_path, args=FLAGS) as proxy:
        async with listener, aiohttp.ClientSession() as http:
            async with http.get(proxy.url + "/v1/models?warm") as response:  # a kept-alive upstream connection
                assert response.status == 200
            async with http.post(proxy.url + "/early", data=b"x" * (1 * MiB)) as response:
                assert response.status == 404
            started = time.monotonic()
            answers = []
            for i in range(5):
                async with http.get(proxy.url + f"/v1/models?next={i}") as response:
                    answers.append((response.status, (await response.json())["path"]))
            elapsed = time.monotonic() - started
    assert answers == [(200, f"/v1/models?next={i}") for i in range(5)]
    assert elapsed < ALONGSIDE_SECONDS * 5
    assert [line for line in seen if b"next" in line] == [b"GET /v1/models?next=%d HTTP/1.1" % i for i in range(5)]
