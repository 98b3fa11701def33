"""The EPD gateway (proxy/gateway.py) in front of units of stand-ins, each behind its own real
EPD proxy with an EC store folder: repeats of a picture go to the unit that primed it, a
conversation stays on its unit, hot pictures spill within the bound, and the weights version
goes with every request."""

from __future__ import annotations

import asyncio
import json

from epd_client import choose_unit, media_items, media_key

CHAT = "/v1/chat/completions"


def picture(i: int) -> dict:
    return {"type": "image_url", "image_url": {"url": f"https://images.test/{i}.png"}}


def chat(*parts: dict, **extra: object) -> dict:
    return {
        "model": "served",
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}],
        **extra,
    }


def key(part: dict, version: str = "") -> str:
    return media_key(media_items([{"content": [part]}])[0], version)


async def post(http, url: str, body: object, **headers: str):
    async with http.post(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json", **headers}
    ) as response:
        return response.status, await response.json(content_type=None)


async def test_repeats_of_a_picture_go_to_the_unit_that_primed_it(units, start_gateway, http):
    u = await units(4)
    gateway = await start_gateway(u.proxies)
    own = choose_unit(key(picture(1)), list(u.proxies)).unit
    for _ in range(8):  # a GRPO group, one sample after the other
        assert (await post(http, gateway.url + CHAT, chat(picture(1))))[0] == 200
    assert {name: len(u.primes(name)) for name in u.proxies if u.primes(name)} == {own: 1}
    assert {name: len(u.served(name)) for name in u.proxies if u.served(name)} == {own: 8}
    # Other pictures go where their own keys say: spread over the units.
    for i in range(2, 30):
        await post(http, gateway.url + CHAT, chat(picture(i)))
    assert sum(bool(u.primes(name)) for name in u.proxies) >= 3
    assert all(u.files[name].misses == [] for name in u.proxies)


async def test_a_conversation_stays_on_its_unit_and_each_picture_is_primed_once(units, start_gateway, http):
    u = await units(3)
    gateway = await start_gateway(u.proxies)
    history: list[dict] = []
    for turn in range(4):  # each turn resends every earlier picture
        history.append({"role": "user", "content": [picture(10 + turn), {"type": "text", "text": f"turn {turn}"}]})
        status, _ = await post(http, gateway.url + CHAT, {"model": "served", "messages": history})
        assert status == 200
        history.append({"role": "assistant", "content": "x"})
    (where,) = [name for name in u.proxies if u.served(name)]
    assert len(u.served(where)) == 4 and len(u.primes(where)) == 4  # one prime per picture, all turns
    # The session header (or the user field) pins a conversation without pictures too.
    for _ in range(3):
        await post(http, gateway.url + CHAT, chat(), **{"X-EPD-Session": "chat-7"})
        await post(http, gateway.url + CHAT, chat(user="alice"))
    pinned = {name for name in u.proxies if any(r.body.get("user") == "alice" for r in u.served(name))}
    assert len(pinned) == 1


async def test_a_hot_picture_spills_to_its_next_unit_within_the_bound(units, start_gateway, http):
    u = await units(2, consumer_delay=0.3)
    gateway = await start_gateway(u.proxies)
    answers = await asyncio.gather(*(post(http, gateway.url + CHAT, chat(picture(1))) for _ in range(8)))
    assert {status for status, _ in answers} == {200}
    served = sorted(len(u.served(name)) for name in u.proxies)
    assert served == [3, 5]  # ceil(1.25 * 8 / 2) = 5 at most on the picture's own unit
    assert sum(len(u.primes(name)) for name in u.proxies) == 2  # one per unit it reached
    text = await gateway.metrics_text()
    assert "epd_gateway_affinity_misses_total 3.0" in text


async def test_the_models_weights_version_goes_with_every_request_unless_the_client_sent_one(
    units, start_gateway, http
):
    u = await units(1)
    gateway = await start_gateway(u.proxies, weights_version="step-5")
    await post(http, gateway.url + CHAT, chat(picture(1)))
    await post(http, gateway.url + CHAT, chat(picture(1)), **{"X-EPD-Weights-Version": "step-6"})
    (name,) = u.proxies
    assert [r.headers["x-epd-weights-version"] for r in u.served(name)] == ["step-5", "step-6"]
    assert [r.body["messages"][0]["content"][0]["uuid"] for r in u.served(name)] == [
        key(picture(1), "step-5"),
        key(picture(1), "step-6"),
    ]
    # A new version of the model reaches the next request (the watch sets it).
    gateway.proxy.units.weights_version = "step-7"
    await post(http, gateway.url + CHAT, chat(picture(1)))
    assert u.served(name)[-1].body["messages"][0]["content"][0]["uuid"] == key(picture(1), "step-7")
    assert len(u.primes(name)) == 3


async def test_without_a_ready_unit_a_503_and_the_prime_endpoint_is_the_units(start_gateway, http):
    gateway = await start_gateway({})
    status, answer = await post(http, gateway.url + CHAT, chat(picture(1)))
    assert status == 503 and "no unit" in answer["error"]["message"]
    status, answer = await post(http, gateway.url + "/epd/v1/prime", {"messages": chat(picture(1))["messages"]})
    assert status == 400 and "unit's proxy" in answer["error"]["message"]


async def test_the_gateway_refuses_a_media_url_the_units_would_refuse(units, start_gateway, http):
    u = await units(2)
    gateway = await start_gateway(u.proxies)
    private = {"type": "image_url", "image_url": {"url": "http://10.0.0.9/cat.png"}}
    status, answer = await post(http, gateway.url + CHAT, chat(private))
    assert status == 400 and "messages[0].content[0]" == answer["error"]["param"]
    assert not any(u.served(name) or u.primes(name) for name in u.proxies)


async def test_two_pictures_under_one_client_uuid_each_get_their_own_embedding(units, start_gateway, http):
    """A client's uuid decides nothing: the gateway places a part by its content, the unit's proxy
    keys it by its content, and a uuid alone (a part without media) is refused at the gateway."""
    u = await units(3)
    gateway = await start_gateway(u.proxies, weights_version="step-1")
    for i in (1, 2, 1, 2):
        assert (await post(http, gateway.url + CHAT, chat({**picture(i), "uuid": "img-0"})))[0] == 200
    for i in (1, 2):
        own = choose_unit(key(picture(i), "step-1"), list(u.proxies)).unit
        primed = [p["messages"][0]["content"][0]["uuid"] for p in u.primes(own)]
        served = [r.body["messages"][0]["content"][0]["uuid"] for r in u.served(own)]
        assert primed.count(key(picture(i), "step-1")) == 1 and served.count(key(picture(i), "step-1")) == 2
    assert all(u.files[name].misses == [] for name in u.proxies)
    assert sum(len(u.primes(name)) for name in u.proxies) == 2
    status, answer = await post(
        http, gateway.url + CHAT, chat({"type": "image_url", "image_url": None, "uuid": "img-0"})
    )
    assert status == 400 and answer["error"]["param"] == "messages[0].content[0]"
    assert "no data" in answer["error"]["message"]
