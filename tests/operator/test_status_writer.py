"""When the status writer patches the status of a deployment of many units (no cluster: the API
is recorded, the clock is the test's)."""

from __future__ import annotations

import kopf
import yaml

from epd_dev.paths import REPO
from epd_operator.ec.scrape import JanitorScraper
from epd_operator.indexes import Indexes, PodSummary
from epd_operator.kube import KubeSession
from epd_operator.metrics import OperatorMetrics
from epd_operator.plans import PlanCache
from epd_operator.status_writer import StatusWriter

KEY = ("ns", "big")
UNITS = 1000


class Statuses:
    def __init__(self) -> None:
        self.patched: list[dict] = []

    async def patch_status(self, _namespace, _name, status):
        self.patched.append(status)


def body(status: dict) -> kopf.Body:
    manifest = yaml.safe_load((REPO / "docs" / "examples" / "encoder-regular.yaml").read_text())
    manifest["metadata"].update(name=KEY[1], namespace=KEY[0], uid="uid-1", generation=1)
    manifest["spec"]["replicas"] = UNITS
    return kopf.Body({**manifest, "status": status})


def ready_pod(i: int, ready: bool = True) -> PodSummary:
    return PodSummary.of(
        {
            "metadata": {"name": f"big-default-{i}"},
            "spec": {"nodeName": "node-a"},
            "status": {
                "podIP": "10.0.0.5",
                "conditions": [
                    {"type": "PodScheduled", "status": "True"},
                    {"type": "Ready", "status": "True" if ready else "False"},
                ],
                "initContainerStatuses": [{"name": "encoder-0", "ready": True, "started": True}],
                "containerStatuses": [
                    {"name": "regular-0", "ready": True, "started": True},
                    {"name": "proxy", "ready": True, "started": True},
                ],
            },
        }
    )


def status_writer(
    kube: Statuses,
    now: list[float],
    requeued: list,
    events: list | None = None,
    metrics: OperatorMetrics | None = None,
) -> StatusWriter:
    def told(kind: str):
        return lambda _body, reason, message: events.append((kind, reason, message)) if events is not None else None

    return StatusWriter(
        KubeSession(kube),  # type: ignore[arg-type]  # records the one call the writer makes here
        JanitorScraper(warn=lambda *_: None, changed=lambda _key: None),
        metrics or OperatorMetrics(),
        warn=told("Warning"),
        inform=told("Normal"),
        requeue_after=lambda key, delay: requeued.append((key, delay)),
        clock=lambda: now[0],
        seconds_per_unit=0.005,  # 5 s at 1,000 units
    )


async def test_counts_are_written_at_most_every_units_times_the_spacing_and_flips_at_once():
    kube, requeued, now = Statuses(), [], [0.0]
    writer = status_writer(kube, now, requeued)
    plans = PlanCache(16, "epd-operator:test")
    pods: dict = {KEY: []}
    indexes = Indexes(deployments={}, stateful_sets={}, services={}, budgets={}, pods=pods)

    async def write_at(t: float, ready: int) -> bool:
        now[0] = t
        pods[KEY] = [ready_pod(i) for i in range(ready)]
        status = kube.patched[-1] if kube.patched else {}
        return await writer.write(KEY, body(status), plans.plan(body(status)), indexes)

    assert await write_at(0.0, 0)  # the first status of a generation: at once
    assert await write_at(0.5, 1) and kube.patched[-1]["phase"] == "Progressing"  # a new phase: at once
    assert not await write_at(1.5, 10)  # only counts moved, 1 s after the last write
    assert requeued == [(KEY, 4.0)]  # the writer comes back when it may write
    assert not await write_at(3.0, 500)
    assert await write_at(5.5, 700) and kube.patched[-1]["ready"] == "700/1000"
    assert await write_at(6.0, UNITS)  # Ready flips: written at once, whatever the spacing
    assert kube.patched[-1]["phase"] == "Ready" and len(kube.patched) == 4
    assert not await write_at(20.0, UNITS)  # nothing changed: nothing written


async def test_a_unit_that_falls_and_comes_back_is_told_in_events_though_the_status_lists_no_units():
    kube, now, events = Statuses(), [0.0], []
    writer = status_writer(kube, now, [], events)
    plans = PlanCache(16, "epd-operator:test")
    pods: dict = {KEY: []}
    indexes = Indexes(deployments={}, stateful_sets={}, services={}, budgets={}, pods=pods)

    async def write_at(t: float, units: list[PodSummary]) -> None:
        now[0] = t
        pods[KEY] = units
        status = kube.patched[-1] if kube.patched else {}
        await writer.write(KEY, body(status), plans.plan(body(status)), indexes)

    everyone = [ready_pod(i) for i in range(UNITS)]
    await write_at(0.0, everyone)
    assert kube.patched[-1]["phase"] == "Ready" and events == []  # a unit's first readiness is no event
    await write_at(10.0, [*everyone[:7], ready_pod(7, ready=False), *everyone[8:]])
    assert events == [("Warning", "UnitUnready", "unit big-default-7: PodNotReady: pod is not Ready")]
    await write_at(20.0, everyone)
    assert events[1:] == [("Normal", "UnitReady", "unit big-default-7 is ready again")]


async def test_the_metrics_say_how_many_units_are_ready_of_how_many_asked_for_even_between_writes():
    kube, now, metrics = Statuses(), [0.0], OperatorMetrics()
    writer = status_writer(kube, now, [], metrics=metrics)
    plans = PlanCache(16, "epd-operator:test")
    pods: dict = {KEY: []}
    indexes = Indexes(deployments={}, stateful_sets={}, services={}, budgets={}, pods=pods)

    def units() -> tuple[float | None, float | None]:
        labels = {"namespace": KEY[0], "name": KEY[1]}
        return (
            metrics.registry.get_sample_value("epd_ready_units", labels),
            metrics.registry.get_sample_value("epd_desired_units", labels),
        )

    async def write_at(t: float, ready: int) -> bool:
        now[0] = t
        pods[KEY] = [ready_pod(i) for i in range(ready)]
        status = kube.patched[-1] if kube.patched else {}
        return await writer.write(KEY, body(status), plans.plan(body(status)), indexes)

    await write_at(0.0, 0)
    assert units() == (0, UNITS)
    assert await write_at(0.5, 1)
    assert not await write_at(1.5, 300)  # the status waits for its spacing; the metrics do not
    assert units() == (300, UNITS)
    metrics.forget(*KEY)
    assert units() == (None, None)
