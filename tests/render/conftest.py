"""Real-parser fixtures: each vLLM minor's parser, started once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from epd_dev.vllm import envs
from epd_dev.vllm.cli_parser import VllmParser

from .cases import VERSIONS


def _minors_in(session: pytest.Session) -> list[str]:
    """The minors the selected tests ask for (`-k vllm-0.34` starts one parser, not all)."""
    wanted = {
        item.callspec.params[name]
        for item in session.items
        if hasattr(item, "callspec")
        for name in ("vllm_parser", "connector_parser")
        if name in item.callspec.params
    }
    return [version for version in VERSIONS if version in wanted] or list(VERSIONS)


@pytest.fixture(scope="session")
def vllm_parsers(request: pytest.FixtureRequest) -> Iterator[dict[str, VllmParser]]:
    """The selected minors' parsers, started together so their imports overlap."""
    try:
        pythons = {version: envs.parser_python(version) for version in _minors_in(request.session)}
    except envs.MissingEnvironment as missing:
        pytest.fail(str(missing), pytrace=False)
    parsers = {version: VllmParser(version, python) for version, python in pythons.items()}
    yield parsers
    for parser in parsers.values():
        parser.close()


@pytest.fixture(params=VERSIONS, ids=lambda v: f"vllm-{v}")
def vllm_parser(request: pytest.FixtureRequest, vllm_parsers: dict[str, VllmParser]) -> VllmParser:
    return vllm_parsers[request.param]


@pytest.fixture(params=[v for v in VERSIONS if envs.runs_ec_connectors(v)], ids=lambda v: f"vllm-{v}")
def connector_parser(request: pytest.FixtureRequest, vllm_parsers: dict[str, VllmParser]) -> VllmParser:
    """The parsers whose venvs also construct EC connectors (from 0.34 on)."""
    return vllm_parsers[request.param]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The real parsers and router come from `make vllm-envs`: `make test-fast` leaves them out."""
    for item in items:
        if {"vllm_parsers", "router_binary"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.vllm)
