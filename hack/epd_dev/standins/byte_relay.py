"""A byte relay, a STAND-IN for no product part: for `make bench-proxy`, the floor of one extra
hop on the machine. It copies bytes between each client connection and a connection of its own
to the upstream (an asyncio Protocol on uvloop, no HTTP parsed), so what it adds is what any
process in the path adds here (two more socket reads and writes, two more wakeups), and the
EPD proxy's own cost is what it adds beyond that.

    python -m epd_dev.standins.byte_relay --upstream http://127.0.0.1:8000 --port 0  # prints its URL
"""

from __future__ import annotations

import argparse
import asyncio
from typing import cast
from urllib.parse import urlsplit


class ToUpstream(asyncio.Protocol):
    def __init__(self, client: FromClient) -> None:
        self._client = client

    def data_received(self, data: bytes) -> None:
        self._client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._client.close()


class FromClient(asyncio.Protocol):
    def __init__(self, host: str, port: int) -> None:
        self._host, self._port = host, port
        self._transport: asyncio.Transport | None = None
        self._upstream: asyncio.Transport | None = None
        self._early: list[bytes] = []  # what the client sent before the upstream connected
        self._connecting: asyncio.Task[None] | None = None  # held: a task only weakly referenced may vanish
        self._client_gone = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._connecting = asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            upstream, _ = await loop.create_connection(lambda: ToUpstream(self), self._host, self._port)
        except OSError:
            self.close()  # no upstream: the client sees its connection closed, as behind any relay
            return
        if self._client_gone:
            upstream.close()  # the client left while this connected: nobody to relay for
            return
        self._upstream = upstream
        for data in self._early:
            self._upstream.write(data)
        self._early.clear()

    def data_received(self, data: bytes) -> None:
        if self._upstream is None:
            self._early.append(data)
        else:
            self._upstream.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._client_gone = True
        if self._upstream is not None:
            self._upstream.close()

    def write(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


async def _serve(upstream: str, port: int) -> None:
    parts = urlsplit(upstream)
    host, upstream_port = parts.hostname or "127.0.0.1", parts.port or 80
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: FromClient(host, upstream_port), "127.0.0.1", port)
    print(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    import uvloop

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, default=0)
    cli = parser.parse_args()
    uvloop.run(_serve(cli.upstream, cli.port))
