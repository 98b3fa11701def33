"""What one reconcile applies and deletes, given the indexes (no cluster: the API is recorded)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import kopf
import pytest
import yaml

import epd_operator.plans as plans_module
from epd_dev.paths import REPO
from epd_operator.children import WriteRefused
from epd_operator.indexes import (
    BudgetSummary,
    DeploymentSummary,
    Indexes,
    NetworkPolicySummary,
    PodSummary,
    ServiceSummary,
    StatefulSetSummary,
)
from epd_operator.kube import KubeError
from epd_operator.reconciler import Reconciler
from epd_operator.resources import FIELD_MANAGER
from epd_operator.settings import Settings

KEY = ("ns", "qwen-vl-regular")


class RecordingKube:
    """Records the calls in order, and keeps the children it holds with their managedFields as
    the API server writes them: a POST leaves an Update entry of the field manager."""

    def __init__(self) -> None:
        self.live: dict[tuple[str, str], dict] = {}
        self.calls: list[tuple[str, str, str]] = []
        self.statuses: list[dict] = []

    def written(self, verb: str) -> list[tuple[str, str]]:
        return [(kind, name) for v, kind, name in self.calls if v == verb]

    def _keep(self, obj: dict, operation: str) -> None:
        entry = {
            "manager": FIELD_MANAGER,
            "operation": operation,
            "apiVersion": obj["apiVersion"],
            "fieldsType": "FieldsV1",
            "fieldsV1": {"f:spec": {}},
        }
        self.live[obj["kind"], obj["metadata"]["name"]] = {
            **obj,
            "metadata": {**obj["metadata"], "resourceVersion": "1", "managedFields": [entry]},
        }

    async def create(self, obj):
        self.calls.append(("create", obj["kind"], obj["metadata"]["name"]))
        if (obj["kind"], obj["metadata"]["name"]) in self.live:
            return False  # 409 AlreadyExists
        self._keep(obj, "Update")
        return True

    async def get(self, kind, _namespace, name):
        self.calls.append(("get", kind, name))
        return self.live.get((kind, name))

    async def replace_managed_fields(self, kind, _namespace, name, resource_version, entries):
        assert resource_version == self.live[kind, name]["metadata"]["resourceVersion"]
        self.calls.append(("own", kind, name))
        self.live[kind, name]["metadata"]["managedFields"] = entries

    async def apply(self, obj):
        self.calls.append(("apply", obj["kind"], obj["metadata"]["name"]))
        live = self.live.get((obj["kind"], obj["metadata"]["name"]))
        # An apply over a child whose fields an Update entry still owns could not remove any.
        assert live is None or all(e["operation"] == "Apply" for e in live["metadata"]["managedFields"]), live
        self._keep(obj, "Apply")

    async def delete(self, kind, _namespace, name):
        self.calls.append(("delete", kind, name))
        self.live.pop((kind, name), None)

    async def patch_status(self, _namespace, _name, status):
        self.statuses.append(status)


@pytest.fixture
def api() -> RecordingKube:
    return RecordingKube()


@pytest.fixture
async def reconciler(api):
    # No spacing of count-only status writes (test_status_writer.py tests it): a reconcile that
    # follows within units x 5 ms would otherwise have its status change deferred.
    settings = Settings(janitor_image="epd-operator:test", janitor_scrape_interval=0, status_seconds_per_unit=0)
    reconciler = Reconciler(settings, kube=api)
    yield reconciler
    await reconciler.aclose()  # the work queue a reconcile may have started (a timer, below)


def body(generation: int = 1, max_model_len: int | None = None, **spec_changes) -> kopf.Body:
    manifest = yaml.safe_load((REPO / "docs" / "examples" / "encoder-regular.yaml").read_text())
    manifest["metadata"].update(namespace=KEY[0], uid="uid-1", generation=generation)
    if max_model_len:
        manifest["spec"]["models"][0]["serverGroups"][1]["overrides"] = {"max_model_len": max_model_len}
    manifest["spec"].update(spec_changes)
    return kopf.Body(manifest)


def watched(**indexes: dict) -> Indexes:
    """Indexes holding what is given, empty otherwise."""
    empty = {"deployments": {}, "stateful_sets": {}, "services": {}, "budgets": {}, "pods": {}, "network_policies": {}}
    return Indexes(**{**empty, **indexes})


SUMMARIES = {
    "StatefulSet": StatefulSetSummary,
    "Service": ServiceSummary,
    "PodDisruptionBudget": BudgetSummary,
    "NetworkPolicy": NetworkPolicySummary,
}


def indexes_after(children: list[dict], api: RecordingKube | None = None) -> Indexes:
    """The child indexes as the operator's watches would fill them: each child as `api` holds it
    (its managedFields as the API server wrote them), or without `api` as a POST left it."""

    def seen(child: dict) -> dict:
        if api is not None:
            child = api.live[child["kind"], child["metadata"]["name"]]
        else:
            update = {"manager": FIELD_MANAGER, "operation": "Update", "fieldsV1": {"f:spec": {}}}
            child = {**child, "metadata": {**child["metadata"], "managedFields": [update]}}
        if child["kind"] == "StatefulSet":  # rolled out
            replicas = child["spec"]["replicas"]
            child = {**child, "status": {"updatedReplicas": replicas, "currentRevision": "r", "updateRevision": "r"}}
        return child

    def of(kind: str) -> dict:
        return {KEY: [SUMMARIES[kind].of(seen(c)) for c in children if c["kind"] == kind]}

    return watched(
        stateful_sets=of("StatefulSet"),
        services=of("Service"),
        budgets=of("PodDisruptionBudget"),
        network_policies=of("NetworkPolicy"),
    )


async def converge(reconciler: Reconciler, b: kopf.Body, indexes: Indexes | None = None) -> None:
    indexes = indexes or watched()
    reconciler.watch(indexes)
    planned = reconciler.plans.plan(b)
    await reconciler.children.converge(
        KEY, b.metadata.uid, planned, lambda: reconciler.plans.desired(b, planned), indexes.children(KEY)
    )


def desired(reconciler: Reconciler, b: kopf.Body) -> list[dict]:
    return reconciler.plans.desired(b, reconciler.plans.plan(b))


async def created(reconciler: Reconciler, api: RecordingKube, b: kopf.Body) -> Indexes:
    """The children of `b` created by a first pass, and the indexes showing them (their watch
    events came); calls cleared."""
    await converge(reconciler, b)
    for child in CHILDREN:
        reconciler.expectations.observed(KEY, child)
    api.calls.clear()
    return indexes_after(desired(reconciler, b), api)


CHILDREN = [
    ("NetworkPolicy", "qwen-vl-regular"),
    ("PodDisruptionBudget", "qwen-vl-regular-default"),
    ("Service", "qwen-vl-regular-default"),
    ("Service", "qwen-vl-regular-default-units"),
    ("StatefulSet", "qwen-vl-regular-default"),
]


async def test_first_pass_creates_every_child_then_writes_nothing_while_they_match(api, reconciler):
    await converge(reconciler, body())
    assert sorted(api.calls) == [("create", *child) for child in CHILDREN]  # a POST each, nothing else
    indexes = indexes_after(desired(reconciler, body()))
    api.calls.clear()
    await converge(reconciler, body(), indexes)
    assert api.calls == []


async def test_a_deleted_child_and_only_it_is_created_again(api, reconciler):
    indexes = await created(reconciler, api, body())
    del api.live["StatefulSet", "qwen-vl-regular-default"]
    # The StatefulSet shares its name with the front Service: the Service alone must not hide its loss.
    await converge(reconciler, body(), dataclasses.replace(indexes, stateful_sets={KEY: []}))
    assert api.calls == [("create", "StatefulSet", "qwen-vl-regular-default")]


async def test_a_spec_change_takes_over_the_created_fields_then_applies_the_statefulset_only(api, reconciler):
    indexes = await created(reconciler, api, body())
    await converge(reconciler, body(generation=2, max_model_len=4096), indexes)
    sts = ("StatefulSet", "qwen-vl-regular-default")
    # Its Update entry becomes an Apply one first, or the apply could not remove a field.
    assert api.calls == [("get", *sts), ("own", *sts), ("apply", *sts)]
    api.calls.clear()
    indexes = indexes_after(desired(reconciler, body(generation=2, max_model_len=4096)), api)
    await converge(reconciler, body(generation=3, max_model_len=2048), indexes)
    assert api.calls == [("apply", *sts)]  # the index shows it owned by the apply: nothing to read


async def test_a_child_the_indexes_do_not_show_yet_is_applied_when_it_exists(api, reconciler):
    await created(reconciler, api, body())
    # A restarted operator whose indexes are not filled yet: each POST answers 409.
    restarted = Reconciler(Settings(janitor_image="epd-operator:test", janitor_scrape_interval=0), kube=api)
    await converge(restarted, body())
    for child in CHILDREN:
        assert [call for call in api.calls if call[1:] == child] == [
            ("create", *child),
            ("get", *child),
            ("own", *child),
            ("apply", *child),
        ]


async def test_a_child_created_is_not_created_again_until_its_watch_event_or_the_settle_time(api):
    reconciler = Reconciler(
        # Long enough that the reconciles before it ends take less, even on a loaded machine.
        Settings(janitor_image="epd-operator:test", janitor_scrape_interval=0, created_settle_seconds=2.0),
        kube=api,
    )
    try:
        await converge(reconciler, body())
        api.calls.clear()
        # A reconcile before any of their events came (a pod event, a status refresh): no second
        # POST, which for a Service would allocate and free a ClusterIP.
        await converge(reconciler, body())
        assert api.calls == []
        # The StatefulSet's events came and it is gone (deleted by someone): created again.
        reconciler.expectations.observed(KEY, ("StatefulSet", "qwen-vl-regular-default"))
        del api.live["StatefulSet", "qwen-vl-regular-default"]
        await converge(reconciler, body())
        assert api.calls == [("create", "StatefulSet", "qwen-vl-regular-default")]
        # No event of any within the settle time: they count as missing again, and a reconcile
        # was queued for then, which POSTs them (409: they exist) and takes them over.
        reconciler.watch(watched(deployments={KEY: [DeploymentSummary.of(body())]}))
        api.calls.clear()
        deadline = asyncio.get_running_loop().time() + 20
        while {call[1:] for call in api.calls if call[0] == "create"} != set(CHILDREN):
            assert asyncio.get_running_loop().time() < deadline, api.calls
            await asyncio.sleep(0.1)
    finally:
        await reconciler.aclose()


async def test_children_of_a_removed_model_are_deleted(api, reconciler):
    indexes = indexes_after(desired(reconciler, body()))
    old = {"name": "qwen-vl-regular-old", "spec_hash": "hash", "controller_uid": "uid-1"}
    indexes.stateful_sets[KEY].append(StatefulSetSummary(**old))
    indexes.services[KEY].append(ServiceSummary(**old))
    indexes.budgets[KEY].append(BudgetSummary(**old))
    await converge(reconciler, body(), indexes)
    assert sorted(api.calls) == [
        ("delete", "PodDisruptionBudget", "qwen-vl-regular-old"),
        ("delete", "Service", "qwen-vl-regular-old"),
        ("delete", "StatefulSet", "qwen-vl-regular-old"),
    ]


async def test_a_labelled_object_another_controls_is_neither_deleted_nor_written(api, reconciler):
    indexes = indexes_after(desired(reconciler, body()))
    # Someone else's objects carrying the operator's labels: one of a name no model asks for,
    # and one with the name of the front Service.
    theirs = {"spec_hash": "hash", "controller_uid": "someone-else"}
    indexes.services[KEY].append(ServiceSummary(name="qwen-vl-regular-old", **theirs))
    front = next(s for s in indexes.services[KEY] if s.name == "qwen-vl-regular-default")
    indexes.services[KEY].remove(front)
    indexes.services[KEY].append(ServiceSummary(name="qwen-vl-regular-default", **theirs))
    with pytest.raises(WriteRefused) as refused:
        await converge(reconciler, body(), indexes)
    assert refused.value.reason == "ChildConflict"
    assert str(refused.value).startswith(
        "Service ns/qwen-vl-regular-default exists and is not controlled by EPDDeployment qwen-vl-regular"
    )
    assert api.calls == []  # not applied, not deleted; nothing else needed writing


async def test_an_object_of_a_childs_name_that_another_controls_is_refused_not_taken_over(api, reconciler):
    await created(reconciler, api, body())
    front = ("Service", "qwen-vl-regular-default")
    api.live[front]["metadata"]["ownerReferences"] = [{"uid": "someone-else", "controller": True}]
    restarted = Reconciler(Settings(janitor_image="epd-operator:test", janitor_scrape_interval=0), kube=api)
    with pytest.raises(WriteRefused, match="Service ns/qwen-vl-regular-default exists and is not controlled"):
        await converge(restarted, body())  # not in the indexes: its POST answers 409, its GET tells
    assert [c for c in api.calls if c[1:] == front] == [("create", *front), ("get", *front)]


@pytest.mark.parametrize("headless", [True, False])
async def test_a_front_service_changing_headlessness_is_deleted_then_created(api, reconciler, headless):
    # Its clusterIP cannot change: an apply setting None is refused, one dropping it is ignored.
    indexes = await created(reconciler, api, body(service={"headless": not headless}))
    await converge(reconciler, body(generation=2, service={"headless": headless}), indexes)
    front = "qwen-vl-regular-default"
    assert api.calls == [("delete", "Service", front), ("create", "Service", front)]


async def test_a_front_service_still_going_after_the_delete_is_left_to_its_deleted_event(api, reconciler):
    indexes = await created(reconciler, api, body())
    front = ("Service", "qwen-vl-regular-default")
    api.delete = lambda kind, _namespace, name: (
        api.calls.append(("delete", kind, name)) or asyncio.sleep(0)
    )  # a finalizer holds it
    await converge(reconciler, body(generation=2, service={"headless": True}), indexes)
    # Applying to the old one would only patch a Service on its way out.
    assert api.calls == [("delete", *front), ("create", *front)]


async def test_a_front_service_changing_type_is_applied_in_place(api, reconciler):
    indexes = await created(reconciler, api, body())
    await converge(reconciler, body(generation=2, service={"type": "LoadBalancer"}), indexes)
    front = ("Service", "qwen-vl-regular-default")
    assert api.calls == [("get", *front), ("own", *front), ("apply", *front)]


async def test_the_events_tell_a_rollouts_story(api):
    events: list[tuple[str, str]] = []
    reconciler = Reconciler(
        Settings(janitor_image="epd-operator:test"),
        kube=api,
        warn=lambda _b, reason, message: events.append((reason, message)),
        inform=lambda _b, reason, message: events.append((reason, message)),
    )
    name = "qwen-vl-regular-default"

    def pod(revision: str, ready: bool) -> PodSummary:
        containers = [{"name": "regular-0", "ready": ready, "started": True}]
        return PodSummary.of(
            {
                "metadata": {"name": f"{name}-0", "labels": {"controller-revision-hash": revision}},
                "spec": {"nodeName": "n"},
                "status": {
                    "podIP": "10.0.0.1",
                    "conditions": [{"type": "Ready", "status": str(ready)}],
                    "initContainerStatuses": [{"name": "encoder-0", "ready": True, "started": True}],
                    "containerStatuses": containers,
                },
            }
        )

    async def write(b: kopf.Body, sets: list, pods: list) -> dict:
        await reconciler.status.write(
            KEY, b, reconciler.plans.plan(b), watched(stateful_sets={KEY: sets}, pods={KEY: pods})
        )
        return api.statuses[-1]

    def unit_set(updated: int, current: str, update: str) -> StatefulSetSummary:
        return StatefulSetSummary(
            name=name,
            spec_hash="h",
            created_replicas=1,
            updated_replicas=updated,
            current_revision=current,
            update_revision=update,
        )

    done = await write(body(), [unit_set(1, "r1", "r1")], [pod("r1", True)])
    assert events == []  # the first rollout of a new object is its creation, not news
    changed = kopf.Body({**body(generation=2, max_model_len=4096), "status": done})
    stalled = await write(changed, [unit_set(1, "r1", "r2")], [pod("r2", False)])
    assert [reason for reason, _ in events] == ["RolloutStarted", "RolloutStalled"]
    assert events[0][1] == "rolling out generation 2: 1/1 units updated"
    assert "unit qwen-vl-regular-default-0: EngineUnready" in events[1][1]
    events.clear()
    fixed = kopf.Body({**body(generation=3), "status": stalled})
    await write(fixed, [unit_set(1, "r3", "r3")], [pod("r3", True)])
    assert [reason for reason, _ in events] == ["RolloutComplete"]


# --------------------------------------------------------------------------- placement Pools


def pools_body(generation: int, placement: str) -> kopf.Body:
    b = body(generation)
    b["spec"]["models"][0]["placement"] = placement
    return b


async def test_switching_to_pools_adds_the_pool_and_back_deletes_it(api, reconciler):
    unit_indexes = await created(reconciler, api, body())
    await converge(reconciler, pools_body(2, "Pools"), unit_indexes)
    assert sorted(api.written("create")) == [
        ("PodDisruptionBudget", "qwen-vl-regular-default-encoders"),
        ("Service", "qwen-vl-regular-default-encoders"),
        ("StatefulSet", "qwen-vl-regular-default-encoders"),
    ]
    # The policy's serving ports follow the engines into their pool.
    both = [("NetworkPolicy", "qwen-vl-regular"), ("StatefulSet", "qwen-vl-regular-default")]
    assert sorted(api.written("apply")) == both
    assert api.written("delete") == []
    pool_indexes = indexes_after(desired(reconciler, pools_body(2, "Pools")))
    api.calls.clear()
    await converge(reconciler, pools_body(3, "Unit"), pool_indexes)
    assert sorted(api.written("apply")) == both and api.written("create") == []
    assert sorted(api.written("delete")) == [
        ("PodDisruptionBudget", "qwen-vl-regular-default-encoders"),
        ("Service", "qwen-vl-regular-default-encoders"),
        ("StatefulSet", "qwen-vl-regular-default-encoders"),
    ]


class GateRecordingKube(RecordingKube):
    def __init__(self) -> None:
        super().__init__()
        self.conditions: list[tuple[str, str, str]] = []

    async def patch_pod_condition(self, _namespace, name, condition):
        self.conditions.append((name, condition["type"], condition["status"]))


def summary(name: str, ready: bool, containers: list[str], *conditions: dict) -> PodSummary:
    """A running pod as the operator's index keeps it."""
    return PodSummary.of(
        {
            "metadata": {"name": name},
            "spec": {"nodeName": "n"},
            "status": {
                "phase": "Running",
                "podIP": "10.0.0.1",
                "conditions": [{"type": "Ready", "status": str(ready)}, *conditions],
                "containerStatuses": [
                    {"name": c, "ready": ready, "started": True, "image": "vllm"} for c in containers
                ],
            },
        }
    )


async def test_the_gate_is_patched_once_per_change_of_the_pool():
    api = GateRecordingKube()
    reconciler = Reconciler(Settings(janitor_image="epd-operator:test"), kube=api)
    b = pools_body(2, "Pools")
    pods = [
        summary("qwen-vl-regular-default-encoders-0", True, ["encoder-0"]),
        summary("qwen-vl-regular-default-0", False, ["regular-0"]),
    ]
    indexes = watched(pods={KEY: pods})
    await reconciler.status.open_gates(KEY, reconciler.plans.plan(b), indexes)
    assert api.conditions == [("qwen-vl-regular-default-0", "epd.vime.dev/encoders-ready", "True")]
    # The pod now carries that condition: nothing to write again.
    gate = {
        "type": "epd.vime.dev/encoders-ready",
        "status": "True",
        "reason": "EncodersReady",
        "message": "encoder pool qwen-vl-regular-default-encoders has a ready encoder",
    }
    pods[1] = summary("qwen-vl-regular-default-0", False, ["regular-0"], gate)
    await reconciler.status.open_gates(KEY, reconciler.plans.plan(b), indexes)
    assert len(api.conditions) == 1
    pods[0] = summary("qwen-vl-regular-default-encoders-0", False, ["encoder-0"])  # the pool's only encoder fails
    await reconciler.status.open_gates(KEY, reconciler.plans.plan(b), indexes)
    assert api.conditions[1:] == [("qwen-vl-regular-default-0", "epd.vime.dev/encoders-ready", "False")]


def test_a_pod_summary_keeps_what_status_reads_and_nothing_else():
    pod = {
        "metadata": {
            "name": "u-0",
            "labels": {"controller-revision-hash": "u-5d8f", "app": "x"},
            "managedFields": [{"manager": "kubelet"}],
        },
        "spec": {"nodeName": "node-1", "containers": [{"name": "regular-0", "args": ["--port", "8101"]}]},
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.7",
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-30T10:00:00Z"}],
            "containerStatuses": [
                {"name": "regular-0", "ready": True, "started": True, "image": "vllm", "state": {"running": {}}}
            ],
        },
    }

    kept = PodSummary.of(pod)

    assert kept.name == "u-0"
    assert kept.tree() == {
        "name": "u-0",
        "metadata": {"deletionTimestamp": None, "labels": {"controller-revision-hash": "u-5d8f"}},
        "spec": {"nodeName": "node-1"},
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.7",
            "conditions": [{"type": "Ready", "status": "True"}],
            "initContainerStatuses": [],
            "containerStatuses": [{"name": "regular-0", "ready": True, "started": True}],
        },
    }
    kept.tree()["status"]["phase"] = "Failed"  # a reader's copy: the index is not changed
    assert kept.tree()["status"]["phase"] == "Running"


def test_the_deployments_index_keeps_what_a_reconcile_reads_and_gives_it_back_whole():
    full = dict(body())
    full["metadata"] = {
        **full["metadata"],
        "managedFields": [{"manager": "kubectl"}],
        "resourceVersion": "7",
        "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{...}"},
    }
    full["status"] = {"observedGeneration": 1, "conditions": [{"type": "Ready", "status": "False"}]}

    indexed = DeploymentSummary.of(full)

    assert indexed.metadata["uid"] == "uid-1" and indexed.metadata.get("generation") == 1
    assert indexed.status() == full["status"]
    rebuilt = indexed.document()
    assert rebuilt["spec"] == full["spec"] and rebuilt["status"] == full["status"]
    assert set(rebuilt["metadata"]) == {
        "name",
        "namespace",
        "uid",
        "generation",
    }  # no managedFields, no last-applied copy
    assert (rebuilt["apiVersion"], rebuilt["kind"]) == (full["apiVersion"], full["kind"])
    assert indexed.document() is not rebuilt  # each reconcile decodes its own copy: none can alter the index


async def test_the_stage_metrics_time_what_a_reconcile_wrote_and_skip_what_it_did_not(api, reconciler):
    def count(stage: str) -> float:
        return (
            reconciler.metrics.registry.get_sample_value("epd_reconcile_stage_duration_seconds_count", {"stage": stage})
            or 0
        )

    children = indexes_after(desired(reconciler, body()))
    reconciler.watch(watched())
    await reconciler.reconcile(body())
    assert (count("plan"), count("children"), count("status")) == (1, 1, 1)

    # The children in place: the status changes (their StatefulSet is seen), nothing is applied.
    reconciler.watch(children)
    await reconciler.reconcile(kopf.Body({**body(), "status": api.statuses[-1]}))
    assert (count("plan"), count("children"), count("status")) == (2, 1, 2)
    # Nothing changed since: planned again, neither stage timed.
    await reconciler.reconcile(kopf.Body({**body(), "status": api.statuses[-1]}))
    assert (count("plan"), count("children"), count("status")) == (3, 1, 2)
    assert len(api.statuses) == 2


class RefusingKube(RecordingKube):
    """Refuses to create the front Service, as a quota or an admission webhook would, while `refusing`."""

    REFUSAL = 'services "qwen-vl-regular-default" is forbidden: exceeded quota: q, requested: services=1'

    def __init__(self) -> None:
        super().__init__()
        self.refusing = True

    async def create(self, obj):
        if self.refusing and obj["kind"] == "Service" and not obj["metadata"]["name"].endswith("-units"):
            self.calls.append(("refused", obj["kind"], obj["metadata"]["name"]))
            raise KubeError("POST", "/api/v1/namespaces/ns/services", 403, json.dumps({"message": self.REFUSAL}))
        return await super().create(obj)


def degraded(status: dict) -> dict:
    return next(c for c in status["conditions"] if c["type"] == "Degraded")


async def test_a_refused_child_is_said_in_the_status_once_retried_and_cleared_when_it_goes():
    api = RefusingKube()
    warnings: list[str] = []
    reconciler = Reconciler(
        Settings(janitor_image="epd-operator:test", janitor_scrape_interval=0),
        kube=api,
        warn=lambda _body, reason, _message: warnings.append(reason),
    )
    try:
        reconciler.watch(watched())
        with pytest.raises(WriteRefused, match="exceeded quota"):  # raised on: the work queue retries it
            await reconciler.reconcile(body())
        assert warnings == ["ApplyFailed"]
        # The status went out with the children, then again once the refusal was known.
        first, status = api.statuses
        assert degraded(first)["reason"] != "ApplyFailed"
        assert status["observedGeneration"] == 1 and status["phase"] == "Degraded"
        condition = degraded(status)
        assert (condition["status"], condition["reason"]) == ("True", "ApplyFailed")
        assert (
            "POST /api/v1/namespaces/ns/services: 403" in condition["message"] and api.REFUSAL in condition["message"]
        )
        assert ("create", "StatefulSet", "qwen-vl-regular-default") in api.calls  # the others were written

        # Retried while the refusal lasts: the same status, so no further write, nor Event.
        with pytest.raises(WriteRefused):
            await reconciler.reconcile(kopf.Body({**body(), "status": status}))
        assert len(api.statuses) == 2 and warnings == ["ApplyFailed"]

        api.refusing = False
        await reconciler.reconcile(kopf.Body({**body(), "status": status}))
        assert degraded(api.statuses[-1])["reason"] != "ApplyFailed"
        assert api.statuses[-1]["phase"] != "Degraded"
        assert ("Service", "qwen-vl-regular-default") in api.live
    finally:
        await reconciler.aclose()  # the work queue the retries queued (the expectations' timer)


def test_a_cached_generation_is_not_validated_again_and_renders_the_same_plans(reconciler, monkeypatch):
    first = reconciler.plans.plan(body())
    calls = []
    real = plans_module.validate
    monkeypatch.setattr(plans_module, "validate", lambda raw, **kw: calls.append(raw) or real(raw, **kw))

    again = reconciler.plans.plan(body())

    assert calls == []  # the cache held the checked spec
    assert (again.spec, again.plans, again.digests) == (first.spec, first.plans, first.digests)
    assert again.plans is not first.plans  # rendered anew: the cache keeps no rendered plans
    reconciler.plans.plan(body(generation=2))  # a new generation is validated
    assert len(calls) == 1
