"""prime_encoder: the seed's contract, retries, failures and cancellation."""

from __future__ import annotations

import argparse
import asyncio
import time

import pytest

from epd_client import (
    Endpoints,
    EPDClient,
    MediaPartError,
    ModelEndpoints,
    PrimeError,
    RetryPolicy,
    Unit,
    prime_encoder,
    prime_encoder_sync,
)
from epd_dev.standins.fault_proxy import delay, http_status, reset

from .helpers import FAST, image_messages, image_urls


def client_for(urls: list[str], policy: RetryPolicy = FAST, **kw: object) -> EPDClient:
    return EPDClient(Endpoints.from_urls(urls, served_model_name="served"), retry=policy, **kw)


async def test_one_concurrent_request_per_image_round_robin(server) -> None:
    encoders = [server(delay=0.5), server(delay=0.5)]
    async with client_for([e.url for e in encoders]) as client:
        await prime_encoder(client, image_messages(5))

    # Image i goes to encoder i % 2, across message boundaries.
    assert sorted(image_urls(encoders[0])) == [f"https://images.test/{i}.png" for i in (0, 2, 4)]
    assert sorted(image_urls(encoders[1])) == [f"https://images.test/{i}.png" for i in (1, 3)]
    records = encoders[0].records + encoders[1].records
    # All in flight together: every request started before any finished.
    assert max(r.started for r in records) < min(r.finished for r in records)
    assert {r.body["model"] for r in records} == {"served"}
    assert len({r.headers["x-request-id"] for r in records}) == 5  # fresh per request


async def test_body_is_the_image_only_message(server) -> None:
    encoder = server()
    part = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"},
    }
    messages = [{"role": "user", "content": [{"type": "text", "text": "what?"}, part]}]
    async with client_for([encoder.url]) as client:
        await prime_encoder(client, messages)
    (record,) = encoder.records
    assert record.path == "/v1/chat/completions"
    assert record.body == {
        "model": "served",
        "messages": [{"role": "user", "content": [part]}],
        "max_tokens": 1,
        "stream": False,
    }
    assert record.headers["x-request-id"]


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "just text"}],
        [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 42}}]}],
        [],
    ],
)
async def test_text_only_is_a_no_op(server, messages) -> None:
    encoder = server()
    async with client_for([encoder.url]) as client:
        await prime_encoder(client, messages)
        # Not even the model name is checked when there is nothing to prime.
        await prime_encoder(client, messages, model_name="no-such-model")
    assert encoder.records == []


async def test_models_without_encoders_are_a_no_op(server) -> None:
    consumer = server()
    non_epd = Endpoints.from_urls([], consumer.url)
    await prime_encoder(non_epd, image_messages(2))
    two_units = Endpoints((ModelEndpoints("default", (Unit("a", consumer_urls=(consumer.url,)), Unit("b"))),))
    await prime_encoder(two_units, image_messages(2))
    vime_rollout_args = argparse.Namespace(vllm_model_encoder_endpoints={"other": ("m", ["http://x"])})
    await prime_encoder(vime_rollout_args, image_messages(2), model_name="actor")
    await prime_encoder(argparse.Namespace(vllm_model_encoder_endpoints={}), image_messages(1))
    assert consumer.records == []


async def test_vime_args_object_works_unchanged(server) -> None:
    encoders = [server(), server()]
    args = argparse.Namespace(
        vllm_model_encoder_endpoints={"actor": ("Qwen/Qwen2-VL", [e.url + "/" for e in encoders])}
    )
    await prime_encoder(args, image_messages(4), model_name="actor")
    assert [len(image_urls(e)) for e in encoders] == [2, 2]
    assert {r.body["model"] for e in encoders for r in e.records} == {"Qwen/Qwen2-VL"}


async def test_vime_args_prime_every_part_vllm_reads_as_media(server) -> None:
    """Vime primes typed image_url parts only; vLLM also loads an image spelled without a type,
    so a consumer would encode it: it is primed too, as a typed part vLLM reads as the same."""
    encoder = server()
    args = argparse.Namespace(vllm_model_encoder_endpoints={"actor": ("m", [encoder.url])})
    typed = {"type": "image_url", "image_url": {"url": "https://images.test/0.png"}}
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "compare"}, typed, {"image_url": "https://images.test/1.png"}],
        }
    ]
    await prime_encoder(args, messages, model_name="actor")
    assert sorted(r.body["messages"][0]["content"][0]["image_url"]["url"] for r in encoder.records) == [
        "https://images.test/0.png",
        "https://images.test/1.png",
    ]
    assert [typed] in [r.body["messages"][0]["content"] for r in encoder.records]  # Vime's body, part as given


async def test_a_reference_without_data_is_refused_before_any_prime(server) -> None:
    encoder = server()
    args = argparse.Namespace(vllm_model_encoder_endpoints={"actor": ("m", [encoder.url])})
    messages = image_messages(2) + [{"role": "user", "content": [{"image_url": None, "uuid": "seen-before"}]}]
    with pytest.raises(MediaPartError, match=r"messages\[3\]\.content\[0\]: this image part has no data"):
        await prime_encoder(args, messages, model_name="actor")
    assert encoder.records == []


@pytest.mark.parametrize("status", [500, 502, 503, 408, 429])
async def test_retryable_statuses_are_retried_then_succeed(server, proxy, status) -> None:
    encoder = server()
    front = proxy(encoder.url)
    front.add(http_status(status), times=2)
    async with client_for([front.url]) as client:
        await prime_encoder(client, image_messages(1))
    assert front.faults() == ["status", "status", "forward"]
    assert len(encoder.records) == 1


async def test_slow_answer_times_out_and_is_retried(server, proxy) -> None:
    encoder = server()
    front = proxy(encoder.url)
    front.add(delay(10.0))
    policy = RetryPolicy(max_attempts=3, backoff=0.01, attempt_timeout=0.3, deadline=10)
    async with client_for([front.url], policy) as client:
        started = time.monotonic()
        await prime_encoder(client, image_messages(1))
        assert time.monotonic() - started < 5.0
    assert front.faults() == ["delay", "forward"]


async def test_connection_reset_is_retried(server, proxy) -> None:
    encoder = server()
    front = proxy(encoder.url)
    front.add(reset(), times=2)
    async with client_for([front.url]) as client:
        await prime_encoder(client, image_messages(1))
    assert front.faults() == ["reset", "reset", "forward"]


async def test_400_is_not_retried(server, proxy) -> None:
    encoder = server()
    front = proxy(encoder.url)
    front.add(http_status(400), times=None)
    async with client_for([front.url]) as client:
        with pytest.raises(PrimeError) as caught:
            await prime_encoder(client, image_messages(1))
    assert front.faults() == ["status"]
    (failure,) = caught.value.failures
    assert failure.error.status_code == 400
    assert failure.error.attempts == 1


async def test_exhausted_retries_name_the_images_and_encoders(server, proxy) -> None:
    healthy = server()
    broken = [proxy(healthy.url), proxy(healthy.url)]
    for front in broken:
        front.add(http_status(503), times=None)
    policy = RetryPolicy(max_attempts=3, backoff=0.01, deadline=10)
    async with client_for([b.url for b in broken], policy) as client:
        with pytest.raises(PrimeError) as caught:
            await prime_encoder(client, image_messages(2))

    error = caught.value
    assert [f.index for f in error.failures] == [0, 1]
    # Retries move to the next encoder: image 0 tried A, B, A; image 1 tried B, A, B.
    a, b = broken[0].url, broken[1].url
    assert error.failures[0].encoders == (a, b, a)
    assert error.failures[1].encoders == (b, a, b)
    assert all(f.error.status_code == 503 and f.error.attempts == 3 for f in error.failures)
    message = str(error)
    for expected in ("image 0", "image 1", "images.test/0.png", "images.test/1.png", a, b, "503"):
        assert expected in message
    assert healthy.records == []


async def test_a_retry_moves_to_the_next_encoder(server, proxy) -> None:
    healthy = server()
    dead = proxy(healthy.url)
    dead.add(http_status(503), times=None)
    async with client_for([dead.url, healthy.url]) as client:
        await prime_encoder(client, image_messages(4))
    # Images 0 and 2 started on the dead encoder and were primed by the healthy one.
    assert sorted(image_urls(healthy)) == [f"https://images.test/{i}.png" for i in range(4)]
    assert dead.faults() == ["status", "status"]


async def test_the_deadline_bounds_the_whole_request(server, proxy) -> None:
    front = proxy(server().url)
    front.add(http_status(503), times=None)
    policy = RetryPolicy(max_attempts=1000, backoff=0.05, max_backoff=0.05, deadline=0.5)
    async with client_for([front.url], policy) as client:
        started = time.monotonic()
        with pytest.raises(PrimeError):
            await prime_encoder(client, image_messages(1))
        elapsed = time.monotonic() - started
    assert 0.3 < elapsed < 2.0  # without the deadline: 1000 attempts, about 25 s
    assert 3 < len(front.log) < 100


async def test_the_deadline_bounds_the_wait_for_a_free_slot(server, proxy) -> None:
    """One slot. The first prime's first attempt times out at 0.8 s; a second prime, waiting for
    the slot since 0.7 s, takes it for its own 0.8 s attempt. The first must give up at its 1 s
    deadline while it waits, not when it gets the slot back at 1.6 s."""
    front = proxy(server().url)
    front.add(delay(3.0), times=2)
    policy = RetryPolicy(max_attempts=3, backoff=0, max_backoff=0, attempt_timeout=0.8, deadline=1.0)
    async with client_for([front.url], policy, max_concurrency=1) as client:
        started = time.monotonic()
        first = asyncio.create_task(prime_encoder(client, image_messages(1)))
        await asyncio.sleep(0.7)
        second = asyncio.create_task(prime_encoder(client, image_messages(1)))
        with pytest.raises(PrimeError, match="deadline"):
            await first
        elapsed = time.monotonic() - started
        await asyncio.gather(second, return_exceptions=True)
    assert elapsed < 1.3  # waiting for the slot: about 1.6 s


async def test_long_data_urls_are_shortened_in_errors(proxy, server) -> None:
    front = proxy(server().url)
    front.add(http_status(400), times=None)
    url = "data:image/png;base64," + "A" * 10_000
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    async with client_for([front.url]) as client:
        with pytest.raises(PrimeError) as caught:
            await prime_encoder(client, messages)
    assert len(str(caught.value)) < 1000
    assert caught.value.failures[0].url.startswith("data:image/png;base64,AAA")


async def test_cancelling_a_prime_leaves_no_tasks_or_requests(server) -> None:
    encoders = [server(delay=30), server(delay=30)]
    async with client_for([e.url for e in encoders]) as client:
        task = asyncio.create_task(prime_encoder(client, image_messages(6)))
        await _until(lambda: sum(len(e.records) for e in encoders) == 6)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert asyncio.all_tasks() == {asyncio.current_task()}
        # The client is still open, yet the servers saw every request abandoned.
        await _until(lambda: all(e.open_connections == 0 for e in encoders))
        assert all(r.aborted for e in encoders for r in e.records)

        # The client stays usable after a cancellation.
        for e in encoders:
            e.delay = 0
        await prime_encoder(client, image_messages(2))


def test_sync_wrapper(server) -> None:
    encoder = server()
    args = argparse.Namespace(vllm_model_encoder_endpoints={"default": ("m", [encoder.url])})
    prime_encoder_sync(args, image_messages(3), extra_body={"mm_processor_kwargs": {"max_pixels": 1024}})
    assert len(encoder.records) == 3
    # The fields vLLM keys an embedding by, as the render will carry them (Vime's own calls pass none).
    assert {r.body["mm_processor_kwargs"]["max_pixels"] for r in encoder.records} == {1024}


async def test_sync_wrapper_refuses_a_running_loop(server) -> None:
    with pytest.raises(RuntimeError, match="await"):
        prime_encoder_sync(Endpoints.from_urls([server().url]), image_messages(1))


async def test_many_images_to_one_encoder_all_run_at_once(server) -> None:
    encoder = server(delay=1.0)  # ample time for 20 connections on a busy machine
    async with client_for([encoder.url], max_concurrency=20) as client:
        await prime_encoder(client, image_messages(20))
        assert encoder.open_connections == 20  # kept alive for the next call
    records = encoder.records
    assert max(r.started for r in records) < min(r.finished for r in records)
    # Closing the client closes its connections.
    await _until(lambda: encoder.open_connections == 0)


async def test_concurrency_is_bounded(server) -> None:
    encoder = server(delay=0.2)
    async with client_for([encoder.url], max_concurrency=2) as client:
        await prime_encoder(client, image_messages(4))
    starts = sorted(r.started for r in encoder.records)
    # Two at a time: the third request starts only after the first pair answered.
    assert starts[2] - starts[0] > 0.15


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def every_kind() -> list[dict]:
    """One media part of each kind the encoders compute, between text parts."""
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what happens here?"},
                {"type": "image_url", "image_url": {"url": "https://media.test/a.png"}},
                {"type": "video_url", "video_url": {"url": "https://media.test/b.mp4"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "audio_url", "audio_url": {"url": "https://media.test/c.wav"}},
                {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                {"type": "image_url", "image_url": {"url": "https://media.test/e.png"}},
                {"type": "input_image", "image_url": "https://media.test/f.png", "detail": "auto"},
            ],
        },
    ]


async def test_every_media_kind_is_primed_like_images(server) -> None:
    encoders = [server(delay=0.3), server(delay=0.3)]
    messages = every_kind()
    parts = [p for m in messages for p in m["content"] if p["type"] != "text"]
    async with client_for([e.url for e in encoders]) as client:
        await prime_encoder(client, messages)

    # One single-part request per item, round-robin by position across kinds and messages.
    for i, part in enumerate(parts):
        (record,) = [r for r in encoders[i % 2].records if r.body["messages"][0]["content"] == [part]]
        assert record.body == {
            "model": "served",
            "messages": [{"role": "user", "content": [part]}],
            "max_tokens": 1,
            "stream": False,
        }
    records = encoders[0].records + encoders[1].records
    assert len(records) == 6
    assert max(r.started for r in records) < min(r.finished for r in records)


async def test_failed_media_are_named_by_kind(server, proxy) -> None:
    fronts = [proxy(server().url), proxy(server().url)]
    fronts[1].add(http_status(400), times=None)  # items 1, 3 and 5: video, input_audio, input_image
    async with client_for([f.url for f in fronts]) as client:
        with pytest.raises(PrimeError) as caught:
            await prime_encoder(client, every_kind())
    error = caught.value
    assert [(f.index, f.kind, f.url) for f in error.failures] == [
        (1, "video_url", "https://media.test/b.mp4"),
        (3, "input_audio", "data:audio/wav;base64,UklGRg=="),
        (5, "input_image", "https://media.test/f.png"),
    ]
    assert "3 of 6 media item(s)" in str(error)
    assert "video 1 (https://media.test/b.mp4)" in str(error)
    assert "audio 3 (data:audio/wav;base64,UklGRg==)" in str(error)
    assert "image 5 (https://media.test/f.png)" in str(error)
