"""Autoscalers on the real control plane (kwok nodes), before KEDA is installed: the EPDDeployment
says KEDA is missing (a condition and an Event) and every other child is applied; the encoder
pool's size is whoever scales it through the scale subresource (as the HPA controller does), the
operator's apply owning no replica count of it (managedFields), however often it reconciles."""

from __future__ import annotations

import json

import pytest
import yaml

from epd_dev.operator_process import wait_for
from tests.operator.test_reconcile import apply, condition, epd, get_json
from tests.operator.test_resources import EXAMPLES

pytestmark = pytest.mark.cluster

NAME = "qwen-vl-pools"
POOL = f"{NAME}-default-encoders"


def manifest(shm: str = "16Gi", **encoders: object) -> dict:
    found = yaml.safe_load((EXAMPLES / "encoder-pools.yaml").read_text())
    found["spec"]["autoscaling"] = {"prometheusAddress": "http://prometheus.monitoring.svc:9090"}
    model = found["spec"]["models"][0]
    del model["encoderReplicas"]
    model["encoderAutoscaling"] = {"minReplicas": 1, "maxReplicas": 4, **encoders}
    model["encoderPool"]["shm"]["sizeLimit"] = shm
    return found


def replica_owners(stateful_set: dict) -> dict[str, str]:
    """Who owns spec.replicas: manager -> operation (and subresource)."""
    owners = {}
    for entry in stateful_set["metadata"].get("managedFields") or []:
        fields = json.dumps(entry.get("fieldsV1", {}))
        if '"f:replicas"' in fields and '"f:spec"' in fields:
            owners[entry["manager"]] = entry["operation"] + (
                f"/{entry['subresource']}" if entry.get("subresource") else ""
            )
    return owners


def test_the_pools_size_is_the_scalers_and_keda_missing_is_said(cluster, namespace, epd_operator):
    keda_served = cluster.kubectl("get", "crd", "scaledobjects.keda.sh", check=False).returncode == 0
    assert not keda_served, "this test runs before KEDA's CRD is installed on the session's cluster"
    apply(cluster, namespace, manifest())

    def keda_missing() -> dict | None:
        found = condition(epd(cluster, namespace, NAME) or {}, "Degraded")
        return found if found.get("reason") == "KEDANotInstalled" else None

    said = wait_for(
        keda_missing,
        90,
        "Degraded=KEDANotInstalled",
        lambda: json.dumps((epd(cluster, namespace, NAME) or {}).get("status")),
    )
    assert "keda.sh/v1alpha1" in said["message"] and "helm install keda" in said["message"]
    events = get_json(cluster, "events", "-n", namespace, "--field-selector", f"involvedObject.name={NAME}")["items"]
    assert any(e["reason"] == "KEDANotInstalled" and e["type"] == "Warning" for e in events)
    pool = wait_for(
        lambda: get_json(cluster, "statefulset", POOL, "-n", namespace, "--show-managed-fields"),
        60,
        "the pool's StatefulSet",
    )
    assert get_json(cluster, "statefulset", NAME + "-default", "-n", namespace), "the units are applied too"
    # Created without a size of the operator's: the API server's default, 1.
    assert pool["spec"]["replicas"] == 1

    # Scaled as the HPA controller scales it: through the scale subresource.
    cluster.kubectl("scale", "statefulset", POOL, "-n", namespace, "--replicas=3")
    # A change of the pool's pods makes the operator apply the pool again.
    apply(cluster, namespace, manifest(shm="8Gi"))
    wait_for(
        lambda: (
            get_json(cluster, "statefulset", POOL, "-n", namespace)["metadata"]["annotations"]
            != pool["metadata"]["annotations"]
            or None
        ),
        60,
        "the pool applied again",
    )
    again = get_json(cluster, "statefulset", POOL, "-n", namespace, "--show-managed-fields")
    owners = replica_owners(again)
    assert again["spec"]["replicas"] == 3, "the operator's apply kept the scaler's size"
    assert "epd-operator" not in owners and owners.get("kubectl") == "Update/scale", owners

    def counted() -> bool:
        models = (epd(cluster, namespace, NAME) or {}).get("status", {}).get("models") or [{}]
        return (models[0].get("encoderPool") or {}).get("replicas") == 3

    wait_for(counted, 60, "the status counting 3 encoder pods")
