"""The client finds the units where the operator's status says to look: what each unit holds in
the status, where each is and whether it is ready in the EndpointSlices kube-controller-manager
keeps for the units' headless Service (real control plane; kwok plays the kubelets)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import yaml

from epd_client import Endpoints, discover
from epd_dev.localcluster.cluster import NODE_RESOURCES
from epd_dev.operator_process import get_json, wait_for

from .test_reconcile import EXAMPLES, SIMULATE_ENCODER_UNREADY, apply, epd, wait_condition

pytestmark = pytest.mark.cluster

PD = "qwen-vl-pd"


def found(cluster, namespace: str, name: str) -> Endpoints:
    return discover(name, namespace, kubeconfig=str(cluster.kubeconfig))


def ready_names(cluster, namespace: str, name: str, model: str = "default") -> list[str]:
    return [u.name for u in found(cluster, namespace, name).model(model).units if u.ready]


def pods(cluster, namespace: str, deployment: str) -> dict[str, dict]:
    selector = f"epd.vime.dev/deployment={deployment}"
    return {p["metadata"]["name"]: p for p in get_json(cluster, "pods", "-n", namespace, "-l", selector)["items"]}


def test_discover_reads_units_from_the_status_and_the_units_endpoint_slices(cluster, namespace, epd_operator):
    manifest = yaml.safe_load((EXAMPLES / "encoder-prefill-decode.yaml").read_text())
    manifest["spec"]["replicas"] = 2
    apply(cluster, namespace, manifest)
    wait_condition(cluster, namespace, PD, "Ready", "True", timeout=120)
    wait_for(lambda: len(ready_names(cluster, namespace, PD)) == 2, 30, "both units ready in the EndpointSlices")

    model = found(cluster, namespace, PD).model("default")
    assert model.served_name == "Qwen/Qwen2.5-VL-7B-Instruct"
    live = pods(cluster, namespace, PD)
    assert sorted(u.name for u in model.units) == sorted(live) == [f"{PD}-default-0", f"{PD}-default-1"]
    for unit in model.units:
        pod = live[unit.name]
        ip = pod["status"]["podIP"]
        ports = {
            c["name"]: c["ports"][0]["containerPort"]
            for c in [*pod["spec"]["initContainers"], *pod["spec"]["containers"]]
        }
        assert unit.encoder_urls == (f"http://{ip}:{ports['encoder-0']}",)
        assert unit.consumer_urls == (f"http://{ip}:{ports['prefill-0']}", f"http://{ip}:{ports['decode-0']}")
        assert unit.entry_url == f"http://{ip}:{ports['proxy']}"  # the unit's EPD proxy, never an encoder
        assert unit.node == pod["spec"]["nodeName"]
        assert [(e.name, e.role) for e in unit.engines] == [
            ("encoder-0", "encoder"),
            ("prefill-0", "prefill"),
            ("decode-0", "decode"),
        ]


def test_a_unit_that_stops_being_ready_is_never_chosen_until_it_is_again(cluster, namespace, epd_operator):
    manifest = yaml.safe_load((EXAMPLES / "encoder-prefill-decode.yaml").read_text())
    manifest["spec"]["replicas"] = 2
    apply(cluster, namespace, manifest)
    wait_condition(cluster, namespace, PD, "Ready", "True", timeout=120)
    sick, well = f"{PD}-default-1", f"{PD}-default-0"
    wait_for(lambda: ready_names(cluster, namespace, PD) == [well, sick], 30, "both units ready")

    cluster.kubectl("annotate", "pod", sick, "-n", namespace, f"{SIMULATE_ENCODER_UNREADY}=true", "--overwrite")
    wait_for(lambda: ready_names(cluster, namespace, PD) == [well], 30, f"{sick} not ready in the EndpointSlices")
    model = found(cluster, namespace, PD).model("default")
    assert {model.unit_for(f"sample-{i}").name for i in range(20)} == {well}
    assert model.unit(sick) is not None and model.unit(sick).entry_url  # listed, with its address, not used
    # The status agrees, and says why.
    obj = wait_condition(cluster, namespace, PD, "Ready", "False")
    assert [(u["name"], u["reason"]) for u in obj["status"]["models"][0]["unready"]] == [(sick, "EncoderUnready")]

    cluster.kubectl("annotate", "pod", sick, "-n", namespace, f"{SIMULATE_ENCODER_UNREADY}=false", "--overwrite")
    wait_for(lambda: ready_names(cluster, namespace, PD) == [well, sick], 30, f"{sick} ready again")


def test_discover_follows_a_scale_and_lists_units_without_an_ip_as_not_ready(cluster, namespace, epd_operator):
    manifest = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())
    manifest["spec"]["replicas"] = 1
    apply(cluster, namespace, manifest)
    name = manifest["metadata"]["name"]
    wait_condition(cluster, namespace, name, "Ready", "True", timeout=120)
    # More units than the 4 kwok nodes of 8 GPUs hold (2 each): the rest stay Pending, without an IP.
    cluster.kubectl("scale", f"epd/{name}", "-n", namespace, "--replicas=20")
    wait_for(lambda: epd(cluster, namespace, name)["status"]["models"][0]["desiredUnits"] == 20, 30, "20 desired")
    scheduled = wait_for(
        lambda: (n := len(ready_names(cluster, namespace, name))) >= 2 and n, 60, "units scheduled and ready"
    )
    units = found(cluster, namespace, name).model("default").units
    assert len(units) == 20 and [u.name for u in units] == [f"{name}-default-{i}" for i in range(20)]
    pending = [u for u in units if u.node is None]
    assert pending and all(not u.ready and u.entry_url is None for u in pending)
    assert all(e.url is None for u in pending for e in u.engines)
    assert len(units) - len(pending) >= scheduled

    cluster.kubectl("scale", f"epd/{name}", "-n", namespace, "--replicas=1")
    wait_for(lambda: len(found(cluster, namespace, name).model("default").units) == 1, 60, "one unit again")


def test_the_units_of_a_pools_model_prime_on_the_pools_ready_encoders(cluster, namespace, epd_operator):
    apply(cluster, namespace, EXAMPLES / "encoder-pools.yaml")
    name = "qwen-vl-pools"
    wait_condition(cluster, namespace, name, "Ready", "True", timeout=120)
    pool = {n: p for n, p in pods(cluster, namespace, name).items() if "-encoders-" in n}

    def pool_urls() -> tuple[str, ...]:
        units = found(cluster, namespace, name).model("default").units
        return units[0].encoder_urls if all(u.ready for u in units) else ()

    expected = tuple(f"http://{pool[n]['status']['podIP']}:8100" for n in sorted(pool))
    wait_for(lambda: pool_urls() == expected, 30, "the pool's ready encoders for every unit")
    model = found(cluster, namespace, name).model("default")
    assert model.pooled and {u.encoder_urls for u in model.units} == {expected}
    assert [e.unit for e in model.engines("encoder")] == sorted(pool)


@pytest.fixture
def roomy_nodes(cluster) -> Iterator[None]:
    """The kwok nodes made to hold 150 units for the test, then as they were."""

    def capacity(resources: dict[str, str]) -> None:
        patch = json.dumps({"status": {"capacity": resources, "allocatable": resources}})
        for node in cluster.node_names:
            cluster.kubectl("patch", "node", node, "--subresource=status", "--type=merge", "-p", patch)

    capacity({**NODE_RESOURCES, "nvidia.com/gpu": "80", "cpu": "128"})
    yield
    capacity(NODE_RESOURCES)


def test_hundreds_of_units_span_several_endpoint_slices_and_a_small_status(
    cluster, namespace, epd_operator, roomy_nodes
):
    """kube-controller-manager puts at most 100 endpoints in a slice: 150 units take two, and
    the status does not grow with them."""
    manifest = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())
    manifest["spec"]["replicas"] = 150
    apply(cluster, namespace, manifest)
    name = manifest["metadata"]["name"]
    wait_condition(cluster, namespace, name, "Ready", "True", timeout=300)
    wait_for(lambda: len(ready_names(cluster, namespace, name)) == 150, 60, "150 units ready in the EndpointSlices")
    slices = get_json(
        cluster, "endpointslices", "-n", namespace, "-l", f"kubernetes.io/service-name={name}-default-units"
    )["items"]
    assert len(slices) >= 2
    ips = {p["status"]["podIP"] for p in pods(cluster, namespace, name).values()}
    assert {
        u.entry_url.split("//")[1].rsplit(":", 1)[0] for u in found(cluster, namespace, name).model("default").units
    } == ips
    assert len(json.dumps(epd(cluster, namespace, name)["status"])) < 8192
