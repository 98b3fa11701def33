"""The byte relay stand-in of `make bench-proxy` (hack/epd_dev/standins/byte_relay.py): it holds
an upstream connection only while its client is there."""

from __future__ import annotations

import asyncio

from epd_dev.standins.byte_relay import FromClient


class _Transport(asyncio.Transport):
    """The client's side of the relay, as the event loop would hand it over."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        self.closed = True


async def _upstream() -> tuple[asyncio.Server, list[asyncio.StreamReader]]:
    accepted: list[asyncio.StreamReader] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(reader)

    return await asyncio.start_server(accept, "127.0.0.1", 0), accepted


async def test_a_client_that_leaves_before_the_upstream_connects_leaves_no_upstream_connection():
    server, accepted = await _upstream()
    async with server:
        relay = FromClient("127.0.0.1", server.sockets[0].getsockname()[1])
        relay.connection_made(_Transport())
        relay.connection_lost(None)  # before the relay's connect has even started
        for _ in range(200):
            if accepted and accepted[0].at_eof():
                break
            await asyncio.sleep(0.01)
        # Connected, then closed by the relay.
        assert len(accepted) == 1 and await asyncio.wait_for(accepted[0].read(), 5) == b""


async def test_bytes_sent_before_the_upstream_connects_reach_it_in_order():
    server, accepted = await _upstream()
    async with server:
        relay = FromClient("127.0.0.1", server.sockets[0].getsockname()[1])
        client = _Transport()
        relay.connection_made(client)
        relay.data_received(b"GET / HTTP/1.1\r\n")
        relay.data_received(b"\r\n")
        while not accepted:
            await asyncio.sleep(0.01)
        assert await accepted[0].readexactly(18) == b"GET / HTTP/1.1\r\n\r\n"
        relay.connection_lost(None)
        assert await asyncio.wait_for(accepted[0].read(), 5) == b""


async def test_a_relay_without_an_upstream_closes_its_client():
    server, _ = await _upstream()
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()  # nothing listens on the port any more
    relay, client = FromClient("127.0.0.1", port), _Transport()
    relay.connection_made(client)
    for _ in range(200):
        if client.closed:
            break
        await asyncio.sleep(0.01)
    assert client.closed
