"""Unit readiness and conditions from observed pods: pure, checked without a cluster."""

import json
from pathlib import Path

import yaml

from epd_operator import api
from epd_operator import status as status_module
from epd_operator.indexes import PodSummary, StatefulSetSummary
from epd_operator.render import render
from epd_operator.status import (
    Observations,
    ObservedPod,
    compute_status,
    encoder_gates,
    invalid_status,
    observe_unit,
    unit_readiness_events,
)
from epd_operator.validation import validate

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
NOW = "2026-11-29T12:00:00Z"


def setup(replicas=1, **spec_changes):
    manifest = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())
    manifest["spec"]["replicas"] = replicas
    manifest["spec"].update(spec_changes)
    checked = validate(manifest["spec"])
    return checked.spec, render(checked, namespace="ns", name="d", uid="u")


def unit_set(replicas=1, *, updated=None, current="rev-1", update="rev-1"):
    """The unit StatefulSet's summary: rolled out unless told otherwise."""
    return {
        "d-default": StatefulSetSummary(
            name="d-default",
            spec_hash="hash",
            replicas=replicas,
            updated_replicas=replicas if updated is None else updated,
            current_revision=current,
            update_revision=update,
        )
    }


def rolling(replicas, updated):
    return unit_set(replicas, updated=updated, current="rev-1", update="rev-2")


def pod(
    name,
    *,
    encoder_ready=True,
    encoder_started=True,
    consumer_ready=True,
    consumer_started=None,
    ready=None,
    ip="10.0.0.5",
    revision="rev-1",
):
    ready = encoder_ready and consumer_ready if ready is None else ready
    consumer_started = consumer_ready if consumer_started is None else consumer_started
    return {
        "name": name,
        "metadata": {"labels": {"controller-revision-hash": revision}},
        "spec": {"nodeName": "node-a"},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": str(ready)}],
            "initContainerStatuses": [{"name": "encoder-0", "ready": encoder_ready, "started": encoder_started}],
            "containerStatuses": [
                {"name": "regular-0", "ready": consumer_ready, "started": consumer_started},
                {"name": "proxy", "ready": True, "started": True},
            ],
        },
    }


def summaries(pods):
    """Pods in the test's shape (name, metadata, spec, status) as the operator's index keeps them."""
    return {p["name"]: PodSummary.of({**p, "metadata": {**p["metadata"], "name": p["name"]}}) for p in pods}


def status_of(pods, replicas=1, sets=None, previous=None):
    spec, plans = setup(replicas)
    return compute_status(
        deployment="d",
        spec=spec,
        plans=plans,
        pods=summaries(pods),
        stateful_sets=unit_set(replicas) if sets is None else sets,
        generation=3,
        previous=previous,
        now=NOW,
    )


def conditions(status):
    return {c["type"]: c for c in status["conditions"]}


def test_all_units_ready():
    status = status_of([pod("d-default-0")])
    assert status["phase"] == "Ready" and status["ready"] == "1/1" and status["observedGeneration"] == 3
    assert {k: c["status"] for k, c in conditions(status).items()} == {
        "Validated": "True",
        "EncodersReady": "True",
        "Ready": "True",
        "Progressing": "False",
        "Degraded": "False",
        "ECBudgetSufficient": "True",
    }
    (model,) = status["models"]
    assert (model["desiredUnits"], model["readyUnits"], model["unready"], model["unreadyReasons"]) == (1, 1, [], {})
    # What every unit holds; where each one is, the units Service's EndpointSlices say.
    assert (model["statefulSet"], model["unitsService"]) == ("d-default", "d-default-units")
    assert model["engines"] == [
        {"name": "encoder-0", "role": "encoder", "port": 8100},
        {"name": "regular-0", "role": "regular", "port": 8101},
    ]
    assert model["entryPort"] == 8000 and "routerPort" not in model  # the proxy, in front of the only consumer


def test_consumer_never_ready_while_its_encoder_is_not_even_if_the_pod_says_so():
    status = status_of([pod("d-default-0", encoder_ready=False, ready=True)])
    (unit,) = status["models"][0]["unready"]
    assert unit == {
        "name": "d-default-0",
        "node": "node-a",
        "reason": "EncoderUnready",
        "message": "encoder encoder-0 not ready: consumers get no traffic",
    }
    c = conditions(status)
    assert c["Ready"]["status"] == "False" and c["EncodersReady"]["status"] == "False"
    assert c["Degraded"]["reason"] == "EncoderUnready" and "unit d-default-0" in c["Degraded"]["message"]


def test_loading_encoder_is_progress_not_degradation():
    status = status_of([pod("d-default-0", encoder_ready=False, encoder_started=False, consumer_ready=False)])
    c = conditions(status)
    assert status["phase"] == "Progressing"
    assert c["Progressing"]["status"] == "True" and c["Degraded"]["status"] == "False"


def test_missing_pods_are_pending_units():
    status = status_of([], replicas=2, sets={})
    assert status["phase"] == "Pending" and status["ready"] == "0/2"
    assert [u["reason"] for u in status["models"][0]["unready"]] == ["PodMissing", "PodMissing"]
    assert status["models"][0]["unreadyReasons"] == {"PodMissing": 2}


def test_a_pod_its_statefulset_cannot_create_is_degraded_with_the_reason():
    spec, plans = setup(1)
    refusal = 'pods "d-default-0" is forbidden: violates PodSecurity "restricted:latest": runAsNonRoot != true'
    status = compute_status(
        deployment="d",
        spec=spec,
        plans=plans,
        pods={},
        stateful_sets=unit_set(1),
        generation=3,
        previous=None,
        now=NOW,
        create_failures={"d-default": refusal},
    )
    (unit,) = status["models"][0]["unready"]
    assert unit["reason"] == "FailedCreate" and refusal in unit["message"]
    degraded = conditions(status)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "FailedCreate") and refusal in degraded["message"]
    assert status["phase"] == "Degraded"


def test_unschedulable_unit_is_degraded_with_the_scheduler_message():
    p = pod("d-default-0", ready=False)
    p["spec"] = {}  # no node
    p["status"] = {
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
            }
        ]
    }
    status = status_of([p])
    c = conditions(status)
    assert c["Degraded"]["reason"] == "Unschedulable" and "Insufficient nvidia.com/gpu" in c["Degraded"]["message"]


def test_a_bound_ready_pod_is_a_ready_unit_despite_a_stale_scheduler_error():
    """Seen in `make chaos` (seed 284893179): the scheduler's bind went through during an API
    server restart, yet it recorded PodScheduled False (SchedulerError, pods/binding forbidden)
    on the pod, which then ran and became Ready on its node; nothing rewrites that condition."""
    p = pod("d-default-0")
    p["status"]["conditions"][0] = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "SchedulerError",
        "message": 'pods "d-default-0" is forbidden: cannot create pods/binding',
    }
    status = status_of([p])
    assert status["models"][0]["readyUnits"] == 1 and conditions(status)["Ready"]["status"] == "True"


def test_transition_time_is_kept_while_a_condition_holds():
    first = status_of([pod("d-default-0")])
    later = compute_status(
        deployment="d",
        spec=setup()[0],
        plans=setup()[1],
        pods=summaries([pod("d-default-0")]),
        stateful_sets=unit_set(),
        generation=3,
        previous=first,
        now="2026-11-29T13:00:00Z",
    )
    assert conditions(later)["Ready"]["lastTransitionTime"] == NOW
    flipped = compute_status(
        deployment="d",
        spec=setup()[0],
        plans=setup()[1],
        pods=summaries([pod("d-default-0", consumer_ready=False)]),
        stateful_sets=unit_set(),
        generation=3,
        previous=first,
        now="2026-11-29T13:00:00Z",
    )
    assert conditions(flipped)["Ready"]["lastTransitionTime"] == "2026-11-29T13:00:00Z"


def test_too_small_ec_budget_is_a_warning_condition():
    spec, plans = setup(shm={"sizeLimit": "1Gi"})
    status = compute_status(
        deployment="d",
        spec=spec,
        plans=plans,
        pods=summaries([pod("d-default-0")]),
        stateful_sets=unit_set(),
        generation=3,
        previous=None,
        now=NOW,
    )
    budget = conditions(status)["ECBudgetSufficient"]
    assert budget["status"] == "False" and budget["reason"] == "BudgetTooSmall"
    assert "model default: EC budget" in budget["message"] and "Raise shm.sizeLimit" in budget["message"]
    assert status["models"][0]["ecStorageMaxBytes"] == int(0.8 * 2**30)
    assert status["phase"] == "Ready"  # a warning, not an outage


def test_scraped_ec_evictions_are_summed_per_model():
    spec, plans = setup(replicas=2)
    pods = summaries([pod("d-default-0"), pod("d-default-1")])

    def status(evictions, previous=None):
        return compute_status(
            deployment="d",
            spec=spec,
            plans=plans,
            pods=pods,
            stateful_sets=unit_set(),
            generation=3,
            previous=previous,
            now=NOW,
            evictions=evictions,
        )

    scraped = status({"d-default-0": 12})
    assert scraped["models"][0]["ecEvictions"] == 12  # the units scraped so far
    assert "ecEvictions" not in status({})["models"][0]  # none scraped: no note rather than a made-up 0
    # A restarted operator that has scraped none of them yet keeps what the status said.
    assert status({}, previous=scraped)["models"][0]["ecEvictions"] == 12


def test_scale_subresource_fields():
    status = status_of([pod("d-default-0"), pod("d-default-1")], replicas=3, sets=unit_set(3))
    assert status["replicas"] == 2  # units that exist: the third pod is not there yet
    assert status["selector"] == "epd.vime.dev/deployment=d,app.kubernetes.io/component=unit"
    assert status["updated"] == "3/3" and status["models"][0]["updatedUnits"] == 3


def test_a_rollout_reports_updated_units():
    pods = [pod("d-default-0"), pod("d-default-1"), pod("d-default-2", revision="rev-2")]
    status = status_of(pods, replicas=3, sets=rolling(3, updated=1))
    c = conditions(status)
    assert c["Progressing"]["status"] == "True" and c["Progressing"]["reason"] == "RollingOut"
    assert c["Progressing"]["message"] == "1/3 units updated"
    assert status["updated"] == "1/3" and c["Degraded"]["status"] == "False"


def test_a_new_revision_that_never_becomes_ready_stalls_the_rollout_as_degraded():
    broken = pod("d-default-2", revision="rev-2", consumer_ready=False, consumer_started=True)
    status = status_of([pod("d-default-0"), pod("d-default-1"), broken], replicas=3, sets=rolling(3, updated=1))
    c = conditions(status)
    assert c["Degraded"]["status"] == "True" and c["Degraded"]["reason"] == "RolloutStalled"
    assert c["Degraded"]["message"].startswith("rollout stopped at 1/3 units updated: unit d-default-2: EngineUnready")
    assert status["phase"] == "Degraded" and c["Progressing"]["reason"] == "RollingOut"


def test_updated_units_count_the_pods_when_the_stateful_sets_status_lags_behind_them():
    # The first pod of the new revision is seen before the StatefulSet controller counts it.
    broken = pod("d-default-2", revision="rev-2", consumer_ready=False, consumer_started=True)
    status = status_of([pod("d-default-0"), pod("d-default-1"), broken], replicas=3, sets=rolling(3, updated=0))
    assert conditions(status)["Degraded"]["message"].startswith("rollout stopped at 1/3 units updated")
    assert status["updated"] == "1/3" and status["models"][0]["updatedUnits"] == 1


def test_an_old_unit_unready_during_a_rollout_is_not_the_rollouts_fault():
    old = pod("d-default-0", consumer_ready=False, consumer_started=True)
    status = status_of([old, pod("d-default-1", revision="rev-2")], replicas=2, sets=rolling(2, updated=1))
    assert conditions(status)["Degraded"]["reason"] == "EngineUnready"


# --------------------------------------------------------------------------- placement Pools

GATE = "epd.vime.dev/encoders-ready"


def pools_setup(replicas=2, encoder_replicas=2):
    manifest = yaml.safe_load((EXAMPLES / "encoder-pools.yaml").read_text())
    manifest["spec"]["replicas"] = replicas
    manifest["spec"]["models"][0]["encoderReplicas"] = encoder_replicas
    checked = validate(manifest["spec"])
    return checked.spec, render(checked, namespace="ns", name="d", uid="u")


def pool_pod(name, *, ready=True, started=True, ip="10.0.1.1"):
    return {
        "name": name,
        "metadata": {},
        "spec": {"nodeName": "node-e"},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": str(ready)}],
            "containerStatuses": [{"name": "encoder-0", "ready": ready, "started": started}],
        },
    }


def unit_pod(name, *, gate=None, ready=True, ip="10.0.2.1"):
    conditions = [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": str(ready)}]
    if gate is not None:
        conditions.append({"type": GATE, **gate})
    return {
        "name": name,
        "metadata": {},
        "spec": {"nodeName": "node-u"},
        "status": {
            "podIP": ip,
            "conditions": conditions,
            "containerStatuses": [
                {"name": "regular-0", "ready": True, "started": True},
                {"name": "proxy", "ready": True, "started": True},
            ],
        },
    }


def pools_status(pods):
    spec, plans = pools_setup()
    sets = {
        **unit_set(2),
        "d-default-encoders": StatefulSetSummary(
            name="d-default-encoders",
            spec_hash="h",
            replicas=2,
            updated_replicas=2,
            current_revision="e",
            update_revision="e",
        ),
    }
    return compute_status(
        deployment="d",
        spec=spec,
        plans=plans,
        pods=summaries(pods),
        stateful_sets=sets,
        generation=3,
        previous=None,
        now=NOW,
    )


def test_pools_status_says_what_the_pool_and_the_units_hold_and_which_pods_are_not_ready():
    status = pools_status(
        [
            pool_pod("d-default-encoders-0"),
            pool_pod("d-default-encoders-1", ready=False),
            unit_pod("d-default-0"),
            unit_pod("d-default-1", ip="10.0.2.2"),
        ]
    )
    (model,) = status["models"]
    assert model["placement"] == "Pools" and "ecStoragePath" not in model
    pool = model["encoderPool"]
    assert (pool["name"], pool["service"], pool["replicas"], pool["readyPods"]) == (
        "d-default-encoders",
        "d-default-encoders",
        2,
        1,
    )
    assert pool["engines"] == [{"name": "encoder-0", "role": "encoder", "port": 8100}]
    assert pool["unready"] == [
        {
            "name": "d-default-encoders-1",
            "node": "node-e",
            "reason": "EncoderUnready",
            "message": "encoder encoder-0 not ready",
        }
    ]
    assert pool["unreadyReasons"] == {"EncoderUnready": 1}
    # Units hold the consumers only.
    assert model["readyUnits"] == 2 and status["ready"] == "2/2"
    assert model["engines"] == [{"name": "regular-0", "role": "regular", "port": 8100}]
    c = conditions(status)
    # One encoder down: the units still serve, but the deployment is not fully Ready.
    assert c["EncodersReady"]["status"] == "False" and c["EncodersReady"]["reason"] == "EncoderUnready"
    assert "encoder pod d-default-encoders-1: EncoderUnready" in c["EncodersReady"]["message"]
    assert c["Ready"]["status"] == "False" and c["Degraded"]["status"] == "True"


def test_a_pool_without_a_ready_encoder_takes_every_unit_out_and_is_named():
    status = pools_status(
        [
            pool_pod("d-default-encoders-0", ready=False),
            pool_pod("d-default-encoders-1", ready=False),
            unit_pod("d-default-0", ready=False),
            unit_pod("d-default-1", ready=False),
        ]
    )
    c = conditions(status)
    assert c["EncodersReady"]["status"] == "False" and c["EncodersReady"]["reason"] == "NoReadyEncoder"
    assert c["EncodersReady"]["message"].startswith(
        "encoder pool d-default-encoders of model default has no ready encoder"
    )
    (model,) = status["models"]
    assert [u["reason"] for u in model["unready"]] == ["NoReadyEncoder"] * 2
    assert "encoder pool d-default-encoders has no ready encoder" in model["unready"][0]["message"]
    assert model["encoderPool"]["readyPods"] == 0 and status["phase"] == "Degraded"


def test_a_unit_is_not_ready_while_its_pool_has_no_ready_encoder_even_if_its_pod_says_so():
    status = pools_status([unit_pod("d-default-0"), unit_pod("d-default-1")])  # pool pods not created yet
    assert status["models"][0]["readyUnits"] == 0
    # The pool is starting: that is progress, not damage.
    assert status["phase"] == "Progressing" and conditions(status)["Degraded"]["status"] == "False"


def test_every_encoder_ready_makes_everything_ready():
    status = pools_status(
        [
            pool_pod("d-default-encoders-0"),
            pool_pod("d-default-encoders-1", ip="10.0.1.2"),
            unit_pod("d-default-0"),
            unit_pod("d-default-1"),
        ]
    )
    assert status["phase"] == "Ready"
    assert conditions(status)["EncodersReady"]["reason"] == "EncodersReady"
    assert status["models"][0]["encoderPool"]["readyPods"] == 2


def gates(pods):
    spec, plans = pools_setup()
    return encoder_gates("d", spec, plans, summaries(pods), {}, NOW)


def test_the_gate_opens_while_one_encoder_is_ready_and_closes_when_none_is():
    units = [unit_pod("d-default-0"), unit_pod("d-default-1")]
    opened = gates([pool_pod("d-default-encoders-0", ready=False), pool_pod("d-default-encoders-1"), *units])
    assert opened == {
        name: {
            "type": GATE,
            "status": "True",
            "reason": "EncodersReady",
            "message": "encoder pool d-default-encoders has a ready encoder",
            "lastTransitionTime": NOW,
        }
        for name in ("d-default-0", "d-default-1")
    }
    closed = gates([pool_pod("d-default-encoders-0", ready=False), *units])
    assert {n: (g["status"], g["reason"]) for n, g in closed.items()} == {
        "d-default-0": ("False", "NoReadyEncoder"),
        "d-default-1": ("False", "NoReadyEncoder"),
    }
    assert closed["d-default-0"]["message"] == "encoder pool d-default-encoders has no ready encoder"


def test_only_pods_whose_gate_differs_are_patched():
    current = {
        k: v
        for k, v in gates([pool_pod("d-default-encoders-0"), unit_pod("d-default-0")])["d-default-0"].items()
        if k != "lastTransitionTime"
    }
    pods = [
        pool_pod("d-default-encoders-0"),
        unit_pod("d-default-0", gate=current),
        unit_pod("d-default-1"),
        {**unit_pod("d-default-2"), "metadata": {"deletionTimestamp": "x"}},
    ]
    assert list(gates(pods)) == ["d-default-1"]  # -0 already says so, -2 is beyond replicas (and terminating)


def test_unit_models_have_no_gates():
    spec, plans = setup()
    assert encoder_gates("d", spec, plans, summaries([pod("d-default-0")]), {}, NOW) == {}


def test_scraped_fallback_encodes_show_per_model_and_in_all():
    spec, plans = setup(replicas=3)
    pods = summaries([pod("d-default-0"), pod("d-default-1"), pod("d-default-2")])
    status = compute_status(
        deployment="d",
        spec=spec,
        plans=plans,
        pods=pods,
        stateful_sets=unit_set(2),
        generation=3,
        previous=None,
        now=NOW,
        fallback_encodes={"d-default-0": 2, "d-default-1": 0},
    )
    (model,) = status["models"]
    assert model["fallbackEncodes"] == 2 and status["fallbackEncodes"] == 2

    nothing_scraped = compute_status(
        deployment="d",
        spec=spec,
        plans=plans,
        pods=pods,
        stateful_sets=unit_set(2),
        generation=3,
        previous=None,
        now=NOW,
    )
    assert "fallbackEncodes" not in nothing_scraped and "fallbackEncodes" not in nothing_scraped["models"][0]


def test_a_unit_whose_proxy_is_not_ready_is_not_ready_and_says_so():
    unit = pod("d-default-0")
    unit["status"]["containerStatuses"][1] = {"name": "proxy", "ready": False, "started": True}
    status = status_of([unit])
    (entry,) = status["models"][0]["unready"]
    assert (entry["reason"], entry["message"]) == ("EngineUnready", "proxy not ready")
    assert status["models"][0]["entryPort"] == 8000 and "routerPort" not in status["models"][0]


def test_thousands_of_units_keep_the_status_small_and_name_the_broken_ones_first():
    """etcd refuses objects over 1.5 MiB: units are counted, and a few are listed by name."""
    replicas = 5000
    pods = [pod(f"d-default-{i}", consumer_ready=False, consumer_started=False) for i in range(replicas)]
    pods[4321] = pod("d-default-4321", consumer_ready=False, consumer_started=True)  # broken, not loading
    status = status_of(pods, replicas=replicas, sets=unit_set(replicas))
    assert len(json.dumps(status)) < 16 * 1024
    (model,) = status["models"]
    assert model["unreadyReasons"] == {"EngineStarting": replicas - 1, "EngineUnready": 1}
    listed = [u["name"] for u in model["unready"]]
    assert len(listed) == api.LISTED_PODS and listed[:2] == ["d-default-4321", "d-default-0"]
    ready = conditions(status)["Ready"]["message"]
    assert ready.startswith("0/5000 units ready: unit d-default-0: EngineStarting") and ready.endswith(
        f"; and {replicas - api.LISTED_PODS} more"
    )


def test_a_pod_observed_again_unchanged_is_not_observed_anew(monkeypatch):
    spec, plans = setup(replicas=2)
    observations = Observations()
    observed = []
    monkeypatch.setattr(status_module, "observe_unit", lambda *a, **k: observed.append(a[1]) or observe_unit(*a, **k))
    pods = summaries([pod("d-default-0"), pod("d-default-1", consumer_ready=False)])

    def status(pods):
        return compute_status(
            deployment="d",
            spec=spec,
            plans=plans,
            pods=pods,
            stateful_sets=unit_set(2),
            generation=3,
            previous=None,
            now=NOW,
            observations=observations,
        )

    first = status(pods)
    assert status(pods) == first and observed == ["d-default-0", "d-default-1"]  # observed once each
    assert status({**pods, **summaries([pod("d-default-1")])})["ready"] == "2/2"
    assert observed[2:] == ["d-default-1"]  # only the pod that changed
    assert status(summaries([pod("d-default-0")]))["models"][0]["unreadyReasons"] == {"PodMissing": 1}


def test_a_status_of_an_older_operator_does_not_stop_an_invalid_spec_being_reported():
    old = {"models": [{"name": "default", "servedModelName": "m", "units": [{"name": "d-default-0"}]}]}
    status = invalid_status(["bad"], 4, old, NOW)
    assert status["phase"] == "Invalid" and status["models"] == []


def _units(**ready: bool) -> dict[str, ObservedPod]:
    return {
        n: ObservedPod(
            n, "default", True, r, False, True, "Ready" if r else "EngineUnready", "" if r else "regular-0 not ready"
        )
        for n, r in ready.items()
    }


def test_a_unit_that_stops_being_ready_is_a_warning_and_ready_again_a_normal_event():
    # Its first readiness is no event: every unit starts unready.
    events, fallen = unit_readiness_events(_units(u0=False), _units(u0=True), False, frozenset())
    assert (events, fallen) == ([], frozenset())
    events, fallen = unit_readiness_events(_units(u0=True, u1=True), _units(u0=False, u1=True), False, fallen)
    assert events == [(True, "UnitUnready", "unit u0: EngineUnready: regular-0 not ready")]
    assert fallen == {"u0"}
    # Still down (restarting, then starting): nothing more to say.
    events, fallen = unit_readiness_events(_units(u0=False, u1=True), _units(u0=False, u1=True), False, fallen)
    assert (events, fallen) == ([], {"u0"})
    events, fallen = unit_readiness_events(_units(u0=False, u1=True), _units(u0=True, u1=True), False, fallen)
    assert (events, fallen) == ([(False, "UnitReady", "unit u0 is ready again")], frozenset())


def test_a_fallen_unit_scaled_away_is_forgotten():
    _, fallen = unit_readiness_events(_units(u0=True, u1=True), _units(u0=True, u1=False), False, frozenset())
    events, fallen = unit_readiness_events(_units(u0=True, u1=False), _units(u0=True), False, fallen)
    assert (events, fallen) == ([], frozenset())


def test_a_unit_a_rollout_takes_down_is_the_rollouts_story_not_an_event():
    events, fallen = unit_readiness_events(_units(u0=True), _units(u0=False), True, frozenset())
    assert (events, fallen) == ([], frozenset())
