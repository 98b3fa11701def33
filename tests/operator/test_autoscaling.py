"""The autoscalers the operator makes (pure): KEDA ScaledObjects on EPD's own signals, the pool
whose size they own (the operator's apply sets none), the bounds refused with their field named,
and the status that reads the size the autoscaler chose."""

from __future__ import annotations

import pytest
import yaml

from epd_operator.indexes import StatefulSetSummary
from epd_operator.render import render
from epd_operator.resources import desired_children
from epd_operator.status import compute_status
from epd_operator.validation import SpecError, validate
from tests.operator.test_resources import EXAMPLES, IMAGE
from tests.operator.test_status import pool_pod, summaries, unit_pod, unit_set

PROMETHEUS = "http://prometheus.monitoring.svc:9090"


def pools(**autoscaling):
    """The Pools example, autoscaling on (its encoderReplicas left out: the size is the autoscaler's,
    encoderReplicas is ignored)."""
    manifest = yaml.safe_load((EXAMPLES / "encoder-pools.yaml").read_text())
    manifest["spec"]["autoscaling"] = {"prometheusAddress": PROMETHEUS, **autoscaling}
    del manifest["spec"]["models"][0]["encoderReplicas"]
    return manifest


def children(manifest):
    checked = validate(manifest["spec"])
    name = manifest["metadata"]["name"]
    plans = render(checked, namespace="team-a", name=name, uid="u")
    found = desired_children(checked.spec, name, plans, IMAGE, namespace="team-a")
    return {(c["kind"], c["metadata"]["name"]): c for c in found}


def test_the_encoder_pool_and_the_units_each_get_a_scaled_object_on_their_own_signal():
    manifest = pools(units={"maxReplicas": 6, "targetRequestsInFlight": 4}, pollingIntervalSeconds=5)
    manifest["spec"]["models"][0]["encoderAutoscaling"] = {
        "minReplicas": 1,
        "maxReplicas": 3,
        "targetPrimesInFlight": 1.5,
        "scaleDownStabilizationSeconds": 30,
    }
    found = children(manifest)
    encoders = found[("ScaledObject", "qwen-vl-pools-default-encoders")]
    assert encoders["apiVersion"] == "keda.sh/v1alpha1"
    spec = encoders["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": "qwen-vl-pools-default-encoders",
    }
    assert (spec["minReplicaCount"], spec["maxReplicaCount"], spec["pollingInterval"]) == (1, 3, 5)
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 30
    (trigger,) = spec["triggers"]
    assert (trigger["type"], trigger["metricType"]) == ("prometheus", "AverageValue")
    assert trigger["metadata"] == {
        "serverAddress": PROMETHEUS,
        "query": 'sum(epd_proxy_primes_in_flight{namespace="team-a",deployment="qwen-vl-pools",role="unit",model="default"})',
        "threshold": "1.5",
    }
    units = found[("ScaledObject", "qwen-vl-pools-units")]["spec"]
    assert units["scaleTargetRef"] == {
        "apiVersion": "epd.vime.dev/v1alpha1",
        "kind": "EPDDeployment",
        "name": "qwen-vl-pools",
    }
    assert (units["minReplicaCount"], units["maxReplicaCount"]) == (1, 6)
    assert units["triggers"][0]["metadata"]["query"] == (
        'sum(epd_proxy_requests_in_flight{namespace="team-a",deployment="qwen-vl-pools",role="unit"})'
    )
    assert units["triggers"][0]["metadata"]["threshold"] == "4"
    # The pool's size is the autoscaler's: the operator's apply sets none (owns none); the units'
    # StatefulSet keeps spec.replicas, which the autoscaler writes through the EPDDeployment.
    assert "replicas" not in found[("StatefulSet", "qwen-vl-pools-default-encoders")]["spec"]
    assert found[("StatefulSet", "qwen-vl-pools-default")]["spec"]["replicas"] == 3
    # Without autoscalers: none, and the pool's size is encoderReplicas.
    plain = yaml.safe_load((EXAMPLES / "encoder-pools.yaml").read_text())
    unscaled = children(plain)
    assert not any(kind == "ScaledObject" for kind, _ in unscaled)
    assert unscaled[("StatefulSet", "qwen-vl-pools-default-encoders")]["spec"]["replicas"] == 2


@pytest.mark.parametrize(
    ("encoders", "units", "prometheus", "expected"),
    [
        (
            {"minReplicas": 4, "maxReplicas": 2},
            None,
            True,
            "encoderAutoscaling: minReplicas (4) is above maxReplicas (2)",
        ),
        ({"minReplicas": 0, "maxReplicas": 2}, None, True, "encoderAutoscaling.minReplicas: 0 (scale from zero)"),
        ({"maxReplicas": 2}, None, False, "set spec.autoscaling.prometheusAddress"),
        (None, {"minReplicas": 3, "maxReplicas": 1}, True, "spec.autoscaling.units: minReplicas (3) is above"),
        ({"maxReplicas": 2, "targetPrimesInFlight": 0}, None, True, "targetPrimesInFlight"),
    ],
)
def test_bad_bounds_are_refused_naming_the_field(encoders, units, prometheus, expected):
    manifest = pools()
    manifest["spec"]["autoscaling"] = {"prometheusAddress": PROMETHEUS} if prometheus else {}
    if units is not None:
        manifest["spec"]["autoscaling"]["units"] = units
    if encoders is not None:
        manifest["spec"]["models"][0]["encoderAutoscaling"] = encoders
    with pytest.raises(SpecError) as refused:
        validate(manifest["spec"])
    assert any(expected in error for error in refused.value.errors), refused.value.errors


def test_a_unit_models_encoders_are_autoscaled_with_its_units():
    manifest = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())
    manifest["spec"]["autoscaling"] = {"prometheusAddress": PROMETHEUS}
    manifest["spec"]["models"][0]["encoderAutoscaling"] = {"maxReplicas": 3}
    with pytest.raises(SpecError) as refused:
        validate(manifest["spec"])
    assert any("placement Unit" in e and "spec.autoscaling.units" in e for e in refused.value.errors)


def test_the_status_counts_the_pool_the_autoscaler_sized():
    manifest = pools()
    manifest["spec"]["replicas"] = 2
    manifest["spec"]["models"][0]["encoderAutoscaling"] = {"maxReplicas": 5}
    checked = validate(manifest["spec"])
    plans = render(checked, namespace="ns", name="d", uid="u")
    sets = {
        **unit_set(2),
        "d-default-encoders": StatefulSetSummary(
            name="d-default-encoders",
            spec_hash="h",
            replicas=3,
            updated_replicas=3,
            current_revision="e",
            update_revision="e",
        ),
    }
    pods = [pool_pod(f"d-default-encoders-{i}") for i in range(3)] + [unit_pod("d-default-0"), unit_pod("d-default-1")]
    status = compute_status(
        deployment="d",
        spec=checked.spec,
        plans=plans,
        pods=summaries(pods),
        stateful_sets=sets,
        generation=3,
        previous=None,
        now="2026-01-01T00:00:00Z",
    )
    pool = status["models"][0]["encoderPool"]
    # The size is the one the autoscaler gave the StatefulSet, not encoderReplicas' default (1).
    assert (pool["replicas"], pool["readyPods"], pool["autoscaler"]) == (3, 3, "d-default-encoders")
