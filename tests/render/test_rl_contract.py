"""What epd_client's RL loop relies on, checked against each supported vLLM minor's real package:
the routes it calls and the fields it sends and reads (in vLLM's own OpenAPI for them), the media
part `uuid` its weights-version keys travel in (vLLM's chat parser reads it for every media kind
the client keys), and the key vLLM makes of it (a new version, a new key; the content alone never
decides). Serving these minors needs GPUs; docs/client.md says what each clears on a weight update.
"""

from __future__ import annotations

import typing

from epd_client import MEDIA_KINDS, EPDClient, media_items
from epd_dev.vllm.cli_parser import VllmParser

PRIME, RENDER, GENERATE, PAUSE, RESUME = (
    "/v1/chat/completions",
    "/v1/chat/completions/render",
    "/inference/v1/generate",
    "/pause",
    "/resume",
)


def _schema(openapi: dict, path: str, part: str = "requestBody") -> dict:
    ref = openapi["paths"][path]["post"][part]["content"]["application/json"]["schema"]["$ref"]
    schema: dict = openapi["components"]["schemas"][ref.rsplit("/", 1)[1]]
    return schema


def test_the_routes_and_fields_the_client_uses_are_vllms(vllm_parser: VllmParser) -> None:
    assert {PRIME, RENDER, GENERATE, PAUSE, RESUME} <= vllm_parser.post_routes()
    openapi = vllm_parser.openapi([PRIME, RENDER, GENERATE, PAUSE, RESUME])
    # Prime: one media part, one token, no stream; a Pools encoder answers with ec_transfer_params.
    chat = _schema(openapi, PRIME)["properties"]
    assert {"model", "messages", "max_tokens", "stream", "ec_transfer_params"} <= set(chat)
    answer = vllm_parser.model_fields("vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionResponse")
    assert "ec_transfer_params" in answer
    # Render takes the chat request (with the primed params); generate takes what render returns.
    assert _schema(openapi, RENDER) == _schema(openapi, PRIME)
    generate = _schema(openapi, GENERATE)["properties"]
    assert {"token_ids", "features", "sampling_params", "ec_transfer_params"} <= set(generate)
    features = openapi["components"]["schemas"]["MultiModalFeatures"]["properties"]
    assert {"mm_hashes", "kwargs_data", "mm_metadata"} <= set(features)
    # pause(mode=..., clear_cache=...) as query parameters, resume without any.
    parameters = {p["name"]: p["schema"] for p in openapi["paths"][PAUSE]["post"]["parameters"]}
    modes = typing.get_args(typing.get_type_hints(EPDClient.pause)["mode"])
    assert set(modes) <= set(parameters["mode"]["enum"]) and parameters["clear_cache"]["type"] == "boolean"
    assert not any(p.get("required") for p in openapi["paths"][RESUME]["post"].get("parameters", []))


def _keyed_parts() -> list[dict]:
    """A content part of every media kind the client keys, with a key as the client writes it."""
    content = [
        {"type": "image_url", "image_url": {"url": "https://i.test/a.png"}},
        {"type": "input_image", "image_url": "https://i.test/b.png"},
        {"type": "video_url", "video_url": {"url": "https://i.test/c.mp4"}},
        {"type": "audio_url", "audio_url": {"url": "https://i.test/d.wav"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    ]
    items = media_items([{"role": "user", "content": content}])
    assert {item.kind for item in items} == set(MEDIA_KINDS)
    return [{**item.part, "uuid": f"epd-{n:032x}"} for n, item in enumerate(items)]


def test_vllm_reads_the_key_from_every_media_part_the_client_keys(vllm_parser: VllmParser) -> None:
    parts = _keyed_parts()
    calls = vllm_parser.media_uuids(parts)
    assert [uuid for _method, uuid in calls] == [part["uuid"] for part in parts]
    assert [method for method, _uuid in calls] == [
        "parse_image",
        "parse_image",
        "parse_video",
        "parse_audio",
        "parse_input_audio",
    ]


def test_a_new_weights_version_is_a_new_key_whatever_the_content(vllm_parser: VllmParser) -> None:
    for kwargs in ({}, {"max_pixels": 1024}):  # without and with processor kwargs in the hash
        step_1, step_1_again, step_2, unkeyed_a, unkeyed_b = vllm_parser.media_keys(
            [
                ("image", "epd-step-1", "image A"),
                ("image", "epd-step-1", "image A, changed at its URL"),
                ("image", "epd-step-2", "image A"),
                ("image", None, "image A"),
                ("image", None, "image A"),
            ],
            kwargs,
        )
        assert step_1 == step_1_again, "within a version, the key alone decides"
        assert step_1 != step_2, "a new version must never read the old one's embeddings"
        assert unkeyed_a == unkeyed_b and unkeyed_a not in (step_1, step_2), "unkeyed: the content's hash"


def test_responses_parts_keep_their_key_and_anthropic_blocks_lose_it(vllm_parser: VllmParser) -> None:
    """What the EPD proxy keys: a Responses input_image keeps the uuid it writes (so the proxy keys
    it); vLLM makes parts of its own of Anthropic image blocks, without any uuid (so the proxy
    cannot key them, and refuses them under a weights version: proxy/keys.py UNKEYED_ROUTES)."""
    found = vllm_parser.route_uuids(
        {
            "model": "m",
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "https://i.test/a.png", "uuid": "epd-1"}],
                }
            ],
        },
        {
            "model": "m",
            "max_tokens": 1,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "url", "url": "https://i.test/a.png"}, "uuid": "epd-1"}
                    ],
                }
            ],
        },
    )
    assert found == {"responses": ["epd-1"], "anthropic": [None]}
