"""One EPDDeployment of thousands of units, the shape of an RL cluster (`make bench`).

The EPDDeployment is docs/examples/encoder-prefill-decode.yaml (E+P+D: 3 GPUs a unit) with
``replicas`` units. Its floor is the same pods made by a bare StatefulSet of the operator's own
pod template (what its Reconciler renders for that EPDDeployment, without owner), applied alone
with the operator stopped, in the same run and the same steps: created, then scaled (1,000 ->
100 -> 1,000). A second floor applies all the operator's children so (its Services'
EndpointSlices and its budget cost kube-controller-manager and the API server work of their
own), which tells the operator's own share from that of the objects it makes. All are timed from
the write (POST, or the PATCH of replicas) to the arrival of the watch event that says the step
is done:

- the floor: its StatefulSet has observed the change and has exactly that many pods, all Ready;
- the EPDDeployment: its status says Ready for the generation with every unit ready, and its
  StatefulSet is as the floor's.

Per step it also counts the operator's status patches (the API server's own metric), and at the
end of each the status' size; per size the operator's CPU and peak RSS, `kubectl get epd -o wide`
and `epd_client.discover` plus the choice of a unit, once the cluster is idle. A repeat of a size
(``--big 1000 1000 1000``) makes its three runs in another order (run_order), so that what one
leaves behind in the cluster does not always weigh on the same one. Before each
EPDDeployment, with the operator running, another team's StatefulSet of the same pods (up to
NEIGHBOUR_PODS, labelled as not the operator's) starts: the operator's CPU meanwhile is what a
shared cluster's other workloads cost it.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kopf
import yaml

import epd_client
from epd_operator.kube import CHILD_KINDS
from epd_operator.reconciler import Reconciler
from epd_operator.settings import Settings

from ..localcluster import LocalCluster
from ..operator_process import OperatorProcess
from ..paths import REPO
from .kit import EPD_PATH, Api, converged, create_namespace, log
from .observe import Stream, apiserver_requests, cpu_seconds, memory_mb, py_spy, request_delta, watching

EXAMPLE = REPO / "docs" / "examples" / "encoder-prefill-decode.yaml"
NAME = "big"
MODEL = "default"
GPUS_PER_UNIT = 3
STATUS_PATCH = ("PATCH", "epddeployments/status")
# A unit's pod requests 3 CPUs for its engines and a little for its router, proxy and janitor;
# kwok nodes advertise 32 CPUs and 110 pods unless told more (node_capacity).
CPUS_PER_UNIT = 4
PODS_PER_NODE = 250
# Another team's pods started beside the operator, before each big run (at most this many).
NEIGHBOUR_PODS = 1000
# A process at rest (kwok between steps; kwok, kube-controller-manager and the operator before
# the reads): under a tenth of a core over 2 s.
IDLE_CPU_SECONDS = 0.2
# The three runs of a size, in the order of its first run; each repeat of the size starts one
# later (rotation), so the state a run leaves the cluster in (etcd's growth, kwok's backlog)
# weighs on each alike over three repeats.
RUNS = ("floor", "children floor", "EPDDeployment")


# One step as _run_steps measured it: seconds, CPU seconds per process, API server requests
# (verb, resource) -> (count, seconds).
Measured = tuple[float, dict[str, float], dict[tuple[str, str], tuple[float, float]]]


@dataclass
class Step:
    """One change of the unit count (0 -> N is the creation), on the EPDDeployment and on its floor."""

    start: int
    units: int
    seconds: float
    floor_seconds: float
    children_floor_seconds: float  # the floor with the operator's other children beside it
    status_patches: float  # the operator's PATCHes of epddeployments/status during the step
    status_bytes: int  # the status as JSON once the step is done
    object_bytes: int  # the whole object so
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds per process during the step
    floor_cpu: dict[str, float] = field(default_factory=dict)
    children_floor_cpu: dict[str, float] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.seconds / self.floor_seconds

    @property
    def children_ratio(self) -> float:
        return self.seconds / self.children_floor_seconds

    @property
    def patches_per_unit(self) -> float:
        return self.status_patches / max(1, abs(self.units - self.start))


@dataclass
class Big:
    units: int
    kcm: str
    steps: list[Step]
    operator_cpu_seconds: float  # from the operator's start to the last step's end
    operator_peak_rss_mb: float
    get_wide_ms: float  # `kubectl get epd <name> -o wide`, median of 5
    get_namespace_ms: float  # `kubectl get namespace <ns>`: kubectl's own cost, for comparison
    discover_ms: list[float]  # epd_client.discover + a unit chosen for a key, each call
    status: dict[str, Any] = field(default_factory=dict)  # the last one, for the report
    api_requests: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)  # the creation step
    profile: list[str] = field(default_factory=list)  # py-spy's hottest functions of the operator (--profile)
    neighbour_pods: int = 0  # another team's pods started beside the operator before the EPDDeployment
    neighbour_seconds: float = 0.0
    neighbour_operator_cpu_seconds: float = 0.0
    order: tuple[str, ...] = RUNS  # the order its three runs were made in (run_order)
    variant: str = ""  # its keys' suffix after the size: a cluster set up otherwise (see big_keys)

    @property
    def created(self) -> Step:
        return self.steps[0]


def manifest(units: int) -> dict[str, Any]:
    document = yaml.safe_load(EXAMPLE.read_text())
    document["metadata"]["name"] = NAME
    document["spec"]["replicas"] = units
    return document


def floor_children(namespace: str, units: int) -> list[dict[str, Any]]:
    """The children the operator's Reconciler renders for the EPDDeployment, owned by nothing:
    the StatefulSet first, then its Services, PodDisruptionBudget and NetworkPolicy."""
    reconciler = Reconciler(Settings(janitor_image="epd-operator:bench"))
    owner = manifest(units)
    owner["metadata"].update(namespace=namespace, uid=str(uuid.uuid4()), generation=1)
    body = kopf.Body(owner)  # type: ignore[arg-type]  # kopf types its RawBody as a TypedDict
    children = reconciler.plans.desired(body, reconciler.plans.plan(body))
    for child in children:
        del child["metadata"]["ownerReferences"]
    return sorted(children, key=lambda c: c["kind"] != "StatefulSet")


def _collection(child: dict[str, Any]) -> str:
    return CHILD_KINDS[child["kind"]].format(ns=child["metadata"]["namespace"])


@contextlib.contextmanager
def node_capacity(api: Api, nodes: list[str], units: int) -> Iterator[None]:
    """Enough GPUs, CPUs and pods on the kwok nodes for `units` units while the block runs, then
    what they had (kwok keeps whatever a node's status says)."""
    per_node = math.ceil(units * 1.2 / len(nodes))
    wanted = {
        "nvidia.com/gpu": str(max(32, per_node * GPUS_PER_UNIT)),
        "cpu": str(max(32, per_node * CPUS_PER_UNIT)),
        "pods": str(max(110, min(PODS_PER_NODE, per_node * 2))),
    }
    before = {name: api.call("GET", f"/api/v1/nodes/{name}")["status"] for name in nodes}

    def patch(name: str, capacity: dict[str, str], allocatable: dict[str, str]) -> None:
        api.merge_patch(f"/api/v1/nodes/{name}/status", {"status": {"capacity": capacity, "allocatable": allocatable}})

    for name in nodes:
        patch(name, wanted, wanted)
    try:
        yield
    finally:
        for name, status in before.items():
            patch(name, {k: status["capacity"][k] for k in wanted}, {k: status["allocatable"][k] for k in wanted})


def neighbour_set(namespace: str, pods: int) -> dict[str, Any]:
    """Another team's StatefulSet on the same cluster: the floor's pods, labelled as its own."""
    stateful_set = floor_children(namespace, pods)[0]
    labels = {"app.kubernetes.io/name": "neighbour"}
    stateful_set["metadata"]["labels"] = labels
    stateful_set["spec"]["selector"] = {"matchLabels": labels}
    stateful_set["spec"]["template"]["metadata"]["labels"] = labels
    return stateful_set


def _measure_neighbours(cluster: LocalCluster, api: Api, pid: int, pods: int, timeout: float) -> tuple[float, float]:
    """Seconds until another team's `pods` are Ready, and the operator's CPU-seconds meanwhile:
    what the operator pays for objects that are not its own (nothing, when its watches ask the
    API server for its own only)."""
    namespace = create_namespace(cluster, api, f"bench-neighbour-{pods}-{uuid.uuid4().hex[:5]}")
    stateful_set = neighbour_set(namespace, pods)
    log(f"big: another team's StatefulSet of {pods} pods, the operator running")
    ((seconds, cpu, _),) = _run_steps(
        cluster,
        api,
        namespace,
        [pods],
        create=lambda: api.call("POST", _collection(stateful_set), json=stateful_set),
        scale=lambda _: None,  # one step: never scaled
        with_epd=False,
        processes={"epd-operator": pid},
        timeout=timeout,
    )
    log(f"  {pods} pods Ready in {seconds:.1f} s; the operator used {cpu['epd-operator']:.2f} CPU-seconds")
    _delete_namespace(cluster, api, namespace, timeout)
    return seconds, cpu["epd-operator"]


def at_target(stateful_set: dict[str, Any], units: int) -> bool:
    status = stateful_set.get("status") or {}
    return (
        status.get("observedGeneration") == stateful_set["metadata"]["generation"]
        and stateful_set["spec"]["replicas"] == units
        and status.get("replicas", 0) == units
        and status.get("readyReplicas", 0) == units
    )


class Tracker:
    """The latest EPDDeployment and StatefulSet seen, and when the step in progress was done."""

    def __init__(self) -> None:
        self.epd: dict[str, Any] = {}
        self.stateful_set: dict[str, Any] = {}
        self.target: int | None = None
        self.done_at: float | None = None
        self.with_epd = True

    def begin(self, units: int, with_epd: bool) -> None:
        self.target, self.done_at, self.with_epd = units, None, with_epd

    def on_epd(self, _type: str, obj: dict[str, Any], at: float) -> None:
        self.epd = obj
        self._check(at)

    def on_set(self, _type: str, obj: dict[str, Any], at: float) -> None:
        self.stateful_set = obj
        self._check(at)

    def _check(self, at: float) -> None:
        if self.target is None or self.done_at is not None or not self.stateful_set:
            return
        if not at_target(self.stateful_set, self.target):
            return
        if self.with_epd:
            status = self.epd.get("status") or {}
            if not (
                self.epd
                and self.epd["spec"]["replicas"] == self.target
                and converged(self.epd)
                and status.get("ready") == f"{self.target}/{self.target}"
            ):
                return
        self.done_at = at


def _wait(tracker: Tracker, watches: list[Any], timeout: float, what: str) -> float:
    deadline = time.monotonic() + timeout
    next_report = time.monotonic() + 30
    while tracker.done_at is None:
        broken = [w for w in watches if w.error]
        if broken:
            raise RuntimeError(f"watch {broken[0].path} failed: {broken[0].error}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        if time.monotonic() >= next_report:
            ready = (tracker.stateful_set.get("status") or {}).get("readyReplicas", 0)
            log(f"  ... {what}: {ready} pods Ready")
            next_report += 30
        time.sleep(0.05)
    return tracker.done_at


def _run_steps(
    cluster: LocalCluster,
    api: Api,
    namespace: str,
    steps: list[int],
    *,
    create: Callable[[], None],
    scale: Callable[[int], None],
    with_epd: bool,
    processes: dict[str, int],
    timeout: float,
    on_done: Callable[[int, Tracker, float], None] = lambda *_: None,
) -> list[Measured]:
    """Each step's seconds, CPU per process and API server requests; `create` makes the first."""
    tracker = Tracker()
    streams: list[Stream] = [(f"/apis/apps/v1/namespaces/{namespace}/statefulsets", tracker.on_set, {})]
    if with_epd:
        streams.append((f"{EPD_PATH}/namespaces/{namespace}/epddeployments", tracker.on_epd, {}))
    measured = []
    with watching(cluster, *streams) as watches:
        for i, units in enumerate(steps):
            tracker.begin(units, with_epd)
            requests_before = apiserver_requests(api)
            cpu_before = {name: cpu_seconds(pid) for name, pid in processes.items()}
            began = time.monotonic()
            create() if i == 0 else scale(units)
            done = _wait(tracker, watches, timeout, f"{units} units")
            cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in processes.items()}
            measured.append((done - began, cpu, request_delta(requests_before, apiserver_requests(api))))
            on_done(units, tracker, done - began)
            if i + 1 < len(steps):
                _settle(api, namespace, units, processes.get("kwok"), timeout)
    return measured


def _settle(api: Api, namespace: str, units: int, kwok: int | None, timeout: float) -> None:
    """Untimed, between steps: wait until the pods a scale-down condemned are gone and kwok (the
    stand-in for kubelets) is idle. kwok deletes pods by name, without the pod's UID: a late
    delete of an old pod kills the new pod the StatefulSet made under the same name, and kwok's
    reaction to that deletion kills the next one, a chain that lasts while kwok lags behind."""
    deadline = time.monotonic() + timeout
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the pods of {namespace} above {units}, or kwok busy, after {timeout:.0f}s")
        if len(api.items(f"/api/v1/namespaces/{namespace}/pods")) > units:
            time.sleep(1)
            continue
        if kwok is None or _idle([kwok]):
            return


def _idle(pids: list[int]) -> bool:
    """Whether each of ``pids`` used under IDLE_CPU_SECONDS of CPU in the next 2 s."""
    before = [cpu_seconds(pid) for pid in pids]
    time.sleep(2)
    return all(cpu_seconds(pid) - was < IDLE_CPU_SECONDS for pid, was in zip(pids, before, strict=True))


def _wait_idle(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not _idle(pids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {pids} still busy after {timeout:.0f}s")


def _delete_namespace(cluster: LocalCluster, api: Api, namespace: str, timeout: float) -> None:
    cluster.kubectl("delete", "namespace", namespace, "--wait=false")
    deadline = time.monotonic() + timeout
    while any(n["metadata"]["name"] == namespace for n in api.items("/api/v1/namespaces")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"namespace {namespace} still there after {timeout:.0f}s")
        time.sleep(1)


def _kubectl_ms(cluster: LocalCluster, *args: str, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        began = time.monotonic()
        cluster.kubectl(*args)
        times.append((time.monotonic() - began) * 1000)
    return statistics.median(times)


def _discover_ms(cluster: LocalCluster, namespace: str, runs: int = 10) -> list[float]:
    """`discover` and the unit `EPDClient.generate` would take for a key, as a client calls them."""
    times = []
    for i in range(runs):
        began = time.monotonic()
        endpoints = epd_client.discover(NAME, namespace, kubeconfig=str(cluster.kubeconfig))
        endpoints.model(MODEL).unit_for(f"sample-{i}")
        times.append((time.monotonic() - began) * 1000)
    return times


def run_order(rotation: int) -> tuple[str, ...]:
    """The order of the three runs of a size's ``rotation``-th repeat (0: RUNS)."""
    shift = rotation % len(RUNS)
    return RUNS[shift:] + RUNS[:shift]


def measure_big(
    cluster: LocalCluster,
    api: Api,
    operator: OperatorProcess,
    units: int,
    kcm: str,
    *,
    scale_to: int | None = None,
    rotation: int = 0,
    timeout: float = 1800,
    profile_dir: Path | None = None,
    variant: str = "",
) -> Big:
    """The floors and the EPDDeployment, through the same steps: created with `units`, then
    (with `scale_to`) scaled to it and back, in ``run_order(rotation)``. The operator is stopped
    for the floors and started fresh for the EPDDeployment, sampled by py-spy through its steps
    with `profile_dir`; it runs again at the end. Each run's namespace is deleted once it is done.
    ``variant`` names a cluster set up otherwise in the keys (big_keys)."""
    with node_capacity(api, cluster.node_names, units):
        return _measure_big(
            cluster,
            api,
            operator,
            units,
            kcm,
            scale_to=scale_to,
            order=run_order(rotation),
            timeout=timeout,
            profile_dir=profile_dir,
            variant=variant,
        )


def _measure_big(
    cluster: LocalCluster,
    api: Api,
    operator: OperatorProcess,
    units: int,
    kcm: str,
    *,
    scale_to: int | None,
    order: tuple[str, ...],
    timeout: float,
    profile_dir: Path | None,
    variant: str,
) -> Big:
    steps = [units, *([scale_to, units] if scale_to is not None else [])]
    processes = dict(cluster.pids)

    def run_floor(tag: str, what: str, all_children: bool) -> list[Measured]:
        operator.stop()
        namespace = create_namespace(cluster, api, f"bench-big-{tag}-{units}-{uuid.uuid4().hex[:5]}")
        children = floor_children(namespace, units)
        stateful_set = children[0]
        sets = _collection(stateful_set)
        name = stateful_set["metadata"]["name"]

        def create() -> None:
            for child in children if all_children else children[:1]:
                api.call("POST", _collection(child), json=child)

        log(f"big: {what} of {units} units ({' -> '.join(map(str, steps))})")
        floor = _run_steps(
            cluster,
            api,
            namespace,
            steps,
            create=create,
            scale=lambda n: api.merge_patch(f"{sets}/{name}", {"spec": {"replicas": n}}),
            with_epd=False,
            processes=processes,
            timeout=timeout,
        )
        log(f"  {tag}: " + ", ".join(f"{n} units {s:.1f} s" for n, (s, _, _) in zip(steps, floor, strict=True)))
        _delete_namespace(cluster, api, namespace, timeout)
        return floor

    def run_epd() -> tuple[Big, list[Measured], list[tuple[int, int]]]:
        operator.stop()
        operator.start()
        pid = operator.proc.pid if operator.proc else 0
        neighbours = min(units, NEIGHBOUR_PODS)
        neighbour_seconds, neighbour_cpu = _measure_neighbours(cluster, api, pid, neighbours, timeout)
        cpu_at_start = cpu_seconds(pid)
        namespace = create_namespace(cluster, api, f"bench-big-{units}-{uuid.uuid4().hex[:5]}")
        epds = f"{EPD_PATH}/namespaces/{namespace}/epddeployments"
        sizes: list[tuple[int, int]] = []

        def measure_size(_units: int, tracker: Tracker, _seconds: float) -> None:
            status = tracker.epd.get("status") or {}
            sizes.append(
                (len(json.dumps(status, separators=(",", ":"))), len(json.dumps(tracker.epd, separators=(",", ":"))))
            )

        log(f"big: one EPDDeployment of {units} units ({' -> '.join(map(str, steps))})")
        with py_spy(pid, profile_dir, f"big-{units}") as profile:
            measured = _run_steps(
                cluster,
                api,
                namespace,
                steps,
                create=lambda: api.call("POST", epds, json=manifest(units)),
                scale=lambda n: api.merge_patch(f"{epds}/{NAME}", {"spec": {"replicas": n}}),
                with_epd=True,
                processes={**processes, "epd-operator": pid},
                timeout=timeout,
                on_done=measure_size,
            )
        operator_cpu = cpu_seconds(pid) - cpu_at_start
        peak = memory_mb(pid, "VmHWM")
        # The reads a client makes of a converged deployment, not of one whose EndpointSlices
        # kube-controller-manager is still writing.
        _wait_idle([p for name, p in processes.items() if name in ("kwok", "kube-controller-manager")] + [pid], timeout)
        get_wide = _kubectl_ms(cluster, "get", "epd", NAME, "-n", namespace, "-o", "wide")
        get_namespace = _kubectl_ms(cluster, "get", "namespace", namespace)
        try:
            discover = _discover_ms(cluster, namespace)
        except epd_client.EPDClientError as error:
            log(f"  discover failed: {error}")
            discover = []
        status = api.call("GET", f"{epds}/{NAME}").get("status") or {}
        _delete_namespace(cluster, api, namespace, timeout)  # with the operator running: it owns the children
        # Everything but the steps, which also need the floors' (made before or after this run).
        big = Big(
            units,
            kcm,
            steps=[],
            operator_cpu_seconds=operator_cpu,
            operator_peak_rss_mb=peak,
            get_wide_ms=get_wide,
            get_namespace_ms=get_namespace,
            discover_ms=discover,
            status=status,
            api_requests=measured[0][2],
            profile=profile.lines if profile else [],
            neighbour_pods=neighbours,
            neighbour_seconds=neighbour_seconds,
            neighbour_operator_cpu_seconds=neighbour_cpu,
            order=order,
            variant=variant,
        )
        return big, measured, sizes

    log(f"big: {units} units, runs in this order: {', '.join(order)}")
    floor: list[Measured] = []
    children_floor: list[Measured] = []
    epd: tuple[Big, list[Measured], list[tuple[int, int]]] | None = None
    for run in order:
        if run == "floor":
            floor = run_floor("floor", "floor, a bare StatefulSet", all_children=False)
        elif run == "children floor":
            children_floor = run_floor("children-floor", "the operator's children applied alone", all_children=True)
        else:
            epd = run_epd()
    assert epd is not None
    if operator.proc is None:
        operator.start()
    big, measured, sizes = epd
    big.steps = [
        Step(
            start=steps[i - 1] if i else 0,
            units=n,
            seconds=seconds,
            floor_seconds=floor[i][0],
            children_floor_seconds=children_floor[i][0],
            status_patches=requests.get(STATUS_PATCH, (0.0, 0.0))[0],
            status_bytes=sizes[i][0],
            object_bytes=sizes[i][1],
            cpu=cpu,
            floor_cpu=floor[i][1],
            children_floor_cpu=children_floor[i][1],
        )
        for i, (n, (seconds, cpu, requests)) in enumerate(zip(steps, measured, strict=True))
    ]
    for step in big.steps:
        log(
            f"  {step.start} -> {step.units} units: {step.seconds:.1f} s (floor {step.floor_seconds:.1f} s, "
            f"{step.ratio:.2f}x; with the children {step.children_floor_seconds:.1f} s, {step.children_ratio:.2f}x), "
            f"{step.status_patches:.0f} status patches, status {step.status_bytes} bytes"
        )
    return big


def report_big(big: Big, out: Callable[[str], None]) -> None:
    out("")
    out(
        f"big: one EPDDeployment of {big.units} units (E+P+D, {GPUS_PER_UNIT} GPUs a unit), "
        f"kube-controller-manager client {big.kcm}; floor: a bare StatefulSet of the operator's pod template; "
        "children floor: the operator's StatefulSet, Services, PodDisruptionBudget and NetworkPolicy applied alone; "
        f"runs in this order: {', '.join(big.order)}"
    )
    out(
        "| step | EPDDeployment s | floor s | ratio | children floor s | ratio "
        "| status patches | per unit | status bytes | object bytes |"
    )
    out("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for s in big.steps:
        out(
            f"| {s.start} -> {s.units} | {s.seconds:.1f} | {s.floor_seconds:.1f} | {s.ratio:.2f}x "
            f"| {s.children_floor_seconds:.1f} | {s.children_ratio:.2f}x "
            f"| {s.status_patches:.0f} | {s.patches_per_unit:.3f} | {s.status_bytes} | {s.object_bytes} |"
        )

    def spent(cpu: dict[str, float]) -> str:
        return ", ".join(f"{n} {c:.1f}" for n, c in sorted(cpu.items(), key=lambda kv: -kv[1]))

    for s in big.steps:
        out(f"  CPU seconds, {s.start} -> {s.units}: {spent(s.cpu)}")
        out(f"    floor: {spent(s.floor_cpu)}")
        out(f"    children floor: {spent(s.children_floor_cpu)}")
    out(
        f"  operator: {big.operator_cpu_seconds:.1f} CPU-seconds from its start to the last step, "
        f"peak RSS {big.operator_peak_rss_mb:.1f} MB"
    )
    out(f"  kubectl get epd -o wide: {big.get_wide_ms:.0f} ms (kubectl get namespace: {big.get_namespace_ms:.0f} ms)")
    if big.discover_ms:
        out(
            f"  epd_client.discover + a unit for a key: median {statistics.median(big.discover_ms):.1f} ms "
            f"(first {big.discover_ms[0]:.1f}, max {max(big.discover_ms):.1f}, {len(big.discover_ms)} calls)"
        )
    if big.neighbour_pods:
        out(
            f"  another team's {big.neighbour_pods} pods, Ready in {big.neighbour_seconds:.1f} s: "
            f"the operator used {big.neighbour_operator_cpu_seconds:.2f} CPU-seconds meanwhile"
        )
    for line in big.profile:
        out(f"  {line}")
    models = big.status.get("models") or []
    out(f"  the status at the end: {json.dumps(big.status)[:600]}" if models else "  (no status)")


def _median(runs: list[Big], value: Callable[[Big], float]) -> float:
    return statistics.median(value(b) for b in runs)


def big_keys(runs: list[Big]) -> dict[str, float]:
    """The keys of the big runs: medians over repeated runs of a size (peak RSS: the largest).
    Runs of a ``variant`` (a cluster set up otherwise) have keys of their own, ``big_N<variant>_*``;
    the headline keys and discover's are the default cluster's."""
    keys: dict[str, float] = {}
    for units, variant in dict.fromkeys((b.units, b.variant) for b in runs):
        same = [b for b in runs if b.units == units and b.variant == variant]
        tag = f"big_{units}{variant}"
        keys[f"{tag}_ready_seconds"] = _median(same, lambda b: b.created.seconds)
        keys[f"{tag}_floor_seconds"] = _median(same, lambda b: b.created.floor_seconds)
        keys[f"{tag}_ready_ratio_floor"] = _median(same, lambda b: b.created.ratio)
        keys[f"{tag}_children_floor_seconds"] = _median(same, lambda b: b.created.children_floor_seconds)
        keys[f"{tag}_ready_ratio_children_floor"] = _median(same, lambda b: b.created.children_ratio)
        keys[f"{tag}_status_patches_per_unit"] = _median(same, lambda b: b.created.patches_per_unit)
        keys[f"{tag}_status_bytes"] = _median(same, lambda b: max(s.status_bytes for s in b.steps))
        keys[f"{tag}_operator_cpu_seconds"] = _median(same, lambda b: b.operator_cpu_seconds)
        keys[f"{tag}_operator_peak_rss_mb"] = max(b.operator_peak_rss_mb for b in same)
        keys[f"{tag}_get_wide_ms"] = _median(same, lambda b: b.get_wide_ms)
        keys[f"{tag}_runs"] = len(same)
        if len(same) > 1:  # the spread of the headline ratios over the repeats
            for name, values in (
                ("ready_ratio_floor", [b.created.ratio for b in same]),
                ("ready_ratio_children_floor", [b.created.children_ratio for b in same]),
            ):
                keys[f"{tag}_{name}_min"], keys[f"{tag}_{name}_max"] = min(values), max(values)
        scaled_runs = max(same, key=lambda b: len(b.steps))
        for i, step in enumerate(scaled_runs.steps[1:], 1):
            scaled = f"{tag}_scale_{step.start}_to_{step.units}"
            with_step = [b.steps[i] for b in same if len(b.steps) > i]
            keys[f"{scaled}_seconds"] = statistics.median(s.seconds for s in with_step)
            keys[f"{scaled}_ratio_floor"] = statistics.median(s.ratio for s in with_step)
            keys[f"{scaled}_ratio_children_floor"] = statistics.median(s.children_ratio for s in with_step)
            keys[f"{scaled}_status_patches_per_unit"] = statistics.median(s.patches_per_unit for s in with_step)
        if not variant and all(b.discover_ms for b in same):
            keys[f"client_discover_{units}_ms"] = _median(same, lambda b: statistics.median(b.discover_ms))
    for pods in dict.fromkeys(b.neighbour_pods for b in runs if b.neighbour_pods and not b.variant):
        beside = [b for b in runs if b.neighbour_pods == pods and not b.variant]
        keys[f"neighbour_{pods}_pods_operator_cpu_seconds"] = _median(
            beside, lambda b: b.neighbour_operator_cpu_seconds
        )
    default = [b for b in runs if not b.variant]
    if default:
        size = 1000 if any(b.units == 1000 for b in default) else default[0].units
        headline = [b for b in default if b.units == size]
        keys["big_status_patches_per_unit"] = _median(headline, lambda b: b.created.patches_per_unit)
        keys["big_status_bytes_per_unit"] = _median(headline, lambda b: max(s.status_bytes for s in b.steps) / b.units)
    return keys
