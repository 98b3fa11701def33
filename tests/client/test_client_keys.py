"""Weight-version keys: with a version, every media part carries a ``uuid``
derived from its content and the version, on the prime and on the render of the request."""

from __future__ import annotations

import argparse
import copy
import itertools
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_client import (
    Endpoints,
    EPDClient,
    MediaPartError,
    ModelEndpoints,
    Unit,
    keyed_items,
    prime_encoder,
    write_keys,
)

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
    # The caller's uuid is replaced by the part's key: vLLM would name the picture by it alone.
    assert x["uuid"].startswith("epd-") and y["uuid"].startswith("epd-") and x["uuid"] != y["uuid"]
    assert sorted(prime_uuids_of(encoder)) == sorted([x["uuid"], y["uuid"]])

    # The same message objects reused at the next step get the next version's key.
    x_v1, y_v1 = x["uuid"], y["uuid"]
    await prime_encoder(args, messages, weights_version="v2")
    assert x["uuid"] not in (x_v1, None) and y["uuid"] not in (y_v1, None)
    await prime_encoder(args, messages, weights_version="v1")
    assert (x["uuid"], y["uuid"]) == (x_v1, y_v1)


async def test_a_callers_uuid_never_names_another_picture(server) -> None:
    """Two pictures under one uuid (a reused id, a collision) get a key each; without a version
    the key is the content's alone, and a part without a uuid is left to vLLM's content hash."""
    encoder = server()
    args = argparse.Namespace(vllm_model_encoder_endpoints={"actor": ("m", [encoder.url])})
    first = request("https://i.test/x.png")["messages"]
    second = request("https://i.test/y.png", "https://i.test/z.png")["messages"]
    first[0]["content"][1]["uuid"] = second[0]["content"][1]["uuid"] = "img-0"
    await prime_encoder(args, first)
    await prime_encoder(args, second)
    x, (y, z) = first[0]["content"][1], second[0]["content"][1:]
    assert x["uuid"] != y["uuid"] and x["uuid"].startswith("epd-") and y["uuid"].startswith("epd-")
    assert "uuid" not in z
    assert sorted(u for u in prime_uuids_of(encoder) if u) == sorted([x["uuid"], y["uuid"]])
    # Its own key (any generation the EPD proxy gave it) is kept, another picture's is not.
    z["uuid"] = f"{x['uuid']}-2"
    y["uuid"] = f"{y['uuid']}-1"
    await prime_encoder(args, second)
    assert y["uuid"].endswith("-1") and z["uuid"].startswith("epd-") and not z["uuid"].startswith(x["uuid"])


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


# Parts of every kind vLLM names by a uuid, with contents drawn small so that equal ones occur.
_CONTENT = st.text(alphabet="ab/:.", min_size=1, max_size=4)
_PARTS = st.one_of(
    st.builds(lambda u: {"type": "image_url", "image_url": {"url": f"https://i.test/{u}"}}, _CONTENT),
    st.builds(lambda u: {"image_url": f"https://i.test/{u}"}, _CONTENT),
    st.builds(lambda u: {"type": "input_image", "image_url": f"https://i.test/{u}", "detail": "auto"}, _CONTENT),
    st.builds(lambda u: {"type": "video_url", "video_url": {"url": f"https://i.test/{u}"}}, _CONTENT),
    st.builds(lambda u: {"type": "audio_url", "audio_url": {"url": f"https://i.test/{u}"}}, _CONTENT),
    st.builds(
        lambda d, f: {"type": "input_audio", "input_audio": {"data": d, "format": f}},
        _CONTENT,
        st.sampled_from(["wav", "mp3"]),
    ),
    st.builds(lambda d: {"type": "image_embeds", "image_embeds": d}, _CONTENT),
    st.builds(lambda d: {"type": "audio_embeds", "audio_embeds": {"audio_embeds": d}}, _CONTENT),
    st.builds(lambda d: {"video_embeds": d}, _CONTENT),
)
_UUIDS = st.one_of(st.none(), st.sampled_from(["img-0", "epd-" + "0" * 32, "epd-" + "0" * 32 + "-1"]))


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.tuples(_PARTS, _UUIDS), min_size=2, max_size=8),
    st.lists(st.sampled_from(["", "step-1", "step-2"]), min_size=8, max_size=8),
)
def test_no_two_different_contents_get_the_same_key(drawn, versions) -> None:
    """Whatever uuids the parts came with (none, one shared by all, another content's key), once
    keyed two parts share a name exactly when their kind, content and weights version are equal."""
    messages, content = [], []
    for (part, uuid), version in zip(drawn, versions, strict=False):
        part = {**part, "uuid": uuid} if uuid is not None else dict(part)
        (item,) = keyed_items([{"content": [part]}])
        write_keys([item], version)
        messages.append(part["uuid"])
        content.append((item.kind, item.source, version))
    for i, j in itertools.combinations(range(len(messages)), 2):
        assert (messages[i] == messages[j]) == (content[i] == content[j]), (drawn[i], drawn[j])


def test_a_uuid_alone_is_refused_whatever_it_names() -> None:
    """A part with a uuid and no media refers to whatever vLLM cached under that name: refused,
    with the part named, for every kind (a key of ours is no proof the client holds the content)."""
    for part in (
        {"type": "image_url", "image_url": None, "uuid": "img-0"},
        {"image_url": None, "uuid": "epd-" + "1" * 32},
        {"type": "video_url", "video_url": {"url": ""}, "uuid": "v"},
        {"type": "input_audio", "input_audio": None, "uuid": "a"},
        {"type": "image_embeds", "image_embeds": None, "uuid": "e"},
        {"audio_embeds": None, "uuid": "e"},
    ):
        with pytest.raises(MediaPartError, match="no data") as refused:
            keyed_items([{"content": [{"type": "text", "text": "hi"}, part]}])
        assert (refused.value.message, refused.value.position) == (0, 1)
    # Embeddings without data and without a uuid name nothing: left to vLLM (which refuses them).
    assert keyed_items([{"content": [{"type": "image_embeds"}]}]) == []
