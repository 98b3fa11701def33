"""The engine liveness check: its decision, and its source as the pod spec carries it, run by a
bare interpreter (`python3 -I`, no site-packages: what any vLLM image has) against a STAND-IN
engine API (/health, /load, /metrics), which can be made to hang, die and restart on demand;
tests/node/test_encoder_outliers.py shows it on a real engine whose core is frozen."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from epd_operator.engine_liveness import Reading, Record, Sample, judge, read_metrics
from epd_operator.resources import ENGINE_LIVENESS_SOURCE

EXPOSITION = """\
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 2.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 1.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 52.0
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e+09
vllm:generation_tokens_total{engine="0",model_name="m"} 4.0
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 3.0
vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 56.0
vllm:num_requests_running{engine="0",model_name="m"} 1.0
process_start_time_seconds 1.7965639661e+09
vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 1.0
vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="weights_offloaded"} 0.0
"""


def test_progress_is_the_sum_of_the_step_counters_and_the_run_is_the_process_start():
    assert read_metrics(EXPOSITION) == Reading(2.0 + 1.0 + 52.0 + 4.0 + 3.0, 1.7965639661e09, asleep=False)
    asleep = EXPOSITION.replace('sleep_state="awake"} 1.0', 'sleep_state="awake"} 0.0')
    assert read_metrics(asleep).asleep


def test_stalled_time_adds_up_while_requests_wait_and_starts_again_with_progress():
    stall = 60.0
    record, stalled = judge(None, Sample(10.0, 1, 5.0), stall)
    assert (record, stalled) == (Record(Sample(10.0, 1, 5.0), 0.0), None)
    record, stalled = judge(record, Sample(50.0, 1, 5.0), stall)  # 40 s waiting, no step
    assert (record.stalled_for, stalled) == (40.0, None)
    # Its client gave up (a timeout): idle spells add nothing, and start nothing again.
    record, _ = judge(record, Sample(60.0, 0, 5.0), stall)
    record, stalled = judge(record, Sample(300.0, 0, 5.0), stall)
    assert (record.stalled_for, stalled) == (40.0, None)
    record, _ = judge(record, Sample(310.0, 2, 5.0), stall)  # the interval before it was idle
    assert record.stalled_for == 40.0
    record, stalled = judge(record, Sample(330.0, 2, 5.0), stall)
    assert (record.stalled_for, stalled) == (60.0, 60.0)
    # It keeps failing until restarted, though nothing waits now: it showed that it does not step.
    record, stalled = judge(record, Sample(340.0, 0, 5.0), stall)
    assert stalled == 60.0
    # A step finished: the count starts again.
    assert judge(record, Sample(350.0, 2, 6.0), stall) == (Record(Sample(350.0, 2, 6.0), 0.0), None)
    # An idle engine, frozen or not, never stalls: nothing waited on it.
    idle: Record | None = None
    for at in range(0, 1000, 10):
        idle, stalled = judge(idle, Sample(float(at), 0, 5.0), stall)
        assert stalled is None


class StandInEngine:
    """A STAND-IN for a vLLM API server's /health, /load and /metrics."""

    def __init__(self) -> None:
        self.health = 200
        self.load = 0
        self.progress = 10.0
        self.started = 1.0
        self.awake = 1
        self.paused: bool | None = None  # None: no /is_paused (VLLM_SERVER_DEV_MODE off)
        self.core_hangs = False  # /is_paused asks the engine core
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/health":
                    status, body = engine.health, b""
                elif self.path == "/load":
                    status, body = 200, json.dumps({"server_load": engine.load}).encode()
                elif self.path == "/is_paused":
                    if engine.core_hangs:
                        time.sleep(10)
                    found = engine.paused is not None
                    status, body = (200 if found else 404), json.dumps({"is_paused": engine.paused}).encode()
                else:
                    lines = [
                        f'vllm:request_success_total{{finished_reason="stop"}} {engine.progress}',
                        f"process_start_time_seconds {engine.started}",
                        f'vllm:engine_sleep_state{{sleep_state="awake"}} {engine.awake}',
                    ]
                    status, body = 200, "\n".join(lines).encode()
                self.send_response(status)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]


@pytest.fixture
def engine() -> Iterator[StandInEngine]:
    stand_in = StandInEngine()
    thread = threading.Thread(target=stand_in.server.serve_forever, daemon=True)
    thread.start()
    yield stand_in
    stand_in.server.shutdown()


def probe(engine: StandInEngine, record: Path, stall_seconds: float) -> subprocess.CompletedProcess[str]:
    """The kubelet's exec: the pod spec's command, with the interpreter isolated from this venv."""
    command = [sys.executable, "-I", "-c", ENGINE_LIVENESS_SOURCE, str(engine.port), str(stall_seconds), str(record)]
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=30)


def test_the_probe_fails_a_busy_engine_that_makes_no_progress_and_no_other(engine, tmp_path):
    record = tmp_path / "record.json"
    assert probe(engine, record, 0.0).returncode == 0  # idle
    engine.load = 2
    assert probe(engine, record, 0.0).returncode == 0  # busy from now: nothing to compare yet
    engine.progress += 1
    assert probe(engine, record, 0.0).returncode == 0  # busy and moving
    stalled = probe(engine, record, 0.0)  # busy, and no step since the last probe
    assert stalled.returncode == 1
    # The wait is the time between two probes: whole seconds, more on a busy machine.
    assert re.search(r"engine stalled: requests waited \d+ s and no step finished \(2 in flight now\)", stalled.stdout)
    assert probe(engine, record, 3600.0).returncode == 0  # within its stallSeconds
    # The container restarted (its engine's counters start again): the old record does not count.
    engine.started, engine.progress = 2.0, 0.0
    assert probe(engine, record, 0.0).returncode == 0
    # Told to wait: paused (vLLM's /pause, for a weight update) or asleep; its requests wait.
    assert probe(engine, record, 0.0).returncode == 1  # stalled since the restart's first probe
    engine.paused = True
    assert probe(engine, record, 0.0).returncode == 0
    assert probe(engine, record, 0.0).returncode == 0
    engine.paused, engine.awake = False, 0
    assert probe(engine, record, 0.0).returncode == 0
    engine.awake = 1
    assert probe(engine, record, 0.0).returncode == 1  # awake, not paused, stalled
    engine.paused, engine.core_hangs = True, True  # a hung core cannot say it is paused
    assert probe(engine, record, 0.0).returncode == 1
    engine.core_hangs = False
    # A dead engine core: /health answers 503, as it did before this check.
    engine.health = 503
    dead = probe(engine, record, 3600.0)
    assert dead.returncode == 1 and "engine not healthy" in dead.stdout and "503" in dead.stdout


def test_the_probe_fails_an_engine_that_does_not_answer(tmp_path):
    stand_in = StandInEngine()
    stand_in.server.server_close()  # nothing listens there any more
    refused = probe(stand_in, tmp_path / "record.json", 60.0)
    assert refused.returncode == 1 and "engine not healthy" in refused.stdout
