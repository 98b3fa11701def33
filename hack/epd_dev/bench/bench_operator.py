"""Operator benchmark on the real local control plane (`make bench`).

Starts its own LocalCluster (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
kwok with 100 fake GPU nodes) in ``--dir``, installs the CRD and runs ``epd-operator run`` as
a real process, then measures:

1. Reconcile latency, N = 50 and 200. Apply N EPDDeployments (docs/examples/
   encoder-regular.yaml under unique names, one ``kubectl apply`` call); per object, the
   time from its creation to: its StatefulSet and both Services exist AND its
   status.observedGeneration == generation. Then N one-pod Deployments, the same way: from
   creation to the pod created by kube-controller-manager (Deployment -> ReplicaSet -> Pod).
   Every time is the arrival of a watch event in this process (creationTimestamp has 1 s
   resolution), so both sides are measured alike. Done with kcm's default client rate limit
   (--kube-api-qps 20, --kube-api-burst 30), then again with kcm restarted at 200/300.
2. Scale, per size of ``--scale`` (default 1,000), ``--repeat`` times: a fresh operator, that
   many EPDDeployments over the nodes, created by 8 concurrent POSTs: time from the first POST
   until all are converged (children exist, status written for their generation: the
   operator's work) and until all are Ready (that also waits for kcm, at its default client
   QPS unless ``--scale-kcm-raised``, to create the pods); the operator's peak RSS (VmHWM), CPU
   seconds, successful reconciles per EPDDeployment (until converged, and until idle), the API
   server's own request metrics by verb and resource; then, once no event has come for 5 s,
   its CPU while idle for 30 s and its RSS (several sizes give RSS per object, a slope). The
   operator runs in a venv of its runtime dependencies only, as the image installs them.

Prints tables and PASS/MISS per target, and ends with ``key=value`` lines. ``--profile DIR``
samples the operator with py-spy during the scale run and prints its hottest functions;
``--operator-src DIR`` runs the operator from another source tree, to A/B a change.

    python -m epd_dev.bench.bench_operator [--sizes 50 200] [--scale 1000] [--repeat 3] [--profile DIR]
    python -m epd_dev.bench.bench_operator --sizes --scale 100 1000 5000 --nodes 200 --gpus-per-node 64
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import json
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import kopf
import yaml

from epd_operator.kube import Kube
from epd_operator.reconciler import Reconciler
from epd_operator.settings import Settings

from ..localcluster import LocalCluster
from ..operator_process import OperatorProcess
from ..paths import REPO
from .big import Big, big_keys, measure_big, report_big
from .kit import (
    EPD_PATH,
    GPUS_PER_NODE,
    OURS,
    Api,
    converged,
    create_namespace,
    epd_manifest,
    log,
    runtime_python,
    session,
    tls_context,
)
from .observe import (
    Recorder,
    Stream,
    apiserver_requests,
    cpu_seconds,
    memory_mb,
    py_spy,
    request_delta,
    settle,
    watching,
)
from .restart import Restart, measure_restart, report_restart

BENCH_LABEL = "bench.epd.vime.dev/deployment"  # ties a benchmark Deployment's pod to it
CHILDREN = 3  # watched children of the example: its unit StatefulSet, front and headless Services
KCM_DEFAULT = "default (--kube-api-qps 20, --kube-api-burst 30)"
KCM_RAISED_ARGS = ("--kube-api-qps=200", "--kube-api-burst=300")
KCM_RAISED = "raised (--kube-api-qps 200, --kube-api-burst 300)"
# KEP-4974 lets a cluster turn off the deprecated v1 Endpoints controller (nothing in this
# cluster reads Endpoints: kube-proxy and the operator read EndpointSlices); the big runs can be
# repeated so to tell its share of the children's cost (--big-without-endpoints-controller).
KCM_NO_ENDPOINTS_ARGS = ("--controllers=*,-endpoint",)
NO_ENDPOINTS_VARIANT = "_no_endpoints_controller"

TARGETS = {  # key: (upper limit, what the target says)
    "reconcile_p50_ratio": (1.0, "reconcile p50 <= 1.0x kcm p50 (kcm at its default client QPS)"),
    "reconcile_p99_ratio": (1.5, "reconcile p99 <= 1.5x kcm p99 (kcm at its default client QPS)"),
    "reconcile_p50_ratio_kcm_qps200": (1.0, "reconcile p50 <= 1.0x kcm p50, kcm at 200 QPS"),
    "reconcile_p99_ratio_kcm_qps200": (1.5, "reconcile p99 <= 1.5x kcm p99, kcm at 200 QPS"),
    "scale_1000_seconds": (15.0, "1,000 EPDDeployments converged (children + status) within 15 s"),
    "operator_peak_rss_mb_1000": (150.0, "operator peak RSS <= 150 MB at 1,000 EPDDeployments"),
    "operator_peak_rss_mb_5000": (200.0, "operator peak RSS <= 200 MB at 5,000 EPDDeployments"),
    "idle_cpu_percent": (1.0, "operator idle CPU <= 1 %"),
    "reconciles_per_epd": (2.0, "successful reconciles per EPDDeployment until converged <= 2"),
    "scale_1000_over_floor": (1.1, "1,000 EPDDeployments converged within 1.1x the floor (the stand-in's writes)"),
    "restart_1000_writes": (0.0, "no write after a restart at 1,000 converged EPDDeployments"),
    "big_1000_ready_ratio_floor": (1.1, "1,000 units Ready within 1.1x a bare StatefulSet's pods"),
    "big_status_patches_per_unit": (0.2, "status patches per unit during the scale-up <= 0.2"),
    "big_5000_status_bytes": (2.0**20, "the status of 5,000 units under 1 MiB"),
    "client_discover_5000_ms": (50.0, "epd_client.discover and a unit for a key, 5,000 units, <= 50 ms"),
    "neighbour_1000_pods_operator_cpu_seconds": (
        1.0,
        "the operator's CPU while another team's 1,000 pods start, <= 1 CPU-second",
    ),
}


# ------------------------------------------------------------------------------ objects


def deployment_manifest(name: str) -> dict[str, Any]:
    labels = {BENCH_LABEL: name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]},
            },
        },
    }


def apply(cluster: LocalCluster, namespace: str, documents: list[dict[str, Any]]) -> float:
    """One `kubectl apply` of every document; returns the seconds it took."""
    began = time.monotonic()
    cluster.kubectl(
        "apply", "--server-side", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(documents), timeout=900
    )
    return time.monotonic() - began


def create_all(api: Api, namespace: str, documents: list[dict[str, Any]], workers: int = 8) -> float:
    """POST every EPDDeployment, ``workers`` at a time; returns the seconds it took. For the
    scale run: one `kubectl apply` sends 1,000 objects one by one (46 s on this machine),
    which would measure kubectl, not the operator."""
    began = time.monotonic()
    path = f"{EPD_PATH}/namespaces/{namespace}/epddeployments"
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for future in [pool.submit(api.call, "POST", path, json=doc) for doc in documents]:
            future.result()
    return time.monotonic() - began


def delete_namespaces(cluster: LocalCluster, api: Api, names: list[str], timeout: float = 600) -> None:
    if not names:
        return
    cluster.kubectl("delete", "namespace", *names, "--wait=false")
    deadline = time.monotonic() + timeout
    while {n["metadata"]["name"] for n in api.items("/api/v1/namespaces")} & set(names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"namespaces {names} still there after {timeout:.0f}s")
        time.sleep(1)


# ------------------------------------------------------------------------------ process


def pid_of(operator: OperatorProcess) -> int:
    assert operator.proc is not None, "the operator is not running"
    return operator.proc.pid


def check_alive(operator: OperatorProcess) -> None:
    """A crashed operator would make every later number meaningless: stop at once."""
    if operator.proc is None or operator.proc.poll() is not None:
        code = operator.proc.returncode if operator.proc else None
        raise RuntimeError(f"the operator exited (code {code}):\n{operator.tail(40)}")


def reconcile_stats(operator: OperatorProcess) -> dict[str, float]:
    """Totals of the operator's reconcile metrics (count by result, seconds)."""
    stats: collections.defaultdict[str, float] = collections.defaultdict(float)
    for line in operator.metrics().splitlines():
        if line.startswith("epd_reconciles_total{"):
            result = line.split('result="', 1)[1].split('"', 1)[0]
            stats[f"reconciles_{result}"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("epd_reconcile_duration_seconds_sum "):
            stats["reconcile_seconds"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith(
            ("epd_reconcile_stage_duration_seconds_sum{", "epd_reconcile_stage_duration_seconds_count{")
        ):
            stage = line.split('stage="', 1)[1].split('"', 1)[0]
            stats[f"stage_{stage}_{line.split('{', 1)[0].rsplit('_', 1)[1]}"] += float(line.rsplit(" ", 1)[1])
    return dict(stats)


STAGES = ("plan", "children", "status")  # the operator's epd_reconcile_stage_duration_seconds{stage}


def format_stages(stages_ms: dict[str, float]) -> str:
    return " / ".join(f"{stages_ms[s]:.1f}" if s in stages_ms else "-" for s in STAGES)


def stage_means_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean milliseconds of each reconcile stage between two reconcile_stats() (plan: every
    reconcile; apply and status: those that wrote), from the operator's own histogram."""
    means = {}
    for stage in STAGES:
        count = after.get(f"stage_{stage}_count", 0) - before.get(f"stage_{stage}_count", 0)
        if count:
            means[stage] = (after.get(f"stage_{stage}_sum", 0) - before.get(f"stage_{stage}_sum", 0)) / count * 1000
    return means


# ---------------------------------------------------------------------------- measuring


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (p99 of 50 values is the largest)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass
class Latencies:
    what: str
    n: int
    kcm: str
    seconds: list[float]
    apply_seconds: float
    stages_ms: dict[str, float] = field(default_factory=dict)  # the operator's mean per reconcile stage
    # The API server's requests from the apply until the last object converged (its pod, for kcm).
    api_requests: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)

    @property
    def p50_ms(self) -> float:
        return percentile(self.seconds, 50) * 1000

    @property
    def p99_ms(self) -> float:
        return percentile(self.seconds, 99) * 1000


def epd_streams(
    namespace: str, rec: Recorder, *, pods: bool = False, seen: Callable[[float], None] = lambda at: None
) -> list[Stream]:
    """Watches marking, per EPDDeployment: "created", "status" (observedGeneration is the
    generation), "converged" (that, and its StatefulSet and both Services exist: the operator's
    work), "ready" (Ready for the generation) and, as "child", when its last child appeared.
    ``seen`` gets the arrival of every event (with ``pods``, of unit pods' and budgets' too)."""

    def mark_converged(name: str, at: float) -> None:
        if name in rec.times["status"] and len(rec.children[name]) == CHILDREN:
            rec.mark("converged", name, at)

    def on_epd(_type: str, obj: dict, at: float) -> None:
        seen(at)
        name = obj["metadata"]["name"]
        rec.mark("created", name, at)
        if (obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"]:
            rec.mark("status", name, at)
            mark_converged(name, at)
        if converged(obj):
            rec.mark("ready", name, at)

    def on_child(type_: str, obj: dict, at: float) -> None:
        seen(at)
        if type_ == "ADDED" and obj["kind"] != "Pod":
            # By kind and name: a model's StatefulSet and its front Service share the name.
            owner = obj["metadata"]["labels"]["epd.vime.dev/deployment"]
            rec.child(owner, f"{obj['kind']}/{obj['metadata']['name']}", at)
            mark_converged(owner, at)

    streams: list[Stream] = [
        (f"{EPD_PATH}/namespaces/{namespace}/epddeployments", on_epd, {}),
        (f"/apis/apps/v1/namespaces/{namespace}/statefulsets", on_child, {"labelSelector": OURS}),
        (f"/api/v1/namespaces/{namespace}/services", on_child, {"labelSelector": OURS}),
    ]
    if pods:
        streams.append((f"/api/v1/namespaces/{namespace}/pods", on_child, {"labelSelector": OURS}))
        # Not children that count for convergence, but the operator watches them: kcm's disruption
        # controller updates their status for minutes after the last unit is Ready, and a window
        # with such events is not idle.
        streams.append(
            (
                f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets",
                lambda _type, _obj, at: seen(at),
                {"labelSelector": OURS},
            )
        )
    return streams


def measure_epds(
    cluster: LocalCluster,
    api: Api,
    namespace: str,
    n: int,
    kcm: str,
    timeout: float = 600,
    spec: dict[str, Any] | None = None,
) -> Latencies:
    """Creation -> StatefulSet + 2 Services + status.observedGeneration, per EPDDeployment;
    then waits until every one is Ready so the next run starts on an idle cluster."""
    rec = Recorder()
    names = [f"bench-{i}" for i in range(n)]
    streams = epd_streams(namespace, rec)

    with watching(cluster, *streams) as watches:
        before = apiserver_requests(api)
        took = apply(cluster, namespace, [epd_manifest(name, **(spec or {})) for name in names])
        rec.wait(lambda: len(rec.times["converged"]) == n, timeout, f"{n} EPDDeployments reconciled", watches)
        requests = request_delta(before, apiserver_requests(api))
        stuck = settle(rec, names, "ready", timeout, watches)
    seconds = [rec.times["converged"][x] - rec.times["created"][x] for x in names]
    if stuck:
        log(f"  MISS: {len(stuck)} EPDDeployments never Ready: {' '.join(stuck[:10])}")
    return Latencies("EPDDeployment -> children + status", n, kcm, seconds, took, api_requests=requests)


def measure_deployments(
    cluster: LocalCluster, api: Api, namespace: str, n: int, kcm: str, timeout: float = 600
) -> Latencies:
    """Creation -> pod created by kube-controller-manager, per one-pod Deployment; then waits
    until every pod runs."""
    rec = Recorder()

    def on_deployment(_type: str, obj: dict, at: float) -> None:
        rec.mark("created", obj["metadata"]["name"], at)

    def on_pod(_type: str, obj: dict, at: float) -> None:
        owner = obj["metadata"]["labels"][BENCH_LABEL]
        rec.mark("pod", owner, at)
        if (obj.get("status") or {}).get("phase") == "Running":
            rec.mark("running", owner, at)

    names = [f"bench-{i}" for i in range(n)]
    streams = [
        (f"/apis/apps/v1/namespaces/{namespace}/deployments", on_deployment, {}),
        (f"/api/v1/namespaces/{namespace}/pods", on_pod, {"labelSelector": BENCH_LABEL}),
    ]
    with watching(cluster, *streams) as watches:
        before = apiserver_requests(api)
        took = apply(cluster, namespace, [deployment_manifest(name) for name in names])
        rec.wait(lambda: len(rec.times["pod"]) == n, timeout, f"pods of {n} Deployments", watches)
        requests = request_delta(before, apiserver_requests(api))
        settle(rec, names, "running", timeout, watches)
    seconds = [rec.times["pod"][x] - rec.times["created"][x] for x in names]
    return Latencies("Deployment -> pod (kcm)", n, kcm, seconds, took, api_requests=requests)


@dataclass
class Scale:
    n: int
    kcm: str
    apply_seconds: float  # creating the objects (concurrent POSTs)
    reconciled_seconds: float  # first POST -> every EPD has its children and a status: converged
    ready_seconds: float  # first POST -> every EPD Ready (inf if some never were); kcm-bound
    not_ready: list[str]  # EPDs still not Ready at the timeout
    quiet_seconds: float  # apply start -> the last event before the idle measurement
    cpu_seconds: float  # operator CPU from apply start to all Ready
    peak_rss_mb: float
    rss_mb: float  # after the idle measurement: what the operator keeps per object
    idle_cpu_percent: float
    idle_seconds: float
    idle_events: int  # events on our objects during the idle measurement (should be none)
    reconciles: dict[str, float] = field(default_factory=dict)  # first POST -> end of the idle measurement
    reconciles_converged: dict[str, float] = field(default_factory=dict)  # first POST -> all converged
    api_requests: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)  # first POST -> Ready
    cpu_to_converged: dict[str, float] = field(default_factory=dict)  # CPU seconds per process, first POST -> converged
    profile: list[str] = field(default_factory=list)

    @property
    def reconciles_per_epd(self) -> float:
        """Successful reconciles from the first POST until every object converged, per object."""
        return self.reconciles_converged.get("reconciles_success", 0) / self.n

    @property
    def reconciles_per_epd_to_idle(self) -> float:
        """The same until the end of the idle measurement: every status refresh up to Ready too."""
        return self.reconciles.get("reconciles_success", 0) / self.n


def measure_scale(
    cluster: LocalCluster,
    api: Api,
    operator: OperatorProcess,
    namespace: str,
    n: int,
    kcm: str,
    *,
    idle_seconds: float = 30,
    profile_dir: Path | None = None,
    timeout: float = 600,
    spec: dict[str, Any] | None = None,
) -> Scale:
    """Create n EPDDeployments; time until all are converged and Ready; then wait until the
    cluster is quiet (kcm works off its rate-limited backlog of StatefulSet status updates
    for a while after the last unit is Ready) and measure the operator's idle CPU."""
    rec = Recorder()
    seen: dict[str, float] = {"events": 0, "last": time.monotonic()}

    def count(at: float) -> None:
        seen["events"] += 1
        seen["last"] = at

    names = [f"scale-{i}" for i in range(n)]
    streams = epd_streams(namespace, rec, pods=True, seen=count)
    pid = pid_of(operator)
    processes = {**cluster.pids, "epd-operator": pid, "benchmark": os.getpid()}
    before, requests_before = reconcile_stats(operator), apiserver_requests(api)
    with watching(cluster, *streams) as watches:
        with py_spy(pid, profile_dir, f"scale-{n}") as profile:
            began = time.monotonic()
            cpu_before = {name: cpu_seconds(p) for name, p in processes.items()}
            took = create_all(api, namespace, [epd_manifest(name, **(spec or {})) for name in names])
            rec.wait(
                lambda: len(rec.times["converged"]) == n,
                timeout,
                f"{n} EPDDeployments converged",
                watches,
                progress=lambda: f"{len(rec.times['converged'])}/{n} converged",
            )
            at_converged = reconcile_stats(operator)
            cpu_converged = {name: cpu_seconds(p) - cpu_before[name] for name, p in processes.items()}
            stuck = settle(rec, names, "ready", timeout, watches)
            cpu = cpu_seconds(pid) - cpu_before["epd-operator"]
            requests = request_delta(requests_before, apiserver_requests(api))
        rec.wait(lambda: time.monotonic() - seen["last"] > 5, timeout, "5 s without an event", watches)
        quiet = seen["last"] - began
        with py_spy(pid, profile_dir, f"idle-{n}") as idle_profile:
            events, cpu0, idle0 = seen["events"], cpu_seconds(pid), time.monotonic()
            time.sleep(idle_seconds)
            idle = (cpu_seconds(pid) - cpu0) / (time.monotonic() - idle0) * 100
            idle_events = int(seen["events"] - events)
    after = reconcile_stats(operator)
    return Scale(
        n,
        kcm,
        took,
        reconciled_seconds=max(rec.times["converged"].values()) - began,
        ready_seconds=math.inf if stuck else max(rec.times["ready"].values()) - began,
        not_ready=stuck,
        quiet_seconds=quiet,
        cpu_seconds=cpu,
        peak_rss_mb=memory_mb(pid, "VmHWM"),
        rss_mb=memory_mb(pid, "VmRSS"),
        idle_cpu_percent=idle,
        idle_seconds=idle_seconds,
        idle_events=idle_events,
        reconciles={k: after.get(k, 0) - before.get(k, 0) for k in after},
        reconciles_converged={k: at_converged.get(k, 0) - before.get(k, 0) for k in at_converged},
        api_requests=requests,
        cpu_to_converged=cpu_converged,
        profile=[*(profile.lines if profile else []), *(idle_profile.lines if idle_profile else [])],
    )


async def write_like_the_operator(
    cluster: LocalCluster, namespace: str, documents: list[dict[str, Any]], *, creators: int = 8, workers: int = 16
) -> None:
    """A STAND-IN for the operator, to measure the floor: the API server's share of convergence.
    POSTs the EPDDeployments (8 at a time, as ``create_all``) and, for each as soon as its POST
    returns, makes the operator's writes through its own client (``Kube``): the children its
    Reconciler plans (spec-hash annotations included), created by POST in parallel, then a
    status patch for the generation (only observedGeneration: the least such a write can be);
    ``workers`` at a time, as the operator's queue. No watch, no kopf event handling, no index."""
    connection = kopf.ConnectionInfo(
        server=cluster.server,
        ca_path=cluster.pki / "ca.crt",
        certificate_path=cluster.pki / "admin.crt",
        private_key_path=cluster.pki / "admin.key",
    )
    kube = Kube(connection)
    reconciler = Reconciler(Settings(janitor_image="epd-operator:bench"), kube=kube)
    created, controlled = asyncio.Semaphore(creators), asyncio.Semaphore(workers)
    path = f"{cluster.server}{EPD_PATH}/namespaces/{namespace}/epddeployments"
    context = tls_context(cluster)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context, limit=creators)) as http:

        async def one(document: dict[str, Any]) -> None:
            async with created, http.post(path, json=document) as response:
                response.raise_for_status()
                body = await response.json()
            async with controlled:
                owner = kopf.Body(body)
                children = reconciler.plans.desired(owner, reconciler.plans.plan(owner))
                await asyncio.gather(*(kube.create(child) for child in children))
                metadata = body["metadata"]
                await kube.patch_status(namespace, metadata["name"], {"observedGeneration": metadata["generation"]})

        try:
            await asyncio.gather(*(one(document) for document in documents))
        finally:
            await kube.aclose()


def measure_floor(
    cluster: LocalCluster, api: Api, namespace: str, n: int, timeout: float = 600, spec: dict[str, Any] | None = None
) -> float:
    """Seconds from the first POST until n EPDDeployments converged, written by the stand-in
    above (the operator must not run meanwhile)."""
    rec = Recorder()
    names = [f"floor-{i}" for i in range(n)]
    with watching(cluster, *epd_streams(namespace, rec)) as watches:
        began = time.monotonic()
        asyncio.run(write_like_the_operator(cluster, namespace, [epd_manifest(name, **(spec or {})) for name in names]))
        rec.wait(lambda: len(rec.times["converged"]) == n, timeout, f"{n} EPDDeployments converged", watches)
    return max(rec.times["converged"].values()) - began


# ------------------------------------------------------------------------------- report


@dataclass
class Results:
    latencies: list[tuple[Latencies, Latencies]] = field(default_factory=list)  # (EPD, kcm) pairs
    scales: list[Scale] = field(default_factory=list)  # every scale run, repeats included
    floors: dict[int, float] = field(default_factory=dict)  # n -> converged seconds with the stand-in writer
    restarts: list[Restart] = field(default_factory=list)  # after the last scale run of each size
    bigs: list[Big] = field(default_factory=list)  # one EPDDeployment of many units, per size
    machine: str = ""
    spec: dict[str, Any] = field(default_factory=dict)  # what every EPDDeployment changed of the example

    def runs(self, n: int) -> list[Scale]:
        return [s for s in self.scales if s.n == n]

    @property
    def headline_scale(self) -> int | None:
        """The size whose figures get the unsuffixed keys: 1,000 when run, else the first."""
        sizes = [s.n for s in self.scales]
        return 1000 if 1000 in sizes else (sizes[0] if sizes else None)

    def rss_slope_kb(self, attribute: str) -> float | None:
        """Least-squares slope of an RSS figure against the number of objects, in KB per object."""
        points = [(s.n, getattr(s, attribute)) for s in self.scales]
        if len({n for n, _ in points}) < 2:
            return None
        mean_n = statistics.fmean(n for n, _ in points)
        mean_mb = statistics.fmean(mb for _, mb in points)
        slope = sum((n - mean_n) * (mb - mean_mb) for n, mb in points) / sum((n - mean_n) ** 2 for n, _ in points)
        return slope * 1024

    def keys(self) -> dict[str, float]:
        keys: dict[str, float] = {}
        headline = [(e, d) for e, d in self.latencies if e.kcm == KCM_DEFAULT]
        if headline:
            epd, deploy = max(headline, key=lambda p: p[0].n)
            keys["reconcile_p50_ms"] = epd.p50_ms
            keys["kcm_p50_ms"] = deploy.p50_ms
            keys["reconcile_p50_ratio"] = epd.p50_ms / deploy.p50_ms
            keys["reconcile_p99_ratio"] = epd.p99_ms / deploy.p99_ms
        raised = [(e, d) for e, d in self.latencies if e.kcm == KCM_RAISED]
        if raised:
            epd, deploy = max(raised, key=lambda p: p[0].n)
            keys["reconcile_p50_ms_kcm_qps200"] = epd.p50_ms
            keys["kcm_p50_ms_qps200"] = deploy.p50_ms
            keys["reconcile_p50_ratio_kcm_qps200"] = epd.p50_ms / deploy.p50_ms
            keys["reconcile_p99_ratio_kcm_qps200"] = epd.p99_ms / deploy.p99_ms
        for n in dict.fromkeys(s.n for s in self.scales):
            runs = self.runs(n)
            converged = [s.reconciled_seconds for s in runs]
            keys[f"scale_{n}_seconds"] = statistics.median(converged)
            if len(runs) > 1:
                keys[f"scale_{n}_seconds_min"], keys[f"scale_{n}_seconds_max"] = min(converged), max(converged)
            keys[f"scale_{n}_ready_seconds"] = statistics.median(s.ready_seconds for s in runs)
            keys[f"operator_peak_rss_mb_{n}"] = max(s.peak_rss_mb for s in runs)
            keys[f"reconciles_per_epd_{n}"] = statistics.median(s.reconciles_per_epd for s in runs)
        if (headline_n := self.headline_scale) is not None:
            runs = self.runs(headline_n)
            keys["operator_peak_rss_mb"] = keys[f"operator_peak_rss_mb_{headline_n}"]
            keys["reconciles_per_epd"] = keys[f"reconciles_per_epd_{headline_n}"]
            keys["reconciles_per_epd_to_idle"] = statistics.median(s.reconciles_per_epd_to_idle for s in runs)
            keys["idle_cpu_percent"] = max(s.idle_cpu_percent for s in runs)
        for n, seconds in self.floors.items():
            keys[f"floor_{n}_seconds"] = seconds
            if self.runs(n):
                keys[f"scale_{n}_over_floor"] = keys[f"scale_{n}_seconds"] / seconds
        for attribute in ("rss_mb", "peak_rss_mb"):
            if (slope := self.rss_slope_kb(attribute)) is not None:
                keys[f"{attribute}_slope_kb_per_epd"] = slope
        for r in self.restarts:
            keys[f"restart_{r.n}_seconds"] = r.seconds
            keys[f"restart_{r.n}_writes"] = r.writes
            keys[f"restart_{r.n}_child_writes"] = r.child_writes
            keys[f"restart_{r.n}_status_writes"] = r.status_writes
        return {**keys, **big_keys(self.bigs)}


def machine() -> str:
    load = os.getloadavg()
    memory = int(Path("/proc/meminfo").read_text().split()[1]) // 1024 // 1024
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return (
        f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores ({cpu}), {memory} GiB, "
        f"Python {platform.python_version()}, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
    )


def report_scale(s: Scale, out: Callable[[str], None]) -> None:
    out("")
    out(f"scale: {s.n} EPDDeployments, kube-controller-manager client {s.kcm}")
    out(f"  created (8 concurrent POSTs)       {s.apply_seconds:6.1f} s")
    out(f"  all converged (children + status)  {s.reconciled_seconds:6.1f} s after the first POST")
    out(f"  all Ready (pods by kcm + kwok)     {s.ready_seconds:6.1f} s after the first POST")
    if s.not_ready:
        out(f"  NOT Ready at the timeout: {len(s.not_ready)}: {' '.join(s.not_ready[:10])}")
    out(f"  operator CPU until all Ready       {s.cpu_seconds:6.1f} s")
    out(f"  operator peak RSS (VmHWM)          {s.peak_rss_mb:6.1f} MB (after idling {s.rss_mb:.1f} MB)")
    out(f"  last event (EPD, child or pod)     {s.quiet_seconds:6.1f} s after the apply began")
    out(
        f"  operator idle CPU over {s.idle_seconds:.0f} s        {s.idle_cpu_percent:6.2f} % "
        f"({s.idle_events} events meanwhile)"
    )
    per = s.reconciles.get("reconcile_seconds", 0) / max(1, s.reconciles.get("reconciles_success", 0))
    out(
        f"  reconciles {json.dumps({k: round(v, 1) for k, v in s.reconciles.items()})}"
        f" ({per * 1000:.1f} ms each on average)"
    )
    out(
        f"  reconciles per EPDDeployment       {s.reconciles_per_epd:6.2f} until converged, "
        f"{s.reconciles_per_epd_to_idle:.2f} until idle"
    )
    if s.cpu_to_converged:
        spent = sorted(s.cpu_to_converged.items(), key=lambda kv: -kv[1])
        out(
            f"  CPU seconds until converged ({s.reconciled_seconds:.1f} s, 2 cores: "
            f"{s.reconciled_seconds * (os.cpu_count() or 1):.0f} CPU-s offered): "
            + ", ".join(f"{name} {seconds:.1f}" for name, seconds in spent)
        )
    if s.api_requests:
        report_requests(s.api_requests, "first POST to all Ready", out)
    for line in s.profile:
        out(f"  {line}")


def report_requests(
    requests: dict[tuple[str, str], tuple[float, float]], window: str, out: Callable[[str], None], top: int = 12
) -> None:
    count, seconds = sum(c for c, _ in requests.values()), sum(s for _, s in requests.values())
    out(
        f"  API server, {window} (apiserver_request_duration_seconds, watches left out): "
        f"{count:.0f} requests, {seconds:.1f} s in all"
    )
    out("  | verb | resource | requests | mean ms | total s |")
    out("  | --- | --- | ---: | ---: | ---: |")
    for (verb, resource), (count, seconds) in sorted(requests.items(), key=lambda kv: -kv[1][1])[:top]:
        out(f"  | {verb} | {resource} | {count:.0f} | {seconds / count * 1000:.1f} | {seconds:.1f} |")


def report(results: Results, out: Callable[[str], None] = print) -> None:
    out("")
    out(f"machine: {results.machine}")
    out(
        f"EPDDeployments: docs/examples/encoder-regular.yaml{' with ' + json.dumps(results.spec) if results.spec else ''}"
    )
    if results.latencies:
        out("")
        out(
            "| N | kube-controller-manager client | EPD p50 ms | EPD p99 ms | kcm p50 ms | kcm p99 ms "
            "| p50 ratio | p99 ratio | apply s (EPD / Deployment) | operator stages, mean ms (plan / children / status) |"
        )
        out("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for epd, deploy in results.latencies:
            out(
                f"| {epd.n} | {epd.kcm} | {epd.p50_ms:.0f} | {epd.p99_ms:.0f} | {deploy.p50_ms:.0f} "
                f"| {deploy.p99_ms:.0f} | {epd.p50_ms / deploy.p50_ms:.2f}x | {epd.p99_ms / deploy.p99_ms:.2f}x "
                f"| {epd.apply_seconds:.1f} / {deploy.apply_seconds:.1f} | {format_stages(epd.stages_ms)} |"
            )
        for epd, deploy in results.latencies:
            for latencies, what in (
                (epd, "EPDDeployments, until all converged"),
                (deploy, "Deployments, until every pod exists"),
            ):
                if latencies.api_requests:
                    out("")
                    report_requests(latencies.api_requests, f"{latencies.n} {what}, kcm {latencies.kcm}", out, top=8)
    for s in results.scales:
        report_scale(s, out)
    if results.scales:
        out("")
        out(
            "| EPDDeployments | run | created s | converged s | Ready s | reconciles/EPD (converged / idle) "
            "| operator CPU s | peak RSS MB | RSS after idle MB | idle CPU % |"
        )
        out("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for n in dict.fromkeys(s.n for s in results.scales):
            for i, s in enumerate(results.runs(n), 1):
                out(
                    f"| {n} | {i} | {s.apply_seconds:.1f} | {s.reconciled_seconds:.1f} | {s.ready_seconds:.1f} "
                    f"| {s.reconciles_per_epd:.2f} / {s.reconciles_per_epd_to_idle:.2f} | {s.cpu_seconds:.1f} "
                    f"| {s.peak_rss_mb:.1f} | {s.rss_mb:.1f} | {s.idle_cpu_percent:.2f} |"
                )
    for n, seconds in results.floors.items():
        out(
            f"floor: {n} EPDDeployments converged in {seconds:.1f} s with the operator stopped and a stand-in "
            "making its writes (no watch, kopf or index): what the API server needs"
        )
    for r in results.restarts:
        report_restart(r, out)
    for b in results.bigs:
        report_big(b, out)
    keys = results.keys()
    out("")
    for key, value in keys.items():
        if key in TARGETS:
            limit, text = TARGETS[key]
            out(f"{'PASS' if value <= limit else 'MISS'}  {text}: {value:.2f}")
    out("")
    for key, value in keys.items():
        out(f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}")


# --------------------------------------------------------------------------------- main


def run_latency(
    cluster: LocalCluster,
    api: Api,
    operator: OperatorProcess,
    sizes: list[int],
    kcm: str,
    results: Results,
    spec: dict[str, Any] | None = None,
) -> list[str]:
    """Both latency runs per size; returns the namespaces used (their objects are kept until
    the caller deletes them: a namespace deletion keeps kcm busy for a while)."""
    used = []
    for n in sizes:
        tag = uuid.uuid4().hex[:5]
        epd_ns = create_namespace(cluster, api, f"bench-epd-{n}-{tag}")
        log(f"{n} EPDDeployments, kcm {kcm}")
        before = reconcile_stats(operator)
        epd = measure_epds(cluster, api, epd_ns, n, kcm, spec=spec)
        epd.stages_ms = stage_means_ms(before, reconcile_stats(operator))
        deploy_ns = create_namespace(cluster, api, f"bench-deploy-{n}-{tag}")
        log(f"{n} Deployments, kcm {kcm}")
        deploy = measure_deployments(cluster, api, deploy_ns, n, kcm)
        check_alive(operator)
        log(
            f"  EPD p50 {epd.p50_ms:.0f} ms p99 {epd.p99_ms:.0f} ms; kcm p50 {deploy.p50_ms:.0f} ms "
            f"p99 {deploy.p99_ms:.0f} ms; operator stages {format_stages(epd.stages_ms)}"
        )
        results.latencies.append((epd, deploy))
        used += [epd_ns, deploy_ns]
    return used


def warm_up(cluster: LocalCluster, api: Api) -> str:
    """One EPDDeployment and one Deployment through the whole path: the first reconcile
    loads templates, the first pods warm the scheduler and kwok."""
    namespace = create_namespace(cluster, api, f"bench-warmup-{uuid.uuid4().hex[:5]}")
    measure_epds(cluster, api, namespace, 1, KCM_DEFAULT)
    measure_deployments(cluster, api, namespace, 1, KCM_DEFAULT)
    return namespace


def benchmark(
    cluster: LocalCluster,
    api: Api,
    operator: OperatorProcess,
    *,
    sizes: list[int],
    scales: list[int],
    repeat: int = 1,
    idle_seconds: float = 30,
    profile_dir: Path | None = None,
    restart_kcm: Callable[[tuple[str, ...]], object] | None = None,
    scale_kcm_raised: bool = False,
    scale_timeout: float = 600,
    floor: bool = False,
    restart: bool = False,
    big: list[int] | None = None,
    big_scale_to: int | None = None,
    big_kcm_raised: bool = False,
    big_without_endpoints_controller: bool = False,
    cleanup: bool = True,
    spec: dict[str, Any] | None = None,
) -> Results:
    """Every measurement, on a running cluster with the CRD and a running operator. With
    ``restart_kcm(extra_args)`` the latency runs are repeated with kcm's client limit raised
    (and, with ``scale_kcm_raised``, the scale runs too). Each scale run, ``repeat`` times per
    size, gets a fresh operator process (its own peak RSS and CPU) and a namespace of its own.
    With ``floor``, each size is also written once by the stand-in of ``write_like_the_operator``;
    with ``restart``, the last run of each size ends with a kill -9 of the operator and a new one
    (restart.py). Then each size of ``big``: one EPDDeployment of that many units against its floor
    (big.py), those of the first size also scaled to ``big_scale_to`` and back, with kcm at 200
    QPS if ``big_kcm_raised``; a size given again is a repeat whose runs go in another order.
    With ``big_without_endpoints_controller`` (and ``restart_kcm``), every size of ``big`` is
    measured again (creation only) with kcm's legacy Endpoints controller off, keys
    ``big_N_no_endpoints_controller_*``; kcm is left so.
    ``cleanup=False`` leaves the last run's objects (the caller drops the cluster: deleting
    5,000 EPDDeployments and their children takes the garbage collector 15 minutes and more).
    ``spec`` changes every EPDDeployment's spec (the example's) in every run."""
    results = Results(machine=machine(), spec=spec or {})
    used = [warm_up(cluster, api)]
    used += run_latency(cluster, api, operator, sizes, KCM_DEFAULT, results, spec)
    raised = False
    if restart_kcm and sizes:
        log(f"restarting kube-controller-manager with {' '.join(KCM_RAISED_ARGS)}")
        restart_kcm(KCM_RAISED_ARGS)
        raised = True
        time.sleep(10)  # a restarted kcm resyncs every object first
        used += run_latency(cluster, api, operator, sizes, KCM_RAISED, results, spec)
    for n in scales:
        for run in range(1, repeat + 1):
            log(f"scale: {n} EPDDeployments, run {run}/{repeat}; a fresh operator")
            operator.stop()
            delete_namespaces(cluster, api, used, timeout=max(600, n * 0.5))
            used = []
            if restart_kcm and raised != scale_kcm_raised:
                restart_kcm(KCM_RAISED_ARGS if scale_kcm_raised else ())
                raised = scale_kcm_raised
                time.sleep(10)
            operator.start()
            namespace = create_namespace(cluster, api, f"bench-scale-{n}-{uuid.uuid4().hex[:5]}")
            used = [namespace]
            s = measure_scale(
                cluster,
                api,
                operator,
                namespace,
                n,
                KCM_RAISED if raised else KCM_DEFAULT,
                idle_seconds=idle_seconds,
                profile_dir=profile_dir,
                timeout=scale_timeout,
                spec=spec,
            )
            log(
                f"  converged {s.reconciled_seconds:.1f} s, Ready {s.ready_seconds:.1f} s, peak RSS "
                f"{s.peak_rss_mb:.1f} MB, reconciles/EPD {s.reconciles_per_epd:.2f} / {s.reconciles_per_epd_to_idle:.2f}"
            )
            results.scales.append(s)
            check_alive(operator)
            if restart and run == repeat:
                log(f"restart: kill -9 of the operator with {n} EPDDeployments converged")
                results.restarts.append(measure_restart(api, operator, n))
        if floor:
            log(f"floor: {n} EPDDeployments written by a stand-in, the operator stopped")
            operator.stop()
            delete_namespaces(cluster, api, used, timeout=max(600, n * 0.5))
            used = [create_namespace(cluster, api, f"bench-floor-{n}-{uuid.uuid4().hex[:5]}")]
            results.floors[n] = measure_floor(cluster, api, used[0], n, timeout=scale_timeout, spec=spec)
            log(f"  converged {results.floors[n]:.1f} s")
            operator.start()
    if big:
        delete_namespaces(cluster, api, used, timeout=max(600, max(scales, default=0) * 0.5))
        used = []
        if restart_kcm and raised != big_kcm_raised:
            restart_kcm(KCM_RAISED_ARGS if big_kcm_raised else ())
            raised = big_kcm_raised
            time.sleep(10)

        def measure_sizes(sizes: list[int], kcm: str, *, scale_to: int | None, variant: str = "") -> None:
            for i, units in enumerate(sizes):
                results.bigs.append(
                    measure_big(
                        cluster,
                        api,
                        operator,
                        units,
                        kcm,
                        scale_to=scale_to if units == sizes[0] else None,
                        rotation=sizes[:i].count(units),  # a repeat of a size runs its floors and itself in turn
                        profile_dir=profile_dir,
                        variant=variant,
                    )
                )
                check_alive(operator)

        kcm = KCM_RAISED if raised else KCM_DEFAULT
        measure_sizes(big, kcm, scale_to=big_scale_to)
        if restart_kcm and big_without_endpoints_controller:
            kcm_args = (*(KCM_RAISED_ARGS if raised else ()), *KCM_NO_ENDPOINTS_ARGS)
            log(f"restarting kube-controller-manager with {' '.join(kcm_args)}")
            restart_kcm(kcm_args)
            time.sleep(10)
            without = f"{kcm}, legacy Endpoints controller off ({KCM_NO_ENDPOINTS_ARGS[0]})"
            measure_sizes(big, without, scale_to=None, variant=NO_ENDPOINTS_VARIANT)
    if used and cleanup:
        delete_namespaces(cluster, api, used, timeout=max(600, scales[-1] * 0.5))
        check_alive(operator)  # deleting many at once is a load of its own
    results.machine += f"; load average at the end {os.getloadavg()[0]:.1f}"
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "epd-bench",
        help="cluster folder (a leftover cluster there is replaced)",
    )
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--sizes", type=int, nargs="*", default=[50, 200], help="latency run sizes")
    parser.add_argument(
        "--scale",
        type=int,
        nargs="*",
        default=[1000],
        help="EPDDeployments per scale run; several sizes give the RSS slope (none: skip)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs per scale size (3: min/median/max)")
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=GPUS_PER_NODE,
        help="GPUs each kwok node advertises (a unit of the example takes 2)",
    )
    parser.add_argument("--scale-timeout", type=float, default=600, help="seconds each scale run may take to Ready")
    parser.add_argument(
        "--no-floor",
        action="store_true",
        help="skip the floor of each scale size (the operator's writes made by a stand-in, the operator stopped)",
    )
    parser.add_argument(
        "--no-restart", action="store_true", help="skip the kill -9 and restart of the operator after each scale size"
    )
    parser.add_argument(
        "--big",
        type=int,
        nargs="*",
        default=[1000, 5000],
        help="units of the one-EPDDeployment runs, each against its floors (none: skip); a size given "
        "again is a repeat, its runs in another order (1000 1000 1000: the median and spread of three)",
    )
    parser.add_argument(
        "--big-scale-to",
        type=int,
        default=100,
        help="the big runs of the first size are scaled to this many units and back",
    )
    parser.add_argument(
        "--big-kcm-default",
        action="store_true",
        help="big runs with kcm at its default 20 QPS (default: 200 QPS; 5,000 units take it 10+ min at 20)",
    )
    parser.add_argument(
        "--big-without-endpoints-controller",
        action="store_true",
        help="then each --big size again with kcm's deprecated v1 Endpoints controller off (--controllers=*,-endpoint)",
    )
    parser.add_argument(
        "--scale-kcm-raised",
        action="store_true",
        help="scale runs with kcm at 200 QPS too (5,000 pods take 10+ min at 20 QPS)",
    )
    parser.add_argument("--idle-seconds", type=float, default=30)
    parser.add_argument("--no-kcm-raised", action="store_true", help="skip the runs with kcm at 200 QPS")
    parser.add_argument(
        "--profile", type=Path, default=None, help="py-spy the scale runs and the big runs into this folder"
    )
    parser.add_argument(
        "--headless-front-service",
        action="store_true",
        help="every EPDDeployment with spec.service.headless: no ClusterIP to allocate",
    )
    parser.add_argument(
        "--operator-src",
        type=Path,
        default=None,
        help="run the operator from this source folder (holding epd_operator/): A/B a change",
    )
    args = parser.parse_args(argv)
    if args.big_without_endpoints_controller and (args.no_kcm_raised or not args.big):
        parser.error(
            "--big-without-endpoints-controller restarts kcm for the --big sizes: give --big, not --no-kcm-raised"
        )
    # `kill` (SIGTERM) unwinds like Ctrl-C, so the cluster and the operator are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    log(f"machine: {machine()}")
    # The operator runs from source in a venv of its runtime dependencies, as the image has it.
    source = args.operator_src or REPO / "operator"
    with session(
        args.dir, args.nodes, operator_python=runtime_python(), operator_src=source, gpus_per_node=args.gpus_per_node
    ) as (cluster, api, operator):
        results = benchmark(
            cluster,
            api,
            operator,
            sizes=args.sizes,
            scales=args.scale,
            repeat=args.repeat,
            idle_seconds=args.idle_seconds,
            profile_dir=args.profile,
            scale_kcm_raised=args.scale_kcm_raised,
            scale_timeout=args.scale_timeout,
            floor=not args.no_floor,
            restart=not args.no_restart,
            big=args.big,
            big_scale_to=args.big_scale_to,
            big_kcm_raised=not args.big_kcm_default,
            big_without_endpoints_controller=args.big_without_endpoints_controller,
            cleanup=False,
            spec={"service": {"headless": True}} if args.headless_front_service else None,
            restart_kcm=None if args.no_kcm_raised else lambda extra: cluster.restart("kube-controller-manager", extra),
        )
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
