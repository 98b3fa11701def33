"""`helm install`, `helm upgrade` and `helm uninstall` of the chart on the real control plane."""

from __future__ import annotations

import json

import pytest

from epd_dev.operator_process import wait_established

from .chart import CHART, ROOT, documents

pytestmark = pytest.mark.cluster

CHART_CRDS = sorted(
    doc["metadata"]["name"] for path in (CHART / "crds").glob("*.yaml") for doc in documents(path.read_text())
)


def get(kubectl, *args: str, check: bool = True) -> dict | None:
    out = kubectl("get", *args, "-o", "json", check=check)
    return json.loads(out.stdout) if out.returncode == 0 else None


def exists(kubectl, *args: str) -> bool:
    return get(kubectl, *args, check=False) is not None


def can_i(kubectl, service_account: str, *args: str) -> bool:
    out = kubectl("auth", "can-i", *args, f"--as={service_account}", check=False)
    return out.stdout.strip() == "yes"


def test_install_upgrade_uninstall(cluster, kubectl, namespace, release):
    rel = release("epd")
    sa = f"system:serviceaccount:{namespace}:{rel.fullname}"
    cluster_scoped = f"{namespace}-{rel.fullname}"  # ClusterRole/Binding names carry the namespace
    absent_before = [crd for crd in CHART_CRDS if not exists(kubectl, "crd", crd)]

    # --- install: every namespace, no peering
    rel.install()
    for crd in CHART_CRDS:
        wait_established(kubectl, crd)
        if crd in absent_before:  # otherwise another test installed it first and helm left it be
            fields = get(kubectl, "crd", crd, "--show-managed-fields")["metadata"]["managedFields"]
            managers = {entry["manager"] for entry in fields}
            assert "helm" in managers, (crd, managers)
    kubectl("wait", "--for=condition=Available", f"deployment/{rel.fullname}", "-n", namespace, "--timeout=120s")
    assert exists(kubectl, "serviceaccount", rel.fullname, "-n", namespace)
    assert exists(kubectl, "service", f"{rel.fullname}-metrics", "-n", namespace)
    role = get(kubectl, "clusterrole", cluster_scoped)
    binding = get(kubectl, "clusterrolebinding", cluster_scoped)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": rel.fullname, "namespace": namespace}]
    assert any("epddeployments" in rule["resources"] for rule in role["rules"])
    assert can_i(kubectl, sa, "list", "epddeployments.epd.vime.dev", "--all-namespaces")
    assert can_i(kubectl, sa, "patch", "statefulsets.apps", "-n", "default")
    assert not can_i(kubectl, sa, "get", "secrets", "-n", namespace)
    assert not can_i(kubectl, sa, "create", "pods", "-n", namespace)

    # A user's EPDDeployment: it must survive the uninstall.
    kubectl("apply", "-n", namespace, "-f", str(ROOT / "docs" / "examples" / "encoder-regular.yaml"))

    # --- upgrade: only this namespace, with peering, more logging
    rel.upgrade({"watchNamespaces": [namespace], "peering.enabled": True, "logLevel": "DEBUG"})
    assert rel.status()["version"] == 2
    kubectl("rollout", "status", f"deployment/{rel.fullname}", "-n", namespace, "--timeout=120s", timeout=130)
    deployment = get(kubectl, "deployment", rel.fullname, "-n", namespace)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert {f"--namespace={namespace}", "--peering=epd-operator", "--log-level=DEBUG"} <= set(args)
    assert "--all-namespaces" not in args and "--standalone" not in args
    assert exists(kubectl, "kopfpeering.kopf.dev", "epd-operator", "-n", namespace)
    assert exists(kubectl, "role", rel.fullname, "-n", namespace)
    assert exists(kubectl, "rolebinding", rel.fullname, "-n", namespace)
    assert can_i(kubectl, sa, "list", "epddeployments.epd.vime.dev", "-n", namespace)
    assert can_i(kubectl, sa, "patch", "kopfpeerings.kopf.dev", "-n", namespace)
    assert not can_i(kubectl, sa, "list", "epddeployments.epd.vime.dev", "--all-namespaces")
    assert not can_i(kubectl, sa, "patch", "statefulsets.apps", "-n", "default")

    # --- uninstall: the operator and its RBAC go; CRDs and users' objects stay (Helm never
    # deletes what it installed from crds/).
    rel.uninstall()
    for args in (
        ("deployment", rel.fullname, "-n", namespace),
        ("serviceaccount", rel.fullname, "-n", namespace),
        ("service", f"{rel.fullname}-metrics", "-n", namespace),
        ("role", rel.fullname, "-n", namespace),
        ("rolebinding", rel.fullname, "-n", namespace),
        ("kopfpeering.kopf.dev", "epd-operator", "-n", namespace),
        ("clusterrole", cluster_scoped),
        ("clusterrolebinding", cluster_scoped),
    ):
        assert not exists(kubectl, *args), f"{args} left behind by helm uninstall"
    for crd in CHART_CRDS:
        assert exists(kubectl, "crd", crd), f"helm uninstall removed CRD {crd}"
    assert exists(kubectl, "epd", "qwen-vl-regular", "-n", namespace), "helm uninstall removed a user's EPDDeployment"
    assert not can_i(kubectl, sa, "list", "epddeployments.epd.vime.dev", "-n", namespace)


def test_cluster_wide_peering_creates_the_cluster_peering_object(cluster, kubectl, namespace, release):
    rel = release("peered")
    rel.install({"peering.enabled": True, "peering.name": f"epd-{namespace}"})
    peering = get(kubectl, "clusterkopfpeering.kopf.dev", f"epd-{namespace}")
    assert peering["metadata"]["labels"]["app.kubernetes.io/instance"] == "peered"
    sa = f"system:serviceaccount:{namespace}:{rel.fullname}"
    assert can_i(kubectl, sa, "patch", "clusterkopfpeerings.kopf.dev")
    rel.uninstall()
    assert not exists(kubectl, "clusterkopfpeering.kopf.dev", f"epd-{namespace}")
