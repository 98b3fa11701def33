"""The proxy's decisions (core.py), without any I/O."""

from __future__ import annotations

import json

import pytest

from epd_client import MediaFailure, PrimeError, RequestError
from epd_dataplane import core
from epd_dataplane.core import BadRequest, DNSTarget


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("POST", "/v1/chat/completions", "chat_completions"),
        ("POST", "/v1/responses", "responses"),
        ("POST", "/v1/messages", "messages"),
        ("POST", "/v1/chat/completions/batch", "chat_completions_batch"),
        ("POST", "/invocations", "invocations"),
        ("POST", "/cohere/v2/chat", "cohere_chat"),
        ("POST", "/v1/systemone", "structured_decisions"),
        ("POST", "/v1/audio/transcriptions", "transcriptions"),
        ("POST", "/v1/audio/translations", "translations"),
        ("POST", "/v1/messages/count_tokens", "other"),  # tokenizes only: no encoder runs
        ("POST", "/tokenize", "other"),
        ("POST", "/v1/decisions", "other"),  # text only (vLLM 0.33 refuses images there itself)
        ("GET", "/v1/chat/completions", "other"),
        ("POST", "/v1/chat/completions/render", "chat_completions_render"),
        ("POST", "/inference/v1/generate", "other"),
        ("POST", "/v1/completions", "other"),
        ("POST", "/v1/responses/resp_1/cancel", "other"),
        ("POST", "/v1/chat/completions/", "other"),
        ("GET", "/health", "health"),
        ("POST", "/health", "other"),
    ],
)
def test_posts_of_routes_that_take_media_are_primed_keyed_or_refused(method, path, expected):
    assert core.route(method, path) == expected


def raw(body: object) -> bytes:
    return json.dumps(body).encode()


def test_a_chat_plan_locates_each_media_part():
    image = {"type": "image_url", "image_url": {"url": "https://i.test/a.png"}}
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    body = {"model": "m", "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": [image, audio]}]}
    found = core.plan("chat_completions", raw(body))
    assert found.body == body and found.model == "m"
    assert [(p.item.part, p.param) for p in found.parts] == [
        (image, "messages[1].content[0]"),
        (audio, "messages[1].content[1]"),
    ]


def test_a_responses_plan_reads_the_input_as_vllm_makes_messages_of_it():
    now = {"type": "input_image", "image_url": "https://i.test/b.png"}
    seen = {"type": "input_image", "image_url": "https://i.test/c.png", "detail": "low"}
    body = {
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}, now]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "a"}, seen]},  # vLLM keeps its text
            {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "y"}, seen]},
        ],
        # Read for gpt-oss only, which takes no media.
        "previous_input_messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    }
    found = core.plan("responses", raw(body))
    assert [p.param for p in found.parts] == ["input[0].content[1]", "input[2].output[1]"]
    # vLLM gives an input_image without detail "auto": the prime says so, or the encoder refuses it.
    assert [p.item.part for p in found.parts] == [{**now, "detail": "auto"}, seen]
    assert found.model is None  # vLLM's default model, for the primes too
    assert core.plan("responses", raw({"model": "m", "input": "text only"})).parts == ()


def test_untyped_and_keyed_parts_are_primed_and_references_refused():
    untyped = {"image_url": "https://i.test/a.png"}
    keyed = {"type": "text", "text": "x", "uuid": "k", "video_url": {"url": "https://i.test/v.mp4"}}
    body = {"messages": [{"role": "system", "content": [untyped]}, {"role": "user", "content": ["hi", keyed]}]}
    found = core.plan("chat_completions", raw(body))
    assert [(p.item.kind, p.item.source, p.param) for p in found.parts] == [
        ("image_url", "https://i.test/a.png", "messages[0].content[0]"),
        ("video_url", "https://i.test/v.mp4", "messages[1].content[1]"),
    ]
    reference = {"messages": [{"role": "user", "content": ["hi", {"image_url": None, "uuid": "k"}]}]}
    with pytest.raises(BadRequest, match="no data") as caught:
        core.plan("chat_completions", raw(reference))
    assert caught.value.param == "messages[0].content[1]"
    with pytest.raises(BadRequest, match="image_pil") as caught:
        core.plan("responses", raw({"input": [{"role": "user", "content": [{"image_pil": None, "uuid": "k"}]}]}))
    assert caught.value.param == "input[0].content[0]"


def test_primes_carry_the_fields_vllm_hashes_media_with():
    fields = {"mm_processor_kwargs": {"max_pixels": 1024}, "media_io_kwargs": {"video": {"num_frames": 8}}}
    body = {"messages": [{"role": "user", "content": [{"image_url": "https://i.test/a.png"}]}], **fields}
    assert core.plan("chat_completions", raw(body)).prime_fields == fields
    assert core.plan("chat_completions", raw({**body, "mm_processor_kwargs": None})).prime_fields == {
        "media_io_kwargs": fields["media_io_kwargs"]
    }
    anthropic = {"messages": [{"role": "user", "content": "hi"}], **fields}
    assert core.plan("messages", raw(anthropic)).prime_fields == {}  # vLLM's Anthropic requests have neither


IMAGE = {"type": "image_url", "image_url": {"url": "https://i.test/a.png"}}


def test_a_batch_plan_locates_parts_in_every_conversation():
    body = {"messages": [[{"role": "user", "content": "text"}], [{"role": "user", "content": ["x", IMAGE]}]]}
    assert [(p.item.part, p.param) for p in core.plan("chat_completions_batch", raw(body)).parts] == [
        (IMAGE, "messages[1][0].content[1]")
    ]


def test_invocations_with_messages_are_chat_completions_and_others_pass():
    chat = {"messages": [{"role": "user", "content": [IMAGE]}]}
    assert [p.param for p in core.plan("invocations", raw(chat)).parts] == ["messages[0].content[0]"]
    assert core.plan("invocations", raw({"prompt": "a completion"})).parts == ()
    assert core.plan("cohere_chat", raw(chat)).parts == core.plan("chat_completions", raw(chat)).parts
    # Cohere: only a user message's image_url blocks, as vLLM converts them (url and detail).
    cohere = {"messages": [{"role": "assistant", "content": [IMAGE]}, {"role": "user", "content": [{**IMAGE, "x": 1}]}]}
    assert [(p.item.part, p.param) for p in core.plan("cohere_chat", raw(cohere)).parts] == [
        (IMAGE, "messages[1].content[0]")
    ]


def test_an_anthropic_plan_primes_image_blocks_as_vllm_converts_them():
    url = {"type": "image", "source": {"type": "url", "url": "https://i.test/a.png"}}
    data = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    tool = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": [{"type": "text", "text": "seen"}, {"type": "image", "source": {"type": "base64", "data": "BBBB"}}],
    }
    body = {
        "model": "m",
        "system": "be brief",
        "messages": [
            {"role": "system", "content": [data]},  # vLLM keeps only a system message's text
            {"role": "user", "content": [{"type": "text", "text": "look"}, url, data]},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "ok"}, {"type": "tool_result", "content": [data]}],
            },
            {"role": "user", "content": [tool]},
            {"role": "user", "content": "text only"},
        ],
    }
    found = core.plan("messages", raw(body))
    assert [(p.item.part["image_url"]["url"], p.param) for p in found.parts] == [
        ("https://i.test/a.png", "messages[1].content[1]"),
        ("data:image/png;base64,AAAA", "messages[1].content[2]"),
        ("data:image/jpeg;base64,BBBB", "messages[3].content[0].content[1]"),  # vLLM's default media type
    ]
    assert {p.item.kind for p in found.parts} == {"image_url"} and found.model == "m"


def test_a_pools_model_refuses_media_on_routes_that_drop_transfer_params():
    chat = raw({"model": "m", "messages": [{"role": "user", "content": [IMAGE]}]})
    with pytest.raises(BadRequest, match="ec_transfer_params") as caught:
        core.plan("cohere_chat", chat, pooled=True)
    assert caught.value.param == "messages[0].content[0]"
    assert len(core.plan("cohere_chat", chat).parts) == 1  # a unit's consumers read the shared store
    assert len(core.plan("chat_completions", chat, pooled=True).parts) == 1
    assert core.plan("cohere_chat", raw({"model": "m", "messages": []}), pooled=True).parts == ()


def test_structured_decisions_without_media_pass():
    assert core.plan("structured_decisions", raw({"state": "s", "questions": {}, "images": []})).parts == ()


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("chat_completions", b"", None),
        ("chat_completions", b"\xff", None),
        ("chat_completions", b'"a string"', None),
        ("chat_completions", raw({"messages": {"role": "user"}}), "messages"),
        ("responses", raw({"input": 3}), "input"),
        ("messages", raw({"messages": "hi"}), "messages"),
        ("chat_completions_batch", raw({"messages": [[], {"role": "user"}]}), "messages[1]"),
        ("structured_decisions", raw({"state": "s", "questions": {}, "images": ["https://i.test/a.png"]}), "images"),
        ("structured_decisions", raw({"state": "s", "questions": {}, "videos": ["https://i.test/a.mp4"]}), "videos"),
    ],
)
def test_unreadable_bodies_are_bad_requests(route, body, param):
    with pytest.raises(BadRequest) as caught:
        core.plan(route, body)
    assert caught.value.param == param


def test_hop_by_hop_headers_and_those_connection_names_are_dropped():
    # Names come lower-cased from the parsers; the Connection header's tokens may be in any case.
    headers = [
        ("host", "front:8000"),
        ("connection", "keep-alive, X-Secret"),
        ("keep-alive", "timeout=5"),
        ("proxy-connection", "keep-alive"),
        ("te", "trailers"),
        ("transfer-encoding", "chunked"),
        ("upgrade", "websocket"),
        ("x-secret", "for this hop"),
        ("content-length", "12"),
        ("expect", "100-continue"),
        ("accept", "a"),
        ("accept", "b"),
        ("authorization", "Bearer t"),
    ]
    assert core.forwarded(headers) == [
        ("host", "front:8000"),
        ("content-length", "12"),
        ("expect", "100-continue"),
        ("accept", "a"),
        ("accept", "b"),
        ("authorization", "Bearer t"),
    ]
    assert core.forwarded(headers, core.REQUEST_DROPPED) == [
        ("accept", "a"),
        ("accept", "b"),
        ("authorization", "Bearer t"),
    ]
    assert core.forwarded([("content-length", "3"), ("date", "d")], core.ANSWER_DROPPED) == [("date", "d")]


def test_primes_carry_credentials_trace_context_and_the_request_id():
    headers = [
        ("authorization", "Bearer t"),
        ("authorization", "second"),
        ("x-request-id", "r1"),
        ("traceparent", "00-a-b-01"),
        ("cookie", "c=1"),
        ("content-type", "application/json"),
    ]
    assert core.prime_headers(headers) == {
        "authorization": "Bearer t",
        "x-request-id": "r1",
        "traceparent": "00-a-b-01",
    }


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "BadRequestError"),
        (413, "RequestEntityTooLargeError"),
        (502, "BadGatewayError"),
        (500, "InternalServerError"),
    ],
)
def test_errors_have_vllms_shape(status, kind):
    error = core.ProxyError(status, "why", "messages")
    assert core.error_body(error, "/v1/chat/completions") == {
        "error": {"message": "why", "type": kind, "param": "messages", "code": status}
    }
    # vLLM's AnthropicErrorResponse on the Anthropic paths: the anthropic SDK reads it there.
    assert core.error_body(error, "/v1/messages") == {"type": "error", "error": {"type": kind, "message": "why"}}


def failure(index: int, status: int | None, reason: str = "boom") -> MediaFailure:
    return MediaFailure(
        index,
        f"https://i.test/{index}",
        ("http://e:1",),
        RequestError("/p", ("http://e:1",), attempts=3, reason=reason, status_code=status),
    )


def parts(count: int) -> tuple[core.MediaPart, ...]:
    images = [{"type": "image_url", "image_url": {"url": f"https://i.test/{i}"}} for i in range(count)]
    return core.plan("chat_completions", raw({"messages": [{"role": "user", "content": images}]})).parts


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        ([503], 502),
        ([None], 502),  # connection errors, timeouts
        ([503, 404], 404),  # a bad request stays bad, whatever else failed
        ([400, 401], 400),
        ([429, 408], 502),  # retried until the end: the encoders' trouble, not the client's
    ],
)
def test_a_prime_failure_is_the_clients_only_for_an_encoder_4xx(statuses, expected):
    error = PrimeError("u", 3, [failure(i + 1, s) for i, s in enumerate(statuses)])
    found = core.prime_failure(error, parts(3))
    assert found.status == expected
    assert found.param == "messages[0].content[1]"
    assert f"{len(statuses)} of 3 media part(s)" in found.message
    assert "image messages[0].content[1] (https://i.test/1) via http://e:1: boom" in found.message


def test_no_encoder_is_a_503_naming_the_first_part():
    found = core.no_encoder(parts(2))
    assert (found.status, found.param) == (503, "messages[0].content[0]")
    assert core.error_body(found)["error"]["type"] == "ServiceUnavailableError"


@pytest.mark.parametrize("route", ["chat_completions", "responses", "messages", "chat_completions_batch"])
def test_a_clients_own_transfer_params_are_refused(route):
    body = {"messages": [], "input": "x", "ec_transfer_params": {"h1": {"peer_host": "10.0.0.9", "peer_port": 1}}}
    with pytest.raises(BadRequest, match="EPD proxy's to set") as caught:
        core.plan(route, raw(body))
    assert caught.value.param == "ec_transfer_params"
    assert core.with_transfer_params({"messages": []}, {"h": 1}) == {"messages": [], "ec_transfer_params": {"h": 1}}


def test_dns_targets():
    assert DNSTarget.parse("pool.ns.svc:8100,8101") == DNSTarget("pool.ns.svc", (8100, 8101))
    assert DNSTarget.parse("pool.ns.svc.cluster.local.:8100") == DNSTarget("pool.ns.svc.cluster.local.", (8100,))
    for bad in ("pool", "pool:", ":8100", "pool:x", "pool:0", "pool:70000", "pool:8100,"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            DNSTarget.parse(bad)


def test_encoder_urls_are_sorted_and_bracket_ipv6():
    assert core.encoder_urls(["10.0.0.10", "fd00::1", "10.0.0.9", "10.0.0.10"], (8100, 8101)) == (
        "http://10.0.0.9:8100",
        "http://10.0.0.9:8101",
        "http://10.0.0.10:8100",
        "http://10.0.0.10:8101",
        "http://[fd00::1]:8100",
        "http://[fd00::1]:8101",
    )
