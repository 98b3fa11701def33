"""The operator as a real process on the real control plane, with kwok GPU nodes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from epd_client import discover
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

    return wait_for(
        check,
        timeout,
        f"epd/{name} {kind}={status}",
        lambda: json.dumps((epd(cluster, namespace, name) or {}).get("status"), indent=1),
    )


def children(cluster, namespace: str, name: str) -> dict[str, list[dict]]:
    selector = f"epd.vime.dev/deployment={name}"
    return {
        kind: get_json(cluster, kind, "-n", namespace, "-l", selector)["items"]
        for kind in ("statefulsets", "services", "pods")
    }


def test_encoder_regular_topology_becomes_ready(cluster, namespace, epd_operator):
    apply(cluster, namespace, EXAMPLES / "encoder-regular.yaml")
    # `kubectl wait` works on the Ready condition, as users will call it.
    cluster.kubectl(
        "wait", "--for=condition=Ready", "epd/qwen-vl-regular", "-n", namespace, "--timeout=120s", timeout=130
    )
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
    assert [c["name"] for c in pod_spec["containers"]] == ["regular-0", "proxy", "janitor"]  # one consumer: no router
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
    assert (model["statefulSet"], model["unitsService"], model["readyUnits"]) == (
        sts["metadata"]["name"],
        headless["metadata"]["name"],
        1,
    )
    # Where the unit is, the units Service's EndpointSlices say; what it holds, the status.
    (unit,) = wait_for(
        lambda: [
            u
            for u in discover("qwen-vl-regular", namespace, kubeconfig=str(cluster.kubeconfig)).model("default").units
            if u.ready
        ],
        30,
        "the unit in its Service's EndpointSlices",
    )
    assert unit.pod == pod["metadata"]["name"] and unit.node == pod["spec"]["nodeName"]
    assert unit.encoder_urls == (f"http://{ip}:{encoder['ports'][0]['containerPort']}",)
    (consumer,) = [c for c in pod_spec["containers"] if c["name"] == "regular-0"]
    assert unit.consumer_urls == (f"http://{ip}:{consumer['ports'][0]['containerPort']}",)
    assert unit.entry_url == f"http://{ip}:{http_port['containerPort']}"  # the EPD proxy, in front of it
    assert unit.router_url is None and "routerPort" not in model

    table = cluster.kubectl("get", "epd", "-n", namespace).stdout
    assert table.split()[:6] == ["NAME", "READY", "PHASE", "MODELS", "REPLICAS", "AGE"]
    assert "qwen-vl-regular   1/1     Ready" in table


def test_prefill_decode_topology_gets_a_router_listing_only_consumers(cluster, namespace, epd_operator):
    apply(cluster, namespace, EXAMPLES / "encoder-prefill-decode.yaml")
    obj = wait_condition(cluster, namespace, "qwen-vl-pd", "Ready", "True", timeout=120)
    (sts,) = children(cluster, namespace, "qwen-vl-pd")["statefulsets"]
    pod_spec = sts["spec"]["template"]["spec"]
    names = [c["name"] for c in pod_spec["containers"]]
    assert names == ["prefill-0", "decode-0", "router", "proxy", "janitor"]
    ports = {c["name"]: c["ports"][0]["containerPort"] for c in [*pod_spec["initContainers"], *pod_spec["containers"]]}
    router_args = " ".join(pod_spec["containers"][2]["args"])
    assert f"127.0.0.1:{ports['prefill-0']}" in router_args and f"127.0.0.1:{ports['decode-0']}" in router_args
    assert f":{ports['encoder-0']}" not in router_args
    nixl = [p for c in pod_spec["containers"] for p in c["ports"] if p["name"].startswith("nixl")]
    assert len({p["containerPort"] for p in nixl}) == 2  # a side channel per engine
    (model,) = obj["status"]["models"]
    # The unit's entry is its EPD proxy; the router serves it on the loopback only.
    assert model["entryPort"] == ports["proxy"] and "routerPort" not in model
    assert "--host 127.0.0.1" in router_args


def test_second_reconcile_changes_nothing(cluster, namespace, epd_operator):
    apply(cluster, namespace, EXAMPLES / "encoder-regular.yaml")
    wait_condition(cluster, namespace, "qwen-vl-regular", "Ready", "True", timeout=120)
    time.sleep(1)  # let the last status write settle
    before = {
        (k, o["metadata"]["name"]): o["metadata"]["resourceVersion"]
        for k, objs in children(cluster, namespace, "qwen-vl-regular").items()
        if k != "pods"
        for o in objs
    }
    status_before = epd(cluster, namespace, "qwen-vl-regular")["status"]
    # Any event on the object makes the operator reconcile it again.
    cluster.kubectl("annotate", "epd/qwen-vl-regular", "-n", namespace, "touched=1")
    time.sleep(3)
    after = {
        (k, o["metadata"]["name"]): o["metadata"]["resourceVersion"]
        for k, objs in children(cluster, namespace, "qwen-vl-regular").items()
        if k != "pods"
        for o in objs
    }
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
    (unready,) = obj["status"]["models"][0]["unready"]
    assert (unready["name"], unready["reason"]) == (sick, "EncoderUnready")
    assert obj["status"]["ready"] == "1/2" and obj["status"]["phase"] == "Degraded"
    # The kubelet's verdict and ours agree: the sick unit's pod is out of the Service.
    endpoints = get_json(
        cluster, "endpointslices", "-n", namespace, "-l", "kubernetes.io/service-name=qwen-vl-regular-default"
    )["items"]
    ready_pods = {
        e["targetRef"]["name"] for s in endpoints for e in s.get("endpoints") or [] if e["conditions"].get("ready")
    }
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
        return [
            p for p in pods if p["metadata"]["uid"] != old_pod["metadata"]["uid"] and p.get("status", {}).get("podIP")
        ]

    (new_pod,) = wait_for(rolled, 90, "the unit pod to be replaced")
    regular = next(c for c in new_pod["spec"]["containers"] if c["name"] == "regular-0")
    assert "--max-model-len" in regular["args"] and "4096" in regular["args"]
    wait_condition(cluster, namespace, "qwen-vl-regular", "Ready", "True", timeout=120)


def test_deleting_the_deployment_removes_everything(cluster, namespace, epd_operator):
    apply(cluster, namespace, EXAMPLES / "encoder-prefill-decode.yaml")
    wait_condition(cluster, namespace, "qwen-vl-pd", "Ready", "True", timeout=120)
    cluster.kubectl("delete", "epd/qwen-vl-pd", "-n", namespace, "--wait=true", timeout=60)
    wait_for(
        lambda: not any(children(cluster, namespace, "qwen-vl-pd").values()), 90, "garbage collection of every child"
    )


def test_deleted_child_is_recreated(cluster, namespace, epd_operator):
    apply(cluster, namespace, EXAMPLES / "encoder-regular.yaml")
    wait_condition(cluster, namespace, "qwen-vl-regular", "Ready", "True", timeout=120)
    cluster.kubectl("delete", "service", "qwen-vl-regular-default", "-n", namespace)
    wait_for(
        lambda: get_json(cluster, "service", "qwen-vl-regular-default", "-n", namespace),
        30,
        "the deleted Service to come back",
    )


def test_invalid_spec_creates_nothing_and_is_reported(cluster, namespace, epd_operator, crd_without_cel):
    manifest = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())
    manifest["spec"]["models"][0]["serverGroups"][1]["workerType"] = "prefill"  # encoder+prefill
    apply(cluster, namespace, manifest)
    obj = wait_condition(cluster, namespace, "qwen-vl-regular", "Validated", "False", timeout=60)
    assert obj["status"]["phase"] == "Invalid"
    assert (
        "model 'default': encoder+prefill is incomplete: add a decode group" in condition(obj, "Validated")["message"]
    )

    def warning():
        events = get_json(
            cluster, "events", "-n", namespace, "--field-selector", "involvedObject.name=qwen-vl-regular,type=Warning"
        )["items"]
        return [e for e in events if e["reason"] == "InvalidSpec"]

    (event,) = wait_for(warning, 30, "a Warning Event")
    assert "add a decode group" in event["message"]
    assert not any(children(cluster, namespace, "qwen-vl-regular").values())
    assert "epd_invalid_specs 1.0" in epd_operator.metrics()


def test_a_child_the_api_server_refuses_is_reported_in_the_status_and_created_once_allowed(
    cluster, namespace, epd_operator
):
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "one-service"},
        "spec": {"hard": {"services": "1"}},
    }
    apply(cluster, namespace, quota)
    # Quota admission refuses every Service until the quota controller has counted the usage.
    wait_for(
        lambda: get_json(cluster, "resourcequota", "one-service", "-n", namespace).get("status", {}).get("hard"),
        30,
        "the quota counted",
    )
    apply(cluster, namespace, EXAMPLES / "encoder-regular.yaml")  # two Services: one is refused
    obj = wait_condition(cluster, namespace, "qwen-vl-regular", "Degraded", "True", timeout=60)
    degraded = condition(obj, "Degraded")
    assert degraded["reason"] == "ApplyFailed", degraded
    assert "services" in degraded["message"] and "exceeded quota: one-service" in degraded["message"]
    assert obj["status"]["phase"] == "Degraded"

    # The quota raised: the next attempt (a pod event's, or the backoff's, at most 60 s apart) goes through.
    quota["spec"]["hard"]["services"] = "2"
    apply(cluster, namespace, quota)
    wait_for(
        lambda: condition(epd(cluster, namespace, "qwen-vl-regular"), "Degraded").get("reason") == "AsExpected",
        90,
        "the refusal cleared",
        lambda: json.dumps(epd(cluster, namespace, "qwen-vl-regular")["status"], indent=1),
    )
    assert len(children(cluster, namespace, "qwen-vl-regular")["services"]) == 2
    wait_condition(cluster, namespace, "qwen-vl-regular", "Ready", "True", timeout=60)


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


# --------------------------------------------------------------------------- placement Pools

POOLS = "qwen-vl-pools"
GATE = "epd.vime.dev/encoders-ready"


def pool_and_unit_pods(cluster, namespace: str, name: str) -> tuple[list[dict], list[dict]]:
    """(encoder pool pods, unit pods) of the deployment's only model, terminating ones left out."""
    pods = [p for p in children(cluster, namespace, name)["pods"] if not p["metadata"].get("deletionTimestamp")]
    pool = [p for p in pods if "epd.vime.dev/encoder-pool" in p["metadata"]["labels"]]
    units = [p for p in pods if "epd.vime.dev/model" in p["metadata"]["labels"]]
    assert len(pool) + len(units) == len(pods)
    return pool, units


def pod_condition(pod: dict, kind: str) -> dict:
    return next((c for c in pod.get("status", {}).get("conditions") or [] if c["type"] == kind), {})


def ready_endpoints(cluster, namespace: str, service: str) -> set[str]:
    slices = get_json(cluster, "endpointslices", "-n", namespace, "-l", f"kubernetes.io/service-name={service}")[
        "items"
    ]
    return {e["targetRef"]["name"] for s in slices for e in s.get("endpoints") or [] if e["conditions"].get("ready")}


def test_pools_put_encoders_and_consumer_units_on_different_nodes(cluster, namespace, epd_operator):
    apply(cluster, namespace, EXAMPLES / "encoder-pools.yaml")  # 2 encoder pool pods, 3 units
    obj = wait_condition(cluster, namespace, POOLS, "Ready", "True", timeout=120)
    pool, units = pool_and_unit_pods(cluster, namespace, POOLS)
    assert sorted(p["metadata"]["name"] for p in pool) == [
        "qwen-vl-pools-default-encoders-0",
        "qwen-vl-pools-default-encoders-1",
    ]
    assert sorted(p["metadata"]["name"] for p in units) == [f"qwen-vl-pools-default-{i}" for i in range(3)]
    encoder_nodes = {p["spec"]["nodeName"] for p in pool}
    unit_nodes = {p["spec"]["nodeName"] for p in units}
    assert encoder_nodes and unit_nodes and not encoder_nodes & unit_nodes, (encoder_nodes, unit_nodes)
    for unit in units:
        assert [c["name"] for c in unit["spec"]["containers"]] == ["regular-0", "proxy"] and not unit["spec"].get(
            "initContainers"
        )
        gate = pod_condition(unit, GATE)
        assert (gate["status"], gate["reason"]) == ("True", "EncodersReady"), gate
    (model,) = obj["status"]["models"]
    assert model["placement"] == "Pools" and model["readyUnits"] == 3
    assert model["encoderPool"]["readyPods"] == 2
    assert condition(obj, "EncodersReady")["status"] == "True"
    # Each Service holds its own kind of pod only.
    unit_names = {p["metadata"]["name"] for p in units}
    pool_names = {p["metadata"]["name"] for p in pool}
    # (The endpoint slice controller follows pod readiness a moment later than the status.)
    wait_for(
        lambda: ready_endpoints(cluster, namespace, "qwen-vl-pools-default") == unit_names,
        30,
        "the model's Service to list the units, and only them",
    )
    wait_for(
        lambda: ready_endpoints(cluster, namespace, "qwen-vl-pools-default-encoders") == pool_names,
        30,
        "the encoder pool Service to list the pool's pods, and only them",
    )


def test_the_readiness_gate_closes_when_every_encoder_is_unready_and_opens_when_one_recovers(
    cluster, namespace, epd_operator
):
    apply(cluster, namespace, EXAMPLES / "encoder-pools.yaml")
    wait_condition(cluster, namespace, POOLS, "Ready", "True", timeout=120)
    encoders = ["qwen-vl-pools-default-encoders-0", "qwen-vl-pools-default-encoders-1"]
    for pod in encoders:
        cluster.kubectl("annotate", "pod", pod, "-n", namespace, f"{SIMULATE_ENCODER_UNREADY}=true", "--overwrite")

    obj = wait_condition(cluster, namespace, POOLS, "EncodersReady", "False")
    wait_for(
        lambda: condition(epd(cluster, namespace, POOLS), "EncodersReady").get("reason") == "NoReadyEncoder",
        30,
        "EncodersReady reason NoReadyEncoder",
    )
    obj = epd(cluster, namespace, POOLS)
    assert (
        "encoder pool qwen-vl-pools-default-encoders of model default has no ready encoder"
        in condition(obj, "EncodersReady")["message"]
    )

    def gates_closed():
        _pool, units = pool_and_unit_pods(cluster, namespace, POOLS)
        closed = [
            u
            for u in units
            if pod_condition(u, GATE).get("status") == "False" and pod_condition(u, "Ready").get("status") == "False"
        ]
        return units if len(closed) == len(units) == 3 else None

    for unit in wait_for(gates_closed, 60, "every unit's gate closed and the unit unready"):
        gate = pod_condition(unit, GATE)
        assert gate["reason"] == "NoReadyEncoder"
        assert gate["message"] == "encoder pool qwen-vl-pools-default-encoders has no ready encoder"
    wait_for(
        lambda: not ready_endpoints(cluster, namespace, "qwen-vl-pools-default"),
        30,
        "no unit left in the model's Service",
    )
    obj = wait_condition(cluster, namespace, POOLS, "Ready", "False")
    assert obj["status"]["models"][0]["unreadyReasons"] == {"NoReadyEncoder": 3}
    assert obj["status"]["models"][0]["encoderPool"]["readyPods"] == 0

    cluster.kubectl("annotate", "pod", encoders[1], "-n", namespace, f"{SIMULATE_ENCODER_UNREADY}=false", "--overwrite")

    def gates_open():
        _pool, units = pool_and_unit_pods(cluster, namespace, POOLS)
        return (
            all(
                pod_condition(u, GATE).get("status") == "True" and pod_condition(u, "Ready").get("status") == "True"
                for u in units
            )
            and len(units) == 3
        )

    wait_for(gates_open, 60, "every unit's gate open again with one encoder back")
    wait_for(
        lambda: len(ready_endpoints(cluster, namespace, "qwen-vl-pools-default")) == 3,
        30,
        "the units back in the model's Service",
    )
    obj = wait_for(
        lambda: (o := epd(cluster, namespace, POOLS))["status"]["models"][0]["readyUnits"] == 3 and o,
        30,
        "3 ready units in the status",
    )
    (model,) = obj["status"]["models"]
    assert model["encoderPool"]["readyPods"] == 1
    # One encoder is still down: the deployment says so, but every unit serves.
    assert condition(obj, "EncodersReady")["reason"] == "EncoderUnready"


def test_scaling_one_pool_leaves_the_others_pods_alone(cluster, namespace, epd_operator):
    manifest = yaml.safe_load((EXAMPLES / "encoder-pools.yaml").read_text())
    manifest["spec"]["models"][0]["encoderPool"].pop("affinity")  # 4 nodes: room for every shape below
    apply(cluster, namespace, manifest)
    wait_condition(cluster, namespace, POOLS, "Ready", "True", timeout=120)
    wait_for(
        lambda: condition(epd(cluster, namespace, POOLS), "Progressing").get("status") == "False",
        60,
        "the rollout to finish",
    )

    def uids() -> tuple[dict[str, str], dict[str, str]]:
        pool, units = pool_and_unit_pods(cluster, namespace, POOLS)
        return (
            {p["metadata"]["name"]: p["metadata"]["uid"] for p in pool},
            {p["metadata"]["name"]: p["metadata"]["uid"] for p in units},
        )

    def ready_counts(pool_pods: int, units: int):
        def check():
            obj = epd(cluster, namespace, POOLS)
            model = obj["status"]["models"][0]
            fresh = obj["status"].get("observedGeneration") == obj["metadata"]["generation"]
            return (
                fresh
                and model["encoderPool"]["readyPods"] == pool_pods
                and model["readyUnits"] == units
                and condition(obj, "Ready")["status"] == "True"
            )

        return check

    pool_before, units_before = uids()
    manifest["spec"]["models"][0]["encoderReplicas"] = 3
    apply(cluster, namespace, manifest)
    wait_for(ready_counts(3, 3), 90, "3 ready encoder pool pods")
    pool_after, units_after = uids()
    assert units_after == units_before, "scaling the encoder pool touched a unit"
    assert {k: pool_after[k] for k in pool_before} == pool_before and len(pool_after) == 3

    manifest["spec"]["replicas"] = 4
    apply(cluster, namespace, manifest)
    wait_for(ready_counts(3, 4), 90, "4 ready units")
    pool_last, units_last = uids()
    assert pool_last == pool_after, "scaling the units touched the encoder pool"
    assert {k: units_last[k] for k in units_after} == units_after and len(units_last) == 4


def test_switching_unit_to_pools_and_back_converges_with_no_orphan(cluster, namespace, epd_operator):
    manifest = apply(cluster, namespace, EXAMPLES / "encoder-regular.yaml")
    name = manifest["metadata"]["name"]
    wait_condition(cluster, namespace, name, "Ready", "True", timeout=120)

    def names(kind: str) -> list[str]:
        return sorted(o["metadata"]["name"] for o in children(cluster, namespace, name)[kind])

    manifest["spec"]["models"][0].update(placement="Pools", encoderReplicas=2)
    apply(cluster, namespace, manifest)
    obj = wait_condition(cluster, namespace, name, "Ready", "True", timeout=120)
    assert obj["status"]["models"][0]["placement"] == "Pools"
    assert names("statefulsets") == ["qwen-vl-regular-default", "qwen-vl-regular-default-encoders"]
    assert names("services") == [
        "qwen-vl-regular-default",
        "qwen-vl-regular-default-encoders",
        "qwen-vl-regular-default-units",
    ]

    def pods_are(pool_count: int):
        def check():
            pods = children(cluster, namespace, name)["pods"]
            pool, units = pool_and_unit_pods(cluster, namespace, name)
            shaped = all(bool(u["spec"].get("initContainers")) == (pool_count == 0) for u in units)
            return len(pods) == pool_count + 1 and len(pool) == pool_count and len(units) == 1 and shaped

        return check

    wait_for(pods_are(2), 90, "the unit without encoders and 2 encoder pool pods")

    manifest["spec"]["models"][0]["placement"] = "Unit"
    del manifest["spec"]["models"][0]["encoderReplicas"]
    apply(cluster, namespace, manifest)
    obj = wait_condition(cluster, namespace, name, "Ready", "True", timeout=120)
    assert obj["status"]["models"][0]["placement"] == "Unit" and "encoderPool" not in obj["status"]["models"][0]
    assert names("statefulsets") == ["qwen-vl-regular-default"]
    assert names("services") == ["qwen-vl-regular-default", "qwen-vl-regular-default-units"]
    wait_for(pods_are(0), 90, "the pool's pods gone (garbage collected) and the unit whole again")
