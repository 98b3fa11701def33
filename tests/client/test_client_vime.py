"""vime_rollout_args: Vime's rollout arguments from an EPDDeployment status."""

from __future__ import annotations

import argparse
import copy

import httpx
import pytest

from epd_client import (
    Endpoints,
    EndpointsError,
    NoReadyUnitError,
    VimeRolloutArgs,
    prime_encoder,
    vime_rollout_args,
)

from .helpers import image_messages

# Two models as multi-model-overrides.yaml deploys them: an actor (encoders + two regular
# engines behind a router) with two units, and a text-only reward model (one engine, no router).
STATUS = {
    "models": [
        {
            "name": "actor",
            "servedModelName": "actor-served",
            "ecStoragePath": "/dev/shm/vime-ec-actor",
            "units": [
                {
                    "name": f"rl-actor-{i}",
                    "ready": True,
                    "encoderUrls": [f"http://10.0.0.{i}:8001", f"http://10.0.0.{i}:8002"],
                    "routerUrl": f"http://10.0.0.{i}:8000",
                    "consumerUrls": [f"http://10.0.0.{i}:8003", f"http://10.0.0.{i}:8004"],
                }
                for i in range(2)
            ],
        },
        {
            "name": "reward",
            "servedModelName": "/models/reward",
            "units": [{"name": "rl-reward-0", "ready": True, "consumerUrls": ["http://10.0.1.0:8001"]}],
        },
    ]
}


def test_the_attributes_vimes_rollout_reads() -> None:
    args = vime_rollout_args(STATUS, units={"actor": "rl-actor-1"})
    assert args == VimeRolloutArgs(
        vllm_model_encoder_endpoints={"actor": ("actor-served", ["http://10.0.0.1:8001", "http://10.0.0.1:8002"])},
        vllm_model_routers={"actor": ("10.0.0.1", 8000), "reward": ("10.0.1.0", 8001)},
        # No model is named "default": the first one's router, as Vime's first model.
        vllm_router_ip="10.0.0.1",
        vllm_router_port=8000,
    )
    # Same from Endpoints (e.g. discover's), and as Vime's own args object.
    assert vime_rollout_args(Endpoints.from_status(STATUS), units={"actor": "rl-actor-1"}) == args
    namespace = argparse.Namespace(hf_checkpoint="/models/actor")
    vars(namespace).update(vars(args))
    assert namespace.vllm_model_routers["reward"] == ("10.0.1.0", 8001)


def test_the_default_model() -> None:
    chosen = {"actor": "rl-actor-0"}
    args = vime_rollout_args(STATUS, default_model="reward", units=chosen)
    assert (args.vllm_router_ip, args.vllm_router_port) == ("10.0.1.0", 8001)
    status = copy.deepcopy(STATUS)
    status["models"][1]["name"] = "default"  # a model named "default" is Vime's default
    args = vime_rollout_args(status, units=chosen)
    assert (args.vllm_router_ip, args.vllm_router_port) == ("10.0.1.0", 8001)
    with pytest.raises(EndpointsError, match="unknown model 'critic'"):
        vime_rollout_args(STATUS, default_model="critic", units=chosen)


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
        vime_rollout_args(STATUS, units=units)


def test_unusable_units_are_refused() -> None:
    status = copy.deepcopy(STATUS)
    status["models"][1]["units"][0]["ready"] = False
    with pytest.raises(NoReadyUnitError, match="unit 'rl-reward-0' of model 'reward'"):
        vime_rollout_args(status, units={"actor": "rl-actor-0"})
    with pytest.raises(EndpointsError, match="lists no models"):
        vime_rollout_args({"phase": "Pending"})


def test_an_ipv6_router_keeps_its_brackets() -> None:
    """Vime builds f"http://{ip}:{port}" itself."""
    status = {
        "models": [{"name": "default", "units": [{"name": "u", "ready": True, "routerUrl": "http://[fd00::5]:8000"}]}]
    }
    args = vime_rollout_args(status)
    assert (args.vllm_router_ip, args.vllm_router_port) == ("[fd00::5]", 8000)
    assert args.vllm_model_encoder_endpoints == {}


async def test_a_vime_rollout_runs_unchanged_against_the_status(make_unit) -> None:
    """Vime's default multimodal generate, step by step: prime without a model name, then
    render and generate at f"http://{vllm_router_ip}:{vllm_router_port}"."""
    unit = make_unit("demo-default-0")
    status = {
        "models": [
            {
                "name": "default",
                "servedModelName": "m",
                "units": [
                    {
                        "name": unit.name,
                        "ready": True,
                        "encoderUrls": [e.url for e in unit.encoders],
                        "consumerUrls": [unit.consumer.url],
                    }
                ],
            }
        ]
    }
    args = argparse.Namespace(hf_checkpoint="m")
    vars(args).update(vars(vime_rollout_args(status)))

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
