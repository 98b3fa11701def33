"""Which model prime_encoder primes, for each form of target: as Vime's own prime_encoder
chooses (vime/rollout/vllm_rollout.py)."""

from __future__ import annotations

import argparse

import pytest

from epd_client import (
    Endpoints,
    EndpointsError,
    EPDClient,
    ModelEndpoints,
    Unit,
    prime_encoder,
    vime_rollout_args,
)

from .helpers import FAST, image_messages


@pytest.fixture
def deployment(server):
    """Stand-ins for a deployment's engines: model name -> (encoder, consumer) servers."""
    made = {}

    def make(*epd: str, text_only: tuple[str, ...] = ()) -> Endpoints:
        models = []
        for name in (*epd, *text_only):
            encoder = server() if name in epd else None
            consumer = server()
            made[name] = (encoder, consumer)
            unit = Unit(
                f"{name}-0",
                encoder_urls=(encoder.url,) if encoder else (),
                consumer_urls=(consumer.url,),
            )
            models.append(ModelEndpoints(name, (unit,), served_model_name=f"served-{name}"))
        return Endpoints(tuple(models))

    make.servers = made
    return make


def primed(deployment) -> dict[str, int]:
    """Prime requests each model's encoder received."""
    return {
        name: len(encoder.requests("/v1/chat/completions"))
        for name, (encoder, _) in deployment.servers.items()
        if encoder is not None
    }


# Each form of target for the same deployment; the Vime form is built the way a Vime
# rollout on Kubernetes would get it.
FORMS = ["endpoints", "client", "vime_rollout_args"]


async def prime(form: str, endpoints: Endpoints, **kw) -> None:
    if form == "endpoints":
        await prime_encoder(endpoints, image_messages(2), **kw)
    elif form == "client":
        async with EPDClient(endpoints, retry=FAST) as client:
            await prime_encoder(client, image_messages(2), **kw)
    else:
        await prime_encoder(vime_rollout_args(endpoints), image_messages(2), **kw)


@pytest.mark.parametrize("form", FORMS)
async def test_vimes_call_without_a_model_name_primes_the_only_epd_model(deployment, form) -> None:
    """The issue's case: Vime's default generate calls prime_encoder(args, messages)."""
    endpoints = deployment("actor", text_only=("reward",))
    await prime(form, endpoints)
    assert primed(deployment) == {"actor": 2}
    encoder = deployment.servers["actor"][0]
    assert {r.body["model"] for r in encoder.records} == {"served-actor"}


@pytest.mark.parametrize("form", FORMS)
async def test_the_named_model_is_primed(deployment, form) -> None:
    endpoints = deployment("default", "actor")
    await prime(form, endpoints, model_name="actor")
    await prime(form, endpoints)  # "default" exists: no fallback
    assert primed(deployment) == {"default": 2, "actor": 2}


@pytest.mark.parametrize("form", FORMS)
async def test_a_model_without_encoders_is_a_no_op(deployment, form) -> None:
    endpoints = deployment("actor", text_only=("reward",))
    await prime(form, endpoints, model_name="reward")
    assert primed(deployment) == {"actor": 0}
    assert deployment.servers["reward"][1].records == []


@pytest.mark.parametrize("form", FORMS)
async def test_a_text_only_default_falls_back_to_the_only_epd_model(deployment, form) -> None:
    """Vime looks the name up among the models with encoders only, so a text-only model
    named "default" does not stop the fallback."""
    endpoints = deployment("actor", text_only=("default",))
    await prime(form, endpoints)
    assert primed(deployment) == {"actor": 2}


async def test_without_a_single_epd_model_vime_args_are_a_no_op(deployment) -> None:
    """Vime's rule, kept for Vime args: no "default" entry and not exactly one entry."""
    await prime("vime_rollout_args", deployment("actor", "critic"))
    await prime("vime_rollout_args", deployment(text_only=("reward",)))
    assert primed(deployment) == {"actor": 0, "critic": 0}


@pytest.mark.parametrize("form", ["endpoints", "client"])
@pytest.mark.parametrize(("epd", "text_only"), [(("actor", "critic"), ()), ((), ("reward",))])
async def test_endpoints_refuse_a_default_that_resolves_to_no_model(deployment, form, epd, text_only) -> None:
    """Endpoints know every model of the deployment: there, a name that is no model at all
    is an error, never the silent no-op that lets consumers encode the images themselves."""
    endpoints = deployment(*epd, text_only=text_only)
    with pytest.raises(EndpointsError, match="unknown model 'default'"):
        await prime(form, endpoints)
    with pytest.raises(EndpointsError, match="unknown model 'typo'"):
        await prime(form, endpoints, model_name="typo")
    assert set(primed(deployment).values()) <= {0}


async def test_vime_args_as_vime_builds_them(server) -> None:
    encoders = [server(), server()]
    one = {"actor": ("Qwen/Qwen2-VL", [e.url for e in encoders])}
    await prime_encoder(argparse.Namespace(vllm_model_encoder_endpoints=one), image_messages(4))
    assert [len(e.records) for e in encoders] == [2, 2]

    # No-ops, as in Vime: an unknown name, an entry without URLs, no attribute at all.
    await prime_encoder(argparse.Namespace(vllm_model_encoder_endpoints=one), image_messages(1), model_name="x")
    empty = {"default": ("m", []), "actor": ("Qwen/Qwen2-VL", [encoders[0].url])}
    await prime_encoder(argparse.Namespace(vllm_model_encoder_endpoints=empty), image_messages(1))
    await prime_encoder(argparse.Namespace(), image_messages(1))
    assert [len(e.records) for e in encoders] == [2, 2]
