"""Unit readiness and conditions from observed pods: pure, checked without a cluster."""

from pathlib import Path

import yaml

from epd_operator.render import render
from epd_operator.status import compute_status
from epd_operator.validation import validate

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
NOW = "2026-11-29T12:00:00Z"


def setup(replicas=1, **spec_changes):
    manifest = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())
    manifest["spec"]["replicas"] = replicas
    manifest["spec"].update(spec_changes)
    checked = validate(manifest["spec"])
    return checked.spec, render(checked, namespace="ns", name="d", uid="u")


def pod(name, *, encoder_ready=True, encoder_started=True, consumer_ready=True, ready=None, ip="10.0.0.5"):
    ready = encoder_ready and consumer_ready if ready is None else ready
    return {
        "name": name,
        "metadata": {},
        "spec": {"nodeName": "node-a"},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": str(ready)}],
            "initContainerStatuses": [{"name": "encoder-0", "ready": encoder_ready, "started": encoder_started}],
            "containerStatuses": [{"name": "regular-0", "ready": consumer_ready, "started": consumer_ready}],
        },
    }


def status_of(pods, replicas=1, rolled_out=True, previous=None):
    spec, plans = setup(replicas)
    return compute_status(deployment="d", spec=spec, plans=plans, pods={p["name"]: p for p in pods},
                          rolled_out=rolled_out, generation=3, previous=previous, now=NOW)


def conditions(status):
    return {c["type"]: c for c in status["conditions"]}


def test_all_units_ready():
    status = status_of([pod("d-default-0")])
    assert status["phase"] == "Ready" and status["ready"] == "1/1" and status["observedGeneration"] == 3
    assert {k: c["status"] for k, c in conditions(status).items()} == {
        "Validated": "True", "EncodersReady": "True", "Ready": "True", "Progressing": "False", "Degraded": "False",
        "ECBudgetSufficient": "True"}
    unit = status["models"][0]["units"][0]
    assert unit["encoderUrls"] == ["http://10.0.0.5:8100"] and unit["consumerUrls"] == ["http://10.0.0.5:8101"]


def test_consumer_never_ready_while_its_encoder_is_not_even_if_the_pod_says_so():
    status = status_of([pod("d-default-0", encoder_ready=False, ready=True)])
    unit = status["models"][0]["units"][0]
    assert unit["ready"] is False and unit["reason"] == "EncoderUnready"
    c = conditions(status)
    assert c["Ready"]["status"] == "False" and c["EncodersReady"]["status"] == "False"
    assert c["Degraded"]["reason"] == "EncoderUnready" and "unit d-default-0" in c["Degraded"]["message"]


def test_loading_encoder_is_progress_not_degradation():
    status = status_of([pod("d-default-0", encoder_ready=False, encoder_started=False, consumer_ready=False)])
    c = conditions(status)
    assert status["phase"] == "Progressing"
    assert c["Progressing"]["status"] == "True" and c["Degraded"]["status"] == "False"


def test_missing_pods_are_pending_units():
    status = status_of([], replicas=2, rolled_out=False)
    assert status["phase"] == "Pending" and status["ready"] == "0/2"
    assert [u["reason"] for u in status["models"][0]["units"]] == ["PodMissing", "PodMissing"]


def test_unschedulable_unit_is_degraded_with_the_scheduler_message():
    p = pod("d-default-0", ready=False)
    p["status"] = {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                   "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]}
    status = status_of([p])
    c = conditions(status)
    assert c["Degraded"]["reason"] == "Unschedulable" and "Insufficient nvidia.com/gpu" in c["Degraded"]["message"]


def test_transition_time_is_kept_while_a_condition_holds():
    first = status_of([pod("d-default-0")])
    later = compute_status(deployment="d", spec=setup()[0], plans=setup()[1], pods={"d-default-0": pod("d-default-0")},
                           rolled_out=True, generation=3, previous=first, now="2026-11-29T13:00:00Z")
    assert conditions(later)["Ready"]["lastTransitionTime"] == NOW
    flipped = compute_status(deployment="d", spec=setup()[0], plans=setup()[1],
                             pods={"d-default-0": pod("d-default-0", consumer_ready=False)},
                             rolled_out=True, generation=3, previous=first, now="2026-11-29T13:00:00Z")
    assert conditions(flipped)["Ready"]["lastTransitionTime"] == "2026-11-29T13:00:00Z"


def test_too_small_ec_budget_is_a_warning_condition():
    spec, plans = setup(shm={"sizeLimit": "1Gi"})
    status = compute_status(deployment="d", spec=spec, plans=plans, pods={"d-default-0": pod("d-default-0")},
                            rolled_out=True, generation=3, previous=None, now=NOW)
    budget = conditions(status)["ECBudgetSufficient"]
    assert budget["status"] == "False" and budget["reason"] == "BudgetTooSmall"
    assert "model default: EC budget" in budget["message"] and "Raise shm.sizeLimit" in budget["message"]
    assert status["models"][0]["ecStorageMaxBytes"] == int(0.8 * 2**30)
    assert status["phase"] == "Ready"  # a warning, not an outage


def test_scraped_ec_evictions_show_per_unit():
    spec, plans = setup(replicas=2)
    pods = {p["name"]: p for p in [pod("d-default-0"), pod("d-default-1")]}
    status = compute_status(deployment="d", spec=spec, plans=plans, pods=pods, rolled_out=True, generation=3,
                            previous=None, now=NOW, evictions={"d-default-0": 12})
    units = status["models"][0]["units"]
    assert units[0]["ecEvictions"] == 12
    assert "ecEvictions" not in units[1]  # not scraped (yet): no note rather than a made-up 0


def test_scraped_fallback_encodes_show_per_unit_per_model_and_in_all():
    spec, plans = setup(replicas=3)
    pods = {p["name"]: p for p in [pod("d-default-0"), pod("d-default-1"), pod("d-default-2")]}
    status = compute_status(deployment="d", spec=spec, plans=plans, pods=pods, rolled_out=True, generation=3,
                            previous=None, now=NOW, fallback_encodes={"d-default-0": 2, "d-default-1": 0})
    (model,) = status["models"]
    assert [u.get("fallbackEncodes") for u in model["units"]] == [2, 0, None]
    assert model["fallbackEncodes"] == 2 and status["fallbackEncodes"] == 2

    nothing_scraped = compute_status(deployment="d", spec=spec, plans=plans, pods=pods, rolled_out=True,
                                     generation=3, previous=None, now=NOW)
    assert "fallbackEncodes" not in nothing_scraped and "fallbackEncodes" not in nothing_scraped["models"][0]
