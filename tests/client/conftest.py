"""Fixtures for the client tests: stand-in engines and fault proxies, each on its own
thread so they keep serving whatever the test's event loop is doing."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

import pytest

from epd_dev.standins.fault_proxy import FaultProxy
from epd_dev.standins.vllm_server import StandinServer

from .helpers import UnitServers


@pytest.fixture
def proxy(stack: ExitStack) -> Callable[[str], FaultProxy]:
    return lambda upstream: stack.enter_context(FaultProxy(upstream))


@pytest.fixture
def make_unit(server: Callable[..., StandinServer]) -> Callable[..., UnitServers]:
    def make(name: str, *, encoders: int = 2, delay: float = 0.0) -> UnitServers:
        store: set[str] = set()
        return UnitServers(
            name,
            [server(delay=delay, ec_store=store) for _ in range(encoders)],
            server(ec_store=store),
        )

    return make
