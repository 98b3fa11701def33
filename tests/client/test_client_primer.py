"""Primer and media_items: the public pieces another door (the EPD proxy) primes with."""

from __future__ import annotations

import pytest

from epd_client import MediaItem, MediaPartError, PrimeError, Primer, media_items, prime_body
from epd_dev.standins.fault_proxy import cut_off, delay, http_status, reset

from .helpers import FAST


def test_media_items_say_where_each_part_is() -> None:
    image = {"type": "image_url", "image_url": {"url": "https://i.test/a.png"}}
    responses_image = {"type": "input_image", "image_url": "https://i.test/b.png", "detail": "auto"}
    conversation = [
        {"role": "system", "content": "be brief"},
        "not a message",  # what a malformed Responses input may hold: skipped, not an error
        {"role": "user", "content": [{"type": "text", "text": "look"}, image]},
        {
            "type": "message",
            "role": "user",
            "content": [responses_image, {"type": "image_embeds", "image_embeds": "A"}],
        },
    ]
    assert media_items(conversation) == [  # type: ignore[arg-type]  # a Responses input list, which media_items also reads
        MediaItem(image, "image_url", "https://i.test/a.png", message=2, position=1),
        MediaItem(responses_image, "input_image", "https://i.test/b.png", message=3, position=0),
    ]


@pytest.mark.parametrize(
    ("part", "kind", "source", "primed"),
    [
        # Untyped: vLLM reads the media key.
        (
            {"image_url": "https://i.test/a"},
            "image_url",
            "https://i.test/a",
            {"type": "image_url", "image_url": {"url": "https://i.test/a"}},
        ),
        (
            {"video_url": "https://i.test/v"},
            "video_url",
            "https://i.test/v",
            {"type": "video_url", "video_url": {"url": "https://i.test/v"}},
        ),
        # With a uuid, vLLM reads the first media key in its order, whatever the type says.
        (
            {"type": "text", "text": "x", "uuid": "k", "audio_url": {"url": "https://i.test/s"}},
            "audio_url",
            "https://i.test/s",
            {"type": "audio_url", "audio_url": {"url": "https://i.test/s"}, "uuid": "k"},
        ),
        (
            {
                "type": "video_url",
                "video_url": {"url": "https://i.test/v"},
                "image_url": {"url": "https://i.test/i"},
                "uuid": "k",
            },
            "image_url",
            "https://i.test/i",
            {"type": "image_url", "image_url": {"url": "https://i.test/i"}, "uuid": "k"},
        ),
        # Without one, the type decides, and Vime's prime carries the part as it is.
        (
            {"type": "video_url", "video_url": {"url": "https://i.test/v"}, "image_url": {"url": "https://i.test/i"}},
            "video_url",
            "https://i.test/v",
            None,
        ),
        (
            {"type": "image_url", "image_url": {"url": "https://i.test/a", "detail": "low"}, "uuid": "k"},
            "image_url",
            "https://i.test/a",
            None,
        ),
        # vLLM builds a data URL of input_audio, format or not.
        (
            {"type": "input_audio", "input_audio": {"data": "AAAA"}},
            "input_audio",
            "data:audio/;base64,AAAA",
            {"type": "audio_url", "audio_url": {"url": "data:audio/;base64,AAAA"}},
        ),
    ],
)
def test_media_parts_are_read_as_vllm_reads_them(part, kind, source, primed) -> None:
    (item,) = media_items([{"role": "user", "content": [{"type": "text", "text": "look"}, part]}])
    assert (item.kind, item.source, item.position) == (kind, source, 1)
    assert prime_body(item, "m")["messages"] == [{"role": "user", "content": [primed or part]}]


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": 7}},  # vLLM refuses the request itself
        {"type": "image_url", "image_url": "https://i.test/a"},  # a typed url must be an object: refused too
        {"type": "image_embeds", "image_embeds": "AAAA"},  # embeddings: no encoder runs on them
        {"type": "prompt_embeds", "data": "AAAA"},
        {"type": "bogus", "image_url": {"url": "https://i.test/a"}},  # an unknown type: refused by vLLM
        {"type": "text", "text": "x", "image_url": {"url": "https://i.test/a"}},  # no uuid: read as text
    ],
)
def test_parts_vllm_loads_no_media_from_are_not_items(part) -> None:
    assert media_items([{"role": "user", "content": [part]}]) == []


@pytest.mark.parametrize(
    ("part", "reason"),
    [
        ({"image_url": None, "uuid": "k"}, "no data"),  # a reference to what vLLM processed before
        ({"type": "image_url", "image_url": {"url": ""}}, "no data"),
        ({"type": "input_image", "file_id": "file-1", "detail": "auto"}, "no data"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "no data"),
        ({"image_pil": None, "uuid": "k"}, "image_pil"),
    ],
)
def test_media_no_prime_can_stand_for_are_refused(part, reason) -> None:
    with pytest.raises(MediaPartError, match=reason) as caught:
        media_items([{"role": "user", "content": "hi"}, {"role": "user", "content": ["x", part]}])
    assert (caught.value.message, caught.value.position) == (1, 1)
    assert str(caught.value).startswith("messages[1].content[1]: ")


def parts(count: int) -> list[MediaItem]:
    return media_items(
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"https://i.test/{i}"}}]}
        for i in range(count)
    )


def url_of(record) -> str:
    return record.body["messages"][0]["content"][0]["image_url"]["url"]


async def test_round_robin_starts_at_first(server) -> None:
    encoders = [server(), server(), server()]
    async with Primer(retry=FAST) as primer:
        assert await primer.prime(parts(4), [e.url for e in encoders], model="m", first=2) == {}
    # Item i on encoder (2 + i) % 3.
    assert [sorted(url_of(r) for r in e.records) for e in encoders] == [
        ["https://i.test/1"],
        ["https://i.test/2"],
        ["https://i.test/0", "https://i.test/3"],
    ]
    assert {r.body["model"] for e in encoders for r in e.records} == {"m"}


async def test_headers_go_with_every_prime_and_request_ids_stay_unique(server) -> None:
    encoder = server()
    headers = {"Authorization": "Bearer token", "X-Request-Id": "client-7"}
    async with Primer(retry=FAST) as primer:
        await primer.prime(parts(3), [encoder.url], model=None, headers=headers)
    assert {r.headers["authorization"] for r in encoder.records} == {"Bearer token"}
    ids = [r.headers["x-request-id"] for r in encoder.records]
    assert len(set(ids)) == 3 and all(i.startswith("client-7-") for i in ids)
    assert all("model" not in r.body for r in encoder.records)  # None: vLLM's default model


async def test_failures_name_each_item(server, proxy) -> None:
    front = proxy(server().url)
    front.add(http_status(503), times=None)
    async with Primer(retry=FAST) as primer:
        with pytest.raises(PrimeError) as caught:
            await primer.prime(parts(2), [front.url], model="m", unit="the pool")
    assert [(f.index, f.error.status_code, f.error.attempts) for f in caught.value.failures] == [
        (0, 503, FAST.max_attempts),
        (1, 503, FAST.max_attempts),
    ]
    assert "on unit 'the pool'" in str(caught.value)


async def test_nothing_to_prime_sends_nothing_and_items_need_encoders(server) -> None:
    encoder = server()
    async with Primer(retry=FAST) as primer:
        assert await primer.prime([], [], model="m") == {}
        with pytest.raises(ValueError, match="no encoder"):
            await primer.prime(parts(1), [], model="m")
    assert encoder.records == []


async def test_pooled_answers_are_merged_and_must_announce(server) -> None:
    announcing, silent = server(ec_transfer=True), server()
    async with Primer(retry=FAST) as primer:
        params = await primer.prime(parts(2), [announcing.url], model="m", pooled=True)
        assert len(params) == 2 and all(p["peer_host"] == "127.0.0.1" for p in params.values())
        with pytest.raises(PrimeError, match="without ec_transfer_params"):
            await primer.prime(parts(1), [silent.url], model="m", pooled=True)


async def test_on_attempt_says_which_encoder_failed_each_prime_request(server, proxy) -> None:
    """A 5xx, a reset, an answer cut off and no answer in time are the encoder failing; a 4xx,
    408 or 429 is the encoder answering (the request or the load is the matter)."""
    healthy = server()
    outcomes: list[tuple[str, bool]] = []
    faults = {503: http_status(503), 400: http_status(400), 429: http_status(429)}
    faults |= {"reset": reset(), "cut off": cut_off(), "slow": delay(5)}  # FAST: 2 s an attempt
    fronts = {name: proxy(healthy.url) for name in faults}
    for name, fault in faults.items():
        fronts[name].add(fault)
    names = {front.url: name for name, front in fronts.items()} | {healthy.url: "healthy"}
    async with Primer(retry=FAST, on_attempt=lambda url, failed: outcomes.append((names[url], failed))) as primer:
        for name in faults:
            try:
                await primer.prime(parts(1), [fronts[name].url, healthy.url], model="m")
            except PrimeError:
                assert name == 400  # a bad request stays bad: not retried elsewhere
    assert outcomes == [
        (503, True), ("healthy", False),
        (400, False),
        (429, False), ("healthy", False),
        ("reset", True), ("healthy", False),
        ("cut off", True), ("healthy", False),
        ("slow", True), ("healthy", False),
    ]  # fmt: skip
