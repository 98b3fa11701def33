"""An engine's liveness check, run by the kubelet in the engine's container (an exec probe: the
pod spec carries this file's source, so it uses the standard library only and any vLLM image's
python3 runs it).

vLLM's /health says whether its engine core died, not whether it makes progress: a core stuck in
a step (a hung collective, a frozen process) keeps /health at 200 and its unit Ready while every
request sent to it waits. The check fails such an engine: none of its step counters moved while
requests were in flight on its API server (`/load`, with --enable-server-load-tracking) for
``stall_seconds`` in all, counted between probes (the last one's record is kept in a file). Idle
spells add nothing and do not start the count again, so requests that each give up sooner (a
client's timeout) add up to a stall too. A busy engine moves the counters every step, and an
idle one has nothing in flight, so neither is restarted; a dead one fails /health as before.
Nor is one that was told to wait: paused for a weight update (vLLM's /pause holds the requests
that come meanwhile) or asleep.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from typing import NamedTuple

# Counters that move with every engine step that finishes work: an encoder-only engine (no
# tokens) finishes requests, a language engine schedules tokens.
PROGRESS_COUNTERS = (
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:iteration_tokens_total_count",
)
START_TIME = "process_start_time_seconds "
AWAKE = 'sleep_state="awake"'
# Three requests, each within this, inside the probe's 10 s.
TIMEOUT_SECONDS = 3.0


class Sample(NamedTuple):
    at: float
    """time.monotonic(): one clock for every process of the container."""
    in_flight: int
    progress: float


class Record(NamedTuple):
    """What a probe leaves for the next one."""

    sample: Sample
    stalled_for: float
    """Seconds with requests in flight (between probes that both found some) since the step
    counters last moved."""


class Reading(NamedTuple):
    progress: float
    """The sum of the progress counters."""
    started: float
    """When the serving process started: a restarted engine's counters start again from 0."""
    asleep: bool
    """vLLM's sleep mode (vllm:engine_sleep_state{sleep_state="awake"} 0)."""


def read_metrics(metrics: str) -> Reading:
    """What the check needs of a Prometheus text exposition."""
    total, started, asleep = 0.0, 0.0, False
    for line in metrics.splitlines():
        if line.startswith(PROGRESS_COUNTERS):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(START_TIME):
            started = float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:engine_sleep_state{") and AWAKE in line:
            asleep = asleep or float(line.rsplit(" ", 1)[1]) == 0
    return Reading(total, started, asleep)


def judge(last: Record | None, sample: Sample, stall_seconds: float) -> tuple[Record, float | None]:
    """The record for the next probe, and how long the engine has stalled (None: it has not,
    or not for ``stall_seconds`` yet)."""
    if last is None or sample.progress != last.sample.progress:
        stalled_for = 0.0
    elif sample.in_flight > 0 and last.sample.in_flight > 0:
        stalled_for = last.stalled_for + (sample.at - last.sample.at)
    else:
        stalled_for = last.stalled_for
    stalled = stalled_for if stalled_for > 0 and stalled_for >= stall_seconds else None
    return Record(sample, stalled_for), stalled


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=TIMEOUT_SECONDS) as response:
        return str(response.read().decode())


def _paused(base: str) -> bool:
    """Paused by vLLM's /pause (served, like /is_paused, only with VLLM_SERVER_DEV_MODE=1: 404
    otherwise). The answer comes from the engine core between its steps, so a hung core gives
    none, and counts as not paused."""
    try:
        return bool(json.loads(_get(base + "/is_paused"))["is_paused"])
    except (OSError, ValueError, KeyError):
        return False


def _load(path: str, started: float) -> Record | None:
    """The last probe's record; a missing or unreadable one, or one of an earlier run of the
    container (the file outlives it), starts afresh."""
    try:
        with open(path) as file:
            at, in_flight, progress, stalled_for, of_run = json.load(file)
    except (OSError, ValueError, TypeError):
        return None
    if of_run != started:
        return None
    return Record(Sample(float(at), int(in_flight), float(progress)), float(stalled_for))


def main(argv: list[str]) -> int:
    port, stall_seconds, state_path = int(argv[0]), float(argv[1]), argv[2]
    base = f"http://127.0.0.1:{port}"
    try:
        _get(base + "/health")  # a dead engine core answers 503, which urlopen raises
        in_flight = int(json.loads(_get(base + "/load"))["server_load"])
        reading = read_metrics(_get(base + "/metrics"))
    except (OSError, ValueError, KeyError) as error:
        print(f"engine not healthy: {error}")
        return 1
    sample = Sample(time.monotonic(), in_flight, reading.progress)
    kept, stalled = judge(_load(state_path, reading.started), sample, stall_seconds)
    if stalled is not None and (reading.asleep or _paused(base)):
        # Its requests wait by design: the stall is counted again from the resume.
        kept, stalled = Record(sample, 0.0), None
    with open(state_path, "w") as file:
        json.dump([*kept.sample, kept.stalled_for, reading.started], file)
    if stalled is not None:
        print(f"engine stalled: requests waited {stalled:.0f} s and no step finished ({in_flight} in flight now)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
