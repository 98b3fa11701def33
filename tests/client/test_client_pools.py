"""Placement Pools: a model's encoders form one pool priming for every unit, and the
consumers pull each embedding from the encoder that computed it, so priming collects the
encoders' ``ec_transfer_params`` and render/generate carry them (stand-in engines in vLLM's
shapes; tests/render checks the rendered engines, a real cross-node run is blocked on this CPU build: docs/testing.md)."""

from __future__ import annotations

import pytest

from epd_client import (
    Endpoints,
    Engine,
    EPDClient,
    ModelEndpoints,
    NoReadyUnitError,
    PrimeError,
    Unit,
    prime_encoder,
    vime_rollout_args,
)

from .helpers import FAST, endpoint_slice, image_messages, image_urls, model_status


def pools_endpoints(encoder_urls: list[str], consumer_urls: list[str], *, placement: str = "Pools") -> Endpoints:
    """A Pools model whose pool's ready encoders and units' consumers are at these URLs (stand-in
    servers, each on a port of its own: not the one port per engine a status names)."""
    pool = tuple(
        Engine(f"demo-actor-encoders-{i}", "encoder-0", "encoder", url)
        for i, url in enumerate([*encoder_urls, "http://10.9.9.9:8100"])
    )
    units = tuple(
        Unit(
            name=f"demo-actor-{i}",
            encoder_urls=tuple(encoder_urls),
            consumer_urls=(url,),
            pod=f"demo-actor-{i}",
            engines=(Engine(f"demo-actor-{i}", "regular-0", "regular", url),),
        )
        for i, url in enumerate(consumer_urls)
    )
    return Endpoints((ModelEndpoints("actor", units, "served", placement, pool),))


def chat(images: int) -> dict:
    return {"messages": image_messages(images), "max_tokens": 8}


def test_status_of_a_pools_model() -> None:
    pool = {
        "name": "demo-actor-encoders",
        "service": "demo-actor-encoders",
        "replicas": 3,
        "readyPods": 2,
        "engines": [{"name": "encoder-0", "role": "encoder", "port": 8100}],
    }
    status = {
        "models": [
            model_status(
                "actor", "demo-actor", 1, [("regular-0", "regular", 8100)], served_model_name="served", pool=pool
            )
        ]
    }
    # The pool's Service has no publishNotReadyAddresses: a pod not Ready is neither ready nor serving.
    slices = [
        endpoint_slice(
            "demo-actor-encoders",
            ("demo-actor-encoders-0", "10.0.1.1", True),
            ("demo-actor-encoders-1", "10.0.1.2", True),
            ("demo-actor-encoders-2", "10.0.1.3", False),
        ),
        endpoint_slice("demo-actor-units", ("demo-actor-0", "10.0.2.1", True)),
    ]
    endpoints = Endpoints.from_status(status, slices)
    model = endpoints.model("actor")
    assert model.pooled and model.has_encoders
    # Every unit primes on the pool's ready encoders.
    (unit,) = model.units
    assert unit.encoder_urls == ("http://10.0.1.1:8100", "http://10.0.1.2:8100")
    assert unit.consumer_urls == ("http://10.0.2.1:8100",) and unit.entry_url == "http://10.0.2.1:8000"
    # Each engine once: the pool's encoders (ready or not), then the units' consumers.
    assert [(e.unit, e.name, e.role, e.url) for e in model.engines()] == [
        ("demo-actor-encoders-0", "encoder-0", "encoder", "http://10.0.1.1:8100"),
        ("demo-actor-encoders-1", "encoder-0", "encoder", "http://10.0.1.2:8100"),
        ("demo-actor-encoders-2", "encoder-0", "encoder", "http://10.0.1.3:8100"),
        ("demo-actor-0", "regular-0", "regular", "http://10.0.2.1:8100"),
    ]
    assert len(model.engines("encoder")) == 3
    # Vime's args name the pool's ready encoders for the model.
    assert vime_rollout_args(endpoints).vllm_model_encoder_endpoints == {
        "actor": ("served", ["http://10.0.1.1:8100", "http://10.0.1.2:8100"])
    }


async def test_prime_round_robins_over_the_pool_and_generate_carries_the_transfer_params(server) -> None:
    encoders = [server(ec_transfer=True), server(ec_transfer=True)]  # no store shared with anyone
    consumers = [server(), server()]
    async with EPDClient(pools_endpoints([e.url for e in encoders], [c.url for c in consumers]), retry=FAST) as client:
        for i in range(4):
            result = await client.generate(chat(2), key=f"sample-{i}", model_name="actor")
            assert result["choices"][0]["token_ids"] == [7, 8, 9]

    # Image i of a request goes to pool encoder i % 2, whichever unit generates.
    assert image_urls(encoders[0]) == ["https://images.test/0.png"] * 4
    assert image_urls(encoders[1]) == ["https://images.test/1.png"] * 4
    for consumer in consumers:
        for render, generate in zip(
            consumer.requests("/v1/chat/completions/render"), consumer.requests("/inference/v1/generate"), strict=True
        ):
            assert len(render.body["ec_transfer_params"]) == 2
            assert generate.body["ec_transfer_params"] == render.body["ec_transfer_params"]
            # Announced items go metadata-only: their tensors are not sent again.
            assert generate.body["features"]["kwargs_data"] == {"image": [None, None]}
            assert generate.body["features"]["mm_metadata"]["image"][0].startswith("metadata-")
        # Every embedding was pulled from the encoder that computed it; none re-encoded.
        assert consumer.ec_misses == 0 and consumer.ec_hits == 0
        assert consumer.metadata_only == consumer.ec_pulls == 2 * len(consumer.requests("/inference/v1/generate"))
    peers = {peer for c in consumers for _h, peer in c.pulled}
    assert peers == {e.url.removeprefix("http://") for e in encoders}


async def test_items_without_metadata_keep_their_tensors(server) -> None:
    """A LLaVA-like model: render gives no mm_metadata (vLLM 0.32, the tests' tiny model), and a
    generate item with neither tensors nor metadata is a 500 in vLLM. The client sends the
    tensors with the transfer params, and the consumer still pulls (it does not encode)."""
    encoder, consumer = server(ec_transfer=True), server(mm_metadata=False)
    async with EPDClient(pools_endpoints([encoder.url], [consumer.url]), retry=FAST) as client:
        result = await client.generate(chat(2), model_name="actor")
    assert result["choices"][0]["token_ids"] == [7, 8, 9]
    (generate,) = consumer.requests("/inference/v1/generate")
    assert generate.body["features"]["mm_metadata"] is None
    assert [t.startswith("tensors-") for t in generate.body["features"]["kwargs_data"]["image"]] == [True, True]
    assert len(generate.body["ec_transfer_params"]) == 2
    assert consumer.ec_pulls == 2 and consumer.metadata_only == 0


async def test_prime_returns_the_transfer_params_to_send_with_render(server) -> None:
    encoder, consumer = server(ec_transfer=True), server()
    endpoints = pools_endpoints([encoder.url], [consumer.url])
    params = await prime_encoder(endpoints, image_messages(3), model_name="actor")
    host = encoder.url.removeprefix("http://").rsplit(":", 1)[0]
    assert len(params) == 3 and all(p["peer_host"] == host for p in params.values())


async def test_an_encoder_answering_without_transfer_params_is_an_error_naming_image_and_encoder(server) -> None:
    good, bad = server(ec_transfer=True), server()  # bad: an EC connector that announces nothing
    consumer = server()
    endpoints = pools_endpoints([good.url, bad.url], [consumer.url])
    async with EPDClient(endpoints, retry=FAST) as client:
        with pytest.raises(PrimeError) as error:
            await client.generate(chat(2), model_name="actor")
    (failure,) = error.value.failures
    assert (failure.index, failure.url, failure.encoders) == (1, "https://images.test/1.png", (bad.url,))
    assert "answered without ec_transfer_params" in str(error.value) and bad.url in str(error.value)
    assert not consumer.records, "nothing is rendered or generated after a failed prime"


async def test_an_entry_without_a_peer_address_is_an_error_too(server, monkeypatch) -> None:
    encoder, consumer = server(ec_transfer=True), server()
    # What vLLM's producer announces for an embedding it no longer holds: metadata, no address.
    monkeypatch.setattr(encoder, "_announce", lambda urls: {"h1": {"item_indices": [0], "metadata": {}}})
    endpoints = pools_endpoints([encoder.url], [consumer.url])
    with pytest.raises(PrimeError, match=r"announced no peer address for h1 \(not saved, or evicted\)"):
        await prime_encoder(endpoints, image_messages(1), model_name="actor")


async def test_a_pool_without_a_ready_encoder_refuses_to_prime(server) -> None:
    consumer = server()
    endpoints = pools_endpoints([], [consumer.url])
    with pytest.raises(NoReadyUnitError, match="encoder pool has no ready encoder"):
        await prime_encoder(endpoints, image_messages(1), model_name="actor")
    # Text-only requests need no encoder at all.
    async with EPDClient(endpoints, retry=FAST) as client:
        await client.generate({"messages": [{"role": "user", "content": "hi"}]}, model_name="actor")
    assert "ec_transfer_params" not in consumer.requests("/inference/v1/generate")[0].body


async def test_unit_models_send_no_transfer_params(make_unit) -> None:
    unit = make_unit("a")
    endpoints = Endpoints((ModelEndpoints("actor", (unit.unit(),), "served"),))
    async with EPDClient(endpoints, retry=FAST) as client:
        assert await prime_encoder(client, image_messages(2), model_name="actor") == {}
        await client.generate(chat(2), model_name="actor")
    (render,) = unit.consumer.requests("/v1/chat/completions/render")
    (generate,) = unit.consumer.requests("/inference/v1/generate")
    assert "ec_transfer_params" not in render.body and "ec_transfer_params" not in generate.body
    assert generate.body["features"]["kwargs_data"]["image"][0].startswith("tensors-")
    assert (unit.consumer.ec_hits, unit.consumer.ec_misses) == (2, 0)
