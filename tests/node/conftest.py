"""Fixtures of the real-node tests (marker `node`): the operator installed by Helm, running in
a pod on epd-real-0, and a namespace enforcing Pod Security "restricted" for the units.

Nothing is skipped: a missing image or node fails with the command that provides it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from epd_dev.images.build import Builder
from epd_dev.operator_process import OperatorProcess, wait_for
from epd_dev.vllm import real_node as on_node
from epd_dev.vllm import tiny_model
from tests.helm.chart import CHART, helm

IMAGES = ("pause", "vllm-cpu", "vllm-router", "epd-operator")


@pytest.fixture(scope="session")
def node_images(real_node) -> None:
    """The local images, in the node's containerd (built by `make images`)."""
    builder = Builder()
    missing = [name for name in IMAGES if builder.cached(name) is None]
    if missing:
        pytest.fail(f"images not built: {', '.join(missing)}. Build them with:\n\n    make images\n", pytrace=False)
    builder.import_cached(real_node)


@pytest.fixture(scope="session")
def node_namespace(cluster) -> Iterator[str]:
    """One namespace for every node test: the operator and the units, under restricted."""
    name = f"epd-node-{uuid.uuid4().hex[:5]}"
    cluster.kubectl("create", "namespace", name)
    cluster.kubectl("label", "namespace", name, "pod-security.kubernetes.io/enforce=restricted")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def helm_operator(cluster, node_images, node_namespace) -> Iterator[dict[str, Any]]:
    """`helm install` of charts/epd-operator with the local image, on the real node, watching
    the node tests' namespace only. The session's host-process operators watch every namespace,
    so they are stopped meanwhile (two operators would fight over the same objects)."""
    paused = OperatorProcess.running(cluster.kubeconfig)
    for operator in paused:
        operator.stop()
    values = {
        "image.repository": "localhost/epd-operator",
        "image.tag": "dev",
        "image.pullPolicy": "Never",
        "watchNamespaces": [node_namespace],
        "nodeSelector": on_node.NODE_SELECTOR,
        "tolerations": on_node.TOLERATIONS,
        "janitorScrape.interval": 5,
        # No cluster DNS on the local cluster: kopf's in-cluster login names the API server so.
        "hostAliases": [{"ip": "10.96.0.1", "hostnames": ["kubernetes.default.svc"]}],
    }
    flags = [arg for key, value in values.items() for arg in ("--set-json", f"{key}={json.dumps(value)}")]
    helm("install", "epd", str(CHART), "-n", node_namespace, *flags, "--wait", "--timeout", "180s", env=cluster.env())
    (pod,) = json.loads(
        cluster.kubectl(
            "get", "pods", "-n", node_namespace, "-l", "app.kubernetes.io/name=epd-operator", "-o", "json"
        ).stdout
    )["items"]
    try:
        yield pod
    finally:
        helm("uninstall", "epd", "-n", node_namespace, "--wait", env=cluster.env(), check=False)
        for operator in paused:
            operator.start()


@pytest.fixture(scope="session")
def tiny_model_claim(cluster, node_namespace) -> Iterator[str]:
    """The tiny model on a local PersistentVolume of the real node, and a claim bound to it."""
    name = f"tiny-model-{node_namespace}"
    objects = on_node.model_volume(name, tiny_model.tiny_model_path())
    cluster.kubectl("apply", "-n", node_namespace, "-f", "-", input=yaml.safe_dump_all(objects))
    wait_for(
        lambda: (
            cluster.kubectl("get", "pvc", name, "-n", node_namespace, "-o", "jsonpath={.status.phase}").stdout
            == "Bound"
        ),
        60,
        f"pvc/{name} Bound",
    )
    yield name
    cluster.kubectl("delete", "pvc", name, "-n", node_namespace, "--wait=false", check=False)
    cluster.kubectl("delete", "pv", name, "--wait=false", check=False)


def get(cluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def wait_ready(cluster, namespace: str, name: str, timeout: float = 900) -> dict[str, Any]:
    """The EPDDeployment once Ready (its status says every unit is: the kubelet's probes)."""
    deadline = time.monotonic() + timeout
    while True:
        epd = get(cluster, "epd", name, "-n", namespace)
        ready = {c["type"]: c["status"] for c in epd.get("status", {}).get("conditions", [])}.get("Ready")
        if ready == "True":
            return epd
        if time.monotonic() > deadline:
            pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
            raise AssertionError(f"epd/{name} not Ready after {timeout:.0f}s:\n{json.dumps(epd.get('status'))}\n{pods}")
        time.sleep(2)
