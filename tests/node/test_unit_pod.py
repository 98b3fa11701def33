"""An EPD unit of the tiny model on the real node: the kubelet runs the operator's pod with real
vLLM in its containers, and says when each container started and is ready.

The operator runs in a pod too, installed by Helm (conftest). Two EPDDeployments start together
for the module: the unit (two encoders, one regular consumer) and the aggregated reference (one
engine, no EC config); every test shares them.
"""

from __future__ import annotations

import datetime as dt
import json
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from epd_client import EPDClient
from epd_dev.localcluster import node
from epd_dev.vllm import payloads
from epd_dev.vllm.payloads import image_part, messages
from epd_dev.vllm.real_node import node_manifest
from epd_dev.vllm.serving import discover_ready
from epd_operator.resources import UNIT_UID
from tests.node.conftest import get, wait_ready

pytestmark = [pytest.mark.node, pytest.mark.cluster, pytest.mark.vllm]

UNIT, REFERENCE, MODEL = "tiny-unit", "tiny-reference", "default"
SHM = "1Gi"


@pytest.fixture(scope="module")
def deployed(cluster, helm_operator, node_namespace, tiny_model_claim):
    unit = node_manifest(
        UNIT,
        tiny_model_claim,
        [{"workerType": "encoder", "numGpus": 2}, {"workerType": "regular", "numGpus": 1}],
        shm=SHM,
    )
    reference = node_manifest(REFERENCE, tiny_model_claim, [{"workerType": "regular", "numGpus": 1}])
    cluster.kubectl("apply", "-n", node_namespace, "-f", "-", input=yaml.safe_dump_all([unit, reference]))
    statuses = {name: wait_ready(cluster, node_namespace, name)["status"] for name in (UNIT, REFERENCE)}
    yield statuses
    cluster.kubectl("delete", "epd", UNIT, REFERENCE, "-n", node_namespace, "--wait=false", check=False)


def unit_pod(cluster, namespace: str, deployment: str = UNIT) -> dict:
    (pod,) = get(cluster, "pods", "-n", namespace, "-l", f"epd.vime.dev/deployment={deployment}")["items"]
    return pod


def started_at(status: dict) -> dt.datetime:
    return dt.datetime.fromisoformat(status["state"]["running"]["startedAt"])


def exec_in(cluster, namespace: str, pod: str, container: str, *argv: str) -> str:
    return cluster.kubectl("exec", "-n", namespace, pod, "-c", container, "--", *argv, timeout=120).stdout


def test_the_unit_is_ready_on_the_real_node_by_the_kubelets_word(cluster, deployed, helm_operator, node_namespace):
    nodes = {n["metadata"]["name"]: n for n in get(cluster, "nodes")["items"]}
    real = nodes[node.NAME]
    assert real["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert {c["type"]: c["status"] for c in real["status"]["conditions"]}["Ready"] == "True"
    assert set(nodes) == {node.NAME, *cluster.node_names}
    # The operator itself runs in a pod there, under its ServiceAccount.
    assert helm_operator["spec"]["nodeName"] == node.NAME
    assert helm_operator["spec"]["serviceAccountName"] == "epd-epd-operator"
    pod = unit_pod(cluster, node_namespace)
    assert pod["spec"]["nodeName"] == node.NAME
    assert {c["type"]: c["status"] for c in pod["status"]["conditions"]}["Ready"] == "True"
    statuses = [*pod["status"]["initContainerStatuses"], *pod["status"]["containerStatuses"]]
    assert {s["name"]: s["ready"] for s in statuses} == {
        "encoder-0": True,
        "encoder-1": True,
        "regular-0": True,
        "janitor": True,
    }
    assert all(s["restartCount"] == 0 for s in statuses)


def test_encoders_start_and_pass_their_startup_probes_before_the_consumer(cluster, deployed, node_namespace):
    pod = unit_pod(cluster, node_namespace)
    encoders = {s["name"]: s for s in pod["status"]["initContainerStatuses"]}
    consumer = next(s for s in pod["status"]["containerStatuses"] if s["name"] == "regular-0")
    assert all(s["started"] for s in encoders.values())
    # Sidecars start one after the other, each once the one before passed its startupProbe:
    # vLLM takes many seconds to load the model, so the gaps are that long, not a moment.
    first, second = started_at(encoders["encoder-0"]), started_at(encoders["encoder-1"])
    assert (second - first).total_seconds() >= 5
    assert (started_at(consumer) - second).total_seconds() >= 5


def test_dev_shm_is_the_pods_memory_emptydir(cluster, deployed, node_namespace):
    pod = unit_pod(cluster, node_namespace)
    name = pod["metadata"]["name"]
    marker = f"epd-node-test-{uuid.uuid4().hex}"
    exec_in(cluster, node_namespace, name, "encoder-0", "python3", "-c", f"open('/dev/shm/{marker}', 'w').write('x')")
    assert exec_in(cluster, node_namespace, name, "regular-0", "cat", f"/dev/shm/{marker}") == "x"
    assert not (Path("/dev/shm") / marker).exists(), "the pod's /dev/shm must not be the host's"
    mounts = exec_in(cluster, node_namespace, name, "regular-0", "cat", "/proc/mounts")
    (shm,) = [line.split() for line in mounts.splitlines() if line.split()[1] == "/dev/shm"]
    assert shm[2] == "tmpfs" and f"size={1024 * 1024}k" in shm[3], shm  # the sizeLimit, 1Gi


def test_logs_exec_and_the_restricted_uid(cluster, deployed, node_namespace):
    pod = unit_pod(cluster, node_namespace)
    name = pod["metadata"]["name"]
    logs = cluster.kubectl("logs", "-n", node_namespace, name, "-c", "encoder-0").stdout
    assert "Application startup complete" in logs
    assert exec_in(cluster, node_namespace, name, "regular-0", "id", "-u").strip() == str(UNIT_UID)
    # The model came from the claim, read-only.
    assert "config.json" in exec_in(cluster, node_namespace, name, "regular-0", "ls", "/models/tiny-llava")


def test_the_janitor_runs_and_serves_its_metrics(cluster, deployed, node_namespace):
    pod = unit_pod(cluster, node_namespace)
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:9400/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert "epd_ec" in text


async def test_epd_client_answers_as_one_aggregated_engine(cluster, deployed, node_namespace):
    """prime -> render -> generate against the pod IPs discover finds, as users' clients do."""
    endpoints = discover_ready(cluster.kubeconfig, UNIT, node_namespace)
    msgs = messages(image_part((10, 200, 200)), image_part((200, 100, 0)), text="two pictures")
    async with EPDClient(endpoints) as client:
        epd = payloads.output(await client.generate(payloads.greedy(msgs, max_tokens=8), model_name=MODEL))
    (ref_unit,) = discover_ready(cluster.kubeconfig, REFERENCE, node_namespace).model(MODEL).units
    reference = payloads.output(
        _post(
            ref_unit.entry_url,
            "/inference/v1/generate",
            _post(ref_unit.entry_url, "/v1/chat/completions/render", payloads.greedy(msgs, max_tokens=8)),
        )
    )
    assert epd[0] == reference[0]
    assert epd[1] == pytest.approx(reference[1], abs=1e-3)


def _post(base: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())
