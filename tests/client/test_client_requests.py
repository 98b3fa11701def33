"""What every request carries (API key, headers, TLS verification) through every entry point,
which requests are retried (generate only when it was never sent), and answers that are cut
off or not JSON."""

from __future__ import annotations

import ssl

import pytest
import trustme

from epd_client import (
    Endpoints,
    EngineError,
    EPDClient,
    InvalidResponseError,
    ModelEndpoints,
    PrimeError,
    Primer,
    RequestError,
    Unit,
    generate_sync,
    media_items,
    prime_encoder,
    prime_encoder_sync,
)
from epd_dev.standins.fault_proxy import cut_off, http_status, not_json, reset
from epd_dev.standins.vllm_server import StandinServer

from .helpers import FAST, image_messages

RENDER = "/v1/chat/completions/render"
GENERATE = "/inference/v1/generate"


def chat(images: int = 1) -> dict:
    return {"messages": image_messages(images), "max_tokens": 8}


def one_unit(encoders: list[str], entry: str, *, pooled: bool = False) -> Endpoints:
    unit = Unit("u", encoder_urls=tuple(encoders), consumer_urls=(entry,))
    return Endpoints((ModelEndpoints("actor", (unit,), "served", placement="Pools" if pooled else "Unit"),))


def auth_of(server: StandinServer) -> set[str | None]:
    return {r.headers.get("authorization") for r in server.records}


# --- retries: generate is not idempotent ---


async def test_generate_whose_connection_dropped_after_sending_is_not_retried(make_unit, proxy) -> None:
    u = make_unit("u")
    front = proxy(u.consumer.url)
    front.add(reset(), path=GENERATE)
    async with EPDClient(one_unit([e.url for e in u.encoders], front.url), retry=FAST) as client:
        with pytest.raises(RequestError) as caught:
            await client.generate(chat(), model_name="actor")
    assert caught.value.path == GENERATE
    assert caught.value.attempts == 1
    assert [e.path for e in front.log].count(GENERATE) == 1


async def test_generate_answered_503_is_not_retried(make_unit, proxy) -> None:
    u = make_unit("u")
    front = proxy(u.consumer.url)
    front.add(http_status(503), path=GENERATE)
    async with EPDClient(one_unit([e.url for e in u.encoders], front.url), retry=FAST) as client:
        with pytest.raises(RequestError) as caught:
            await client.generate(chat(), model_name="actor")
    assert (caught.value.status_code, caught.value.attempts) == (503, 1)


async def test_render_is_retried_where_generate_is_not(make_unit, proxy) -> None:
    u = make_unit("u")
    front = proxy(u.consumer.url)
    front.add(reset(), path=RENDER)
    front.add(http_status(503), path=RENDER)
    async with EPDClient(one_unit([e.url for e in u.encoders], front.url), retry=FAST) as client:
        result = await client.generate(chat(), model_name="actor")
    assert result["choices"]
    assert front.faults() == ["reset", "status", "forward", "forward"]
    assert len(u.consumer.requests(GENERATE)) == 1


async def test_generate_is_retried_while_its_connection_cannot_be_opened(make_unit, proxy) -> None:
    u = make_unit("u")
    front = proxy(u.consumer.url)
    front.go_away_after(RENDER)
    async with EPDClient(one_unit([e.url for e in u.encoders], front.url), retry=FAST) as client:
        with pytest.raises(RequestError) as caught:
            await client.generate(chat(), model_name="actor")
    assert caught.value.path == GENERATE
    assert caught.value.attempts == FAST.max_attempts
    assert "ConnectError" in caught.value.reason
    assert u.consumer.requests(GENERATE) == []


# --- answers that are not whole JSON ---


@pytest.mark.parametrize("fault", [not_json(), cut_off()], ids=["not-json", "cut-off"])
async def test_generate_answer_not_whole_json_is_an_engine_error_naming_the_entry(make_unit, proxy, fault) -> None:
    u = make_unit("u")
    front = proxy(u.consumer.url)
    front.add(fault, path=GENERATE)
    async with EPDClient(one_unit([e.url for e in u.encoders], front.url), retry=FAST) as client:
        with pytest.raises(EngineError) as caught:
            await client.generate(chat(), model_name="actor")
    ((entry, error),) = caught.value.failures
    assert (entry.unit, entry.name, entry.url) == ("u", "entry", front.url)
    assert isinstance(error, InvalidResponseError)
    assert (error.status_code, error.attempts) == (200, 1)
    message = str(caught.value)
    assert f"u/entry ({front.url})" in message
    assert ("not JSON (text/html" if fault.kind == "not_json" else "cut off") in message
    assert [e.path for e in front.log].count(GENERATE) == 1


async def test_render_answer_cut_off_is_retried(make_unit, proxy) -> None:
    u = make_unit("u")
    front = proxy(u.consumer.url)
    front.add(cut_off(), path=RENDER)
    async with EPDClient(one_unit([e.url for e in u.encoders], front.url), retry=FAST) as client:
        assert (await client.generate(chat(), model_name="actor"))["choices"]
    assert front.faults()[:2] == ["cut_off", "forward"]


async def test_pooled_encoder_answer_not_json_fails_its_item(server, proxy) -> None:
    encoder = proxy(server(ec_transfer=True).url)
    encoder.add(not_json(), path="/v1/chat/completions")
    with pytest.raises(PrimeError) as caught:
        await prime_encoder(one_unit([encoder.url], server().url, pooled=True), image_messages(2), model_name="actor")
    (failure,) = caught.value.failures
    assert failure.encoders == (encoder.url,)
    assert isinstance(failure.error, InvalidResponseError)
    assert "not JSON" in str(caught.value)


# --- what every request carries ---


async def test_api_key_and_headers_go_with_primes_render_and_generate(make_unit) -> None:
    u = make_unit("u")
    client = EPDClient(
        one_unit([e.url for e in u.encoders], u.consumer.url), retry=FAST, api_key="sk-team", headers={"x-team": "a"}
    )
    async with client:
        await client.generate(chat(2), model_name="actor")
    for server in (*u.encoders, u.consumer):
        assert auth_of(server) == {"Bearer sk-team"}
        assert {r.headers.get("x-team") for r in server.records} == {"a"}


async def test_an_authorization_header_wins_over_api_key(make_unit) -> None:
    u = make_unit("u", encoders=1)
    await prime_encoder(
        one_unit([u.encoders[0].url], u.consumer.url),
        image_messages(1),
        model_name="actor",
        api_key="sk-ignored",
        headers={"Authorization": "Basic dGVhbTprZXk="},
    )
    assert auth_of(u.encoders[0]) == {"Basic dGVhbTprZXk="}


def test_sync_helpers_pass_api_key_and_headers(make_unit) -> None:
    u = make_unit("u", encoders=1)
    endpoints = one_unit([u.encoders[0].url], u.consumer.url)
    prime_encoder_sync(endpoints, image_messages(1), model_name="actor", api_key="sk-1")
    generate_sync(endpoints, chat(), model_name="actor", retry=FAST, api_key="sk-2", headers={"x-team": "b"})
    assert [r.headers.get("authorization") for r in u.encoders[0].records] == ["Bearer sk-1", "Bearer sk-2"]
    assert auth_of(u.consumer) == {"Bearer sk-2"}
    assert {r.headers.get("x-team") for r in u.consumer.records} == {"b"}


async def test_primer_sends_its_api_key_and_each_calls_headers(server) -> None:
    encoder = server()
    async with Primer(retry=FAST, api_key="sk-proxy") as primer:
        await primer.prime(
            media_items(image_messages(1)), [encoder.url], model="served", headers={"x-request-id": "r1"}
        )
    (record,) = encoder.records
    assert record.headers["authorization"] == "Bearer sk-proxy"
    assert record.headers["x-request-id"].startswith("r1-")


async def test_connection_options_with_a_client_are_refused(server) -> None:
    async with EPDClient(Endpoints.from_urls([server().url]), retry=FAST) as client:
        with pytest.raises(TypeError, match="set them there"):
            await prime_encoder(client, image_messages(1), api_key="sk")


# --- TLS verification ---


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def tls_server(ca, server) -> StandinServer:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    return server(tls=context)


async def test_tls_is_verified_by_default_and_a_refused_certificate_is_not_retried(tls_server) -> None:
    with pytest.raises(PrimeError, match="CERTIFICATE_VERIFY_FAILED") as caught:
        await prime_encoder(Endpoints.from_urls([tls_server.url]), image_messages(1))
    assert caught.value.failures[0].error.attempts == 1
    assert tls_server.records == []


async def test_verify_takes_a_ca_bundle_path_an_ssl_context_or_false(tls_server, ca, tmp_path) -> None:
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    context = ssl.create_default_context()
    ca.configure_trust(context)
    endpoints = Endpoints.from_urls([tls_server.url], tls_server.url)
    await prime_encoder(endpoints, image_messages(1), verify=str(bundle))
    await prime_encoder(endpoints, image_messages(1), verify=context)
    async with EPDClient(endpoints, retry=FAST, verify=False) as client:
        await client.generate(chat())
    assert len(tls_server.requests("/v1/chat/completions")) == 3
    assert len(tls_server.requests(GENERATE)) == 1
