"""Which unit a request goes to (epd_client._affinity): rendezvous hashing with bounded load, the
one function EPDClient and the EPD gateway share, and the key a request is placed by."""

from __future__ import annotations

import collections
import math
import random

import pytest

from epd_client import Endpoints, EPDClient, ModelEndpoints, Unit, media_items
from epd_client._affinity import BALANCE, affinity_key, choose
from epd_client._media import media_key

UNITS = [f"demo-actor-{i}" for i in range(8)]


def test_a_key_keeps_its_unit_and_only_a_leaving_units_keys_move() -> None:
    before = {f"k{i}": choose(f"k{i}", UNITS).unit for i in range(400)}
    assert all(choose(k, UNITS).preferred for k in before)
    assert {k: choose(k, list(reversed(UNITS))).unit for k in before} == before  # order does not matter
    gone = UNITS[3]
    after = {k: choose(k, [u for u in UNITS if u != gone]).unit for k in before}
    moved = {k for k in before if before[k] != after[k]}
    assert moved == {k for k, u in before.items() if u == gone}
    # Spread: each unit prefers about an eighth of the keys.
    counts = collections.Counter(before.values())
    assert set(counts) == set(UNITS) and max(counts.values()) < 2 * len(before) / len(UNITS)


def test_a_loaded_unit_passes_its_keys_on_in_their_own_order_and_no_unit_exceeds_the_bound() -> None:
    key = "hot image"
    own = choose(key, UNITS).unit
    loads = {u: 0 for u in UNITS}
    placed = []
    for _ in range(400):  # one hot key, requests that never finish
        choice = choose(key, UNITS, loads)
        loads[choice.unit] += 1
        placed.append(choice)
        total = sum(loads.values())
        assert max(loads.values()) <= math.ceil(BALANCE * total / len(UNITS))
    assert placed[0].unit == own and placed[0].preferred
    assert {c.unit for c in placed if c.preferred} == {own}
    # The spill goes to the key's second unit first, not to a random one.
    second = next(c.unit for c in placed if not c.preferred)
    assert second == choose(key, [u for u in UNITS if u != own]).unit


def test_many_keys_under_load_stay_within_the_bound_and_mostly_on_their_own_unit() -> None:
    rng = random.Random(7)
    loads = {u: 0 for u in UNITS}
    in_flight: collections.deque[str] = collections.deque()
    misses = 0
    for n in range(20_000):
        key = f"conversation-{rng.randrange(1000)}"
        choice = choose(key, UNITS, loads)
        misses += not choice.preferred
        loads[choice.unit] += 1
        in_flight.append(choice.unit)
        # Bounded where it is placed: no more than its share of what is in flight now.
        assert loads[choice.unit] <= math.ceil(BALANCE * sum(loads.values()) / len(UNITS))
        if len(in_flight) > 64:  # 64 requests in flight
            loads[in_flight.popleft()] -= 1
    assert misses < 20_000 * 0.2  # 11 % measured: the bound moves few requests off their unit


def test_without_a_key_the_least_loaded_unit_with_idle_units_taking_turns() -> None:
    assert choose(None, UNITS, {u: 1 for u in UNITS} | {"demo-actor-5": 0}).unit == "demo-actor-5"
    assert [choose(None, UNITS, start=s).unit for s in range(3)] == UNITS[:3]
    assert not choose(None, UNITS).preferred
    with pytest.raises(ValueError):
        choose("k", [])


def test_unit_for_is_the_same_function() -> None:
    model = ModelEndpoints("actor", tuple(Unit(name=u, encoder_urls=("http://e",)) for u in UNITS))
    for i in range(50):
        assert model.unit_for(f"k{i}").name == choose(f"k{i}", UNITS).unit
    loads = {choose("k1", UNITS).unit: 10}
    assert model.unit_for("k1", loads).name == choose("k1", UNITS, loads).unit != choose("k1", UNITS).unit


def test_a_request_is_placed_by_its_conversation_else_its_first_media_parts_key() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    later = {"type": "image_url", "image_url": {"url": "data:image/png;base64,BBBB"}}
    turn_1 = [{"role": "user", "content": [image, {"type": "text", "text": "what is it?"}]}]
    turn_2 = [*turn_1, {"role": "assistant", "content": "a dot"}, {"role": "user", "content": [later]}]
    first = media_items(turn_1)[0]
    assert affinity_key(media_items(turn_1), weights_version="step-1") == media_key(first, "step-1")
    assert affinity_key(media_items(turn_2), weights_version="step-1") == media_key(first, "step-1")
    assert affinity_key(media_items(turn_1)) == media_key(first, "")
    assert affinity_key(media_items(turn_1), weights_version="step-2") != media_key(first, "step-1")
    assert affinity_key(media_items(turn_1), user="alice") == "session:alice"
    assert affinity_key(media_items(turn_1), user="alice", session="chat-9") == "session:chat-9"
    assert affinity_key([], user=None) is None
    # A client's uuid places nothing: the part is its content (the unit's proxy keys it so).
    keyed = [{"role": "user", "content": [{**image, "uuid": "mine"}]}]
    assert affinity_key(media_items(keyed), weights_version="step-1") == media_key(first, "step-1")
    other = [{"role": "user", "content": [{**later, "uuid": "mine"}]}]
    assert affinity_key(media_items(other), weights_version="step-1") != media_key(first, "step-1")


async def test_generate_without_a_key_sends_every_repeat_of_a_picture_to_one_unit(make_unit) -> None:
    units = [make_unit(f"demo-actor-{i}", encoders=1) for i in range(4)]
    endpoints = Endpoints((ModelEndpoints("default", tuple(u.unit() for u in units)),))
    image = {"type": "image_url", "image_url": {"url": "https://images.test/cat.png"}}
    request = {"messages": [{"role": "user", "content": [image, {"type": "text", "text": "and now?"}]}]}
    own = choose(media_key(media_items(request["messages"])[0], "step-3"), [u.name for u in units]).unit
    async with EPDClient(endpoints, weights_version="step-3") as client:
        for _ in range(5):  # a GRPO group, one sample after the other
            await client.generate(request)
    assert {u.name: u.prime_count for u in units if u.prime_count} == {own: 5}
    # Another picture goes wherever its own key says, not to the same unit by accident.
    others = {
        choose(
            media_key(
                media_items([{"content": [{**image, "image_url": {"url": f"https://i.test/{n}"}}]}])[0], "step-3"
            ),
            [u.name for u in units],
        ).unit
        for n in range(20)
    }
    assert len(others) > 1
