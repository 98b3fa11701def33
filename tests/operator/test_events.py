"""Which watch events queue a reconcile (handlers.py): a deleted or drifted child does; an event
that only confirms what the operator applied or wrote does not (no cluster)."""

from __future__ import annotations

import asyncio
import copy

import kopf
import pytest

from epd_operator import handlers
from epd_operator.indexes import DeploymentSummary
from epd_operator.reconciler import Reconciler
from epd_operator.resources import ANNOTATION_SPEC_HASH, FIELD_MANAGER, LABEL_DEPLOYMENT, LABEL_MANAGED_BY
from epd_operator.settings import Settings

from .test_converge import KEY, RecordingKube, body, watched


class Queued:
    def __init__(self, reconciler: Reconciler) -> None:
        self.now: list[tuple] = []
        self.later: list[tuple] = []
        reconciler.enqueue = lambda key, urgent=False: self.now.append((key, urgent))
        reconciler.enqueue_after = lambda key, delay: self.later.append(key)


def watching(api: RecordingKube | None = None) -> Reconciler:
    """A Reconciler whose indexes hold the EPDDeployment and none of its children yet."""
    reconciler = Reconciler(Settings(janitor_image="epd-operator:test"), kube=api or RecordingKube())
    reconciler.watch(watched(deployments={KEY: [DeploymentSummary.of(body())]}))
    return reconciler


@pytest.fixture
def reconciler() -> Reconciler:
    return watching()


def child(reconciler: Reconciler, kind: str, digest: str | None = None) -> kopf.Body:
    planned = next(c for c in reconciler.plans.desired(body(), reconciler.plans.plan(body())) if c["kind"] == kind)
    if digest:
        planned["metadata"]["annotations"][ANNOTATION_SPEC_HASH] = digest
    return kopf.Body(planned)


async def child_event(reconciler: Reconciler, type: str, obj: kopf.Body) -> None:
    handler = handlers.set_changed if obj["kind"] == "StatefulSet" else handlers.child_changed
    await handler(
        memo=kopf.Memo(reconciler=reconciler),
        type=type,
        namespace=KEY[0],
        labels={LABEL_DEPLOYMENT: KEY[1]},
        body=obj,
        meta=obj.metadata,
    )


@pytest.mark.parametrize("kind", ["Service", "PodDisruptionBudget"])
async def test_a_confirming_service_or_budget_event_queues_nothing_a_deleted_or_drifted_one_does(reconciler, kind):
    queued = Queued(reconciler)
    await child_event(reconciler, "ADDED", child(reconciler, kind))
    await child_event(reconciler, "MODIFIED", child(reconciler, kind))
    assert queued.now == [] and queued.later == []
    await child_event(reconciler, "DELETED", child(reconciler, kind))
    await child_event(reconciler, "MODIFIED", child(reconciler, kind, digest="edited"))
    assert queued.now == [(KEY, False), (KEY, False)]


async def test_a_confirming_statefulset_event_refreshes_the_status_later_a_deleted_one_reconciles_now(reconciler):
    queued = Queued(reconciler)
    await child_event(reconciler, "MODIFIED", child(reconciler, "StatefulSet"))
    assert queued.now == [] and queued.later == [KEY]  # its rollout fields feed the status
    await child_event(reconciler, "DELETED", child(reconciler, "StatefulSet"))
    assert queued.now == [(KEY, False)]


async def test_child_events_before_the_owner_is_planned_queue_a_reconcile(reconciler):
    planned = child(reconciler, "Service")
    fresh = watching()
    queued = Queued(fresh)
    await child_event(fresh, "ADDED", planned)  # e.g. just restarted: nothing planned yet
    assert queued.now == [(KEY, False)]


async def test_the_echo_of_our_status_queues_nothing_an_edit_or_a_new_generation_does():
    api = RecordingKube()
    reconciler = watching(api)
    await reconciler.reconcile(body())
    queued = Queued(reconciler)

    async def event(b: kopf.Body) -> None:
        await handlers.epd_changed(
            memo=kopf.Memo(reconciler=reconciler), type="MODIFIED", namespace=KEY[0], name=KEY[1], body=b
        )

    echo = copy.deepcopy(dict(body()))
    echo["status"] = api.statuses[-1]
    await event(kopf.Body(echo))
    assert queued.now == []
    edited = copy.deepcopy(echo)
    edited["status"]["conditions"] = []
    await event(kopf.Body(edited))
    newer = copy.deepcopy(echo)
    newer["metadata"]["generation"] = 2
    await event(kopf.Body(newer))
    assert queued.now == [(KEY, False), (KEY, True)]


@pytest.mark.parametrize("kind", ["StatefulSet", "Service", "PodDisruptionBudget"])
async def test_the_child_indexes_say_whether_the_posts_update_entry_still_owns_fields(reconciler, kind):
    index = {
        "StatefulSet": handlers.stateful_sets,
        "Service": handlers.services,
        "PodDisruptionBudget": handlers.budgets,
    }[kind]

    async def indexed(operation: str) -> bool:
        obj = child(reconciler, kind)
        obj["metadata"]["managedFields"] = [{"manager": FIELD_MANAGER, "operation": operation, "fieldsV1": {}}]
        (entry,) = (
            await index(namespace=KEY[0], labels={LABEL_DEPLOYMENT: KEY[1]}, body=obj, meta=obj.metadata)
        ).values()
        return entry.owned_by_update

    assert await indexed("Update")  # created by POST: the next apply reads and takes it over first
    assert not await indexed("Apply")  # taken over: applied to without a read


async def test_the_liveness_probe_fails_while_reconcile_workers_are_gone():
    reconciler = watching()
    memo = kopf.Memo(reconciler=reconciler)
    assert handlers.workers_alive(memo=memo) == 0  # no event yet: no queue, nothing missing
    reconciler.enqueue_after(KEY, 3600)  # starts the queue
    try:
        assert handlers.workers_alive(memo=memo) == reconciler.settings.max_concurrent_reconciles
        # As if the workers had died for good.
        reconciler._queue._closing = True
        for worker in list(reconciler._queue._workers):
            worker.cancel()
        await asyncio.sleep(0)
        with pytest.raises(kopf.PermanentError, match="16 of 16 reconcile workers are gone"):
            handlers.workers_alive(memo=memo)
    finally:
        await reconciler.aclose()


async def test_the_api_server_sends_only_the_operators_own_children_and_pods() -> None:
    """kopf's handler label filters run after an object is decoded; the watch of each child kind
    and of pods asks the API server for the operator's own objects, the EPDDeployments for all."""
    settings = kopf.OperatorSettings()
    await handlers.configure(settings=settings)
    own = f"{LABEL_MANAGED_BY}={FIELD_MANAGER}"

    def selectors(group: str, version: str, plural: str) -> list[str]:
        return list(settings.watching.label_selectors.collect(kopf.Resource(group, version, plural)))

    for group, version, plural in [
        ("apps", "v1", "statefulsets"),
        ("", "v1", "services"),
        ("policy", "v1", "poddisruptionbudgets"),
        ("networking.k8s.io", "v1", "networkpolicies"),
        ("", "v1", "pods"),
    ]:
        assert selectors(group, version, plural) == [own], plural
    assert selectors("epd.vime.dev", "v1alpha1", "epddeployments") == []
    assert selectors("serving.knative.dev", "v1", "services") == []  # another group's "services"
