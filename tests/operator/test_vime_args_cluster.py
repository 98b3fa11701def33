"""The client reads Vime's rollout arguments and every engine of a model from the live status
the operator wrote and the EndpointSlices it names."""

from __future__ import annotations

import json

import pytest
import yaml

from epd_client import (
    Endpoints,
    EndpointsError,
    Engine,
    EPDClient,
    VimeRolloutArgs,
    discover,
    vime_rollout_args,
)
from epd_dev.operator_process import wait_for

from .test_reconcile import EXAMPLES, apply, wait_condition

pytestmark = pytest.mark.cluster

NAME = "rl-rollout"


def unit_pods(cluster, namespace: str) -> dict[str, dict]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", f"epd.vime.dev/deployment={NAME}", "-o", "json")
    return {p["metadata"]["name"]: p for p in json.loads(out.stdout)["items"]}


def engine_containers(pod: dict) -> list[tuple[str, str]]:
    """(container name, URL) of each vLLM engine of a unit pod, encoders (sidecars) first."""
    ip, spec = pod["status"]["podIP"], pod["spec"]
    return [
        (c["name"], f"http://{ip}:{c['ports'][0]['containerPort']}")
        for c in [*spec.get("initContainers", []), *spec["containers"]]
        if c.get("command") == ["vllm", "serve"]
    ]


def port_of(pod: dict, container: str) -> int:
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == container]
    return c["ports"][0]["containerPort"]


@pytest.fixture
def deployment(cluster, namespace, epd_operator) -> tuple[Endpoints, dict[str, dict]]:
    """multi-model-overrides.yaml, Ready: an actor (2 encoders, 2 regular engines, a router)
    with two units and a text-only reward model (one engine, no router) with two; as discover
    finds it once the EndpointSlices show every unit ready."""
    manifest = yaml.safe_load((EXAMPLES / "multi-model-overrides.yaml").read_text())
    # The test cluster has no model-cache claim; the pods need only be scheduled.
    del manifest["spec"]["volumes"], manifest["spec"]["volumeMounts"]
    apply(cluster, namespace, manifest)
    wait_condition(cluster, namespace, NAME, "Ready", "True", timeout=120)

    def found() -> Endpoints | None:
        endpoints = discover(NAME, namespace, kubeconfig=str(cluster.kubeconfig))
        return endpoints if all(u.ready for m in endpoints.models for u in m.units) else None

    return wait_for(found, 30, "every unit ready in the EndpointSlices"), unit_pods(cluster, namespace)


def test_vime_args_from_the_live_status(deployment):
    endpoints, pods = deployment
    actor, reward = pods[f"{NAME}-actor-1"], pods[f"{NAME}-reward-0"]
    chosen = {"actor": f"{NAME}-actor-1", "reward": f"{NAME}-reward-0"}

    args = vime_rollout_args(endpoints, units=chosen)

    actor_ip, reward_ip = actor["status"]["podIP"], reward["status"]["podIP"]
    # Each unit's front door is its EPD proxy, which passes Vime's render/generate on unprimed.
    router = (actor_ip, port_of(actor, "proxy"))
    assert args == VimeRolloutArgs(
        vllm_model_encoder_endpoints={
            "actor": ("actor", [url for name, url in engine_containers(actor) if name.startswith("encoder-")]),
        },
        # The text-only reward model has no encoder, so no proxy: its one engine is the front.
        vllm_model_routers={"actor": router, "reward": (reward_ip, port_of(reward, "regular-0"))},
        vllm_router_ip=router[0],  # no model is named "default": the first model's router
        vllm_router_port=router[1],
    )
    assert len(args.vllm_model_encoder_endpoints["actor"][1]) == 2
    with pytest.raises(EndpointsError, match=rf"'actor' has 2 units \({NAME}-actor-0, {NAME}-actor-1\)"):
        vime_rollout_args(endpoints)


def test_every_engine_of_a_model_from_the_live_status(deployment):
    endpoints, pods = deployment
    for model in ("actor", "reward"):
        expected = [
            Engine(unit.name, name, name.rsplit("-", 1)[0], url)
            for unit in endpoints.model(model).units
            for name, url in engine_containers(pods[unit.name])
        ]
        assert endpoints.engines(model) == tuple(expected)
    assert len(endpoints.engines("actor")) == 8  # 2 units x (2 encoders + 2 regular engines)
    assert len(EPDClient(endpoints).engines("actor", "encoder")) == 4
    assert EPDClient(endpoints).engines("reward", "encoder") == ()
