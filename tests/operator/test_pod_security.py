"""The unit and encoder-pool pods pass Pod Security "restricted", as the real API server's
admission judges it (a server-side dry run in a namespace that enforces it)."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.operator.test_reconcile import apply, condition, get_json, wait_condition
from tests.operator.test_resources import EXAMPLES, children_of

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("example", ["encoder-regular.yaml", "encoder-prefill-decode.yaml", "encoder-pools.yaml"])
def test_pods_pass_restricted(cluster, namespace, example):
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    # The units', the pools' and the EPD gateway's pods (whose ServiceAccount must exist).
    children = children_of(example, gateway={"enabled": True})
    (account,) = [c for c in children if c["kind"] == "ServiceAccount"]
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(account))
    templates = [c for c in children if c["kind"] in ("StatefulSet", "Deployment")]
    assert templates and any(c["kind"] == "Deployment" for c in templates)
    for sts in templates:
        template = sts["spec"]["template"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": sts["metadata"]["name"], "labels": template["metadata"]["labels"]},
            "spec": template["spec"],
        }
        out = cluster.kubectl(
            "create", "--dry-run=server", "-n", namespace, "-f", "-", input=json.dumps(pod), check=False
        )
        assert out.returncode == 0, f"{sts['metadata']['name']}: {out.stderr}"


def test_the_examples_become_ready_in_a_namespace_enforcing_restricted(cluster, namespace, epd_operator):
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    apply(cluster, namespace, EXAMPLES / "encoder-regular.yaml")
    wait_condition(cluster, namespace, "qwen-vl-regular", "Ready", "True")


def test_a_pod_admission_refuses_is_said_in_the_status_and_an_event(cluster, namespace, epd_operator):
    """A pod the StatefulSet cannot create (here: root in a restricted namespace) is no longer
    `PodMissing` forever: Degraded, reason FailedCreate, with the API server's words."""
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    manifest = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())
    manifest["spec"]["podSecurityContext"] = {"runAsNonRoot": False, "runAsUser": 0}
    apply(cluster, namespace, manifest)
    obj = wait_condition(cluster, namespace, "qwen-vl-regular", "Degraded", "True", timeout=120)
    degraded = condition(obj, "Degraded")
    assert degraded["reason"] == "FailedCreate" and obj["status"]["phase"] == "Degraded"
    assert 'violates PodSecurity "restricted:latest"' in degraded["message"], degraded
    (unit,) = obj["status"]["models"][0]["unready"]
    assert unit["reason"] == "FailedCreate"
    events = get_json(cluster, "events", "-n", namespace, "--field-selector", "involvedObject.kind=EPDDeployment")
    assert any(e["reason"] == "FailedCreate" and e["type"] == "Warning" for e in events["items"])


def test_another_apps_object_with_a_childs_name_is_left_alone_and_reported(cluster, namespace, epd_operator):
    theirs = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "bar-epd-actor", "labels": {"app": "bar-epd-actor"}},
        "spec": {"selector": {"app": "bar-epd-actor"}, "ports": [{"port": 80}]},
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(theirs))
    before = get_json(cluster, "service", "bar-epd-actor", "-n", namespace)
    manifest = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())
    manifest["metadata"]["name"] = "bar-epd"
    manifest["spec"]["models"][0]["name"] = "actor"
    apply(cluster, namespace, manifest)
    obj = wait_condition(cluster, namespace, "bar-epd", "Degraded", "True", timeout=120)
    degraded = condition(obj, "Degraded")
    assert degraded["reason"] == "ChildConflict", degraded
    assert (
        f"Service {namespace}/bar-epd-actor exists and is not controlled by EPDDeployment bar-epd"
        in degraded["message"]
    )
    after = get_json(cluster, "service", "bar-epd-actor", "-n", namespace)
    assert after["spec"]["selector"] == {"app": "bar-epd-actor"} and "ownerReferences" not in after["metadata"]
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]  # not touched at all
    # The EPDDeployment's other children are there, its NetworkPolicy among them.
    policy = get_json(cluster, "networkpolicy", "bar-epd", "-n", namespace)
    assert policy["metadata"]["ownerReferences"][0]["name"] == "bar-epd"
    assert get_json(cluster, "statefulset", "bar-epd-actor", "-n", namespace)
