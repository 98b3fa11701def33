"""Proof that each part of the local control plane is the real thing.

Every check goes through the real kubectl against the real apiserver; kwok is
the only fake (it plays the kubelets).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from epd_dev.localcluster import (
    ETCD_VERSION,
    HELM_VERSION,
    K8S_VERSION,
    KWOK_VERSION,
    ClusterBusy,
    ClusterError,
    LocalCluster,
    binaries,
)
from epd_dev.localcluster.cluster import alive_components
from epd_dev.operator_process import wait_established, wait_for

from .fixtures import require_binaries

pytestmark = pytest.mark.cluster


def wait(what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
    return wait_for(check, timeout, what)


def get(kubectl, *args: str) -> dict:
    return json.loads(kubectl("get", *args, "-o", "json").stdout)


def condition(obj: dict, kind: str) -> dict:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), {})


# --------------------------------------------------------------------- versions


@pytest.mark.parametrize("binary", binaries.BINARIES, ids=lambda b: b.name)
def test_binary_reports_pinned_version(binary: binaries.Binary) -> None:
    require_binaries()
    out = subprocess.run(
        [str(binaries.bin_dir() / binary.name), *binary.version_args], capture_output=True, text=True, check=True
    )
    assert binary.expect in out.stdout + out.stderr


def test_pinned_versions() -> None:
    # The constants the cache key is built from are the ones the brief pins.
    assert (K8S_VERSION, ETCD_VERSION, KWOK_VERSION, HELM_VERSION) == ("v1.36.3", "v3.6.16", "v0.8.0", "v3.22.0")


def test_server_version_and_nodes(cluster: LocalCluster, kubectl) -> None:
    version = json.loads(kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == K8S_VERSION
    everything = get(kubectl, "nodes")["items"]
    # kwok's GPU nodes, and the real node when the session has it (tests/node checks that one).
    assert sorted(n["metadata"]["name"] for n in everything) == sorted([*cluster.node_names, *cluster.real_node_names])
    nodes = [n for n in everything if n["metadata"]["name"] in cluster.node_names]
    for node in nodes:
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
        assert condition(node, "Ready")["status"] == "True"
        assert not node["spec"].get("taints")


# ------------------------------------------- controller-manager, scheduler, kwok

DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: gpu-app}
spec:
  replicas: 3
  selector: {matchLabels: {app: gpu-app}}
  template:
    metadata: {labels: {app: gpu-app}}
    spec:
      containers:
      - name: main
        image: registry.example/never-pulled:1
        resources:
          limits: {nvidia.com/gpu: 4}
"""


def test_deployment_gets_replicaset_and_running_pods(cluster, kubectl, namespace) -> None:
    kubectl("apply", "-n", namespace, "-f", "-", input=DEPLOYMENT)

    # kube-controller-manager: Deployment -> ReplicaSet -> Pods, linked by ownerReferences.
    rs = wait("a ReplicaSet", lambda: get(kubectl, "rs", "-n", namespace)["items"])
    assert rs[0]["metadata"]["ownerReferences"][0]["kind"] == "Deployment"

    def ready_pods():
        pods = get(kubectl, "pods", "-n", namespace, "-l", "app=gpu-app")["items"]
        ready = [
            p for p in pods if p["status"].get("phase") == "Running" and condition(p, "Ready").get("status") == "True"
        ]
        return ready if len(ready) == 3 else None

    # kube-scheduler binds them to kwok nodes; kwok marks them Running and Ready.
    pods = wait("3 Running and Ready pods", ready_pods)
    for pod in pods:
        assert pod["metadata"]["ownerReferences"][0]["kind"] == "ReplicaSet"
        assert pod["spec"]["nodeName"] in cluster.node_names
        assert pod["status"]["podIP"]
    # 4 GPUs each on 8-GPU nodes: the scheduler never puts more than 2 on a node.
    per_node: dict[str, int] = {}
    for pod in pods:
        per_node[pod["spec"]["nodeName"]] = per_node.get(pod["spec"]["nodeName"], 0) + 1
    assert max(per_node.values()) <= 2

    # And the Deployment controller sees them available.
    wait(
        "Deployment available",
        lambda: get(kubectl, "deploy", "gpu-app", "-n", namespace)["status"].get("availableReplicas") == 3,
    )


TOO_MANY_GPUS = """
apiVersion: v1
kind: Pod
metadata: {name: greedy}
spec:
  containers:
  - name: main
    image: registry.example/never-pulled:1
    resources:
      limits: {nvidia.com/gpu: 9}
"""


def test_pod_asking_for_more_gpus_than_a_node_has_stays_pending(kubectl, namespace) -> None:
    kubectl("apply", "-n", namespace, "-f", "-", input=TOO_MANY_GPUS)

    def unschedulable():
        cond = condition(get(kubectl, "pod", "greedy", "-n", namespace), "PodScheduled")
        return cond if cond.get("reason") == "Unschedulable" else None

    cond = wait("PodScheduled=False/Unschedulable", unschedulable)
    assert cond["status"] == "False"
    assert "Insufficient nvidia.com/gpu" in cond["message"]
    events = get(
        kubectl, "events", "-n", namespace, "--field-selector", "involvedObject.name=greedy,reason=FailedScheduling"
    )
    assert any("nvidia.com/gpu" in e["message"] for e in events["items"])
    pod = get(kubectl, "pod", "greedy", "-n", namespace)
    assert pod["status"]["phase"] == "Pending"
    assert not pod["spec"].get("nodeName")


# ------------------------------------------------------------- CRD validation

CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: widgets.test.epd.dev}
spec:
  group: test.epd.dev
  names: {kind: Widget, plural: widgets, singular: widget}
  scope: Namespaced
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              min: {type: integer}
              max: {type: integer}
            x-kubernetes-validations:
            - rule: self.min <= self.max
              message: min must not exceed max
"""


def widget(name: str, low: int, high: int) -> str:
    return f"apiVersion: test.epd.dev/v1\nkind: Widget\nmetadata: {{name: {name}}}\nspec: {{min: {low}, max: {high}}}\n"


def test_crd_cel_rule_rejects_bad_object_at_apply(kubectl, namespace) -> None:
    kubectl("apply", "-f", "-", input=CRD)
    wait_established(kubectl, "widgets.test.epd.dev")

    kubectl("apply", "-n", namespace, "-f", "-", input=widget("good", 1, 2))
    bad = kubectl("apply", "-n", namespace, "-f", "-", input=widget("bad", 3, 2), check=False)
    assert bad.returncode != 0
    assert "min must not exceed max" in bad.stderr
    assert kubectl("get", "widget", "bad", "-n", namespace, check=False).returncode != 0


# ----------------------------------------------------------- garbage collector


def test_deleting_owner_garbage_collects_dependent(kubectl, namespace) -> None:
    kubectl("create", "configmap", "owner", "-n", namespace)
    uid = get(kubectl, "configmap", "owner", "-n", namespace)["metadata"]["uid"]
    dependent = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "dependent",
            "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}],
        },
    }
    kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(dependent))

    kubectl("delete", "configmap", "owner", "-n", namespace)
    wait(
        "the dependent to be garbage-collected",
        lambda: kubectl("get", "configmap", "dependent", "-n", namespace, check=False).returncode != 0,
    )


# ---------------------------------------------------- native sidecar and /dev/shm

SIDECAR_POD = """
apiVersion: v1
kind: Pod
metadata: {name: with-sidecar}
spec:
  initContainers:
  - name: proxy
    image: registry.example/proxy:1
    restartPolicy: Always
  containers:
  - name: engine
    image: registry.example/engine:1
    volumeMounts:
    - {name: dshm, mountPath: /dev/shm}
  volumes:
  - name: dshm
    emptyDir: {medium: Memory, sizeLimit: 1Gi}
"""


def test_native_sidecar_and_memory_shm_are_accepted(kubectl, namespace) -> None:
    kubectl("apply", "-n", namespace, "-f", "-", input=SIDECAR_POD)

    def running():
        pod = get(kubectl, "pod", "with-sidecar", "-n", namespace)
        return pod if pod["status"].get("phase") == "Running" else None

    pod = wait("the sidecar pod Running", running)
    assert pod["spec"]["initContainers"][0]["restartPolicy"] == "Always"
    assert pod["spec"]["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    sidecar = pod["status"]["initContainerStatuses"][0]
    assert sidecar["started"] is True and "running" in sidecar["state"]


# ------------------------------------------------------------------------ RBAC


def test_rbac_is_enforced(kubectl, namespace) -> None:
    sa = f"system:serviceaccount:{namespace}:default"
    assert kubectl("auth", "can-i", "list", "pods", "-n", namespace, "--as", sa, check=False).stdout.strip() == "no"
    kubectl(
        "create", "rolebinding", "view", "--clusterrole=view", f"--serviceaccount={namespace}:default", "-n", namespace
    )
    assert kubectl("auth", "can-i", "list", "pods", "-n", namespace, "--as", sa).stdout.strip() == "yes"


# ------------------------------------------------------------------------ helm


def test_helm_installs_a_chart(cluster, namespace, tmp_path: Path) -> None:
    chart = tmp_path / "demo"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: demo\nversion: 0.1.0\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: demo}\ndata: {release: '{{ .Release.Name }}'}\n"
    )
    helm = subprocess.run(
        ["helm", "install", "rel", str(chart), "-n", namespace, "--wait"],
        check=False,
        capture_output=True,
        text=True,
        env=cluster.env(),
        timeout=120,
    )
    assert helm.returncode == 0, helm.stderr
    cm = get(cluster.kubectl, "configmap", "demo", "-n", namespace)
    assert cm["data"] == {"release": "rel"}


# ---------------------------------------------------- launcher: isolation, CLI


def test_second_cluster_beside_the_first_and_cli_lifecycle(cluster, tmp_path: Path) -> None:
    """A second cluster runs beside the session one; the CLI in other processes manages it."""

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "epd_dev.localcluster", *args, "--dir", str(tmp_path)],
            check=False,
            capture_output=True,
            text=True,
            timeout=240,
        )

    try:
        up = cli("up", "--nodes", "1")
        assert up.returncode == 0, up.stdout + up.stderr
        first = json.loads((tmp_path / "state.json").read_text())
        session_ports = json.loads(cluster.state_file.read_text())["ports"]
        assert not set(first["ports"].values()) & set(session_ports.values())
        assert cli("status").returncode == 0
        second = LocalCluster(tmp_path, nodes=1)
        assert second.kubectl("get", "nodes", "-o", "name").stdout.split() == ["node/kwok-node-0"]
        assert cluster.kubectl("get", "nodes", "-o", "name").stdout.count("node/") == 4 + cluster.real_nodes

        # The launcher process is gone; a new `up` finds and kills what it left running.
        again = cli("up", "--nodes", "1", "--recreate")
        assert again.returncode == 0, again.stdout + again.stderr
        assert "killed leftovers" in again.stdout
        assert not alive_components(first)
        renewed = json.loads((tmp_path / "state.json").read_text())

        down = cli("down")
        assert down.returncode == 0, down.stdout + down.stderr
        assert not alive_components(renewed)
        assert cli("status").returncode == 1
        assert cluster.status()["running"]  # the session cluster is untouched
    finally:
        cli("down")  # a cluster the CLI started has no owner to stop it otherwise


def test_a_folder_in_use_is_refused(cluster) -> None:
    # The session owns its folder: a second start there must not kill its cluster.
    with pytest.raises(ClusterBusy):
        LocalCluster(cluster.dir, nodes=1, log=lambda msg: None).start()
    assert cluster.status()["running"]


class _BrokenScheduler(LocalCluster):
    def _scheduler_args(self) -> list[str]:
        return [*super()._scheduler_args(), "--no-such-flag"]


def test_failing_component_is_reported_with_its_log_and_everything_stops(tmp_path: Path) -> None:
    require_binaries()
    broken = _BrokenScheduler(tmp_path, nodes=1, die_with_parent=True, log=lambda msg: None)
    with pytest.raises(ClusterError) as failure:
        broken.start()
    message = str(failure.value)
    assert "kube-scheduler exited" in message
    assert "unknown flag: --no-such-flag" in message  # the tail of logs/kube-scheduler.log
    assert not (tmp_path / "state.json").exists()
    assert not broken.status()["components"]["kube-apiserver"]
