"""Fixtures for tests against real vLLM engines on CPU (marker `vllm`).

Missing environments are errors, never skips: the message names the install command.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.vllm import engines, envs, tiny_model

# Cold start of an engine is ~40 s on an idle 2-core machine, ~150 s when it is busy.
ENGINE_READY_TIMEOUT_S = 600

_running: list[engines.Engine] = []   # for log tails in failure reports
_timings: dict[str, float] = {}       # printed in the terminal summary


@dataclass
class EpdPair:
    encoder: engines.Engine
    consumer: engines.Engine
    ec_dir: Path
    model: str


def ec_config(role: str, ec_dir: Path) -> str:
    return json.dumps({
        "ec_connector": "ECExampleConnector",
        "ec_role": role,
        "ec_connector_extra_config": {"shared_storage_path": str(ec_dir)},
    })


# Hand-written for now; the operator's arg renderer will provide these later.
COMMON_ARGS = ["--enforce-eager", "--max-model-len", "512", "--dtype", "bfloat16"]


def encoder_args(ec_dir: Path) -> list[str]:
    return [*COMMON_ARGS, "--mm-encoder-only", "--no-enable-prefix-caching",
            "--ec-transfer-config", ec_config("ec_producer", ec_dir)]


def consumer_args(ec_dir: Path) -> list[str]:
    return [*COMMON_ARGS, "--enable-scale-out",
            "--ec-transfer-config", ec_config("ec_consumer", ec_dir)]


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


@pytest.fixture(scope="module")
def ec_dir():
    """An isolated EC folder in shared memory, as Vime makes one per model."""
    path = Path(f"/dev/shm/vime-ec-test-{uuid.uuid4().hex[:12]}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start_all(group: list[engines.Engine], timeout: float = ENGINE_READY_TIMEOUT_S) -> None:
    """Start engines together (they load in parallel) and wait for every /health."""
    for engine in group:
        _running.append(engine)
        engine.start()
    for engine in group:
        _timings[f"{engine.name} ready"] = engine.wait_healthy(timeout)


def stop_all(group: list[engines.Engine]) -> None:
    for engine in group:
        engine.stop()
        if engine in _running:
            _running.remove(engine)


@pytest.fixture(scope="module")
def epd(serving_python, tiny_model_dir, ec_dir, tmp_path_factory):
    """One encoder (ec_producer) and one consumer (ec_consumer) sharing `ec_dir`.

    Vime starts consumers only once encoders are up; nothing in vLLM needs that order
    (they only share a folder), so both load at once here to halve the wait.
    """
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    served = tiny_model.SERVED_NAME
    encoder = engines.vllm_server("encoder", serving_python, tiny_model_dir,
                                  encoder_args(ec_dir), log_dir=log_dir, served_name=served)
    consumer = engines.vllm_server("consumer", serving_python, tiny_model_dir,
                                   consumer_args(ec_dir), log_dir=log_dir, served_name=served)
    group = [encoder, consumer]
    try:
        start_all(group)
        yield EpdPair(encoder, consumer, ec_dir, served)
    finally:
        stop_all(group)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for engine in _running:
            report.sections.append(
                (f"{engine.name} log tail ({engine.log_path})", engine.log_tail(60)))


def pytest_terminal_summary(terminalreporter):
    if _timings:
        terminalreporter.section("vllm timings")
        for what, seconds in _timings.items():
            terminalreporter.write_line(f"{what}: {seconds:.1f}s")
