"""The operator under failure on the real local control plane (`make chaos`).

A churn of 500 EPDDeployments (created in batches, updated: replicas, an engine argument,
the model's name so that a whole model's children must go; deleted; re-created under the
same name, i.e. a new uid), while the operator is killed with SIGKILL 20 times at random
moments and kube-apiserver is killed and started again once midway. Then, once the operator
and kube-controller-manager's garbage collector had time (up to --settle seconds), it counts:

- orphans: a StatefulSet or Service none of whose owners is a live EPDDeployment (by uid),
  or a unit pod whose StatefulSet is gone;
- duplicates: for a live EPDDeployment, more than one StatefulSet or two Services for its
  model, children of a model no longer in its spec, or more pods than replicas;
- unconverged: a live EPDDeployment not Ready for its current generation, or whose spec is
  not what the churn last applied.

Prints the counts; exits 1 if any is not zero.

    python -m epd_dev.bench.chaos [--objects 500] [--kills 20] [--seed N]
"""

from __future__ import annotations

import argparse
import collections
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from ..localcluster import ClusterError, LocalCluster
from ..operator_process import OperatorProcess
from .kit import EPD_PATH, OURS, Api, converged, create_namespace, epd_manifest, log, session

LABEL_DEPLOYMENT = "epd.vime.dev/deployment"
LABEL_MODEL = "epd.vime.dev/model"
MODEL_NAMES = ("default", "alt")  # renaming the model makes the operator delete its children
MAX_MODEL_LENS = (2048, 4096, 8192)  # a changed engine argument rolls the units


@dataclass(frozen=True)
class Desired:
    """What the churn last applied to one EPDDeployment."""

    replicas: int
    model: str
    max_model_len: int

    def manifest(self, name: str) -> dict[str, Any]:
        manifest = epd_manifest(name, replicas=self.replicas)
        model = manifest["spec"]["models"][0]
        model["name"] = self.model
        model["serverGroups"][1]["overrides"] = {"max_model_len": self.max_model_len}
        return manifest


@dataclass(frozen=True)
class Step:
    kind: str  # "apply" or "delete"
    names: tuple[str, ...]
    desired: tuple[Desired, ...] = ()  # per name, for "apply"


@dataclass
class Churn:
    """A seeded plan: every object is created once; about half are then updated, a quarter
    deleted and a tenth of those re-created. ``max_units`` bounds the units alive at once
    (what the nodes' GPUs can hold)."""

    steps: list[Step]
    final: dict[str, Desired]
    counts: collections.Counter[str] = field(default_factory=collections.Counter)

    @classmethod
    def plan(cls, rng: random.Random, objects: int, max_units: int) -> Churn:
        fresh = [f"chaos-{i}" for i in range(objects)]
        live: dict[str, Desired] = {}
        gone: list[str] = []
        budget = {"update": objects // 2, "delete": objects // 4, "recreate": max(1, objects // 40)}
        counts: collections.Counter[str] = collections.Counter()
        steps: list[Step] = []

        def pick(current: int) -> Desired:
            units = sum(d.replicas for d in live.values()) - current
            replicas = rng.choice([r for r in (0, 1, 2) if r == 0 or units + r <= max_units])
            return Desired(replicas, rng.choice(MODEL_NAMES), rng.choice(MAX_MODEL_LENS))

        while kinds := [
            k
            for k, ok in (
                ("create", fresh),
                ("update", budget["update"] and live),
                ("delete", budget["delete"] and live),
                ("recreate", budget["recreate"] and gone),
            )
            if ok
        ]:
            kind = rng.choice(kinds)
            size = rng.randint(1, max(1, objects // 20))
            if kind in ("create", "recreate"):
                pool, count = (fresh, size) if kind == "create" else (gone, min(size, budget["recreate"]))
                names = [pool.pop(rng.randrange(len(pool))) for _ in range(min(count, len(pool)))]
                desired = []
                for name in names:
                    live[name] = pick(0)
                    desired.append(live[name])
                steps.append(Step("apply", tuple(names), tuple(desired)))
            elif kind == "update":
                names = rng.sample(sorted(live), min(size, len(live), budget["update"]))
                desired = []
                for name in names:
                    live[name] = pick(live[name].replicas)
                    desired.append(live[name])
                steps.append(Step("apply", tuple(names), tuple(desired)))
            else:
                names = rng.sample(sorted(live), min(size, len(live), budget["delete"]))
                for name in names:
                    del live[name]
                gone += names
                steps.append(Step("delete", tuple(names)))
            if kind != "create":
                budget[kind] -= len(names)
            counts[kind] += len(names)
        return cls(steps, live, counts)


def run_step(cluster: LocalCluster, namespace: str, step: Step, retry_for: float = 180) -> None:
    """kubectl, retried while the API server is away (both calls are idempotent)."""
    if step.kind == "apply":
        args = ["apply", "--server-side", "-n", namespace, "-f", "-"]
        text = yaml.safe_dump_all([d.manifest(n) for n, d in zip(step.names, step.desired, strict=True)])
    else:
        args, text = ["delete", "epd", "-n", namespace, "--wait=false", "--ignore-not-found", *step.names], None
    deadline = time.monotonic() + retry_for
    while True:
        try:
            cluster.kubectl(*args, input=text, timeout=120)
            return
        except ClusterError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


@dataclass
class Verdict:
    orphans: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    unconverged: list[str] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)  # operator exits nobody caused

    @property
    def clean(self) -> bool:
        return not (self.orphans or self.duplicates or self.unconverged or self.crashes)


def inspect(api: Api, namespace: str, final: dict[str, Desired]) -> Verdict:
    """One look at everything in the namespace (LISTs, so it is one consistent-enough view)."""
    epds = {e["metadata"]["name"]: e for e in api.items(f"{EPD_PATH}/namespaces/{namespace}/epddeployments")}
    sets = api.items(f"/apis/apps/v1/namespaces/{namespace}/statefulsets", labelSelector=OURS)
    services = api.items(f"/api/v1/namespaces/{namespace}/services", labelSelector=OURS)
    for kind, items in (("StatefulSet", sets), ("Service", services)):
        for item in items:
            item["kind"] = kind  # list items carry no kind
    pods = api.items(f"/api/v1/namespaces/{namespace}/pods", labelSelector=OURS)
    live_uids = {e["metadata"]["uid"] for e in epds.values()}
    set_uids = {s["metadata"]["uid"] for s in sets}
    verdict = Verdict()

    def owners(obj: dict) -> set[str]:
        return {o["uid"] for o in obj["metadata"].get("ownerReferences") or []}

    for obj in [*sets, *services]:
        if not owners(obj) & live_uids:
            verdict.orphans.append(f"{obj['kind']} {obj['metadata']['name']}")
    for pod in pods:
        if not owners(pod) & set_uids:
            verdict.orphans.append(f"Pod {pod['metadata']['name']}")

    children: dict[str, list[dict]] = collections.defaultdict(list)
    for obj in [*sets, *services]:
        children[obj["metadata"]["labels"][LABEL_DEPLOYMENT]].append(obj)
    running: collections.Counter[str] = collections.Counter(
        p["metadata"]["labels"][LABEL_DEPLOYMENT] for p in pods if not p["metadata"].get("deletionTimestamp")
    )
    for name, epd in sorted(epds.items()):
        want = final.get(name)
        if want is None:
            verdict.unconverged.append(f"{name}: should have been deleted")
            continue
        spec = epd["spec"]
        if spec["replicas"] != want.replicas or spec["models"][0]["name"] != want.model:
            verdict.unconverged.append(f"{name}: spec is not the last one applied")
        if not converged(epd):
            verdict.unconverged.append(f"{name}: not Ready for generation {epd['metadata']['generation']}")
        kinds = collections.Counter((c["kind"], c["metadata"]["labels"][LABEL_MODEL]) for c in children[name])
        stale = sorted(f"{kind} of model {model}" for kind, model in kinds if model != want.model)
        if stale:
            verdict.duplicates.append(f"{name}: {', '.join(stale)}")
        if kinds[("StatefulSet", want.model)] > 1 or kinds[("Service", want.model)] > 2:
            verdict.duplicates.append(f"{name}: {dict(kinds)}")
        if running[name] > want.replicas:
            verdict.duplicates.append(f"{name}: {running[name]} pods for {want.replicas} replicas")
    verdict.unconverged += [f"{name}: missing" for name in sorted(final.keys() - epds.keys())]
    return verdict


def alive(operator: OperatorProcess) -> bool:
    return operator.proc is not None and operator.proc.poll() is None


def last_words(operator: OperatorProcess) -> str:
    return operator.tail(3).replace("\n", " | ")


def settle(
    api: Api, operator: OperatorProcess, namespace: str, final: dict[str, Desired], timeout: float
) -> tuple[Verdict, float]:
    """Look until everything is clean, the operator died or ``timeout`` passed; the last
    verdict and how long it took."""
    began = time.monotonic()
    last_log = began
    while True:
        try:
            verdict = inspect(api, namespace, final)
        except httpx.HTTPError as error:  # a connection the API server restart broke
            log(f"inspect failed ({error}); again")
            time.sleep(1)
            continue
        waited = time.monotonic() - began
        if verdict.clean or waited > timeout or not alive(operator):
            return verdict, waited
        if time.monotonic() - last_log > 15:
            last_log = time.monotonic()
            log(
                f"orphans={len(verdict.orphans)} duplicates={len(verdict.duplicates)} "
                f"unconverged={len(verdict.unconverged)}"
            )
        time.sleep(2)


@dataclass
class Result:
    counts: collections.Counter[str]
    kills: int
    apiserver_restart_seconds: float | None
    churn_seconds: float
    settle_seconds: float
    verdict: Verdict

    def lines(self) -> list[str]:
        v = self.verdict
        restart = (
            "none"
            if self.apiserver_restart_seconds is None
            else f"killed and back in {self.apiserver_restart_seconds:.1f} s"
        )
        out = [
            f"churn: {dict(self.counts)} in {self.churn_seconds:.0f} s",
            f"operator kill -9: {self.kills}; kube-apiserver: {restart}",
            f"settled in {self.settle_seconds:.0f} s after the churn",
        ]
        for what, items in (
            ("orphans", v.orphans),
            ("duplicates", v.duplicates),
            ("unconverged", v.unconverged),
            ("operator_crashes", v.crashes),
        ):
            out.append(f"{what}={len(items)}")
            out += [f"  {item}" for item in items[:20]]
        return out


def run(
    cluster: LocalCluster,
    api: Api,
    operator: OperatorProcess,
    namespace: str,
    *,
    objects: int,
    kills: int,
    seed: int,
    max_units: int,
    restart_apiserver: Callable[[], float] | None = None,
    settle_timeout: float = 600,
) -> Result:
    """The churn on one thread; kills (and the API server restart, half-way) on this one.

    Kill k waits for its step of the churn, then a random 0-1 s (the operator is busy
    with what that step applied), kills, and starts the operator again after a random 0-2 s
    (the churn goes on meanwhile). The churn runs at most two steps past a kill not yet done,
    so every kill falls inside it. After the middle kill's restart, the API server is killed
    and started again while the operator runs.
    """
    rng = random.Random(seed)
    churn = Churn.plan(rng, objects, max_units)
    kill_at = sorted(rng.sample(range(1, len(churn.steps)), min(kills, len(churn.steps) - 1)))
    progress = {"steps": 0, "kills": 0}
    changed = threading.Condition()
    failure: list[BaseException] = []
    crashes: list[str] = []  # log tails of operator processes that exited by themselves

    def churner() -> None:
        try:
            for index, step in enumerate(churn.steps):

                def kills_caught_up(index: int = index) -> bool:
                    return progress["kills"] >= sum(1 for at in kill_at if at < index - 2)

                with changed:
                    changed.wait_for(kills_caught_up)
                run_step(cluster, namespace, step)
                with changed:
                    progress["steps"] = index + 1
                    changed.notify_all()
                time.sleep(rng.uniform(0, 0.3))
        except BaseException as error:  # noqa: BLE001 - re-raised on the main thread
            failure.append(error)
            with changed:
                changed.notify_all()

    restart_seconds = None
    began = time.monotonic()
    thread = threading.Thread(target=churner, name="churn", daemon=True)
    thread.start()
    for k, at in enumerate(kill_at):

        def churned_to_it(at: int = at) -> bool:
            return progress["steps"] >= at or bool(failure)

        with changed:
            changed.wait_for(churned_to_it)
        if failure:
            break
        time.sleep(rng.uniform(0, 1))
        if not alive(operator):
            crashes.append(last_words(operator))  # it died on its own: a kill would hide that
        operator.kill()
        with changed:
            progress["kills"] = k + 1
            changed.notify_all()
        time.sleep(rng.uniform(0, 2))
        operator.start()
        log(f"kill {k + 1}/{len(kill_at)} at step {at}/{len(churn.steps)}")
        if restart_apiserver and k == len(kill_at) // 2:
            time.sleep(rng.uniform(0, 1))
            log("killing kube-apiserver (the operator runs on)")
            restart_seconds = restart_apiserver()
    thread.join()
    if failure:
        raise failure[0]
    churn_seconds = time.monotonic() - began
    log(f"churn done in {churn_seconds:.0f} s; waiting for the operator and the garbage collector")
    verdict, waited = settle(api, operator, namespace, churn.final, settle_timeout)
    if not alive(operator):
        crashes.append(last_words(operator))
    verdict.crashes = crashes
    return Result(churn.counts, progress["kills"], restart_seconds, churn_seconds, waited, verdict)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "epd-chaos",
        help="cluster folder (a leftover cluster there is replaced)",
    )
    parser.add_argument("--nodes", type=int, default=40)
    parser.add_argument("--objects", type=int, default=500)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    parser.add_argument("--settle", type=float, default=600, help="seconds to wait for convergence")
    parser.add_argument(
        "--operator-src",
        type=Path,
        default=None,
        help="run the operator from this source folder (holding epd_operator/): A/B a change",
    )
    args = parser.parse_args(argv)
    # `kill` (SIGTERM) unwinds like Ctrl-C, so the cluster and the operator are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    log(f"seed {seed}")

    with session(args.dir, args.nodes, operator_src=args.operator_src) as (cluster, api, operator):
        namespace = create_namespace(cluster, api, "chaos")
        gpus = sum(int(n["status"]["allocatable"]["nvidia.com/gpu"]) for n in api.items("/api/v1/nodes"))
        result = run(
            cluster,
            api,
            operator,
            namespace,
            objects=args.objects,
            kills=args.kills,
            seed=seed,
            max_units=gpus // 2,
            settle_timeout=args.settle,
            restart_apiserver=lambda: cluster.restart("kube-apiserver", hard=True),
        )
        for line in result.lines():
            print(line)
        if not result.verdict.clean:
            print(f"--- operator log (tail) ---\n{operator.tail(60)}", file=sys.stderr)
    return 0 if result.verdict.clean else 1


if __name__ == "__main__":
    sys.exit(main())
