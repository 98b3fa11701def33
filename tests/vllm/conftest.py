"""Fixtures for tests against real vLLM engines on CPU (marker `vllm`).

Every engine is the operator's: a test module writes a real EPDDeployment for the tiny model
(`epd_dev.vllm.serving.tiny_manifest`), gets the unit pod the operator creates (or renders), and runs it with
unit_runner.py. Missing environments are errors, never skips: the message names the install
command.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from epd_dev.vllm import engines, envs, tiny_model, unit_runner
from epd_dev.vllm.serving import aggregated_manifest

_timings: dict[str, float] = {}  # printed in the terminal summary
_vllm_seconds = [0.0]  # wall time of every `vllm` test, fixtures included


@contextlib.contextmanager
def start_unit(runner: unit_runner.UnitRunner, label: str) -> Iterator[unit_runner.UnitRunner]:
    """Run a unit for the block, recording how long each of its engines took to be ready."""
    started = time.monotonic()
    with runner:
        for engine, seconds in runner.ready_after_s.items():
            _timings[f"{label}: {engine} ready"] = seconds
        _timings[f"{label}: whole unit ready"] = time.monotonic() - started
        yield runner


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


@pytest.fixture(scope="session")
def aggregated(tiny_model_dir, tmp_path_factory) -> engines.Engine:
    """The reference: one engine serving the whole model, no EC config (a text-only model's
    rendered command). Session scope: every module compares against the same engine."""
    runner = unit_runner.UnitRunner.from_manifest(
        aggregated_manifest(tiny_model_dir), tmp_path_factory.mktemp("aggregated-logs"), uid=str(uuid.uuid4())
    )
    (engine,) = runner.consumers
    assert "--ec-transfer-config" not in engine.argv
    with start_unit(runner, "aggregated engine"):
        yield engine


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.monotonic()
    yield
    if item.get_closest_marker("vllm"):
        _vllm_seconds[0] += time.monotonic() - start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for engine in engines.RUNNING:
            report.sections.append((f"{engine.name} log tail ({engine.log_path})", engine.log_tail(60)))


def pytest_terminal_summary(terminalreporter):
    if not _vllm_seconds[0]:
        return
    terminalreporter.section("vllm timings")
    for what, seconds in _timings.items():
        terminalreporter.write_line(f"{what}: {seconds:.1f}s")
    terminalreporter.write_line(f"vLLM tests took {_vllm_seconds[0]:.0f}s in all (engine starts and stops included)")
