"""The official `openai` SDK, an ordinary client knowing nothing of encoders, through the proxy
in front of stand-ins (epd_dev/standins, not vLLM): its images are primed, its answers are the
upstream's, sync and streaming, and a failed prime is an error the SDK understands."""

from __future__ import annotations

import asyncio

import openai
import pytest

from epd_dev.standins.fault_proxy import http_status
from epd_dev.standins.vllm_server import STREAM_TOKENS

from .conftest import keyed

IMAGE = "https://images.test/cat.png"
MESSAGES = [
    {
        "role": "user",
        "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": IMAGE}}],
    }
]


def primed_urls(encoder) -> list[str]:
    return [r.body["messages"][0]["content"][0]["image_url"]["url"] for r in encoder.requests("/v1/chat/completions")]


@pytest.fixture
async def unit(server, start_proxy):
    encoder, upstream = server(), server()
    proxy = await start_proxy(upstream.url, [encoder.url])
    return encoder, upstream, proxy


async def test_sync_chat_completion(unit):
    encoder, upstream, proxy = unit
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0)
    # The sync client blocks its thread; the proxy serves on this test's event loop meanwhile.
    answer = await asyncio.to_thread(client.chat.completions.create, model="served", messages=MESSAGES, max_tokens=4)
    assert answer.choices[0].message.content == "x"
    assert primed_urls(encoder) == [IMAGE]
    (forwarded,) = upstream.records
    assert forwarded.body["messages"] == keyed(MESSAGES)
    assert forwarded.headers["authorization"] == "Bearer sk-test"
    assert encoder.records[0].headers["authorization"] == "Bearer sk-test"


async def test_streaming_chat_completion(unit):
    encoder, upstream, proxy = unit
    async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0) as client:
        stream = await client.chat.completions.create(model="served", messages=MESSAGES, stream=True)
        tokens = [chunk.choices[0].delta.content async for chunk in stream]
    assert tokens == list(STREAM_TOKENS)
    assert primed_urls(encoder) == [IMAGE]
    assert upstream.records[0].body["stream"] is True


async def test_responses_with_an_input_image(unit):
    encoder, upstream, proxy = unit
    async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0) as client:
        response = await client.responses.create(
            model="served",
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": IMAGE, "detail": "auto"},
                    ],
                }
            ],
        )
    assert response.output_text == "x"
    (prime,) = encoder.records
    assert prime.body["messages"][0]["content"] == [
        keyed({"type": "input_image", "image_url": IMAGE, "detail": "auto"})
    ]
    assert [r.path for r in upstream.records] == ["/v1/responses"]


async def test_models_pass_through(unit):
    encoder, _, proxy = unit
    async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0) as client:
        assert [m.id async for m in client.models.list()] == ["standin"]
    assert encoder.records == []


async def test_a_failed_prime_is_an_api_error_naming_the_part(server, faulty, start_proxy):
    broken, upstream = faulty(server().url), server()
    broken.add(http_status(503), times=None)
    proxy = await start_proxy(upstream.url, [broken.url])
    async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="served", messages=MESSAGES)
    assert caught.value.status_code == 502
    assert "messages[0].content[1]" in caught.value.message and IMAGE in caught.value.message
    assert upstream.records == []


async def test_an_image_without_a_type_is_primed_too(unit):
    """vLLM loads ``{"image_url": "<url>"}`` as an image: unprimed, the consumer would encode it."""
    encoder, upstream, proxy = unit
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"image_url": IMAGE}]}]
    async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0) as client:
        await client.chat.completions.create(model="served", messages=messages)  # type: ignore[arg-type]  # vLLM's part shapes, which the SDK's types do not list
    (prime,) = encoder.records
    # Primed as the typed part vLLM reads it as, under the key the forwarded part carries.
    forwarded = upstream.records[0].body["messages"]
    assert forwarded == keyed(messages)
    key = forwarded[0]["content"][1]["uuid"]
    assert prime.body["messages"][0]["content"] == [{"type": "image_url", "image_url": {"url": IMAGE}, "uuid": key}]


async def test_a_media_reference_without_data_is_a_400_naming_the_part(unit):
    encoder, upstream, proxy = unit
    messages = [{"role": "user", "content": [{"type": "text", "text": "again?"}, {"image_url": None, "uuid": "seen"}]}]
    async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="served", messages=messages)  # type: ignore[arg-type]  # vLLM's part shapes, which the SDK's types do not list
    assert caught.value.body["param"] == "messages[0].content[1]"  # type: ignore[index]  # the SDK types an error's body as object; vLLM's is a dict
    assert "no data" in caught.value.message
    assert encoder.records == [] and upstream.records == []
