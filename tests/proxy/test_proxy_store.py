"""Each picture encoded once per weights version (proxy/store.py, ec/leases.py): the proxy keys
every media part by its weights version, looks in its unit's EC store before priming, primes a
key once however many requests want it, and leases what its requests rely on so that the
janitor's evictions never make a consumer encode.

The engines are stand-ins with ECExampleConnector's file semantics on a real folder
(epd_dev/standins/ec_files.py: vLLM's encoder memory included); the janitor is the real one
(ec/janitor.py's sweep), racing the requests on that folder.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from epd_client import Endpoints, EPDClient, ModelEndpoints, PrimeError, media_items, media_key
from epd_client import Unit as Unit_
from epd_dataplane import core, keys
from epd_dev.standins.ec_files import FileStore
from epd_dev.standins.fault_proxy import http_status
from epd_operator.ec import janitor, leases

from .conftest import keyed

CHAT = "/v1/chat/completions"
PRIME = "/epd/v1/prime"


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


class Unit:
    """A unit of stand-ins around one EC store folder: an encoder, a consumer, the proxy."""

    def __init__(self, server, root: Path, *, consumer_delay: float = 0.0, **files: bool) -> None:
        self.store = root / "vime-ec-demo"
        self.files = FileStore(self.store, **files)
        self.encoder = server(files=self.files, ec_role="producer")
        self.consumer = server(files=self.files, ec_role="consumer", delay=consumer_delay)
        self.proxy = None

    @property
    def primes(self) -> list[dict]:
        return [r.body for r in self.encoder.requests(CHAT)]

    def forwarded_names(self) -> list[list[str]]:
        return [[p["uuid"] for p in r.body["messages"][0]["content"] if "uuid" in p] for r in self.consumer.records]


@pytest.fixture
def unit(server, tmp_path):
    def make(**options) -> Unit:
        return Unit(server, tmp_path, **options)

    return make


async def post(http, url: str, body: object, **headers: str):
    async with http.post(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json", **headers}
    ) as response:
        return response.status, await response.json(content_type=None)


def metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + "{", name + " ")))


async def test_the_same_picture_sent_eight_times_is_primed_once(unit, start_proxy, http):
    u = unit()
    proxy = await start_proxy(u.consumer.url, [u.encoder.url], ec_store=str(u.store))
    for _ in range(8):
        assert (await post(http, proxy.url + CHAT, chat(picture(1), picture(2))))[0] == 200
    assert len(u.primes) == 2  # one per picture
    assert u.files.encoded == [key(picture(1)), key(picture(2))] or u.files.encoded == [
        key(picture(2)),
        key(picture(1)),
    ]
    assert u.forwarded_names() == [[key(picture(1)), key(picture(2))]] * 8
    assert (u.files.hits, u.files.misses) == (16, [])
    text = await proxy.metrics_text()
    assert metric(text, "epd_proxy_media_primed_total") == 2 and metric(text, "epd_proxy_media_stored_total") == 14
    assert metric(text, "epd_proxy_leased_keys") == 0 and metric(text, "epd_proxy_store_verified") == 1


async def test_concurrent_requests_for_one_picture_share_one_prime(server, unit, start_proxy, http):
    u = unit()
    slow = server(files=u.files, ec_role="producer", delay=0.3)
    proxy = await start_proxy(u.consumer.url, [slow.url], ec_store=str(u.store))
    answers = await asyncio.gather(*(post(http, proxy.url + CHAT, chat(picture(1))) for _ in range(8)))
    assert [status for status, _ in answers] == [200] * 8
    assert len(slow.requests(CHAT)) == 1
    assert (u.files.hits, u.files.misses) == (8, [])
    text = await proxy.metrics_text()
    assert metric(text, "epd_proxy_prime_shared_total") == 7


async def test_a_new_weights_version_primes_again_under_a_new_key(unit, start_proxy, http):
    u = unit()
    proxy = await start_proxy(u.consumer.url, [u.encoder.url], ec_store=str(u.store))
    for version in ("step-1", "step-1", "step-2", "step-2", "step-1"):
        status, _ = await post(http, proxy.url + CHAT, chat(picture(1)), **{"X-EPD-Weights-Version": version})
        assert status == 200
    assert u.files.encoded == [key(picture(1), "step-1"), key(picture(1), "step-2")]
    assert [names[0] for names in u.forwarded_names()] == [
        key(picture(1), v) for v in ("step-1", "step-1", "step-2", "step-2", "step-1")
    ]
    # The old version's entry is another name: a new version never reads it.
    assert key(picture(1), "step-1") != key(picture(1), "step-2")
    status, answer = await post(http, proxy.url + CHAT, chat(picture(1)), **{"X-EPD-Weights-Version": "has space"})
    assert status == 400 and "X-EPD-Weights-Version" in answer["error"]["message"]


async def test_a_uuid_the_client_chose_never_names_another_picture(unit, start_proxy, http):
    """vLLM names a part by its uuid alone: two pictures sent with one client uuid would read one
    embedding. The proxy replaces the client's uuid by each part's key, so each is its own, and a
    repeat under the same uuid is found in the store like any other."""
    u = unit()
    proxy = await start_proxy(u.consumer.url, [u.encoder.url], ec_store=str(u.store))
    for i in (1, 2, 1):
        assert (await post(http, proxy.url + CHAT, chat({**picture(i), "uuid": "img-0"})))[0] == 200
    assert u.forwarded_names() == [[key(picture(1))], [key(picture(2))], [key(picture(1))]]
    assert u.files.encoded == [key(picture(1)), key(picture(2))] and len(u.primes) == 2
    # Another picture's key is no better than a uuid of the client's own.
    assert (await post(http, proxy.url + CHAT, chat({**picture(3), "uuid": key(picture(1))})))[0] == 200
    assert u.forwarded_names()[-1] == [key(picture(3))] and u.files.misses == []
    text = await proxy.metrics_text()
    assert metric(text, "epd_proxy_client_uuids_replaced_total") == 4


async def test_an_evicted_entry_the_encoder_still_remembers_is_primed_under_the_next_generation(
    unit, start_proxy, http
):
    u = unit()
    first = key(picture(1))

    def evict() -> None:  # the janitor's eviction of every entry
        for entry in janitor.scan_store(str(u.store)):
            assert janitor.evict(str(u.store), entry)

    proxy = await start_proxy(u.consumer.url, [u.encoder.url], ec_store=str(u.store))
    assert (await post(http, proxy.url + CHAT, chat(picture(1))))[0] == 200
    evict()
    # A restarted proxy (it knows nothing of the key) primes the key: the encoder answers from
    # its memory and writes nothing, so the part goes on under <key>-1, which it stores.
    restarted = await start_proxy(u.consumer.url, [u.encoder.url], ec_store=str(u.store))
    assert (await post(http, restarted.url + CHAT, chat(picture(1))))[0] == 200
    assert [p["messages"][0]["content"][0]["uuid"] for p in u.primes] == [first, first, f"{first}-1"]
    assert u.forwarded_names()[-1] == [f"{first}-1"] and u.files.misses == []
    assert metric(await restarted.metrics_text(), "epd_proxy_prime_regenerated_total") == 1
    assert (await post(http, restarted.url + CHAT, chat(picture(1))))[0] == 200
    assert len(u.primes) == 3 and u.forwarded_names()[-1] == [f"{first}-1"]  # found under its generation
    # Evicted again: the proxy remembers where it stored last, and goes on from there at once.
    evict()
    assert (await post(http, restarted.url + CHAT, chat(picture(1))))[0] == 200
    assert [p["messages"][0]["content"][0]["uuid"] for p in u.primes][3:] == [f"{first}-2"]
    assert u.files.misses == []


async def test_a_model_that_names_entries_otherwise_is_primed_every_time(unit, start_proxy, http):
    u = unit(own_names=True)
    proxy = await start_proxy(u.consumer.url, [u.encoder.url], ec_store=str(u.store))
    for _ in range(3):
        assert (await post(http, proxy.url + CHAT, chat(picture(1))))[0] == 200
    # The first two primes (the key, then its next generation) stored nothing under their names,
    # and no entry is named by a key: from then on the proxy primes each request as it is (the
    # consumer reads what the encoder named alike).
    assert len(u.primes) == 2 + 2 and u.files.misses == []
    text = await proxy.metrics_text()
    assert metric(text, "epd_proxy_store_verified") == 0 and metric(text, "epd_proxy_leased_keys") == 0


async def test_hash_factors_go_with_the_primes_and_such_parts_are_primed_every_time(unit, start_proxy, http):
    u = unit()
    proxy = await start_proxy(u.consumer.url, [u.encoder.url], ec_store=str(u.store))
    request = chat(picture(1), mm_processor_kwargs={"max_pixels": 1024})
    for _ in range(2):
        assert (await post(http, proxy.url + CHAT, request))[0] == 200
    assert [p["mm_processor_kwargs"] for p in u.primes] == [{"max_pixels": 1024}] * 2
    assert u.forwarded_names() == [[key(picture(1))]] * 2


async def test_versioned_models_refuse_media_without_a_version(unit, start_proxy, http):
    u = unit()
    proxy = await start_proxy(u.consumer.url, [u.encoder.url], ec_store=str(u.store), require_weights_version=True)
    status, answer = await post(http, proxy.url + CHAT, chat(picture(1)))
    assert status == 400 and "weightsVersion" in answer["error"]["message"]
    assert (await post(http, proxy.url + CHAT, chat()))[0] == 200  # text passes
    image_block = {"type": "image", "source": {"type": "url", "url": "https://images.test/a.png"}}
    status, answer = await post(
        http,
        proxy.url + "/v1/messages",
        {"max_tokens": 8, "messages": [{"role": "user", "content": [image_block]}]},
        **{"X-EPD-Weights-Version": "step-1"},
    )
    assert status == 400 and "Anthropic" in answer["error"]["message"]
    assert u.primes == []


async def test_a_failed_prime_fails_every_request_waiting_for_it(server, faulty, unit, start_proxy, http):
    u = unit()
    broken = faulty(server().url)
    broken.add(http_status(503), times=None)
    proxy = await start_proxy(u.consumer.url, [broken.url], ec_store=str(u.store))
    answers = await asyncio.gather(
        post(http, proxy.url + CHAT, chat(picture(1))), post(http, proxy.url + CHAT, chat(picture(0), picture(1)))
    )
    assert [status for status, _ in answers] == [502, 502]
    assert "messages[0].content[0]" in answers[0][1]["error"]["message"]
    assert "messages[0].content[1]" in answers[1][1]["error"]["message"]  # its own part named
    assert u.consumer.records == []
    assert metric(await proxy.metrics_text(), "epd_proxy_leased_keys") == 0


async def test_a_client_that_leaves_cancels_the_prime_only_it_waited_for(server, unit, start_proxy):
    u = unit()
    slow = server(files=u.files, ec_role="producer", delay=2)
    proxy = await start_proxy(u.consumer.url, [slow.url], ec_store=str(u.store))
    async with aiohttp.ClientSession() as http:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(post(http, proxy.url + CHAT, chat(picture(1))), 0.5)
    await asyncio.sleep(0.3)
    assert slow.requests(CHAT)[0].aborted and len(proxy.proxy.flights) == 0
    assert proxy.proxy.store.leases.held() == 0


async def test_epd_client_primes_through_the_proxy_with_a_lease_for_its_render_and_generate(unit, start_proxy, http):
    u = unit()
    proxy = await start_proxy(u.consumer.url, [u.encoder.url], ec_store=str(u.store))
    body = {"model": "served", "messages": chat(picture(1), picture(2))["messages"], "lease_seconds": 30}
    status, answer = await post(http, proxy.url + PRIME, body, **{"X-EPD-Weights-Version": "step-7"})
    assert status == 200 and answer["primed"] == 2 and answer["stored"] == 0
    assert answer["keys"] == [key(picture(1), "step-7"), key(picture(2), "step-7")]
    assert u.consumer.records == []  # nothing forwarded
    held = leases.fresh_keys(str(u.store))
    assert held == set(answer["keys"])
    # A request naming the grant keeps it while it runs, past its seconds.
    status, again = await post(http, proxy.url + PRIME, body, **{"X-EPD-Weights-Version": "step-7"})
    assert again["stored"] == 2 and again["primed"] == 0 and len(u.primes) == 2
    grants = proxy.proxy.grants
    assert len(grants) == 2
    grants.close()
    assert leases.fresh_keys(str(u.store)) == set()
    status, answer = await post(http, proxy.url + PRIME, {**body, "lease_seconds": 0})
    assert status == 400 and answer["error"]["param"] == "lease_seconds"


async def test_a_grant_outlives_its_seconds_while_a_request_carries_it(server, unit, start_proxy, http):
    u = unit()
    slow_consumer = server(files=u.files, ec_role="consumer", delay=1.0)
    proxy = await start_proxy(slow_consumer.url, [u.encoder.url], ec_store=str(u.store))
    body = {"messages": chat(picture(1))["messages"], "lease_seconds": 0.2}
    _, answer = await post(http, proxy.url + PRIME, body)
    lease = answer["lease"]
    render = asyncio.create_task(
        post(http, proxy.url + "/v1/chat/completions/render", keyed(chat(picture(1))), **{"X-EPD-Lease": lease})
    )
    await asyncio.sleep(0.5)  # past the grant's seconds, the render still under way
    assert leases.fresh_keys(str(u.store)) == {answer["keys"][0]}
    await render
    assert leases.fresh_keys(str(u.store)) == set()


def _janitor(store: Path, stop: threading.Event, *, respect_leases: bool) -> janitor.StoreMetrics:
    """The real janitor's sweep, as fast as it goes, with no grace period and a budget of one
    entry: it evicts every settled entry it may, all the time."""
    metrics = janitor.StoreMetrics([str(store)], 1)
    state = janitor.StoreState()
    original = leases.fresh_keys

    def sweep_forever() -> None:
        while not stop.is_set():
            if not respect_leases:
                leases.fresh_keys = lambda *_a, **_k: set()  # type: ignore[assignment]  # the janitor's lease check swapped for this test, then put back
            try:
                janitor.sweep(str(store), metrics, state, max_bytes=1, ttl_seconds=None, grace_seconds=0)
            finally:
                leases.fresh_keys = original  # type: ignore[assignment]  # the janitor's lease check swapped for this test, then put back
            time.sleep(0.001)

    threading.Thread(target=sweep_forever, daemon=True).start()
    return metrics


@pytest.mark.parametrize("respect_leases", [True, False], ids=["with leases", "janitor ignoring leases (control)"])
async def test_evictions_raced_against_requests_never_make_the_consumer_encode(unit, start_proxy, http, respect_leases):
    """Many requests for a few pictures, while the janitor evicts everything it may. With the
    leases no consumer read misses, however the evictions fall; the control, a janitor that
    ignores them, shows the race is there to lose (the consumer reads a while after the proxy
    looked: vLLM schedules the request first)."""
    u = unit(consumer_delay=0.005, memory_size=4)
    proxy = await start_proxy(u.consumer.url, [u.encoder.url], ec_store=str(u.store))
    stop = threading.Event()
    metrics = _janitor(u.store, stop, respect_leases=respect_leases)
    try:
        for _ in range(12):
            answers = await asyncio.gather(
                *(post(http, proxy.url + CHAT, chat(picture(i % 3), picture((i + 1) % 3))) for i in range(12))
            )
            assert {status for status, _ in answers} == {200}
    finally:
        stop.set()
        await asyncio.sleep(0.05)
    evicted = sum(s.value for s in next(iter(metrics.evictions.collect())).samples if s.name.endswith("_total"))
    assert evicted > 10  # the janitor did evict, again and again
    if respect_leases:
        assert u.files.misses == []
        assert len(u.primes) > 3  # evicted entries were primed again (under new generations)
    else:
        assert u.files.misses, "the control should lose the race: the test would not see a broken lease"


async def test_epd_client_primes_through_the_units_proxy_once_per_picture(unit, start_proxy):
    u = unit()
    proxy = await start_proxy(u.consumer.url, [u.encoder.url], ec_store=str(u.store))
    endpoint = Unit_(
        name="demo-actor-0", encoder_urls=(u.encoder.url,), consumer_urls=(u.consumer.url,), front_url=proxy.url
    )
    endpoints = Endpoints((ModelEndpoints("actor", (endpoint,), "served"),))
    request = {"messages": chat(picture(1), picture(2))["messages"], "max_tokens": 4}
    async with EPDClient(endpoints, weights_version="step-3") as client:
        for _ in range(4):
            await client.generate(request, model_name="actor")
    assert len(u.primes) == 2 and all(p["model"] == "served" for p in u.primes)
    renders = u.consumer.requests("/v1/chat/completions/render")
    assert len(renders) == 4 and "uuid" not in request["messages"][0]["content"][0]  # the caller's left as it was
    assert [p["uuid"] for p in renders[0].body["messages"][0]["content"][:2]] == [
        key(picture(1), "step-3"),
        key(picture(2), "step-3"),
    ]
    # Render and generate carried the lease of what the prime found or primed.
    leased = {r.headers.get("x-epd-lease") for r in u.consumer.records}
    assert None not in leased and len(leased) == 4
    text = await proxy.metrics_text()
    assert metric(text, "epd_proxy_media_primed_total") == 2 and metric(text, "epd_proxy_media_stored_total") == 6


async def test_epd_client_primes_the_encoders_itself_behind_a_proxy_without_the_endpoint(server, unit):
    u = unit()
    old_proxy = server()  # answers 404 to POST /epd/v1/prime, as a proxy passing it on would
    endpoint = Unit_(name="u", encoder_urls=(u.encoder.url,), consumer_urls=(u.consumer.url,), front_url=old_proxy.url)
    async with EPDClient(Endpoints((ModelEndpoints("actor", (endpoint,)),))) as client:
        for _ in range(2):
            await client.generate({"messages": chat(picture(1))["messages"]}, model_name="actor")
    assert len(u.primes) == 2 and len(old_proxy.requests(PRIME)) == 1  # asked once, then remembered


async def test_epd_client_without_a_version_is_refused_by_a_versioned_models_proxy(unit, start_proxy):
    u = unit()
    proxy = await start_proxy(u.consumer.url, [u.encoder.url], ec_store=str(u.store), require_weights_version=True)
    endpoint = Unit_(name="u", encoder_urls=(u.encoder.url,), consumer_urls=(u.consumer.url,), front_url=proxy.url)
    endpoints = Endpoints((ModelEndpoints("actor", (endpoint,)),))
    async with EPDClient(endpoints) as client:
        with pytest.raises(PrimeError) as refused:
            await client.generate({"messages": chat(picture(1))["messages"]}, model_name="actor")
    assert "weightsVersion" in str(refused.value) and u.primes == [] and u.consumer.records == []
    async with EPDClient(endpoints, weights_version="step-9") as client:
        await client.generate({"messages": chat(picture(1))["messages"]}, model_name="actor")
    assert [p["messages"][0]["content"][0]["uuid"] for p in u.primes] == [key(picture(1), "step-9")]


def test_only_parts_of_the_body_itself_are_keyed():
    """A planner may make a part of another shape (vLLM's image_url part of an Anthropic block):
    a key written there would never reach the engines, so only the body's own parts are keyed."""
    chat_plan = core.plan("chat_completions", json.dumps(chat(picture(1))).encode())
    block = {"type": "image", "source": {"type": "url", "url": "https://images.test/a.png"}}
    anthropic_plan = core.plan("messages", json.dumps({"messages": [{"role": "user", "content": [block]}]}).encode())
    assert all(id(p.item.part) in keys.in_body(chat_plan.body) for p in chat_plan.parts)
    assert not any(id(p.item.part) in keys.in_body(anthropic_plan.body) for p in anthropic_plan.parts)


async def test_a_render_carries_its_parts_keys_bound_to_their_content(unit, start_proxy, http):
    """Renders are not primed (the client primed), but their uuids name what the generate reads:
    a client's uuid, or another picture's key, is replaced by the part's own; a key the proxy gave
    (any generation of it) is kept; a versioned model's render needs its version."""
    u = unit()
    proxy = await start_proxy(u.consumer.url, [u.encoder.url], ec_store=str(u.store), require_weights_version=True)
    render = "/v1/chat/completions/render"
    version = {"X-EPD-Weights-Version": "step-4"}
    parts = [
        {**picture(1), "uuid": "img-0"},
        {**picture(2), "uuid": key(picture(1), "step-4")},
        {**picture(3), "uuid": f"{key(picture(3), 'step-4')}-2"},
        {"type": "image_embeds", "image_embeds": "AAAA", "uuid": "img-0"},
    ]
    assert (await post(http, proxy.url + render, chat(*parts), **version))[0] == 200
    (sent,) = u.consumer.requests(render)
    assert [p.get("uuid") for p in sent.body["messages"][0]["content"][:4]] == [
        key(picture(1), "step-4"),
        key(picture(2), "step-4"),
        f"{key(picture(3), 'step-4')}-2",
        keyed({"type": "image_embeds", "image_embeds": "AAAA"}, "step-4")["uuid"],
    ]
    assert u.primes == []
    status, answer = await post(http, proxy.url + render, chat(*parts))
    assert status == 400 and "X-EPD-Weights-Version" in answer["error"]["message"]
    text = await proxy.metrics_text()
    assert 'epd_proxy_client_uuids_replaced_total{route="chat_completions_render"} 3.0' in text


async def test_epd_client_renders_and_generates_under_its_weights_version(unit, start_proxy):
    u = unit()
    proxy = await start_proxy(u.consumer.url, [u.encoder.url], ec_store=str(u.store), require_weights_version=True)
    endpoint = Unit_(name="u", encoder_urls=(u.encoder.url,), consumer_urls=(u.consumer.url,), front_url=proxy.url)
    request = {"messages": chat({**picture(1), "uuid": "img-0"})["messages"]}
    async with EPDClient(Endpoints((ModelEndpoints("actor", (endpoint,)),)), weights_version="step-8") as client:
        await client.generate(request, model_name="actor")
    render, generate = u.consumer.records
    assert render.headers.get("x-epd-weights-version") == generate.headers.get("x-epd-weights-version") == "step-8"
    assert render.body["messages"][0]["content"][0]["uuid"] == key(picture(1), "step-8")
    assert request["messages"][0]["content"][0]["uuid"] == "img-0"  # the caller's request as it was
