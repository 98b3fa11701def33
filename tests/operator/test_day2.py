"""Day-2 operations on the real control plane: scale (kubectl, HPA), disruption budgets through the
real Eviction API, and rollouts that stop at a revision that never becomes Ready."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from epd_dev.operator_process import get_json, wait_for
from epd_dev.paths import REPO

from .test_reconcile import condition, epd, wait_condition

pytestmark = pytest.mark.cluster

EXAMPLE = REPO / "docs" / "examples" / "encoder-regular.yaml"
NAME = "qwen-vl-regular"
STS = f"{NAME}-default"
# kwok's Stage epd-revision-never-ready (hack/epd_dev/localcluster/stages) plays a kubelet whose
# engines of this image fail their readiness probes.
NEVER_READY_IMAGE = "vllm/vllm-openai:v0.33.0-kwok-unready"


def apply(cluster, namespace: str, **spec) -> None:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"].update(spec)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))


def ready_units(cluster, namespace: str, count: int, timeout: float = 120, *, updated: bool = False) -> dict:
    """Until `count` units are Ready (and, with `updated`, all of them run the current spec)."""

    def check():
        obj = epd(cluster, namespace, NAME)
        fresh = obj and obj.get("status", {}).get("observedGeneration") == obj["metadata"]["generation"]
        done = fresh and obj["status"].get("ready") == f"{count}/{count}"
        rolled = (
            done
            and obj["status"].get("updated") == f"{count}/{count}"
            and condition(obj, "Progressing").get("reason") == "Complete"
        )
        return obj if done and (not updated or rolled) else None

    return wait_for(
        check,
        timeout,
        f"{count} ready units" + (" on the current spec" if updated else ""),
        lambda: json.dumps((epd(cluster, namespace, NAME) or {}).get("status"), indent=1),
    )


def pods(cluster, namespace: str) -> list[dict]:
    return get_json(cluster, "pods", "-n", namespace, "-l", f"epd.vime.dev/deployment={NAME}")["items"]


def test_kubectl_scale_and_an_hpa_drive_the_units(cluster, namespace, epd_operator):
    apply(cluster, namespace)
    ready_units(cluster, namespace, 1)
    cluster.kubectl("scale", f"epd/{NAME}", "-n", namespace, "--replicas", "3")
    obj = ready_units(cluster, namespace, 3)
    assert get_json(cluster, "statefulset", STS, "-n", namespace)["spec"]["replicas"] == 3
    assert obj["status"]["replicas"] == 3 and len(pods(cluster, namespace)) == 3
    scale = json.loads(
        cluster.kubectl(
            "get", "--raw", f"/apis/epd.vime.dev/v1alpha1/namespaces/{namespace}/epddeployments/{NAME}/scale"
        ).stdout
    )
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
    # The HPA controller finds the unit pods through the selector the scale subresource reports.
    selector = scale["status"]["selector"]
    assert {p["metadata"]["name"] for p in pods(cluster, namespace)} == {
        p["metadata"]["name"] for p in get_json(cluster, "pods", "-n", namespace, "-l", selector)["items"]
    }

    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": NAME},
        "spec": {
            "scaleTargetRef": {"apiVersion": "epd.vime.dev/v1alpha1", "kind": "EPDDeployment", "name": NAME},
            "minReplicas": 1,
            "maxReplicas": 4,
            "metrics": [
                {
                    "type": "Resource",
                    "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}},
                }
            ],
        },
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(hpa))

    def able_to_scale():
        obj = get_json(cluster, "hpa", NAME, "-n", namespace) or {}
        found = {c["type"]: c for c in obj.get("status", {}).get("conditions", [])}.get("AbleToScale", {})
        return found if found.get("status") == "True" else None

    # No metrics server here, so the HPA cannot compute a recommendation; it resolved its target.
    able = wait_for(
        able_to_scale,
        90,
        "the HPA to resolve its scale target",
        lambda: cluster.kubectl("describe", "hpa", NAME, "-n", namespace, check=False).stdout,
    )
    assert able["reason"] == "SucceededGetScale"


def test_the_disruption_budget_refuses_a_second_eviction(cluster, namespace, epd_operator, k8s_api):
    from kubernetes import client

    apply(cluster, namespace, replicas=2)
    ready_units(cluster, namespace, 2)
    budget = get_json(cluster, "pdb", STS, "-n", namespace)
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["metadata"]["ownerReferences"][0]["name"] == NAME
    wait_for(
        lambda: (get_json(cluster, "pdb", STS, "-n", namespace) or {}).get("status", {}).get("disruptionsAllowed") == 1,
        60,
        "the disruption controller to allow one disruption",
    )

    core = client.CoreV1Api(k8s_api)

    def evict(pod: str) -> int:
        body = client.V1Eviction(metadata=client.V1ObjectMeta(name=pod, namespace=namespace))
        try:
            core.create_namespaced_pod_eviction(pod, namespace, body)
            return 201
        except client.ApiException as error:
            return error.status

    # As during a drain: the evicted unit cannot come back at once (kwok would make its new pod
    # Ready within a second, which would rightly give the budget back before the second eviction).
    nodes = [f"node/{n}" for n in cluster.node_names]
    cluster.kubectl("cordon", *nodes)
    try:
        first, second = evict(f"{STS}-0"), evict(f"{STS}-1")
        assert (first, second) == (201, 429), "one unit may go; the second would break maxUnavailable: 1"
    finally:
        cluster.kubectl("uncordon", *nodes)
    ready_units(cluster, namespace, 2)  # the evicted unit comes back; the budget is whole again
    cluster.kubectl("delete", "epd", NAME, "-n", namespace)
    wait_for(lambda: get_json(cluster, "pdb", STS, "-n", namespace) is None, 60, "the budget garbage-collected")


def test_a_rollout_stops_at_a_revision_that_never_becomes_ready(cluster, namespace, epd_operator):
    apply(cluster, namespace, replicas=3)
    ready_units(cluster, namespace, 3)
    apply(cluster, namespace, replicas=3, image=NEVER_READY_IMAGE)
    stalled = wait_condition(cluster, namespace, NAME, "Degraded", "True", timeout=120)
    degraded = condition(stalled, "Degraded")
    assert degraded["reason"] == "RolloutStalled"
    assert degraded["message"].startswith(f"rollout stopped at 1/3 units updated: unit {STS}-2: EngineUnready")
    assert condition(stalled, "Progressing")["reason"] == "RollingOut"
    assert stalled["status"]["updated"] == "1/3" and stalled["status"]["phase"] == "Degraded"

    time.sleep(5)  # longer than kwok takes to make a pod Ready: nothing else may move meanwhile
    images = sorted(p["spec"]["containers"][0]["image"] for p in pods(cluster, namespace))
    example_image = yaml.safe_load(EXAMPLE.read_text())["spec"]["image"]
    assert images == sorted([NEVER_READY_IMAGE, example_image, example_image])
    assert sum(condition(p, "Ready").get("status") != "True" for p in pods(cluster, namespace)) == 1

    apply(cluster, namespace, replicas=3, image="vllm/vllm-openai:v0.33.1")  # the fix
    fixed = ready_units(cluster, namespace, 3, timeout=180, updated=True)
    assert condition(fixed, "Degraded")["status"] == "False" and condition(fixed, "Progressing")["reason"] == "Complete"

    def reasons() -> set[str]:
        events = get_json(cluster, "events", "-n", namespace, "--field-selector", f"involvedObject.name={NAME}")
        return {e["reason"] for e in events["items"]}

    # kopf posts Events in the background.
    wait_for(
        lambda: {"RolloutStarted", "RolloutStalled", "RolloutComplete"} <= reasons(),
        30,
        "the rollout's Events",
        lambda: str(reasons()),
    )
    wide = cluster.kubectl("get", "epd", NAME, "-n", namespace, "-o", "wide").stdout
    assert "UPDATED" in wide.splitlines()[0] and "3/3" in wide.splitlines()[1]


def test_the_front_service_moves_between_cluster_ip_headless_and_load_balancer(cluster, namespace, epd_operator):
    """clusterIP cannot change on a Service: the operator re-creates the front Service when
    headless flips, and applies a type change in place, with no failed reconcile on the way."""

    def front(want):
        return wait_for(
            lambda: (s := get_json(cluster, "service", STS, "-n", namespace)) and want(s["spec"]) and s,
            60,
            "the front Service",
            lambda: json.dumps(get_json(cluster, "service", STS, "-n", namespace)),
        )

    apply(cluster, namespace)
    ready_units(cluster, namespace, 1)
    first = front(lambda s: s["clusterIP"] not in ("", "None"))
    apply(cluster, namespace, service={"headless": True})
    headless = front(lambda s: s["clusterIP"] == "None")
    assert headless["metadata"]["uid"] != first["metadata"]["uid"], "re-created"
    apply(cluster, namespace, service={"type": "LoadBalancer", "annotations": {"lb.example/internal": "true"}})
    balanced = front(lambda s: s["type"] == "LoadBalancer" and s["clusterIP"] != "None")
    assert balanced["metadata"]["annotations"]["lb.example/internal"] == "true"
    assert balanced["spec"]["ports"][0]["nodePort"] > 0
    apply(cluster, namespace)  # back to the default
    back = front(lambda s: s["type"] == "ClusterIP")
    assert back["metadata"]["uid"] == balanced["metadata"]["uid"], "a type change is applied in place"
    assert "nodePort" not in back["spec"]["ports"][0] and "lb.example/internal" not in back["metadata"]["annotations"]
    obj = ready_units(cluster, namespace, 1)
    assert condition(obj, "Ready")["status"] == "True"
    warnings = get_json(cluster, "events", "-n", namespace, "--field-selector", "type=Warning")["items"]
    assert [e["reason"] for e in warnings if e["involvedObject"]["name"] == NAME] == []


def test_what_the_spec_stops_setting_leaves_children_the_operator_created(cluster, namespace, epd_operator):
    """Children are created by POST, which leaves their fields to an Update entry of the field
    manager; the operator turns it into its Apply entry before the next apply, or an env var or
    annotation dropped from the spec would stay on the child forever."""

    def env(sts):
        return {e["name"] for c in sts["spec"]["template"]["spec"]["containers"] for e in c.get("env") or []}

    def managers(obj):
        return sorted(
            (e["manager"], e["operation"]) for e in obj["metadata"]["managedFields"] if e["manager"] == "epd-operator"
        )

    apply(
        cluster,
        namespace,
        env=[{"name": "EXTRA_SETTING", "value": "1"}],
        service={"annotations": {"lb.example/internal": "true"}},
    )
    created = wait_for(
        lambda: get_json(cluster, "statefulset", STS, "-n", namespace, "--show-managed-fields"), 60, "the StatefulSet"
    )
    assert "EXTRA_SETTING" in env(created)
    assert managers(created) == [("epd-operator", "Update")], "created by POST"
    apply(cluster, namespace)  # neither any more
    wait_for(
        lambda: "EXTRA_SETTING" not in env(get_json(cluster, "statefulset", STS, "-n", namespace)),
        60,
        "the env var gone",
        lambda: json.dumps(get_json(cluster, "statefulset", STS, "-n", namespace)["spec"]),
    )
    wait_for(
        lambda: (
            "lb.example/internal" not in get_json(cluster, "service", STS, "-n", namespace)["metadata"]["annotations"]
        ),
        60,
        "the annotation gone",
    )
    sts = get_json(cluster, "statefulset", STS, "-n", namespace, "--show-managed-fields")
    service = get_json(cluster, "service", STS, "-n", namespace, "--show-managed-fields")
    assert managers(sts) == managers(service) == [("epd-operator", "Apply")]
    # Fields the API server defaulted at creation were owned too, and are defaulted again.
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["terminationMessagePath"] == "/dev/termination-log" and sts["spec"]["revisionHistoryLimit"] == 10
    ready_units(cluster, namespace, 1, updated=True)
