"""The operator as a real process on the real control plane, with kwok GPU nodes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from epd_dev.operator_process import get_json, wait_for
from epd_dev.paths import REPO

pytestmark = pytest.mark.cluster

EXAMPLES = REPO / "docs" / "examples"
# Read by the kwok Stage that simulates a kubelet whose encoder readiness probe fails
# (epd_dev.localcluster's kwok config): "true" marks the unit's encoders unready, "false" ready again.
SIMULATE_ENCODER_UNREADY = "kwok.epd.vime.dev/encoder-unready"


def apply(cluster, namespace: str, manifest: dict | Path) -> dict:
    text = manifest.read_text() if isinstance(manifest, Path) else yaml.safe_dump(manifest)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=text)
    return yaml.safe_load(text)


def epd(cluster, namespace: str, name: str) -> dict:
    return get_json(cluster, "epd", name, "-n", namespace)


def condition(obj: dict, kind: str) -> dict:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def wait_condition(cluster, namespace: str, name: str, kind: str, status: str, timeout: float = 90) -> dict:
    def check():
        obj = epd(cluster, namespace, name)
        current = obj and condition(obj, kind)
        fresh = current and current.get("observedGeneration") == obj["metadata"]["generation"]
        return obj if fresh and current["status"] == status else None

    return wait_for(check, timeout, f"epd/{name} {kind}={status}",
                    lambda: json.dumps((epd(cluster, namespace, name) or {}).get("status"), indent=1))


def children(cluster, namespace: str, name: str) -> dict[str, list[dict]]:
    selector = f"epd.vime.dev/deployment={name}"
    return {
        kind: get_json(cluster, kind, "-n", namespace, "-l", selector)["items"]
        for kind in ("statefulsets", "services", "pods")
    }


def test_encoder_regular_topology_becomes_ready(cluster, namespace, epd_operator):
    apply(cluster, namespace, EXAMPLES / "encoder-regular.yaml")
    # `kubectl wait` works on the Ready condition, as users will call it.
    cluster.kubectl("wait", "--for=condition=Ready", "epd/qwen-vl-regular", "-n", namespace, "--timeout=120s",
                    timeout=130)
    obj = epd(cluster, namespace, "qwen-vl-regular")
    kids = children(cluster, namespace, "qwen-vl-regular")

    (sts,) = kids["statefulsets"]
    assert sts["metadata"]["name"] == "qwen-vl-regular-default"
    assert sts["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    pod_spec = sts["spec"]["template"]["spec"]
    (encoder,) = pod_spec["initContainers"]
    assert encoder["name"] == "encoder-0" and encoder["restartPolicy"] == "Always"
    assert encoder["startupProbe"]["httpGet"]["path"] == "/health"
    assert encoder["readinessProbe"]["httpGet"]["path"] == "/health"
    assert [c["name"] for c in pod_spec["containers"]] == ["regular-0", "janitor"]  # one consumer: no router
    for container in (encoder, pod_spec["containers"][0]):
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert pod_spec["volumes"][0]["emptyDir"]["medium"] == "Memory"
    assert not any("hostPath" in v for v in pod_spec["volumes"])

    (pod,) = kids["pods"]
    assert pod["spec"]["nodeName"].startswith("kwok-node-")
    ip = pod["status"]["podIP"]

    services = {s["metadata"]["name"]: s for s in kids["services"]}
    front, headless = services["qwen-vl-regular-default"], services["qwen-vl-regular-default-units"]
    assert headless["spec"]["clusterIP"] == "None"
    for service in (front, headless):
        assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    http_port = next(p for c in pod_spec["containers"] for p in c["ports"] if p["name"] == "http")
    assert http_port["containerPort"] != encoder["ports"][0]["containerPort"]  # encoders never behind a Service

    status = obj["status"]
    assert status["phase"] == "Ready" and status["ready"] == "1/1"
    assert condition(obj, "EncodersReady")["status"] == "True"
    (model,) = status["models"]
    assert model["ecStoragePath"].startswith("/dev/shm/vime-ec-")
    (unit,) = model["units"]
    assert unit["pod"] == pod["metadata"]["name"] and unit["ready"] is True
    assert unit["encoderUrls"] == [f"http://{ip}:{encoder['ports'][0]['containerPort']}"]
    assert unit["consumerUrls"] == [f"http://{ip}:{http_port['containerPort']}"]
    assert "routerUrl" not in unit

    table = cluster.kubectl("get", "epd", "-n", namespace).stdout
    assert table.split()[:6] == ["NAME", "READY", "PHASE", "MODELS", "REPLICAS", "AGE"]
    assert "qwen-vl-regular   1/1     Ready" in table


def test_prefill_decode_topology_gets_a_router_listing_only_consumers(cluster, namespace, epd_operator):
    apply(cluster, namespace, EXAMPLES / "encoder-prefill-decode.yaml")
    obj = wait_condition(cluster, namespace, "qwen-vl-pd", "Ready", "True", timeout=120)
    (sts,) = children(cluster, namespace, "qwen-vl-pd")["statefulsets"]
    pod_spec = sts["spec"]["template"]["spec"]
    names = [c["name"] for c in pod_spec["containers"]]
    assert names == ["prefill-0", "decode-0", "router", "janitor"]
    ports = {c["name"]: c["ports"][0]["containerPort"] for c in [*pod_spec["initContainers"], *pod_spec["containers"]]}
    router_args = " ".join(pod_spec["containers"][2]["args"])
    assert f"127.0.0.1:{ports['prefill-0']}" in router_args and f"127.0.0.1:{ports['decode-0']}" in router_args
    assert f":{ports['encoder-0']}" not in router_args
    nixl = [p for c in pod_spec["containers"] for p in c["ports"] if p["name"].startswith("nixl")]
    assert len({p["containerPort"] for p in nixl}) == 2  # a side channel per engine
    unit = obj["status"]["models"][0]["units"][0]
    assert unit["routerUrl"].endswith(f":{ports['router']}")


def test_second_reconcile_changes_nothing(cluster, namespace, epd_operator):
    apply(cluster, namespace, EXAMPLES / "encoder-regular.yaml")
    wait_condition(cluster, namespace, "qwen-vl-regular", "Ready", "True", timeout=120)
    time.sleep(1)  # let the last status write settle
    before = {(k, o["metadata"]["name"]): o["metadata"]["resourceVersion"]
              for k, objs in children(cluster, namespace, "qwen-vl-regular").items() if k != "pods" for o in objs}
    status_before = epd(cluster, namespace, "qwen-vl-regular")["status"]
    # Any event on the object makes the operator reconcile it again.
    cluster.kubectl("annotate", "epd/qwen-vl-regular", "-n", namespace, "touched=1")
    time.sleep(3)
    after = {(k, o["metadata"]["name"]): o["metadata"]["resourceVersion"]
             for k, objs in children(cluster, namespace, "qwen-vl-regular").items() if k != "pods" for o in objs}
    assert after == before
    assert epd(cluster, namespace, "qwen-vl-regular")["status"] == status_before


def test_unready_encoder_takes_its_unit_out_and_recovers(cluster, namespace, epd_operator):
    manifest = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())
    manifest["spec"]["replicas"] = 2
    apply(cluster, namespace, manifest)
    wait_condition(cluster, namespace, "qwen-vl-regular", "Ready", "True", timeout=120)
    sick = "qwen-vl-regular-default-1"
    cluster.kubectl("annotate", "pod", sick, "-n", namespace, f"{SIMULATE_ENCODER_UNREADY}=true", "--overwrite")

    obj = wait_condition(cluster, namespace, "qwen-vl-regular", "Ready", "False")
    assert condition(obj, "EncodersReady")["status"] == "False"
    degraded = condition(obj, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "EncoderUnready"
    assert sick in degraded["message"] and "encoder-0" in degraded["message"]
    units = {u["pod"]: u for u in obj["status"]["models"][0]["units"]}
    assert units[sick]["ready"] is False and units[sick]["reason"] == "EncoderUnready"
    assert units["qwen-vl-regular-default-0"]["ready"] is True
    assert obj["status"]["ready"] == "1/2" and obj["status"]["phase"] == "Degraded"
    # The kubelet's verdict and ours agree: the sick unit's pod is out of the Service.
    endpoints = get_json(cluster, "endpointslices", "-n", namespace, "-l",
                         "kubernetes.io/service-name=qwen-vl-regular-default")["items"]
    ready_pods = {e["targetRef"]["name"] for s in endpoints for e in s.get("endpoints") or []
                  if e["conditions"].get("ready")}
    assert sick not in ready_pods

    cluster.kubectl("annotate", "pod", sick, "-n", namespace, f"{SIMULATE_ENCODER_UNREADY}=false", "--overwrite")
    obj = wait_condition(cluster, namespace, "qwen-vl-regular", "Ready", "True")
    assert condition(obj, "Degraded")["status"] == "False"


def test_spec_change_rolls_the_units(cluster, namespace, epd_operator):
    manifest = apply(cluster, namespace, EXAMPLES / "encoder-regular.yaml")
    wait_condition(cluster, namespace, "qwen-vl-regular", "Ready", "True", timeout=120)
    (old_pod,) = children(cluster, namespace, "qwen-vl-regular")["pods"]
    manifest["spec"]["models"][0]["serverGroups"][1]["overrides"] = {"max_model_len": 4096}
    apply(cluster, namespace, manifest)

    def rolled():
        pods = children(cluster, namespace, "qwen-vl-regular")["pods"]
        return [p for p in pods if p["metadata"]["uid"] != old_pod["metadata"]["uid"]
                and p.get("status", {}).get("podIP")]

    (new_pod,) = wait_for(rolled, 90, "the unit pod to be replaced")
    regular = next(c for c in new_pod["spec"]["containers"] if c["name"] == "regular-0")
    assert "--max-model-len" in regular["args"] and "4096" in regular["args"]
    wait_condition(cluster, namespace, "qwen-vl-regular", "Ready", "True", timeout=120)


def test_deleting_the_deployment_removes_everything(cluster, namespace, epd_operator):
    apply(cluster, namespace, EXAMPLES / "encoder-prefill-decode.yaml")
    wait_condition(cluster, namespace, "qwen-vl-pd", "Ready", "True", timeout=120)
    cluster.kubectl("delete", "epd/qwen-vl-pd", "-n", namespace, "--wait=true", timeout=60)
    wait_for(lambda: not any(children(cluster, namespace, "qwen-vl-pd").values()), 90,
             "garbage collection of every child")


def test_deleted_child_is_recreated(cluster, namespace, epd_operator):
    apply(cluster, namespace, EXAMPLES / "encoder-regular.yaml")
    wait_condition(cluster, namespace, "qwen-vl-regular", "Ready", "True", timeout=120)
    cluster.kubectl("delete", "service", "qwen-vl-regular-default", "-n", namespace)
    wait_for(lambda: get_json(cluster, "service", "qwen-vl-regular-default", "-n", namespace), 30,
             "the deleted Service to come back")


def test_invalid_spec_creates_nothing_and_is_reported(cluster, namespace, epd_operator, crd_without_cel):
    manifest = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())
    manifest["spec"]["models"][0]["serverGroups"][1]["workerType"] = "prefill"  # encoder+prefill
    apply(cluster, namespace, manifest)
    obj = wait_condition(cluster, namespace, "qwen-vl-regular", "Validated", "False", timeout=60)
    assert obj["status"]["phase"] == "Invalid"
    assert "model 'default': encoder+prefill is incomplete: add a decode group" in condition(obj, "Validated")["message"]

    def warning():
        events = get_json(cluster, "events", "-n", namespace,
                          "--field-selector", "involvedObject.name=qwen-vl-regular,type=Warning")["items"]
        return [e for e in events if e["reason"] == "InvalidSpec"]

    (event,) = wait_for(warning, 30, "a Warning Event")
    assert "add a decode group" in event["message"]
    assert not any(children(cluster, namespace, "qwen-vl-regular").values())
    assert 'epd_invalid_specs 1.0' in epd_operator.metrics()


def test_killed_operator_converges_without_duplicates(cluster, namespace, epd_operator):
    base = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())
    names = [f"unit-{i}" for i in range(6)]
    for name in names:
        manifest = json.loads(json.dumps(base))
        manifest["metadata"]["name"] = name
        apply(cluster, namespace, manifest)
    time.sleep(0.3)
    epd_operator.kill()  # kill -9, mid-reconcile
    epd_operator.start()
    for name in names:
        wait_condition(cluster, namespace, name, "Ready", "True", timeout=120)
    for name in names:
        kids = children(cluster, namespace, name)
        assert len(kids["statefulsets"]) == 1 and len(kids["services"]) == 2 and len(kids["pods"]) == 1
