"""Fixtures for tests against the real vLLM serving venv on this host (marker `vllm`).

The operator's units run on the real node (tests/node); what stays here needs the venv itself (ECCPUConnector's
transport between two of nodes.py's namespaced nodes). Missing environments are errors, never skips: the
message names the install command.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from epd_dev.vllm import envs, tiny_model

_timings: dict[str, float] = {}  # printed in the terminal summary
_vllm_seconds = [0.0]  # wall time of every `vllm` test, fixtures included


@pytest.fixture(scope="session")
def vllm_timings() -> dict[str, float]:
    """Tests add "what: seconds" here; printed at the end of the run."""
    return _timings


@pytest.fixture(scope="session")
def serving_python() -> Path:
    return envs.serving_python()  # raises MissingEnvironment with the install command


@pytest.fixture(scope="session")
def tiny_model_dir(serving_python: Path) -> Path:
    start = time.monotonic()
    path = tiny_model.tiny_model_path()
    _timings["tiny model (build or cache hit)"] = time.monotonic() - start
    return path


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.monotonic()
    yield
    if item.get_closest_marker("vllm"):
        _vllm_seconds[0] += time.monotonic() - start


def pytest_terminal_summary(terminalreporter):
    if not _vllm_seconds[0]:
        return
    terminalreporter.section("vllm timings")
    for what, seconds in _timings.items():
        terminalreporter.write_line(f"{what}: {seconds:.1f}s")
    terminalreporter.write_line(f"vLLM tests took {_vllm_seconds[0]:.0f}s in all (engine starts and stops included)")
