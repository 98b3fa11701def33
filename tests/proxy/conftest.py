"""Fixtures for the EPD proxy's tests: stand-in engines (each on its own thread) and the proxy
itself, in-process on the test's event loop, with quick retries."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from epd_client import EMBEDS_KINDS, MEDIA_KINDS, Primer, RetryPolicy, keyed_items, write_keys
from epd_dataplane.core import DNSTarget
from epd_dataplane.encoders import Encoders, Resolve, resolve_addresses
from epd_dataplane.epp import EPPConfig, EPPServer, picker_of
from epd_dataplane.gateway import Gateway, UnitsView
from epd_dataplane.metrics import ProxyMetrics
from epd_dataplane.server import Proxy, ProxyConfig, serve
from epd_dev.standins.ec_files import FileStore
from epd_dev.standins.fault_proxy import FaultProxy
from epd_operator.proxy_limits import Limits

# Quick retries so failure paths take milliseconds.
FAST = RetryPolicy(max_attempts=3, backoff=0.01, max_backoff=0.05, attempt_timeout=5, deadline=10)
# A public address (example.com's), never connected to: the tests' media hosts (images.test, ...)
# are in no DNS here, and the stand-in encoders fetch nothing.
PUBLIC = "93.184.216.34"


async def public_media_hosts(host: str) -> list[str]:
    """A stand-in for DNS, for the proxy's media URL check: every name is a public host."""
    return [PUBLIC]


@dataclass
class RunningProxy:
    url: str
    admin_url: str
    proxy: Proxy

    async def metrics_text(self) -> str:
        async with aiohttp.ClientSession() as http, http.get(self.admin_url + "/metrics") as response:
            return await response.text()


@contextlib.asynccontextmanager
async def raw_upstream(
    answer: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[str]:
    """An upstream written as raw bytes by ``answer`` (a shape no stand-in engine takes): its URL."""
    listener = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with listener:
        yield f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"


@pytest.fixture(params=["new", "kept"], ids=["new upstream connection", "kept-alive upstream connection"])
def warm(request: pytest.FixtureRequest) -> Callable[[aiohttp.ClientSession, str], Awaitable[None]]:
    """``await warm(http, proxy_url)`` before a test's request. Twice a test: as the first
    request (the proxy connects upstream from a task), and after a GET /v1/models left an upstream
    connection idle (the proxy forwards at once and follows the answer from callbacks)."""

    async def warm_up(http: aiohttp.ClientSession, proxy_url: str) -> None:
        if request.param == "kept":
            async with http.get(proxy_url + "/v1/models") as response:
                assert response.status == 200
                await response.read()

    return warm_up


async def answer_models(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """For a raw upstream: answer GET requests (warm's) with ``{}`` until another comes; its head."""
    while (head := await reader.readuntil(b"\r\n\r\n")).startswith(b"GET "):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
    return head


@pytest.fixture
def faulty(stack: ExitStack) -> Callable[[str], FaultProxy]:
    return lambda upstream: stack.enter_context(FaultProxy(upstream))


@pytest.fixture
async def start_proxy() -> AsyncIterator[Callable[..., Any]]:
    """``await start_proxy(upstream_url, encoder_urls, **config)``: a proxy serving on free ports
    (``config``: ProxyConfig's fields and Limits' fields; ``media_resolve``: what media URLs' hosts
    resolve to, by default public addresses)."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(
            upstream: str,
            encoders: Sequence[str] = (),
            *,
            dns: str | None = None,
            resolve: Resolve = resolve_addresses,
            media_resolve: Resolve = public_media_hosts,
            retry: RetryPolicy = FAST,
            **config: Any,
        ) -> RunningProxy:
            limits = Limits(**{k: config.pop(k) for k in list(config) if k in Limits.__dataclass_fields__})
            metrics = ProxyMetrics()
            target = DNSTarget.parse(dns) if dns else None
            found = Encoders(metrics, encoders, target, refresh_seconds=0.05, resolve=resolve)
            primer = await stack.enter_async_context(Primer(retry=retry))
            proxy = await stack.enter_async_context(
                Proxy(ProxyConfig(upstream, limits=limits, **config), found, primer, metrics, media_resolve)
            )
            stop, ready = asyncio.Event(), asyncio.get_running_loop().create_future()
            task = asyncio.create_task(
                serve(proxy, host="127.0.0.1", port=0, metrics_port=0, shutdown_timeout=5, stop=stop, ready=ready)
            )
            stack.push_async_callback(lambda: task)  # awaited after stop is set
            stack.callback(stop.set)
            port, admin = await asyncio.wait_for(ready, 10)
            return RunningProxy(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}", proxy)

        yield start


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def keyed(value: Any, version: str = "") -> Any:
    """``value`` (a request body, a message list or one media part) as the proxy forwards and
    primes it: a copy whose every media and embeddings part carries its key for ``version`` as its
    uuid (a uuid the client set is replaced)."""
    value = copy.deepcopy(value)
    if isinstance(value, dict) and value.get("type") in {**MEDIA_KINDS, **EMBEDS_KINDS}:
        write_keys(keyed_items([{"content": [value]}]), version)
        return value
    if isinstance(value, list):  # a message list
        write_keys(keyed_items(value), version)
        return value
    for field in ("messages", "input"):  # previous_input_messages: gpt-oss's only, never primed
        found = value.get(field) if isinstance(value, dict) else None
        if isinstance(found, list):
            conversations = found if found and all(isinstance(c, list) for c in found) else [found]
            for conversation in conversations:
                write_keys(keyed_items(conversation), version)
    return value


@pytest.fixture
async def start_gateway() -> AsyncIterator[Callable[..., Any]]:
    """``await start_gateway(units, **config)``: a gateway on free ports in front of fixed units
    (``{name: proxy URL}``, or a UnitsView), with ProxyConfig's and Limits' fields as config."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(
            units: dict[str, str] | UnitsView, *, weights_version: str | None = None, **config: Any
        ) -> RunningProxy:
            limits = Limits(**{k: config.pop(k) for k in list(config) if k in Limits.__dataclass_fields__})
            metrics = ProxyMetrics()
            view = units if isinstance(units, UnitsView) else UnitsView.fixed("actor", units, weights_version)
            primer = await stack.enter_async_context(Primer(retry=FAST))
            gateway = await stack.enter_async_context(
                Gateway(
                    ProxyConfig("http://gateway.invalid", limits=limits, **config),
                    Encoders(metrics),
                    primer,
                    metrics,
                    public_media_hosts,
                    units=view,
                )
            )
            stop, ready = asyncio.Event(), asyncio.get_running_loop().create_future()
            task = asyncio.create_task(
                serve(gateway, host="127.0.0.1", port=0, metrics_port=0, shutdown_timeout=5, stop=stop, ready=ready)
            )
            stack.push_async_callback(lambda: task)
            stack.callback(stop.set)
            port, admin = await asyncio.wait_for(ready, 10)
            return RunningProxy(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}", gateway)

        yield start


class Units:
    def __init__(self) -> None:
        self.files: dict[str, FileStore] = {}
        self.encoders: dict[str, object] = {}
        self.consumers: dict[str, object] = {}
        self.proxies: dict[str, str] = {}

    def primes(self, name: str) -> list[dict]:
        return [r.body for r in self.encoders[name].requests("/v1/chat/completions")]  # type: ignore[attr-defined]  # the encoders are stand-in servers that record requests

    def served(self, name: str) -> list:
        return self.consumers[name].records  # type: ignore[attr-defined]  # the consumers are stand-in servers that record requests


@pytest.fixture
def units(server, start_proxy, tmp_path: Path):
    """``await units(count)``: units of stand-ins (an encoder and a consumer sharing an EC store
    folder), each behind its own real EPD proxy."""

    async def make(count: int, *, consumer_delay: float = 0.0) -> Units:
        found = Units()
        for i in range(count):
            name = f"demo-actor-{i}"
            files = FileStore(tmp_path / name / "store")
            found.files[name] = files
            found.encoders[name] = server(files=files, ec_role="producer")
            found.consumers[name] = server(files=files, ec_role="consumer", delay=consumer_delay)
            proxy = await start_proxy(found.consumers[name].url, [found.encoders[name].url], ec_store=str(files.root))
            found.proxies[name] = proxy.url
        return found

    return make


@dataclass
class RunningPicker:
    server: EPPServer
    address: str

    @property
    def health_address(self) -> str:
        return f"127.0.0.1:{self.server.health_port}"


@pytest.fixture
async def start_epp() -> AsyncIterator[Callable[..., Any]]:
    """``await start_epp(gateway, **EPPConfig)``: the endpoint picker of a running gateway
    (start_gateway's), plaintext on free ports unless told otherwise."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(
            gateway: RunningProxy, *, ready: bool = True, fallbacks: int = 0, **config: Any
        ) -> RunningPicker:
            assert isinstance(gateway.proxy, Gateway)
            options = {"port": 0, "health_port": 0, "secure": False, "host": "127.0.0.1", **config}
            picker = picker_of(gateway.proxy, fallbacks)
            server = EPPServer(picker, EPPConfig(**options), ["localhost", "127.0.0.1"])
            await server.start()
            stack.push_async_callback(server.stop, 1)
            if ready:
                await asyncio.wait_for(server.ready_once(gateway.proxy.units), 5)
            return RunningPicker(server, f"127.0.0.1:{server.port}")

        yield start
