"""The EPD gateway's endpoint picker (epd_dataplane/epp.py) over its real gRPC server, driven as a
gateway drives it (ext_proc streams, FULL_DUPLEX_STREAMED bodies) in front of units of stand-ins
behind their real EPD proxies: what it picks, what it hands back, and how it refuses."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epd_client import choose_unit, media_items, media_key, rank_units
from epd_dataplane.epp import MAX_CHUNK_BYTES, self_signed
from epd_dataplane.gateway import UnitsView

from .ext_proc import body, chat_body, exchange, headers, with_metadata


def picture(i: int) -> dict:
    return {"type": "image_url", "image_url": {"url": f"https://images.test/{i}.png"}}


def key(part: dict, version: str = "") -> str:
    return media_key(media_items([{"content": [part]}])[0], version)


@pytest.fixture
async def picked(units, start_gateway, start_epp):
    """Three units behind a gateway on weights version step-1, its picker, and a channel to it."""
    u = await units(3)
    gateway = await start_gateway(u.proxies, weights_version="step-1")
    picker = await start_epp(gateway, fallbacks=2)
    async with grpc.aio.insecure_channel(picker.address) as channel:
        yield u, gateway, picker, channel


def endpoint_of(u, name: str) -> str:
    return u.proxies[name].removeprefix("http://")


async def test_a_request_goes_to_the_unit_that_holds_its_picture_and_its_body_comes_back_whole(picked):
    u, gateway, _, channel = picked
    data = chat_body(picture(1))
    answer = await exchange(
        channel, [headers(**{"content-length": str(len(data))}), body(data[:40], end=False), body(data[40:])], 2
    )
    own = choose_unit(key(picture(1), "step-1"), list(u.proxies)).unit
    order = [own, *rank_units(key(picture(1), "step-1"), [n for n in u.proxies if n != own])]
    assert answer.destination == [endpoint_of(u, name) for name in order]  # the pick, then its fallbacks
    assert answer.metadata == {"envoy.lb": {"x-gateway-destination-endpoint": ",".join(answer.destination)}}
    assert answer.set_headers["x-epd-weights-version"] == "step-1" and answer.clears_route_cache
    assert answer.set_headers["content-length"] == str(len(data))
    assert answer.body_chunks == [(data, True)]
    # The client's own version is kept; the same picture goes to the same unit.
    again = await exchange(channel, [headers(**{"x-epd-weights-version": "mine"}), body(data)], 2)
    assert "x-epd-weights-version" not in again.set_headers
    assert again.destination[0] == endpoint_of(u, choose_unit(key(picture(1), "mine"), list(u.proxies)).unit)
    text = await gateway.metrics_text()
    assert 'epd_epp_requests_total{code="200"} 2.0' in text and 'epd_gateway_routed_total{by="media"} 2.0' in text


async def test_a_large_body_comes_back_in_chunks_a_gateway_takes(picked):
    _, _, _, channel = picked
    data = chat_body(picture(2), padding="x" * 200_000)
    answer = await exchange(
        channel,
        [headers(), *(body(data[i : i + 65536], end=i + 65536 >= len(data)) for i in range(0, len(data), 65536))],
        1 + 4,
    )
    assert all(len(chunk) <= MAX_CHUNK_BYTES for chunk, _ in answer.body_chunks)
    assert answer.body == data and [last for _, last in answer.body_chunks] == [False, False, False, True]


async def test_a_request_without_a_body_is_picked_at_once_by_its_session(picked):
    u, _, _, channel = picked
    first = await exchange(channel, [headers("GET", "/v1/models", end=True, **{"x-epd-session": "chat-7"})], 1)
    second = await exchange(channel, [headers("GET", "/v1/models", end=True, **{"x-epd-session": "chat-7"})], 1)
    assert first.destination == second.destination and first.body_chunks == []
    assert first.destination[0] == endpoint_of(u, choose_unit("session:chat-7", list(u.proxies)).unit)


async def test_the_subset_hint_limits_the_pick_and_none_eligible_is_a_503(picked):
    u, _, _, channel = picked
    allowed = endpoint_of(u, sorted(u.proxies)[1])
    # A list, one string, a comma-separated string with an endpoint the pool lacks.
    for hint in ([allowed], allowed, f"10.9.9.9:1, {allowed}"):
        message = with_metadata(headers(), {"envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": hint}})
        answer = await exchange(channel, [message, body(chat_body(picture(3)))], 2)
        assert answer.destination == [allowed], hint
    # An address alone allows every port of it: every unit listens on 127.0.0.1.
    address = with_metadata(
        headers(), {"envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": ["127.0.0.1"]}}
    )
    assert len((await exchange(channel, [address, body(chat_body(picture(3)))], 2)).destination) == 3
    nowhere = with_metadata(
        headers(), {"envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": ["10.9.9.9:8000"]}}
    )
    refused = await exchange(channel, [nowhere, body(chat_body(picture(3)))], 1)
    assert refused.immediate is not None and refused.immediate[0] == 503
    assert "no ready unit the request may go to" in refused.immediate[1]["error"]["message"]


async def test_requests_in_flight_count_until_the_response_ends(picked):
    u, gateway, _, channel = picked
    loads = gateway.proxy.units.loads
    call = ext_proc_grpc.ExternalProcessorStub(channel).Process()
    await call.write(headers())
    await call.write(body(chat_body(picture(4))))
    answer = [await call.read(), await call.read()]
    pick = answer[0].request_headers.response.header_mutation.set_headers[0].header.raw_value.decode().split(",")[0]
    (name,) = [n for n in u.proxies if endpoint_of(u, n) == pick]
    assert loads[name] == 1
    served = with_metadata(
        ext_proc.ProcessingRequest(response_headers=ext_proc.HttpHeaders()),
        {"envoy.lb": {"x-gateway-destination-endpoint-served": "10.1.1.1:8000"}},
    )
    await call.write(served)
    assert (await call.read()).HasField("response_headers")
    await call.write(ext_proc.ProcessingRequest(response_body=ext_proc.HttpBody(body=b'{"ok":1}', end_of_stream=True)))
    echoed = await call.read()
    assert echoed.response_body.response.body_mutation.streamed_response.body == b'{"ok":1}'
    assert loads[name] == 0
    await call.done_writing()
    assert "epd_epp_served_elsewhere_total 1.0" in await gateway.metrics_text()


async def test_bad_input_gets_a_clear_status_and_holds_nothing(picked):
    _, gateway, _, channel = picked
    view = gateway.proxy.units
    budget = gateway.proxy.budget
    # A part with a uuid and no media: refused as the units refuse it, naming the part.
    answer = await exchange(
        channel, [headers(), body(chat_body({"type": "image_url", "image_url": None, "uuid": "x"}))], 1
    )
    assert answer.immediate is not None and answer.immediate[0] == 400
    assert answer.immediate[1]["error"]["param"] == "messages[0].content[0]"
    # Over the bound: declared, or as it comes.
    limit = gateway.proxy.limits.max_request_bytes
    declared = await exchange(channel, [headers(**{"content-length": str(limit + 1)})], 1)
    assert declared.immediate is not None and declared.immediate[0] == 413
    streamed = await exchange(
        channel, [headers(), body(b"x" * 65536, end=False)] + [body(b"x" * 65536, end=False)] * (limit // 65536 + 1), 1
    )
    assert streamed.immediate is not None and streamed.immediate[0] == 413
    # The route the units refuse, and the units' own prime route.
    for path in ("/v1/audio/transcriptions", "/epd/v1/prime"):
        refused = await exchange(channel, [headers(path=path), body(b"{}")], 1)
        assert refused.immediate is not None and refused.immediate[0] == 400
    # A stream that breaks the protocol: a body first; a second request's headers.
    for messages in ([body(b"{}")], [headers(), headers()]):
        call = ext_proc_grpc.ExternalProcessorStub(channel).Process()
        for message in messages:
            await call.write(message)
        with pytest.raises(grpc.aio.AioRpcError) as broken:
            await call.read()
        assert broken.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # A stream that ends mid-body (the client left): nothing picked, nothing held.
    call = ext_proc_grpc.ExternalProcessorStub(channel).Process()
    await call.write(headers())
    await call.write(body(b'{"messages": [', end=False))
    await call.done_writing()
    await asyncio.sleep(0.2)
    assert sum(view.loads.values()) == 0 and budget.free == budget.total
    text = await gateway.metrics_text()
    assert "epd_epp_protocol_errors_total 2.0" in text and 'epd_epp_requests_total{code="413"} 2.0' in text
    assert "epd_epp_streams 0.0" in text


async def test_shedding_when_the_body_budget_is_full_is_a_429(units, start_gateway, start_epp):
    u = await units(1)
    gateway = await start_gateway(u.proxies, max_buffered_bytes=8 * 1024 * 1024, max_request_bytes=1024 * 1024)
    picker = await start_epp(gateway)
    held = gateway.proxy.budget.try_reserve(gateway.proxy.budget.total)
    assert held is not None
    async with grpc.aio.insecure_channel(picker.address) as channel:
        answer = await exchange(channel, [headers(), body(chat_body(picture(1)))], 1)
        held.release()
        after = await exchange(channel, [headers(), body(chat_body(picture(1)))], 2)
    assert answer.immediate is not None and answer.immediate[0] == 429
    assert after.destination[0] == u.proxies["demo-actor-0"].removeprefix("http://")


async def test_no_ready_unit_is_a_503_and_the_health_services_say_when_it_is_ready(start_gateway, start_epp):
    view = UnitsView("actor")  # no watch has answered yet
    gateway = await start_gateway(view)
    picker = await start_epp(gateway, ready=False)
    async with grpc.aio.insecure_channel(picker.health_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)

        async def status(service: str) -> int:
            return (await health.Check(health_pb2.HealthCheckRequest(service=service))).status

        assert await status("liveness") == health_pb2.HealthCheckResponse.SERVING
        assert await status("readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
        view.synced = True  # the watches answered: an EPDDeployment without this model
        await asyncio.wait_for(picker.server.ready_once(view), 5)
        for service in ("readiness", "inference-extension", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert await status(service) == health_pb2.HealthCheckResponse.SERVING
    async with grpc.aio.insecure_channel(picker.address) as channel:
        answer = await exchange(channel, [headers(), body(chat_body(picture(1)))], 1)
    assert answer.immediate is not None and answer.immediate[0] == 503
    assert "knows no unit" in answer.immediate[1]["error"]["message"]


async def test_tls_by_default_with_a_self_signed_certificate(units, start_gateway, start_epp, tmp_path):
    u = await units(1)
    gateway = await start_gateway(u.proxies)
    key, cert = self_signed(["localhost"])
    (tmp_path / "tls.key").write_bytes(key)
    (tmp_path / "tls.crt").write_bytes(cert)
    picker = await start_epp(gateway, secure=True, cert_path=str(tmp_path))
    trust = grpc.ssl_channel_credentials(root_certificates=cert)
    async with grpc.aio.secure_channel(
        picker.address, trust, options=[("grpc.ssl_target_name_override", "localhost")]
    ) as channel:
        answer = await exchange(channel, [headers(), body(chat_body(picture(1)))], 2)
    assert answer.destination[0] == u.proxies["demo-actor-0"].removeprefix("http://")
    async with grpc.aio.insecure_channel(picker.address) as plain:
        with pytest.raises(grpc.aio.AioRpcError):
            await exchange(plain, [headers(), body(chat_body(picture(1)))], 2)
