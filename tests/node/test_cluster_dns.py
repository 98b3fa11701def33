"""The local cluster's DNS on the real node (hack/epd_dev/localcluster/dns.py): CoreDNS answers the
cluster's names to pods as on every real cluster, so the chart installs with the values a user
gives (image, node selector, toleration) and nothing else.
"""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from epd_dev import operator_chart
from epd_dev.images import recipes
from epd_dev.localcluster import dns, node
from epd_dev.localcluster.cluster import CLUSTER_DNS_IP
from epd_dev.operator_process import OperatorProcess, wait_for
from epd_dev.vllm.real_node import node_manifest
from tests.node.conftest import RESTRICTED_CONTAINER, get, restricted_namespace

pytestmark = [pytest.mark.node, pytest.mark.cluster]

# Names a pod resolves through the cluster's DNS, and what each must resolve to.
NAMES = {
    "kubernetes.default.svc.cluster.local": "10.96.0.1",
    "kubernetes.default": "10.96.0.1",  # through the pod's search domains
    f"{dns.SERVICE}.{dns.NAMESPACE}.svc": CLUSTER_DNS_IP,
}
# Printed by the pod: each name and what it resolved to, or the resolver's error.
RESOLVE = """
import json, socket, sys
found = {}
for name in sys.argv[1:]:
    try:
        found[name] = socket.gethostbyname(name)
    except OSError as error:
        found[name] = f"error: {error}"
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def dns_namespace(cluster) -> Iterator[str]:
    with restricted_namespace(cluster, "epd-dns") as name:
        yield name


def resolved_in_a_pod(cluster, namespace: str, names: list[str]) -> dict[str, str]:
    """`kubectl run` of a restricted pod on the real node that resolves `names`; what it printed."""
    pod = f"resolve-{uuid.uuid4().hex[:5]}"
    overrides = {
        "apiVersion": "v1",
        "spec": {
            "nodeSelector": node.NODE_SELECTOR,
            "tolerations": node.TOLERATIONS,
            "containers": [
                {
                    "name": pod,
                    "image": recipes.OPERATOR_REF,
                    "command": ["python3", "-c", RESOLVE, *names],
                    "securityContext": RESTRICTED_CONTAINER,
                }
            ],
        },
    }
    cluster.kubectl(
        "run", pod, "-n", namespace, f"--image={recipes.OPERATOR_REF}", "--restart=Never",
        f"--overrides={json.dumps(overrides)}",
    )  # fmt: skip
    cluster.kubectl(
        "wait", "--for=jsonpath={.status.phase}=Succeeded", f"pod/{pod}", "-n", namespace, "--timeout=120s",
        timeout=150,
    )  # fmt: skip
    return dict(json.loads(cluster.kubectl("logs", pod, "-n", namespace).stdout))


def test_coredns_runs_as_the_clusters_dns_on_the_real_node(cluster, real_node):
    service = get(cluster, "service", dns.SERVICE, "-n", dns.NAMESPACE)
    assert service["spec"]["clusterIP"] == CLUSTER_DNS_IP
    (pod,) = get(cluster, "pods", "-n", dns.NAMESPACE, "-l", "k8s-app=kube-dns")["items"]
    assert pod["spec"]["nodeName"] == node.NAME
    assert pod["spec"]["containers"][0]["image"] == recipes.COREDNS_REF
    (status,) = pod["status"]["containerStatuses"]
    assert status["ready"] and status["containerID"].startswith("containerd://")
    # The kubelet hands every pod the cluster's DNS.
    kubelet = yaml.safe_load(real_node.layout.kubelet_config.read_text())
    assert (kubelet["clusterDNS"], kubelet["clusterDomain"]) == ([CLUSTER_DNS_IP], dns.DOMAIN)


def test_a_restricted_pod_resolves_the_clusters_names_and_nothing_outside(cluster, node_images, dns_namespace):
    missing = ["no-such-service", f"no-such-service.{dns_namespace}.svc", "pypi.org"]
    found = resolved_in_a_pod(cluster, dns_namespace, [*NAMES, *missing])
    assert {name: found[name] for name in NAMES} == NAMES
    # "No such name" (EAI_NONAME), as a real cluster answers, never "try again": a resolver that
    # searched a short name's domains and met a SERVFAIL would say that. Nothing leaves the
    # machine: pypi.org too is answered by the cluster's DNS.
    no_such_name = f"error: [Errno {socket.EAI_NONAME}] Name or service not known"
    assert {name: found[name] for name in missing} == dict.fromkeys(missing, no_such_name)


@pytest.fixture(scope="module")
def default_install(cluster, node_images, dns_namespace) -> Iterator[dict[str, Any]]:
    """The chart with only the values a user gives on this cluster: image, node selector,
    toleration. It then watches every namespace, so the session's other operators are paused
    meanwhile (two operators would reconcile the same objects)."""
    paused = OperatorProcess.running(cluster.kubeconfig)
    for operator in paused:
        operator.stop()
    others = [
        d
        for d in get(cluster, "deployments", "-A", "-l", "app.kubernetes.io/name=epd-operator")["items"]
        if d["spec"].get("replicas")
    ]
    for deployment in others:
        cluster.kubectl("scale", "deployment", deployment["metadata"]["name"], "-n", deployment["metadata"]["namespace"], "--replicas=0")  # fmt: skip
    given = operator_chart.values()
    assert set(given) == {"image.repository", "image.tag", "nodeSelector", "tolerations"}
    try:
        yield operator_chart.install(cluster, dns_namespace, given)
    finally:
        operator_chart.uninstall(cluster, dns_namespace)
        for deployment in others:
            meta = deployment["metadata"]
            cluster.kubectl("scale", "deployment", meta["name"], "-n", meta["namespace"], f"--replicas={deployment['spec']['replicas']}")  # fmt: skip
        for operator in paused:
            operator.start()


def test_the_chart_installed_with_only_image_node_selector_and_toleration_is_ready_and_reconciles(
    cluster, default_install, dns_namespace, tiny_model_claim, node_namespace
):
    pod = default_install
    assert pod["spec"]["nodeName"] == node.NAME
    assert not pod["spec"].get("hostAliases")
    cluster.kubectl(
        "wait", "--for=condition=Ready", f"pod/{pod['metadata']['name']}", "-n", dns_namespace, "--timeout=120s",
        timeout=150,
    )  # fmt: skip
    # kopf logged in at https://kubernetes.default.svc, a name only the cluster's DNS answers.
    (container,) = pod["spec"]["containers"]
    assert not any(e.get("name") == "KUBERNETES_SERVICE_HOST" for e in container.get("env", []))
    # An EPDDeployment on the real node gets its status from it (its pods need not start).
    manifest = node_manifest("dns-check", tiny_model_claim, [{"workerType": "regular", "numGpus": 1}])
    cluster.kubectl("apply", "-n", node_namespace, "-f", "-", input=yaml.safe_dump(manifest))
    try:

        def reconciled() -> dict[str, Any] | None:
            item = get(cluster, "epd", "dns-check", "-n", node_namespace)
            status = item.get("status", {})
            return status if status.get("observedGeneration") == item["metadata"]["generation"] else None

        status = wait_for(reconciled, 120, "the default install's operator to write the EPDDeployment's status")
        assert {c["type"] for c in status["conditions"]} >= {"Ready", "Progressing"}
        logs = cluster.kubectl("logs", pod["metadata"]["name"], "-n", dns_namespace).stdout
        assert "ClientConnectorDNSError" not in logs and "Temporary failure in name resolution" not in logs
    finally:
        cluster.kubectl("delete", "epd", "dns-check", "-n", node_namespace, "--wait=false", check=False)
