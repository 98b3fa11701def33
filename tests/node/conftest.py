"""Fixtures of the real-node tests (marker `node`): the operator installed by Helm, running in
a pod on epd-real-0, and a namespace enforcing Pod Security "restricted" for the units.

Nothing is skipped: a missing image or node fails with the command that provides it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from epd_client import Endpoints, Unit
from epd_dev import demo_serving, operator_chart
from epd_dev.images.build import Builder
from epd_dev.localcluster import node
from epd_dev.operator_process import OperatorProcess, wait_for
from epd_dev.vllm import real_node as on_node
from epd_dev.vllm import tiny_model
from epd_dev.vllm.serving import MODEL, discover_ready

IMAGES = ("pause", "vllm-cpu", "vllm-router", "epd-operator")


@pytest.fixture(scope="session")
def node_images(real_node, node_images_imported) -> None:
    """The local images, in the node's containerd (built by `make images`; imported since the
    session started)."""
    builder = Builder()
    missing = [name for name in IMAGES if builder.cached(name) is None]
    if missing:
        pytest.fail(f"images not built: {', '.join(missing)}. Build them with:\n\n    make images\n", pytrace=False)
    builder.import_cached(real_node)  # nothing left to do, unless one was built meanwhile


# A container's securityContext that Pod Security "restricted" admits (the tests' own pods).
RESTRICTED_CONTAINER = {
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


@contextlib.contextmanager
def restricted_namespace(cluster, prefix: str) -> Iterator[str]:
    """A fresh namespace enforcing Pod Security "restricted", deleted afterwards."""
    name = f"{prefix}-{uuid.uuid4().hex[:5]}"
    cluster.kubectl("create", "namespace", name)
    cluster.kubectl("label", "namespace", name, "pod-security.kubernetes.io/enforce=restricted")
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def node_namespace(cluster) -> Iterator[str]:
    """One namespace for every node test: the operator and the units, under restricted."""
    with restricted_namespace(cluster, "epd-node") as name:
        yield name


@pytest.fixture(scope="session")
def helm_operator(cluster, node_images, node_namespace) -> Iterator[dict[str, Any]]:
    """`helm install` of charts/epd-operator with the local image, on the real node, watching
    the node tests' namespace only. The session's host-process operators watch every namespace,
    so they are stopped meanwhile (two operators would fight over the same objects)."""
    paused = OperatorProcess.running(cluster.kubeconfig)
    for operator in paused:
        operator.stop()
    try:
        yield operator_chart.install(
            cluster, node_namespace, operator_chart.values([node_namespace], **{"janitorScrape.interval": 5})
        )
    finally:
        operator_chart.uninstall(cluster, node_namespace)
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


def host_shm(pod: dict[str, Any]) -> Path:
    """Where the kubelet keeps `pod`'s /dev/shm (its memory emptyDir `dshm`) on the host: the
    tests run as root on the node and read the engines' stores there."""
    return node.KUBELET_ROOT / "pods" / pod["metadata"]["uid"] / "volumes" / "kubernetes.io~empty-dir" / "dshm"


def get(cluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def kubelet_view(pod: dict[str, Any]) -> dict[str, tuple[str, int, bool]]:
    """container -> (container ID, restarts, ready), as the kubelet reports them."""
    return {s["name"]: (s.get("containerID", ""), s["restartCount"], s["ready"]) for s in demo_serving.containers(pod)}


def container_spec(pod: dict[str, Any], name: str) -> dict[str, Any]:
    """A container of the pod's spec by name, init containers (native sidecars) included."""
    (spec,) = [c for c in [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]] if c["name"] == name]
    return dict(spec)


def server_load(url: str) -> int:
    """vLLM's /load: the requests in flight on an engine's API server (the liveness check reads it)."""
    with urllib.request.urlopen(url + "/load", timeout=10) as response:
        return int(json.loads(response.read())["server_load"])


def pod_ready(pod: dict[str, Any]) -> bool:
    return {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}.get("Ready") == "True"


def engine_core(real_node: node.RealNode, container_id: str) -> int:
    """The host PID of the EngineCore process in a container (its vLLM engine's core, beside
    the API server's process)."""
    listed = real_node.ctr("task", "ps", container_id.removeprefix("containerd://")).stdout.splitlines()[1:]
    (pid,) = [
        pid
        for pid in (int(line.split()[0]) for line in listed)
        if b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    return pid


def scrape(url: str) -> dict[Any, float]:
    """The samples of `url`/metrics by name, or by (name, reason) where a sample has a reason."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: dict[Any, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            reason = sample.labels.get("reason")
            samples[(sample.name, reason) if reason else sample.name] = sample.value
    return samples


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat_request(msgs: list[dict[str, Any]], **extra: object) -> dict[str, Any]:
    """Greedy and of fixed length, with token ids (vLLM's extras through extra_body)."""
    return {
        "model": tiny_model.SERVED_NAME,
        "messages": msgs,
        "max_tokens": 8,
        "temperature": 0,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
        **extra,
    }


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


@dataclasses.dataclass(frozen=True)
class Deployed:
    """An EPDDeployment of one model and one unit, once Ready: its status, and its unit where a
    client finds it (`discover`: the status and the units' EndpointSlices)."""

    status: dict[str, Any]
    endpoints: Endpoints

    @property
    def unit(self) -> Unit:
        (unit,) = self.endpoints.model(MODEL).units
        return unit

    @property
    def ec_storage_path(self) -> str:
        return str(self.status["models"][0]["ecStoragePath"])


def deployed_ready(cluster, namespace: str, name: str, timeout: float = 900) -> Deployed:
    status = wait_ready(cluster, namespace, name, timeout)["status"]
    return Deployed(status, discover_ready(cluster.kubeconfig, name, namespace))


@pytest.fixture(scope="session")
def reference_applied(cluster, helm_operator, node_namespace, tiny_model_claim, tmp_path_factory) -> Iterator[str]:
    """The aggregated reference (one engine of the tiny model, no EC config), the demo's
    EPDDeployment `tiny-aggregated`, applied once for the session; its name. A module asks for
    this before applying its unit, and for `reference` once the unit is Ready: both load at once."""
    demo_serving.apply(
        cluster, tmp_path_factory.mktemp("reference"), node_namespace, tiny_model_claim, names=(demo_serving.REFERENCE,)
    )
    yield demo_serving.REFERENCE
    cluster.kubectl("delete", "epd", demo_serving.REFERENCE, "-n", node_namespace, "--wait=false", check=False)


@pytest.fixture(scope="session")
def reference(cluster, node_namespace, reference_applied) -> Deployed:
    """The reference, once Ready."""
    return deployed_ready(cluster, node_namespace, reference_applied)


def reference_url(reference: Deployed) -> str:
    url = reference.unit.entry_url
    assert url is not None
    return url
