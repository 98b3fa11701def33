"""An encoder pool sized by KEDA on the real node: the scenario `make demo-autoscale` shows, `make
bench-autoscale` measures and tests/node/test_autoscaling.py asserts.

A placement Pools model of STAND-IN engines (the vllm-standin image: `vllm serve` answered by
epd_dev/standins/vllm_shim.py, since vLLM 0.34, which Pools needs, has no CPU build): each
encoder runs 2 primes at once, 0.2 s a picture, the others wait, as vLLM's
num_requests_waiting shows; one unit (its EPD proxy, its regular consumer). The model's
encoderAutoscaling makes a KEDA ScaledObject on the proxies' epd_proxy_primes_in_flight, which
Prometheus scrapes as the chart's PodMonitor says; KEDA's HPA, run by the cluster's own
kube-controller-manager, scales the pool's StatefulSet through its scale subresource.

The load: official openai SDK clients sending one new picture each request through the model's
front Service, closed loop, in phases (PHASES): one client; a step to 3, which one encoder's batch
of 2 cannot hold without a queue; a surge to 12; then none. Every 2 s the sampler records the
pool's size and ready pods, the signal (what KEDA reads) and the prime p90 (both from
Prometheus), and the clients' own answers (their p90 time to answer: one-token answers, so about
their time to first token).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import statistics
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import openai

from .images import recipes
from .localcluster import node
from .vllm import payloads

NAME = "standin-pools"
MODEL = "default"
POOL = f"{NAME}-{MODEL}-encoders"
SCALED_OBJECT = f"{NAME}-{MODEL}-encoders"
HPA = f"keda-hpa-{SCALED_OBJECT}"
# The autoscaler's settings: 1.5 primes in flight per encoder pod, below the 2 one stand-in
# encoder runs at once, so the pool grows before primes queue; 1 to 3 pods; a short scale-down
# window so the demo ends in minutes.
TARGET_PRIMES_IN_FLIGHT = 1.5
MAX_ENCODERS = 3
SCALE_DOWN_WINDOW_SECONDS = 30
POLLING_SECONDS = 5
# What the prime p90 must come back under once the pool has grown: an encoder's own time for a
# picture (0.2 s), a queue's at the target, and the prime histogram's resolution (its buckets
# around it are 0.5 and 1 s; one encoder under the surge reads 2.3 s).
PRIME_P90_TARGET_SECONDS = 1.0
SAMPLE_SECONDS = 2.0
# (phase, clients, seconds); "after" lasts until the pool is back to one pod.
PHASES = (("before", 1, 20.0), ("step", 3, 40.0), ("surge", 12, 60.0))
# A client whose request failed waits this long before its next (a closed loop must not spin).
FAILED_PAUSE_SECONDS = 0.5


def manifest(prometheus: str) -> dict[str, Any]:
    """The EPDDeployment: pinned to the real node, small requests, probes every 2 s."""
    requests = {"cpu": "50m", "memory": "64Mi"}
    encoder_env = [{"name": "EPD_STANDIN_SECONDS", "value": "0.2"}, {"name": "EPD_STANDIN_RUNNING", "value": "2"}]
    return {
        "apiVersion": "epd.vime.dev/v1alpha1",
        "kind": "EPDDeployment",
        "metadata": {"name": NAME},
        "spec": {
            "image": recipes.STANDIN_REF,
            "replicas": 1,
            "models": [
                {
                    "name": MODEL,
                    "model": "standin",
                    "placement": "Pools",
                    "encoderAutoscaling": {
                        "minReplicas": 1,
                        "maxReplicas": MAX_ENCODERS,
                        "targetPrimesInFlight": TARGET_PRIMES_IN_FLIGHT,
                        "scaleDownStabilizationSeconds": SCALE_DOWN_WINDOW_SECONDS,
                    },
                    "encoderPool": {"shm": {"sizeLimit": "64Mi"}},
                    "serverGroups": [
                        {
                            "workerType": "encoder",
                            "numGpus": 1,
                            "resources": {"requests": requests},
                            "env": encoder_env,
                        },
                        {"workerType": "regular", "numGpus": 1, "resources": {"requests": requests}},
                    ],
                }
            ],
            "autoscaling": {"prometheusAddress": prometheus, "pollingIntervalSeconds": POLLING_SECONDS},
            # Prometheus scrapes the proxies from its own namespace.
            "networkPolicy": {
                "monitoring": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
            },
            "proxy": {"primeTimeoutSeconds": 120},
            "nodeSelector": dict(node.NODE_SELECTOR),
            "tolerations": [dict(t) for t in node.TOLERATIONS],
            "shm": {"sizeLimit": "64Mi"},
            "probes": {"periodSeconds": 2, "failureThreshold": 3},
        },
    }


def png(index: int) -> str:
    """A 4x4 PNG of its own for each request: a new picture, primed once."""
    rgb = ((index >> 16) & 0xFF, (index >> 8) & 0xFF, index & 0xFF)
    return payloads.data_url(payloads.png(4, 4, lambda x, y: rgb))


@dataclass
class Sample:
    at: float  # seconds since the run began
    phase: str
    replicas: int  # the pool's StatefulSet spec.replicas: what the HPA chose
    ready: int  # its ready encoder pods
    signal: float | None  # sum(epd_proxy_primes_in_flight), what KEDA reads
    prime_p90: float | None  # seconds, the proxies' histogram over the last 10 s
    answer_p90: float | None  # seconds, the clients' answers in the last sample's span
    clients: int


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    answers: list[tuple[float, float]] = field(default_factory=list)  # (finished at, seconds)
    failures: list[str] = field(default_factory=list)
    step_at: float = 0.0
    stop_at: float = 0.0
    consumer_encodes: int = 0
    rescales: list[str] = field(default_factory=list)


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def value(self, query: str) -> float | None:
        address = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
        with urllib.request.urlopen(address, timeout=5) as answer:
            result = json.load(answer)["data"]["result"]
        if not result:
            return None
        number = float(result[0]["value"][1])
        return None if math.isnan(number) else number  # NaN: no data in the window


def signal_query(namespace: str) -> str:
    return f'sum(epd_proxy_primes_in_flight{{namespace="{namespace}",deployment="{NAME}",model="{MODEL}",role="unit"}})'


def prime_p90_query(namespace: str) -> str:
    selector = f'namespace="{namespace}",deployment="{NAME}",model="{MODEL}",role="unit"'
    return f"histogram_quantile(0.9, sum by (le) (rate(epd_proxy_prime_duration_seconds_bucket{{{selector}}}[10s])))"


async def _clients(base_url: str, run: Run, wanted: Callable[[], int], began: float) -> None:
    """Closed-loop clients, as many as ``wanted()`` says at each moment, until it says -1."""
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=180)
    counter = iter(range(10**9))

    async def one(slot: int) -> None:
        while slot < wanted():
            index = next(counter)
            content: list[Any] = [
                {"type": "image_url", "image_url": {"url": png(index)}},
                {"type": "text", "text": "what is this?"},
            ]
            started = time.monotonic()
            try:
                await client.chat.completions.create(
                    model="standin", messages=[{"role": "user", "content": content}], max_tokens=1
                )
                run.answers.append((time.monotonic() - began, time.monotonic() - started))
            except openai.OpenAIError as error:
                run.failures.append(f"{time.monotonic() - began:.1f}s: {error}")
                await asyncio.sleep(FAILED_PAUSE_SECONDS)

    running: dict[int, asyncio.Task[None]] = {}
    while wanted() >= 0:
        for slot in range(wanted()):
            if slot not in running or running[slot].done():
                running[slot] = asyncio.create_task(one(slot))
        await asyncio.sleep(0.2)
    await asyncio.gather(*running.values())
    await client.close()


def proxies_know_encoders(cluster: Any, namespace: str) -> bool:
    """Whether every unit's EPD proxy has found an encoder of the pool (its DNS answer, which
    a resolver may still cache empty for a while after the pool's first pod became ready)."""
    pods = json.loads(
        cluster.kubectl(
            "get", "pods", "-n", namespace, "-l", f"epd.vime.dev/deployment={NAME},epd.vime.dev/role=unit", "-o", "json"
        ).stdout
    )["items"]
    for pod in pods:
        with urllib.request.urlopen(f"http://{pod['status']['podIP']}:9401/metrics", timeout=5) as answer:
            found = [line for line in answer.read().decode().splitlines() if line.startswith("epd_proxy_encoders ")]
        if not found or float(found[0].split()[1]) < 1:
            return False
    return bool(pods)


def run_scenario(
    cluster: Any,
    namespace: str,
    front_url: str,
    prometheus_url: str,
    *,
    phases: tuple[tuple[str, int, float], ...] = PHASES,
    after_seconds: float = 150,
    say: Callable[[str], None] = print,
) -> Run:
    """The load, phase after phase, and the samples; then no load until the pool is back to one
    pod (at most ``after_seconds``)."""
    run = Run()
    prometheus = Prometheus(prometheus_url)
    starts = list(itertools.accumulate((seconds for _, _, seconds in phases), initial=0.0))
    run.step_at, run.stop_at = starts[1], starts[-1]
    done = threading.Event()
    began = time.monotonic()

    def phase(at: float) -> tuple[str, int]:
        for (name, clients, _), start, end in zip(phases, starts[:-1], starts[1:], strict=True):
            if start <= at < end:
                return name, clients
        return "after", 0

    def clients_now() -> int:
        """How many clients now; -1 once the load is over."""
        at = time.monotonic() - began
        return phase(at)[1] if at < run.stop_at else -1

    def sample() -> None:
        while not done.is_set():
            at = time.monotonic() - began
            stateful_set = json.loads(cluster.kubectl("get", "statefulset", POOL, "-n", namespace, "-o", "json").stdout)
            recent = [s for t, s in run.answers if t > at - SAMPLE_SECONDS * 2]
            try:
                signal, prime_p90 = (
                    prometheus.value(signal_query(namespace)),
                    prometheus.value(prime_p90_query(namespace)),
                )
            except OSError:
                signal = prime_p90 = None
            name, clients = phase(at)
            found = Sample(
                round(at, 1),
                name,
                stateful_set["spec"].get("replicas", 1),
                stateful_set.get("status", {}).get("readyReplicas", 0),
                signal,
                prime_p90,
                statistics.quantiles(recent, n=10)[-1] if len(recent) >= 2 else None,
                clients,
            )
            run.samples.append(found)
            say(
                f"{found.at:6.1f}s {found.phase:<6} clients {found.clients:>2}  encoders {found.replicas} "
                f"({found.ready} ready)  primes in flight {_num(found.signal)}  prime p90 {_num(found.prime_p90, 's')}  "
                f"answer p90 {_num(found.answer_p90, 's')}"
            )
            back = found.phase == "after" and found.replicas == 1 and found.ready == 1 and at > run.stop_at + 10
            if back or at > run.stop_at + after_seconds:
                done.set()
            done.wait(SAMPLE_SECONDS)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    asyncio.run(_clients(front_url, run, clients_now, began))
    sampler.join()
    events = json.loads(
        cluster.kubectl(
            "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={HPA}", "-o", "json"
        ).stdout
    )
    run.rescales = [e["message"] for e in events["items"] if e["reason"] == "SuccessfulRescale"]
    return run


def _num(value: float | None, unit: str = "") -> str:
    return "  -  " if value is None else f"{value:5.2f}{unit}"


@dataclass(frozen=True)
class Summary:
    most_encoders: int
    last_encoders: int
    failures: int
    consumer_encodes: int
    operator_replica_writes: int
    step_to_serving_seconds: float | None  # the step to the first new encoder ready
    prime_p90_before: float | None
    prime_p90_step_peak: float | None
    prime_p90_after_scale: float | None  # once the grown pool serves
    signal_crossed_at: float | None  # seconds after the step the signal passed its target
    answers_slowed_at: float | None  # seconds after the step the answers' p90 passed twice its before

    def line(self) -> str:
        return (
            f"autoscaled: encoders 1 -> {self.most_encoders} -> {self.last_encoders}, failed requests {self.failures}, "
            f"consumer encodes {self.consumer_encodes}, operator replica writes {self.operator_replica_writes}"
        )


def summarise(run: Run, operator_replica_writes: int) -> Summary:
    before = [s for s in run.samples if s.phase == "before"]
    loaded = [s for s in run.samples if s.phase not in ("before", "after")]
    grown = next((s for s in loaded if s.ready > 1), None)
    served_after = [s for s in loaded if s.ready == MAX_ENCODERS and s.prime_p90 is not None]
    answered = [s.answer_p90 for s in before if s.answer_p90]
    baseline = statistics.median(answered) if answered else None
    # The signal past what the pool of that moment aims at: the HPA's cue to grow it.
    crossed = next((s.at - run.step_at for s in loaded if (s.signal or 0) > TARGET_PRIMES_IN_FLIGHT * s.replicas), None)
    slowed = next(
        (s.at - run.step_at for s in loaded if baseline and s.answer_p90 and s.answer_p90 > 2 * baseline), None
    )

    def median(values: list[float | None]) -> float | None:
        found = [v for v in values if v is not None]
        return statistics.median(found) if found else None

    return Summary(
        most_encoders=max((s.replicas for s in run.samples), default=0),
        last_encoders=run.samples[-1].replicas if run.samples else 0,
        failures=len(run.failures),
        consumer_encodes=run.consumer_encodes,
        operator_replica_writes=operator_replica_writes,
        step_to_serving_seconds=grown.at - run.step_at if grown else None,
        prime_p90_before=median([s.prime_p90 for s in before]),
        prime_p90_step_peak=max((s.prime_p90 for s in loaded if s.prime_p90 is not None), default=None),
        prime_p90_after_scale=median([s.prime_p90 for s in served_after[-5:]]),
        signal_crossed_at=crossed,
        answers_slowed_at=slowed,
    )


def replica_writers(cluster: Any, namespace: str) -> dict[str, str]:
    """Who owns the pool's spec.replicas: manager -> operation (and subresource)."""
    found = json.loads(
        cluster.kubectl("get", "statefulset", POOL, "-n", namespace, "-o", "json", "--show-managed-fields").stdout
    )
    owners = {}
    for entry in found["metadata"].get("managedFields") or []:
        if '"f:replicas"' in json.dumps(entry.get("fieldsV1", {}).get("f:spec", {})):
            owners[entry["manager"]] = entry["operation"] + (
                f"/{entry['subresource']}" if entry.get("subresource") else ""
            )
    return owners


def consumer_encodes(cluster: Any, namespace: str) -> int:
    """The pictures the unit's consumers got without transfer params (what vLLM would encode
    itself), read from each consumer's /metrics at its pod IP."""
    pods = json.loads(
        cluster.kubectl(
            "get", "pods", "-n", namespace, "-l", f"epd.vime.dev/deployment={NAME},epd.vime.dev/role=unit", "-o", "json"
        ).stdout
    )
    total = 0
    for pod in pods["items"]:
        ip = pod["status"].get("podIP")
        port = next(
            p["containerPort"] for c in pod["spec"]["containers"] if c["name"].startswith("regular") for p in c["ports"]
        )
        with urllib.request.urlopen(f"http://{ip}:{port}/metrics", timeout=5) as answer:
            for line in answer.read().decode().splitlines():
                if line.startswith("epd_standin_consumer_encodes_total "):
                    total += int(float(line.split()[1]))
    return total


def plot(run: Run, summary: Summary, path: Any) -> None:
    """The run as a PNG: the pool's size over time above, the signal and the p90s below."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file
    import matplotlib.pyplot as plt

    at = [s.at for s in run.samples]
    figure, (sizes, times) = plt.subplots(2, 1, sharex=True, figsize=(9, 6), height_ratios=(1, 1.4))
    sizes.step(at, [s.replicas for s in run.samples], where="post", label="encoder pods (the HPA's size)")
    sizes.step(at, [s.ready for s in run.samples], where="post", linestyle="--", label="ready")
    sizes.set_ylabel("encoder pods")
    sizes.set_ylim(0, MAX_ENCODERS + 1)
    signal = times.twinx()
    signal.plot(at, [s.signal for s in run.samples], color="tab:gray", label="primes in flight (the signal)")
    signal.axhline(TARGET_PRIMES_IN_FLIGHT, color="tab:gray", linestyle=":", linewidth=1)
    signal.set_ylabel("primes in flight")
    times.plot(at, [s.prime_p90 for s in run.samples], color="tab:red", label="prime p90")
    times.plot(at, [s.answer_p90 for s in run.samples], color="tab:purple", label="answer p90 (clients)")
    times.axhline(PRIME_P90_TARGET_SECONDS, color="tab:red", linestyle=":", linewidth=1)
    times.set_ylabel("seconds")
    times.set_xlabel("seconds since the run began")
    for axis in (sizes, times):
        axis.axvspan(run.step_at, run.stop_at, color="tab:orange", alpha=0.1)
    sizes.legend(loc="upper right", fontsize=8)
    lines = times.get_legend_handles_labels()
    extra = signal.get_legend_handles_labels()
    times.legend(lines[0] + extra[0], lines[1] + extra[1], loc="upper right", fontsize=8)
    figure.suptitle(summary.line(), fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
