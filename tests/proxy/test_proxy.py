"""The EPD proxy in front of stand-ins (epd_dev/standins, not vLLM): it primes every media part
on the encoders, then forwards the unchanged request and streams the answer back; everything
else passes straight through; failures never reach the consumer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator

import aiohttp
import pytest
from yarl import URL

from epd_dataplane import core
from epd_dataplane import server as server_module
from epd_dev.standins.fault_proxy import http_status, reset
from epd_dev.standins.vllm_server import STREAM_TOKENS

from .conftest import FAST, answer_models, keyed, raw_upstream

CHAT = "/v1/chat/completions"


def image(i: int) -> dict:
    return {"type": "image_url", "image_url": {"url": f"https://images.test/{i}.png"}}


def chat(*parts: dict, **extra: object) -> dict:
    return {
        "model": "served",
        "messages": [
            {"role": "system", "content": "You describe pictures."},
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}, *parts]},
        ],
        "max_tokens": 8,
        **extra,
    }


def unordered(parts: list[dict]) -> list[str]:
    """Parts primed at once arrive in any order."""
    return sorted(json.dumps(p, sort_keys=True) for p in parts)


def primed_parts(encoder) -> list[dict]:
    return [r.body["messages"][0]["content"][0] for r in encoder.requests(CHAT)]


async def post(http, url: str, body: object, **kw):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(url, data=data, headers={"content-type": "application/json", **kw}) as response:
        return response.status, await response.json(content_type=None), response.headers


async def test_every_media_part_is_primed_concurrently_round_robin_then_forwarded(server, start_proxy, http):
    encoders, upstream = [server(delay=0.3), server(delay=0.3)], server()
    proxy = await start_proxy(upstream.url, [e.url for e in encoders])
    video = {"type": "video_url", "video_url": {"url": "https://media.test/v.mp4"}}
    request = chat(image(0), image(1), video, {"type": "image_embeds", "image_embeds": "AAAA"}, image(3))

    status, answer, _ = await post(http, proxy.url + CHAT, request)

    assert status == 200 and answer["object"] == "chat.completion"
    # One image-only prime per media part (not the inline embedding), part i on encoder i % 2.
    # Each carries its key (no weights version: content-only), the uuid the consumer reads it by.
    assert unordered(primed_parts(encoders[0])) == unordered([keyed(image(0)), keyed(video)])
    assert unordered(primed_parts(encoders[1])) == unordered([keyed(image(1)), keyed(image(3))])
    primes = encoders[0].records + encoders[1].records
    assert all(
        r.body == {"model": "served", "messages": r.body["messages"], "max_tokens": 1, "stream": False} for r in primes
    )
    assert max(r.started for r in primes) < min(r.finished for r in primes)  # all in flight at once
    # Then the request itself, unchanged but for the keys, once every prime was answered.
    (forwarded,) = upstream.records
    assert (forwarded.method, forwarded.path, forwarded.body) == ("POST", CHAT, keyed(request))
    assert forwarded.started > max(r.finished for r in primes)


async def test_round_robin_goes_on_across_requests(server, start_proxy, http):
    encoders, upstream = [server(), server()], server()
    proxy = await start_proxy(upstream.url, [e.url for e in encoders])
    for i in range(4):
        assert (await post(http, proxy.url + CHAT, chat(image(i))))[0] == 200
    assert [primed_parts(e) for e in encoders] == [
        [keyed(image(0)), keyed(image(2))],
        [keyed(image(1)), keyed(image(3))],
    ]


async def test_a_stream_is_passed_on_event_by_event(server, start_proxy, http, warm):
    """The stand-in sends event i+1 only once the test has read event i through the proxy: a
    proxy buffering the answer would never hand over the first event, and the test would hang."""
    gate = threading.Semaphore(0)
    encoder, upstream = server(), server(chunk_gate=gate)
    proxy = await start_proxy(upstream.url, [encoder.url])
    await warm(http, proxy.url)
    events = []
    async with http.post(proxy.url + CHAT, json=chat(image(0), stream=True)) as response:
        assert response.status == 200 and response.headers["content-type"] == "text/event-stream"
        while len(events) < len(STREAM_TOKENS) + 1:
            line = await asyncio.wait_for(response.content.readline(), 10)
            if line.startswith(b"data: "):
                events.append(line.removeprefix(b"data: ").strip())
                gate.release()  # only now may the stand-in send the next one
        assert await response.content.read() == b"\n"
    assert [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]] == list(STREAM_TOKENS)
    assert events[-1] == b"[DONE]"
    assert primed_parts(encoder) == [keyed(image(0))]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, chat()),
        (CHAT, {"messages": [{"role": "user", "content": "no picture"}]}),
        (CHAT, chat({"type": "image_url", "image_url": {"url": None}}, {"type": "image_embeds", "image_embeds": "A"})),
        ("/v1/responses", {"model": "served", "input": "no picture"}),
        ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}),
    ],
)
async def test_text_only_requests_never_reach_an_encoder(server, start_proxy, http, path, body):
    encoder, upstream = server(), server()
    proxy = await start_proxy(upstream.url, [encoder.url])
    assert (await post(http, proxy.url + path, body))[0] == 200
    assert encoder.records == []
    # The client's own embeddings are keyed by their content (vLLM names them by a uuid too).
    assert [(r.path, r.body) for r in upstream.records] == [(path, keyed(body))]


async def test_other_paths_pass_straight_through_unprimed(server, start_proxy, http):
    encoder, upstream = server(), server()
    proxy = await start_proxy(upstream.url, [encoder.url])
    with_image = chat(image(0))
    calls = [
        ("GET", "/v1/models?limit=5&x=%2F", None, 200),
        ("POST", "/v1/completions", {"model": "served", "prompt": "hi"}, 200),
        # A rollout client that primed itself renders and generates: never primed again (the
        # render's parts keyed by their content: what its generate reads by).
        ("POST", "/v1/chat/completions/render", with_image, 200),
        ("POST", "/inference/v1/generate", {"token_ids": [1, 2]}, 200),
        ("GET", "/v1/chat/completions", None, 404),  # only a POST is primed
        ("GET", "/health", None, 200),
        ("GET", "/metrics", None, 404),  # the upstream's, not the proxy's own
        ("DELETE", "/v1/responses/resp_1", None, 404),
    ]
    for method, path, body, status in calls:
        # encoded: sent exactly as written (aiohttp would normalise %2F otherwise)
        async with http.request(method, URL(proxy.url + path, encoded=True), json=body) as response:
            assert response.status == status, (method, path)
    assert encoder.records == []
    assert [(r.method, r.path, r.body) for r in upstream.records] == [
        (m, p, keyed(b) if p.endswith("/render") else b) for m, p, b, _ in calls
    ]


async def test_responses_input_images_are_primed(server, start_proxy, http):
    encoder, upstream = server(), server()
    proxy = await start_proxy(upstream.url, [encoder.url])
    responses_image = {"type": "input_image", "image_url": "https://images.test/r.png", "detail": "auto"}
    request = {
        "model": "served",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "and this?"}, responses_image]},
        ],
        # vLLM reads these for gpt-oss only, which takes no media: not primed.
        "previous_input_messages": [{"role": "user", "content": [image(9)]}],
    }
    status, answer, _ = await post(http, proxy.url + "/v1/responses", request)
    assert status == 200 and answer["object"] == "response"
    assert primed_parts(encoder) == [keyed(responses_image)]
    assert [r.body for r in upstream.records] == [keyed(request)]


async def test_anthropic_messages_images_are_primed_as_vllm_converts_them(server, start_proxy, http):
    """The stand-in upstream knows no /v1/messages (404): what matters is what reached it."""
    encoder, upstream = server(), server()
    proxy = await start_proxy(upstream.url, [encoder.url])
    request = {
        "model": "served",
        "max_tokens": 8,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "and these?"},
                    {"type": "image", "source": {"type": "url", "url": "https://images.test/a.png"}},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
                ],
            }
        ],
    }
    await post(http, proxy.url + "/v1/messages", request)
    assert unordered(primed_parts(encoder)) == unordered(
        [
            {"type": "image_url", "image_url": {"url": "https://images.test/a.png"}},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ]
    )
    # Unchanged: vLLM drops the uuid of Anthropic image blocks, so they carry no key.
    assert [(r.path, r.body) for r in upstream.records] == [("/v1/messages", request)]


async def test_an_anthropic_request_whose_prime_fails_gets_an_anthropic_error(server, faulty, start_proxy, http):
    broken, upstream = faulty(server().url), server()
    broken.add(http_status(503), times=None)
    proxy = await start_proxy(upstream.url, [broken.url])
    image_block = {"type": "image", "source": {"type": "url", "url": "https://images.test/a.png"}}
    status, answer, _ = await post(
        http, proxy.url + "/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": [image_block]}]}
    )
    assert status == 502 and answer["type"] == "error"
    assert answer["error"]["type"] == "BadGatewayError"
    assert "image messages[0].content[0] (https://images.test/a.png)" in answer["error"]["message"]
    assert upstream.records == []


async def test_batches_and_sagemaker_invocations_are_primed(server, start_proxy, http):
    encoder, upstream = server(), server()
    proxy = await start_proxy(upstream.url, [encoder.url])
    batch = {"model": "served", "messages": [[{"role": "user", "content": [image(1)]}], chat(image(2))["messages"]]}
    await post(http, proxy.url + "/v1/chat/completions/batch", batch)
    await post(http, proxy.url + "/invocations", chat(image(3)))
    await post(http, proxy.url + "/invocations", {"model": "served", "prompt": "a completion"})
    assert unordered(primed_parts(encoder)) == unordered([keyed(image(1)), keyed(image(2)), keyed(image(3))])
    assert [r.path for r in upstream.records] == ["/v1/chat/completions/batch", "/invocations", "/invocations"]
    assert upstream.records[0].body == keyed(batch)


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/v1/audio/translations"])
async def test_uploaded_audio_is_refused_unread_and_never_forwarded(server, start_proxy, http, path):
    encoder, upstream = server(), server()
    proxy = await start_proxy(upstream.url, [encoder.url])
    form = aiohttp.FormData()
    form.add_field("file", b"RIFF" + bytes(300_000), filename="a.wav", content_type="audio/wav")
    form.add_field("model", "served")
    async with http.post(proxy.url + path, data=form) as response:
        answer = await response.json()
        assert response.status == 400 and response.headers["connection"] == "close"  # the body was left unread
    assert answer["error"]["type"] == "BadRequestError"
    assert "input_audio part to /v1/chat/completions" in answer["error"]["message"]
    assert encoder.records == [] and upstream.records == []


async def test_structured_decisions_with_media_are_refused_and_without_pass(server, start_proxy, http):
    encoder, upstream = server(), server()
    proxy = await start_proxy(upstream.url, [encoder.url])
    decision = {"state": "a picture", "questions": {"q": {"type": "predicate"}}}
    status, answer, _ = await post(http, proxy.url + "/v1/systemone", {**decision, "images": ["https://i.test/a.png"]})
    assert (status, answer["error"]["param"]) == (400, "images")
    await post(http, proxy.url + "/v1/systemone", decision)
    assert encoder.records == [] and [r.body for r in upstream.records] == [decision]


async def test_an_encoder_failing_after_retries_gets_a_502_and_nothing_is_forwarded(server, faulty, start_proxy, http):
    broken, upstream = faulty(server().url), server()
    broken.add(http_status(503), times=None)
    proxy = await start_proxy(upstream.url, [broken.url])

    status, answer, _ = await post(http, proxy.url + CHAT, chat(image(0)))

    assert status == 502
    error = answer["error"]
    assert (error["type"], error["code"], error["param"]) == ("BadGatewayError", 502, "messages[1].content[1]")
    assert "image messages[1].content[1] (https://images.test/0.png)" in error["message"]
    assert "HTTP 503" in error["message"] and broken.url in error["message"]
    assert broken.faults() == ["status"] * FAST.max_attempts  # retried, then given up
    assert upstream.records == []  # the consumer never got to encode it itself
    assert 'epd_proxy_prime_failures_total{reason="encoder_error"} 1.0' in await proxy.metrics_text()


async def test_a_retry_moves_to_the_next_encoder(server, faulty, start_proxy, http):
    broken, working, upstream = faulty(server().url), server(), server()
    broken.add(reset(), times=None)
    proxy = await start_proxy(upstream.url, [broken.url, working.url])
    assert (await post(http, proxy.url + CHAT, chat(image(0), image(1))))[0] == 200
    assert sorted(p["image_url"]["url"] for p in primed_parts(working)) == [
        "https://images.test/0.png",
        "https://images.test/1.png",
    ]
    assert len(upstream.records) == 1


async def test_an_encoder_4xx_is_the_clients_bad_request(server, faulty, start_proxy, http):
    """vLLM answers 400 for a media URL it cannot fetch: a bad request stays bad (no retry)."""
    refusing, upstream = faulty(server().url), server()
    refusing.add(http_status(400), times=None)
    proxy = await start_proxy(upstream.url, [refusing.url])
    status, answer, _ = await post(http, proxy.url + CHAT, chat(image(0)))
    assert status == 400
    assert (answer["error"]["type"], answer["error"]["param"]) == ("BadRequestError", "messages[1].content[1]")
    assert refusing.faults() == ["status"]
    assert upstream.records == []


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, b"{not json", None),
        (CHAT, b"\xff\xfe", None),
        (CHAT, b"[1, 2]", None),
        (CHAT, {"model": "served"}, "messages"),
        (CHAT, {"messages": "hello"}, "messages"),
        ("/v1/responses", {"model": "served"}, "input"),
    ],
)
async def test_unreadable_requests_get_a_400_and_are_not_forwarded(server, start_proxy, http, path, body, param):
    encoder, upstream = server(), server()
    proxy = await start_proxy(upstream.url, [encoder.url])
    status, answer, _ = await post(http, proxy.url + path, body)
    assert status == 400
    assert (answer["error"]["type"], answer["error"]["code"], answer["error"]["param"]) == (
        "BadRequestError",
        400,
        param,
    )
    assert encoder.records == [] and upstream.records == []


async def test_without_an_encoder_media_requests_get_a_503(server, start_proxy, http):
    upstream = server()

    async def no_pods(host: str) -> list[str]:
        return []

    proxy = await start_proxy(upstream.url, dns="pool.test:8100", resolve=no_pods)
    status, answer, _ = await post(http, proxy.url + CHAT, chat(image(0)))
    assert (status, answer["error"]["type"]) == (503, "ServiceUnavailableError")
    assert (await post(http, proxy.url + CHAT, chat()))[0] == 200  # text needs no encoder
    assert [r.body for r in upstream.records] == [chat()]


async def test_headers_kept_end_to_end_and_on_primes_hop_by_hop_dropped(server, start_proxy, http):
    end_to_end = [("x-upstream", "yes"), ("set-cookie", "a=1"), ("set-cookie", "b=2")]
    hop_by_hop = [("keep-alive", "timeout=5"), ("connection", "x-upstream-private"), ("x-upstream-private", "no")]
    encoder, upstream = server(), server(response_headers=end_to_end + hop_by_hop)
    proxy = await start_proxy(upstream.url, [encoder.url])
    sent = {
        "Authorization": "Bearer secret",
        "X-Request-Id": "req-42",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "X-Custom": "kept",
        "Connection": "x-private",
        "X-Private": "for the proxy only",
        "TE": "trailers",
    }
    async with http.post(proxy.url + CHAT, json=chat(image(0), image(1)), headers=sent) as response:
        assert response.status == 200
        assert response.headers["x-upstream"] == "yes"
        assert response.headers.getall("set-cookie") == ["a=1", "b=2"]
        assert "keep-alive" not in response.headers and "x-upstream-private" not in response.headers

    (forwarded,) = upstream.records
    for name in ("authorization", "x-request-id", "traceparent", "x-custom"):
        assert forwarded.headers[name] == sent[next(k for k in sent if k.lower() == name)]
    assert "x-private" not in forwarded.headers and "te" not in forwarded.headers
    assert forwarded.headers["host"] == upstream.url.removeprefix("http://")
    primes = encoder.records
    assert {r.headers["authorization"] for r in primes} == {"Bearer secret"}
    assert {r.headers["traceparent"] for r in primes} == {sent["traceparent"]}
    ids = [r.headers["x-request-id"] for r in primes]
    assert len(set(ids)) == 2 and all(i.startswith("req-42-") for i in ids)  # traceable, never shared
    assert not any("x-custom" in r.headers for r in primes)


async def test_primed_bodies_are_bounded_others_are_streamed(server, start_proxy, http):
    encoder, upstream = server(), server()
    proxy = await start_proxy(upstream.url, [encoder.url], max_request_bytes=4096)
    big_text = "x" * 8192
    status, answer, _ = await post(http, proxy.url + CHAT, chat(image(0), {"type": "text", "text": big_text}))
    assert (status, answer["error"]["type"]) == (413, "RequestEntityTooLargeError")
    assert encoder.records == [] and upstream.records == []
    # A body the proxy does not read passes whatever its size.
    assert (await post(http, proxy.url + "/v1/completions", {"prompt": big_text}))[0] == 200
    assert [len(r.body["prompt"]) for r in upstream.records] == [8192]


async def test_a_pools_model_gets_the_encoders_transfer_params(server, start_proxy, http):
    pool, upstream = [server(ec_transfer=True), server(ec_transfer=True)], server()
    proxy = await start_proxy(upstream.url, [e.url for e in pool], pooled=True)
    request = chat(image(0), image(1))
    assert (await post(http, proxy.url + CHAT, request))[0] == 200
    (forwarded,) = upstream.records
    params = forwarded.body.pop("ec_transfer_params")
    assert forwarded.body == keyed(request)
    assert len(params) == 2 and {v["peer_port"] for v in params.values()} == {
        int(e.url.rsplit(":", 1)[1]) for e in pool
    }


@pytest.mark.parametrize("pooled", [True, False], ids=["Pools", "Unit"])
async def test_a_clients_own_transfer_params_are_refused(server, start_proxy, http, pooled):
    """They would pick the address a consumer pulls an embedding from: the proxy's alone."""
    pool, upstream = [server(ec_transfer=True)], server()
    proxy = await start_proxy(upstream.url, [e.url for e in pool], pooled=pooled)
    own = {"client-hash": {"peer_host": "10.0.0.9", "peer_port": 1}}
    for body in (chat(image(0), ec_transfer_params=own), chat(ec_transfer_params=own)):
        status, answer, _ = await post(http, proxy.url + CHAT, body)
        assert (status, answer["error"]["param"]) == (400, "ec_transfer_params")
        assert "Remove it" in answer["error"]["message"]
    assert pool[0].records == [] and upstream.records == []


async def test_a_pools_encoder_announcing_nothing_is_a_failure(server, start_proxy, http):
    silent, upstream = server(), server()
    proxy = await start_proxy(upstream.url, [silent.url], pooled=True)
    status, answer, _ = await post(http, proxy.url + CHAT, chat(image(0)))
    assert status == 502 and "without ec_transfer_params" in answer["error"]["message"]
    assert upstream.records == []


async def test_an_unreachable_upstream_is_a_502(server, start_proxy, http):
    encoder = server()
    proxy = await start_proxy("http://127.0.0.1:9", [encoder.url])
    status, answer, _ = await post(http, proxy.url + CHAT, chat())
    assert (status, answer["error"]["type"]) == (502, "BadGatewayError")
    assert "unreachable" in answer["error"]["message"]


async def test_a_client_that_leaves_aborts_the_upstream_request(server, start_proxy, http, warm):
    upstream = server()
    proxy = await start_proxy(upstream.url, [server().url])
    await warm(http, proxy.url)
    upstream.delay = 30
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(post(http, proxy.url + CHAT, chat()), 0.5)
    for _ in range(100):  # the stand-in notices the closed connection at once; give it 10 s
        if upstream.records and upstream.records[-1].aborted:
            break
        await asyncio.sleep(0.1)
    assert upstream.records[-1].aborted


async def test_metrics_and_health(server, start_proxy, http):
    encoders, upstream = [server(), server()], server()
    proxy = await start_proxy(upstream.url, [e.url for e in encoders])
    await post(http, proxy.url + CHAT, chat(image(0), {"type": "audio_url", "audio_url": {"url": "https://a.test/x"}}))
    await post(http, proxy.url + CHAT, b"nope")
    async with http.get(proxy.url + "/v1/models") as response:
        assert response.status == 200
    async with http.get(proxy.url + "/health") as response:  # the readiness probe, through to the upstream
        assert response.status == 200
    async with http.get(proxy.admin_url + "/health") as response:
        assert (response.status, await response.text()) == (200, "ok")
    text = await proxy.metrics_text()
    for line in (
        'epd_proxy_requests_total{code="200",route="chat_completions"} 1.0',
        'epd_proxy_requests_total{code="400",route="chat_completions"} 1.0',
        'epd_proxy_requests_total{code="200",route="other"} 1.0',
        'epd_proxy_requests_total{code="200",route="health"} 1.0',
        'epd_proxy_media_primed_total{kind="image"} 1.0',
        'epd_proxy_media_primed_total{kind="audio"} 1.0',
        "epd_proxy_prime_duration_seconds_count 1.0",
        'epd_proxy_prime_failures_total{reason="client_error"} 0.0',
        "epd_proxy_encoders 2.0",
    ):
        assert line in text, line
    assert "process_resident_memory_bytes" in text


async def test_an_upstream_too_slow_for_the_request_timeout_is_a_504(server, start_proxy, http, warm):
    upstream = server()
    proxy = await start_proxy(upstream.url, [server().url], request_timeout_seconds=0.3)
    await warm(http, proxy.url)
    upstream.delay = 5
    status, answer, _ = await post(http, proxy.url + CHAT, chat())
    assert (status, answer["error"]["type"]) == (504, "GatewayTimeoutError")


@contextlib.asynccontextmanager
async def upstream_breaking_off(start: bytes) -> AsyncIterator[str]:
    """An upstream (its URL) that reads a request, sends ``start`` of an answer and drops the
    connection."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answer_models(reader, writer)
        writer.write(start)
        await writer.drain()
        writer.transport.abort()

    async with raw_upstream(answer) as url:
        yield url


async def test_an_answer_broken_off_upstream_is_broken_off_for_the_client(start_proxy, http, server, warm):
    """Headers and one event, then the upstream's connection drops: the client must not get a
    well-ended answer that is missing its end."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    async with upstream_breaking_off(head + b"d\r\ndata: first\n\n\r\n") as upstream:
        proxy = await start_proxy(upstream, [server().url])
        await warm(http, proxy.url)
        async with http.post(proxy.url + "/v1/completions", json={"prompt": "x", "stream": True}) as response:
            assert response.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await response.read()


async def test_a_whole_answer_broken_off_upstream_is_a_502(start_proxy, http, server, warm):
    """An answer of known length is read whole before anything goes out, so when the upstream
    drops it halfway the client can still get a proper error instead of a cut body."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
    async with upstream_breaking_off(head + b'{"id": ') as upstream:
        proxy = await start_proxy(upstream, [server().url])
        await warm(http, proxy.url)
        status, answer, _ = await post(http, proxy.url + "/v1/completions", {"prompt": "x"})
    assert (status, answer["error"]["type"]) == (502, "BadGatewayError")
    assert "broke off" in answer["error"]["message"]


async def test_a_proxy_failure_passing_an_answer_on_is_a_500_and_logged(
    server, start_proxy, http, warm, monkeypatch, caplog
):
    upstream = server()
    proxy = await start_proxy(upstream.url, [server().url])
    await warm(http, proxy.url)
    real = server_module.forwarded

    def failing(headers, drop=core.HOP_BY_HOP):
        if drop is core.ANSWER_DROPPED:
            raise RuntimeError("a bug")
        return real(headers, drop)

    monkeypatch.setattr(server_module, "forwarded", failing)
    status, answer, _ = await post(http, proxy.url + CHAT, chat())
    assert (status, answer["error"]["type"]) == (500, "InternalServerError")
    assert "the proxy failed" in caplog.text and "a bug" in caplog.text
    assert len(upstream.requests(CHAT)) == 1


async def test_a_proxy_failure_before_forwarding_is_a_500_logged_and_nothing_is_forwarded(
    server, start_proxy, http, monkeypatch, caplog
):
    upstream = server()
    proxy = await start_proxy(upstream.url, [server().url])

    def failing(route_name, raw, **options):
        raise RuntimeError("a bug in plan")

    with monkeypatch.context() as patched:
        patched.setattr(server_module, "plan", failing)
        status, answer, _ = await post(http, proxy.url + CHAT, chat())
    assert (status, answer["error"]["type"]) == (500, "InternalServerError")
    assert "the proxy failed" in caplog.text and "a bug in plan" in caplog.text
    assert upstream.requests(CHAT) == []
    assert (await post(http, proxy.url + CHAT, chat()))[0] == 200  # and the proxy serves on
