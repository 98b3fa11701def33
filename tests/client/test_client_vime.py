"""vime_rollout_args: Vime's rollout arguments from an EPDDeployment's endpoints."""

from __future__ import annotations

import argparse
import copy

import httpx
import pytest

from epd_client import (
    Endpoints,
    EndpointsError,
    ModelEndpoints,
    NoReadyUnitError,
    VimeRolloutArgs,
    prime_encoder,
    vime_rollout_args,
)

from .helpers import endpoint_slice, image_messages, model_status

# Two models as multi-model-overrides.yaml deploys them: an actor (encoders + two regular
# engines behind a router) with two units, and a text-only reward model (one engine, no router).
ACTOR = [("encoder-0", "encoder", 8001), ("encoder-1", "encoder", 8002), ("regular-0", "regular", 8003)]
STATUS = {
    "models": [
        model_status(
            "actor", "rl-actor", 2, [*ACTOR, ("regular-1", "regular", 8004)], served_model_name="actor-served"
        ),
        model_status(
            "reward",
            "rl-reward",
            1,
            [("regular-0", "regular", 8001)],
            served_model_name="/models/reward",
            entry_port=8001,
        ),
    ]
}
SLICES = [
    endpoint_slice("rl-actor-units", ("rl-actor-0", "10.0.0.0", True), ("rl-actor-1", "10.0.0.1", True)),
    endpoint_slice("rl-reward-units", ("rl-reward-0", "10.0.1.0", True)),
]
ENDPOINTS = Endpoints.from_status(STATUS, SLICES)


def test_the_attributes_vimes_rollout_reads() -> None:
    args = vime_rollout_args(ENDPOINTS, units={"actor": "rl-actor-1"})
    assert args == VimeRolloutArgs(
        vllm_model_encoder_endpoints={"actor": ("actor-served", ["http://10.0.0.1:8001", "http://10.0.0.1:8002"])},
        vllm_model_routers={"actor": ("10.0.0.1", 8000), "reward": ("10.0.1.0", 8001)},
        # No model is named "default": the first one's router, as Vime's first model.
        vllm_router_ip="10.0.0.1",
        vllm_router_port=8000,
    )
    # Into Vime's own args object.
    namespace = argparse.Namespace(hf_checkpoint="/models/actor")
    vars(namespace).update(vars(args))
    assert namespace.vllm_model_routers["reward"] == ("10.0.1.0", 8001)


def test_the_default_model() -> None:
    chosen = {"actor": "rl-actor-0"}
    args = vime_rollout_args(ENDPOINTS, default_model="reward", units=chosen)
    assert (args.vllm_router_ip, args.vllm_router_port) == ("10.0.1.0", 8001)
    status = copy.deepcopy(STATUS)
    status["models"][1]["name"] = "default"  # a model named "default" is Vime's default
    args = vime_rollout_args(Endpoints.from_status(status, SLICES), units=chosen)
    assert (args.vllm_router_ip, args.vllm_router_port) == ("10.0.1.0", 8001)
    with pytest.raises(EndpointsError, match="unknown model 'critic'"):
        vime_rollout_args(ENDPOINTS, default_model="critic", units=chosen)


@pytest.mark.parametrize(
    ("units", "message"),
    [
        (None, r"model 'actor' has 2 units \(rl-actor-0, rl-actor-1\).*units=\{'actor': \.\.\.\}"),
        ({"actor": "rl-actor-7"}, r"no unit 'rl-actor-7' \(units: rl-actor-0, rl-actor-1\)"),
        ({"actor": "rl-actor-0", "critic": "x"}, "unknown models: critic"),
    ],
)
def test_one_unit_per_model_must_be_named(units, message) -> None:
    with pytest.raises(EndpointsError, match=message):
        vime_rollout_args(ENDPOINTS, units=units)


def test_unusable_units_are_refused() -> None:
    slices = [SLICES[0], endpoint_slice("rl-reward-units", ("rl-reward-0", "10.0.1.0", False))]
    with pytest.raises(NoReadyUnitError, match="unit 'rl-reward-0' of model 'reward'"):
        vime_rollout_args(Endpoints.from_status(STATUS, slices), units={"actor": "rl-actor-0"})
    with pytest.raises(EndpointsError, match="lists no models"):
        vime_rollout_args(Endpoints.from_status({"phase": "Pending"}))


def test_an_ipv6_router_keeps_its_brackets() -> None:
    """Vime builds f"http://{ip}:{port}" itself."""
    status = {"models": [model_status("default", "u", 1, [("regular-0", "regular", 8100)])]}
    args = vime_rollout_args(Endpoints.from_status(status, [endpoint_slice("u-units", ("u-0", "fd00::5", True))]))
    assert (args.vllm_router_ip, args.vllm_router_port) == ("[fd00::5]", 8000)
    assert args.vllm_model_encoder_endpoints == {}


async def test_a_vime_rollout_runs_unchanged_against_the_status(make_unit) -> None:
    """Vime's default multimodal generate, step by step: prime without a model name, then
    render and generate at f"http://{vllm_router_ip}:{vllm_router_port}"."""
    unit = make_unit("demo-default-0")
    endpoints = Endpoints((ModelEndpoints("default", (unit.unit(),), "m"),))
    args = argparse.Namespace(hf_checkpoint="m")
    vars(args).update(vars(vime_rollout_args(endpoints)))

    messages = image_messages(3)
    await prime_encoder(args, messages)
    base = f"http://{args.vllm_router_ip}:{args.vllm_router_port}"
    async with httpx.AsyncClient() as http:
        rendered = await http.post(
            f"{base}/v1/chat/completions/render", json={"model": args.hf_checkpoint, "messages": messages}
        )
        await http.post(f"{base}/inference/v1/generate", json=rendered.json())

    assert unit.prime_count == 3
    assert (unit.consumer.ec_hits, unit.consumer.ec_misses) == (3, 0)
