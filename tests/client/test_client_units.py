"""Unit choice and affinity: priming and render/generate of a request on one unit."""

from __future__ import annotations

import httpx
import pytest

from epd_client import (
    Endpoints,
    EndpointsError,
    EPDClient,
    ModelEndpoints,
    NoReadyUnitError,
    Unit,
    generate_sync,
    prime_encoder,
)

from .helpers import FAST, image_messages


def endpoints(*units: Unit, model: str = "actor") -> Endpoints:
    return Endpoints((ModelEndpoints(model, units, served_model_name="served"),))


def chat(images: int) -> dict:
    return {"messages": image_messages(images), "max_tokens": 8, "temperature": 0}


async def test_generate_primes_and_generates_on_one_unit(make_unit) -> None:
    units = [make_unit("a"), make_unit("b")]
    async with EPDClient(endpoints(*(u.unit() for u in units)), retry=FAST) as client:
        for i in range(20):
            result = await client.generate(chat(2), key=f"sample-{i}", model_name="actor")
            assert result["choices"][0]["token_ids"] == [7, 8, 9]

    for u in units:
        # Every generate found its images in its own unit's EC store.
        assert u.consumer.ec_misses == 0
        assert u.consumer.ec_hits == 2 * len(u.consumer.requests("/inference/v1/generate"))
        assert u.prime_count == u.consumer.ec_hits
    # The keys spread over both units.
    assert all(u.consumer.ec_hits > 0 for u in units)


async def test_the_stand_in_detects_cross_unit_generation(make_unit) -> None:
    """What the API prevents: priming on A, generating on B misses B's EC store."""
    a, b = make_unit("a"), make_unit("b")
    await prime_encoder(endpoints(a.unit()), image_messages(2), model_name="actor")
    async with httpx.AsyncClient(base_url=b.consumer.url) as http:
        rendered = await http.post("/v1/chat/completions/render", json=chat(2))
        await http.post("/inference/v1/generate", json=rendered.json())
    assert (a.prime_count, b.consumer.ec_misses) == (2, 2)


async def test_generate_sends_render_response_to_generate(make_unit) -> None:
    u = make_unit("a")
    async with EPDClient(endpoints(u.unit()), retry=FAST) as client:
        await client.generate(chat(1), model_name="actor")
    (render,) = u.consumer.requests("/v1/chat/completions/render")
    (generate,) = u.consumer.requests("/inference/v1/generate")
    assert render.body["model"] == "served"
    assert render.body["messages"] == chat(1)["messages"]
    assert generate.body["token_ids"] == [1, 2, 3, 4]
    assert generate.body["request_id"].startswith("render-")
    # Priming finished before render started.
    assert max(r.finished for e in u.encoders for r in e.records) <= render.started


async def test_text_only_generate_skips_priming(make_unit) -> None:
    u = make_unit("a")
    async with EPDClient(endpoints(u.unit()), retry=FAST) as client:
        await client.generate({"messages": [{"role": "user", "content": "hi"}]}, model_name="actor")
    assert u.prime_count == 0
    assert [r.path for r in u.consumer.records] == [
        "/v1/chat/completions/render",
        "/inference/v1/generate",
    ]


async def test_a_key_always_gets_the_same_unit(make_unit) -> None:
    units = [make_unit(name, encoders=1) for name in "abc"]
    async with EPDClient(endpoints(*(u.unit() for u in units))) as client:
        chosen = {}
        for i in range(30):
            async with client.session(f"k{i}", model_name="actor") as session:
                chosen[f"k{i}"] = session.unit.name
        for key, name in chosen.items():
            async with client.session(key, model_name="actor") as session:
                assert session.unit.name == name
        assert set(chosen.values()) == {"a", "b", "c"}

        # Unit b stops being ready: only b's keys move.
        client.endpoints = endpoints(units[0].unit(), units[1].unit(ready=False), units[2].unit())
        for key, name in chosen.items():
            async with client.session(key, model_name="actor") as session:
                if name != "b":
                    assert session.unit.name == name
                else:
                    assert session.unit.name in ("a", "c")


async def test_without_a_key_the_least_busy_unit_is_chosen(make_unit) -> None:
    a, b = make_unit("a"), make_unit("b")
    async with EPDClient(endpoints(a.unit(), b.unit())) as client:
        async with client.session(model_name="actor") as first:
            for _ in range(4):
                async with client.session(model_name="actor") as other:
                    assert other.unit.name != first.unit.name
        # Idle units take turns.
        names = []
        for _ in range(4):
            async with client.session(model_name="actor") as session:
                names.append(session.unit.name)
        assert sorted(names) == ["a", "a", "b", "b"]


async def test_priming_without_a_session_needs_a_single_unit(make_unit) -> None:
    a, b = make_unit("a"), make_unit("b")
    async with EPDClient(endpoints(a.unit(), b.unit())) as client:
        with pytest.raises(EndpointsError, match="session"):
            await prime_encoder(client, image_messages(1), model_name="actor")
    with pytest.raises(EndpointsError, match="session"):
        await prime_encoder(endpoints(a.unit(), b.unit()), image_messages(1), model_name="actor")
    assert a.prime_count == b.prime_count == 0


async def test_unknown_model_and_unready_units_raise(make_unit) -> None:
    a = make_unit("a")
    async with EPDClient(endpoints(a.unit(ready=False))) as client:
        with pytest.raises(NoReadyUnitError):
            await client.generate(chat(1), model_name="actor")
        with pytest.raises(EndpointsError, match="unknown model 'default'"):
            await client.generate(chat(1))
        with pytest.raises(EndpointsError, match="unknown model"):
            await prime_encoder(client, image_messages(1), model_name="typo")
    assert a.prime_count == 0 and a.consumer.records == []


async def test_a_unit_without_entry_url_cannot_generate(make_unit) -> None:
    a = make_unit("a")
    encoders_only = Unit("a", encoder_urls=tuple(e.url for e in a.encoders))
    async with EPDClient(endpoints(encoders_only)) as client:
        with pytest.raises(EndpointsError, match="no router or consumer"):
            await client.generate(chat(1), model_name="actor")


def test_generate_sync(make_unit) -> None:
    a = make_unit("a")
    result = generate_sync(endpoints(a.unit()), chat(2), key="s", model_name="actor", retry=FAST)
    assert result["choices"][0]["token_ids"] == [7, 8, 9]
    assert a.consumer.ec_hits == 2
