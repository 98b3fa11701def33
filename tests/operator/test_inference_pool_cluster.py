"""spec.gateway.inferencePool on the real control plane (kwok nodes): without the Gateway API
Inference Extension's CRD, a condition and an Event say how to install it and every other child
is applied; once the CRD is installed (the chart's copy, as `inferencePoolCRD.install` applies
it), the operator makes the model's InferencePool within seconds, owned by the EPDDeployment,
changes it with the spec, and deletes it when the pool is turned off. The API server validates the pool against
GAIE's own schema."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from epd_dev.operator_process import wait_for
from tests.operator.test_reconcile import apply, condition, epd, get_json
from tests.operator.test_resources import EXAMPLES

pytestmark = pytest.mark.cluster

NAME = "qwen-vl-regular"
POOL = f"{NAME}-default"
CRD = Path(__file__).resolve().parents[2] / "charts/epd-operator/files/inference.networking.k8s.io_inferencepools.yaml"


def manifest(**pool: object) -> dict:
    found = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())
    found["spec"]["gateway"] = {"enabled": True, "inferencePool": {"enabled": True, **pool}}
    return found


def pool(cluster, namespace: str) -> dict | None:
    out = cluster.kubectl(
        "get", "inferencepools.inference.networking.k8s.io", POOL, "-n", namespace, "-o", "json", check=False
    )
    return yaml.safe_load(out.stdout) if out.returncode == 0 else None


def test_the_inference_pool_without_its_crd_then_with_it(cluster, namespace, epd_operator):
    crd_served = (
        cluster.kubectl("get", "crd", "inferencepools.inference.networking.k8s.io", check=False).returncode == 0
    )
    assert not crd_served, "this test installs the InferencePool CRD itself: it must run before anything else does"
    apply(cluster, namespace, manifest())

    def degraded() -> dict | None:
        found = condition(epd(cluster, namespace, NAME) or {}, "Degraded")
        return found if found.get("reason") == "InferencePoolCRDMissing" else None

    said = wait_for(degraded, 90, "Degraded=InferencePoolCRDMissing")
    assert "inferencePoolCRD.install=true" in said["message"] and "kubectl apply" in said["message"]
    events = get_json(cluster, "events", "-n", namespace, "--field-selector", f"involvedObject.name={NAME}")["items"]
    assert any(e["reason"] == "InferencePoolCRDMissing" and e["type"] == "Warning" for e in events)
    # Everything else is applied: the units, the gateway and its picker's Service.
    assert get_json(cluster, "deployment", f"{POOL}-gateway", "-n", namespace)
    assert get_json(cluster, "service", f"{POOL}-epp", "-n", namespace)
    assert get_json(cluster, "statefulset", POOL, "-n", namespace)

    installed = time.monotonic()
    cluster.kubectl("apply", "--server-side", "-f", str(CRD))
    created = wait_for(lambda: pool(cluster, namespace), 180, f"InferencePool {POOL}")
    print(f"\nthe InferencePool {time.monotonic() - installed:.1f} s after its CRD was installed")
    owner = epd(cluster, namespace, NAME)
    (reference,) = created["metadata"]["ownerReferences"]
    assert (reference["kind"], reference["uid"], reference["controller"]) == (
        "EPDDeployment",
        owner["metadata"]["uid"],
        True,
    )
    spec = created["spec"]
    assert spec["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": f"{POOL}-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    units = get_json(cluster, "statefulset", POOL, "-n", namespace)["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= units.items()
    wait_for(lambda: not degraded(), 90, "the CRD condition cleared")

    # Changed with the spec.
    apply(cluster, namespace, manifest(failureMode="FailOpen"))
    wait_for(
        lambda: (
            (pool(cluster, namespace) or {}).get("spec", {}).get("endpointPickerRef", {}).get("failureMode")
            == "FailOpen"
        ),
        60,
        "failureMode FailOpen",
    )
    # Turned off: deleted, with the picker's Service.
    apply(cluster, namespace, manifest(enabled=False))
    wait_for(lambda: pool(cluster, namespace) is None, 60, "the pool deleted")
    assert cluster.kubectl("get", "service", f"{POOL}-epp", "-n", namespace, check=False).returncode != 0
