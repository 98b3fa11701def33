"""Weight-version keys: with a version, every media part carries a ``uuid``
derived from its content and the version, on the prime and on the render of the request."""

from __future__ import annotations

import argparse
import copy
from types import MappingProxyType

import pytest

from epd_client import Endpoints, EPDClient, MediaPartError, ModelEndpoints, Unit, prime_encoder

from .helpers import FAST


def request(*urls: str) -> dict:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, *content]}]}


def prime_uuids(unit) -> list[str | None]:
    """The uuid of the part of each prime request the unit's encoders received."""
    records = [r for e in unit.encoders for r in e.requests("/v1/chat/completions")]
    return [r.body["messages"][0]["content"][0].get("uuid") for r in records]


def rendered_uuids(unit) -> list[list[str | None]]:
    """The uuids of the media parts of each render request, in order."""
    return [
        [p.get("uuid") for p in r.body["messages"][0]["content"] if p["type"] != "text"]
        for r in unit.consumer.requests("/v1/chat/completions/render")
    ]


def endpoints_of(*units) -> Endpoints:
    return Endpoints((ModelEndpoints("default", tuple(u.unit() for u in units)),))


async def test_generate_keys_prime_and_render_alike_without_touching_the_request(make_unit) -> None:
    unit = make_unit("a", encoders=1)
    sent = request("https://i.test/x.png", "https://i.test/y.png")
    original = copy.deepcopy(sent)
    async with EPDClient(endpoints_of(unit), retry=FAST, weights_version="step-1") as client:
        await client.generate(sent)
        await client.generate(sent)
        client.weights_version = "step-2"  # the next step, after a weight update
        await client.generate(sent)

    assert sent == original
    first, again, next_step = rendered_uuids(unit)
    assert first == again  # stable within a version
    (x1, y1), (x2, y2) = first, next_step
    assert len({x1, y1, x2, y2}) == 4  # another image or another version: another key
    assert all(k.startswith("epd-") and len(k) == 36 for k in (x1, y1, x2, y2))
    # Each call primed exactly the keys it rendered (the two primes of a call run at once).
    primes = prime_uuids(unit)
    assert [sorted(primes[i : i + 2]) for i in (0, 2, 4)] == [sorted(first), sorted(again), sorted(next_step)]


async def test_without_a_version_nothing_is_keyed(make_unit) -> None:
    unit = make_unit("a", encoders=1)
    async with EPDClient(endpoints_of(unit), retry=FAST) as client:
        await client.generate(request("https://i.test/x.png"))
    assert prime_uuids(unit) == [None]
    assert rendered_uuids(unit) == [[None]]


async def test_a_session_keeps_the_version_it_started_with(make_unit) -> None:
    unit = make_unit("a", encoders=1)
    async with EPDClient(endpoints_of(unit), retry=FAST, weights_version="v1") as client:
        async with client.session() as session:
            client.weights_version = "v2"  # changed while the request is in flight
            await session.generate(request("https://i.test/x.png"))
        await client.generate(request("https://i.test/x.png"))
    v1, v2 = prime_uuids(unit)
    assert rendered_uuids(unit) == [[v1], [v2]] and v1 != v2


async def test_vime_path_writes_keys_into_the_callers_messages(server) -> None:
    """The caller renders by itself: the keys must be in the messages it renders."""
    encoder = server()
    args = argparse.Namespace(vllm_model_encoder_endpoints={"actor": ("m", [encoder.url])})
    messages = request("https://i.test/x.png", "https://i.test/y.png")["messages"]
    messages[0]["content"][2]["uuid"] = "callers-own-id"

    await prime_encoder(args, messages, weights_version="v1")
    x, y = messages[0]["content"][1:]
    assert x["uuid"].startswith("epd-") and y["uuid"] == "callers-own-id"  # the caller's is kept
    assert sorted(prime_uuids_of(encoder)) == sorted([x["uuid"], "callers-own-id"])

    # The same message objects reused at the next step get the next version's key.
    x_v1 = x["uuid"]
    await prime_encoder(args, messages, weights_version="v2")
    assert x["uuid"] not in (x_v1, None) and y["uuid"] == "callers-own-id"
    await prime_encoder(args, messages, weights_version="v1")
    assert x["uuid"] == x_v1


def prime_uuids_of(encoder) -> list[str | None]:
    return [r.body["messages"][0]["content"][0].get("uuid") for r in encoder.records]


async def test_prime_encoder_uses_the_clients_version_unless_told(server) -> None:
    encoder = server()
    messages = request("https://i.test/x.png")["messages"]
    part = messages[0]["content"][1]
    async with EPDClient(Endpoints.from_urls([encoder.url]), weights_version="v1") as client:
        await prime_encoder(client, messages)
        from_client = part["uuid"]
        await prime_encoder(client, messages, weights_version="v2")
        assert part["uuid"] != from_client
    await prime_encoder(Endpoints.from_urls([encoder.url]), messages, weights_version="v1")
    assert part["uuid"] == from_client  # the key depends on content and version only


async def test_every_kind_is_keyed_by_kind_content_and_version(server) -> None:
    encoder = server()
    same_url = "https://media.test/clip"
    parts = [
        {"type": "image_url", "image_url": {"url": same_url}},
        {"type": "input_image", "image_url": same_url},
        {"type": "video_url", "video_url": {"url": same_url}},
        {"type": "audio_url", "audio_url": {"url": same_url}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "mp3"}},
    ]
    await prime_encoder(Endpoints.from_urls([encoder.url]), [{"role": "user", "content": parts}], weights_version="v1")
    keys = [p["uuid"] for p in parts]
    assert len(set(keys)) == 6
    assert sorted(prime_uuids_of(encoder)) == sorted(keys)


async def test_parts_of_a_model_without_encoders_are_keyed_too(server) -> None:
    """Its own engines cache embeddings by the same key."""
    consumer = server()
    endpoints = Endpoints((ModelEndpoints("reward", (Unit("r", consumer_urls=(consumer.url,)),)),))
    messages = request("https://i.test/x.png")["messages"]
    await prime_encoder(endpoints, messages, model_name="reward", weights_version="v1")
    assert messages[0]["content"][1]["uuid"].startswith("epd-")
    assert consumer.records == []


async def test_read_only_parts_cannot_take_a_key(server) -> None:
    part = MappingProxyType({"type": "image_url", "image_url": {"url": "https://i.test/x.png"}})
    with pytest.raises(TypeError, match="plain dicts"):
        await prime_encoder(
            Endpoints.from_urls([server().url]), [{"role": "user", "content": [part]}], weights_version="v1"
        )


async def test_primes_carry_the_fields_vllm_keys_embeddings_by(make_unit) -> None:
    """vLLM keys an item's embedding by the request's mm_processor_kwargs and media_io_kwargs
    too: a prime without them would store it under a key the render does not look up."""
    unit = make_unit("a", encoders=1)
    fields = {"mm_processor_kwargs": {"max_pixels": 1024}, "media_io_kwargs": {"image": {"image_mode": "L"}}}
    async with EPDClient(endpoints_of(unit), retry=FAST) as client:
        await client.generate({**request("https://i.test/x.png"), **fields, "max_tokens": 3})
    (prime,) = [r for e in unit.encoders for r in e.requests("/v1/chat/completions")]
    assert {k: prime.body.get(k) for k in fields} == fields
    assert prime.body["max_tokens"] == 1  # the prime's own fields, not the request's


async def test_a_part_that_reads_otherwise_once_keyed_is_refused(server) -> None:
    """With a uuid vLLM reads a part by the first media key it holds, not by its type: keying
    this part would make the consumer read another item than the one primed."""
    encoder = server()
    args = argparse.Namespace(vllm_model_encoder_endpoints={"actor": ("m", [encoder.url])})
    part = {"type": "video_url", "video_url": {"url": "https://i.test/v.mp4"}, "image_url": {"url": "https://i.test/x"}}
    with pytest.raises(MediaPartError, match="several media fields"):
        await prime_encoder(args, [{"role": "user", "content": [part]}], weights_version="v1")
    assert encoder.records == [] and "uuid" not in part
