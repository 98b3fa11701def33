"""Real-parser fixtures: both vLLM versions' parsers, started once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from epd_dev.vllm import envs

from .cases import VERSIONS
from .vllm_parser import VllmParser


@pytest.fixture(scope="session")
def vllm_parsers() -> Iterator[dict[str, VllmParser]]:
    """Both versions' parsers, started together so their imports overlap."""
    try:
        pythons = {version: envs.parser_python(version) for version in VERSIONS}
    except envs.MissingEnvironment as missing:
        pytest.fail(str(missing), pytrace=False)
    parsers = {version: VllmParser(version, python) for version, python in pythons.items()}
    yield parsers
    for parser in parsers.values():
        parser.close()


@pytest.fixture(params=VERSIONS, ids=lambda v: f"vllm-{v}")
def vllm_parser(request: pytest.FixtureRequest, vllm_parsers: dict[str, VllmParser]) -> VllmParser:
    return vllm_parsers[request.param]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The real parsers and router come from `make vllm-envs`: `make test-fast` leaves them out."""
    for item in items:
        if {"vllm_parsers", "router_binary"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.vllm)
