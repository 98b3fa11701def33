"""What a media part is, held to vLLM 0.32 and 0.33's own chat parsing: for a corpus of requests
of every primed route (typed and untyped parts, every media key vLLM reads, uuids, every role and
the shapes each route converts), the items vLLM would load and hand its multimodal processor are
exactly the items the EPD proxy primes, and each prime request is read by vLLM as that same item,
under the same hash factors; a part vLLM would read as media that no prime can stand for is
refused, and nothing else is primed.

vLLM runs in its parser venvs (parse_with_vllm.py, op ``media``): its request models validate
each body, its route code converts it (Responses, Anthropic, Cohere, batch), its chat parser reads
the messages; only the loading of the media is replaced by a recorder."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

from epd_client import is_key, key_of, prime_body
from epd_dataplane import core, keys
from epd_dev.vllm.cli_parser import VllmParser

URL = "https://media.test/a.png"
OTHER = "https://media.test/b.mp4"
DATA = "data:image/png;base64,iVBORw0KGgo="
# Loaded as media: by type, and (without a type, or with a uuid) by key, in vLLM's key order.
URL_KEYS = ("image_url", "audio_url", "video_url")
ALL_KEYS = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
    "tool_reference",
    "input_image",
    "file",
    "input_file",
)
ENCODED = {"image", "audio", "video"}
EMBEDS = {"image_embeds", "audio_embeds", "video_embeds"}


def values(key: str) -> list[Any]:
    """The values a part may give ``key``: well formed, in the other spelling, empty, odd."""
    if key in URL_KEYS:
        return [{"url": URL}, URL, {"url": DATA}, {"url": ""}, None, {"url": 7}, {"detail": "low"}]
    if key == "input_audio":
        return [{"data": "UklGRg==", "format": "wav"}, {"data": "UklGRg=="}, {"data": "", "format": "wav"}, "x", None]
    if key == "input_image":
        return [URL, None]
    if key in ("image_embeds", "audio_embeds", "video_embeds", "prompt_embeds"):
        return ["AAAA", None]
    if key == "tool_reference":
        return ["search"]
    return [{"file_data": "AAAA", "filename": "a.pdf"}, None]


def part_shapes() -> list[dict[str, Any]]:
    """Every media key with each of its values: typed, untyped, with a uuid; typed parts that
    hold another media key too; types vLLM does not know."""
    shapes: list[dict[str, Any]] = []
    for key in ALL_KEYS:
        field = "image_url" if key == "input_image" else key
        for value in values(key):
            body = {} if value is None and key != "input_image" else {field: value}
            if key == "input_image":
                body = {"image_url": value} if value else {"file_id": "file-1"}
                body["detail"] = "auto"
            shapes += [{"type": key, **body}, {**body}, {"type": key, **body, "uuid": "u-1"}, {**body, "uuid": "u-1"}]
    shapes.append({"type": "input_image", "image_url": URL})  # without the detail chat parsing requires
    for first, second in itertools.permutations(["image_url", "video_url", "audio_url", "image_embeds"], 2):
        typed = {"type": first, first: {"url": URL} if first in URL_KEYS else "AAAA", second: {"url": OTHER}}
        shapes += [typed, {**typed, "uuid": "u-2"}]
    shapes += [
        {"type": "text", "text": "hi", "uuid": "u-3", "image_url": {"url": URL}},
        {"type": "text", "text": "hi", "image_url": {"url": URL}},
        {"type": "bogus", "image_url": {"url": URL}},
        {"type": "bogus", "image_url": {"url": URL}, "uuid": "u-4"},
        {"type": 7, "image_url": {"url": URL}},
        {"uuid": "u-5"},
        {"type": "image_url", "image_url": {"url": URL, "detail": "high"}, "uuid": None},
    ]
    return shapes


def chat(*content: Any, role: str = "user", **fields: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"role": role, "content": list(content)}
    if role == "tool":
        message["tool_call_id"] = "call-1"
    return {"model": "m", "messages": [message], **fields}


def chat_requests() -> list[tuple[str, dict[str, Any]]]:
    requests = [
        ("chat_completions", chat({"type": "text", "text": "look"}, shape, role=role))
        for shape in part_shapes()
        for role in ("user", "system", "assistant", "tool", "developer")
    ]
    image, video = {"type": "image_url", "image_url": {"url": URL}}, {"type": "video_url", "video_url": {"url": OTHER}}
    requests += [
        ("chat_completions", chat(image, {"image_url": DATA}, video, {"type": "text", "text": "and?"})),
        ("chat_completions", {"model": "m", "messages": [{"role": "user", "content": "only text"}]}),
        ("chat_completions", chat(video, mm_processor_kwargs={"use_audio_in_video": True})),
        ("chat_completions", chat(image, mm_processor_kwargs={"max_pixels": 1024})),
        ("chat_completions", chat(image, media_io_kwargs={"image": {"image_mode": "L"}})),
        ("chat_completions_batch", {"model": "m", "messages": [chat(image)["messages"], chat(video)["messages"]]}),
        (
            "chat_completions_batch",
            {"messages": [chat({"image_url": URL})["messages"]], "mm_processor_kwargs": {"a": 1}},
        ),
        ("invocations", chat({"image_url": URL}, {"type": "text", "text": "x"})),
        ("invocations", {"model": "m", "prompt": "a completion"}),
    ]
    return requests


def responses_requests() -> list[tuple[str, dict[str, Any]]]:
    def responses(*items: Any, **fields: Any) -> tuple[str, dict[str, Any]]:
        return "responses", {"model": "m", "input": list(items), **fields}

    image = {"type": "input_image", "image_url": URL, "detail": "auto"}
    bare = {"type": "input_image", "image_url": URL}
    text = {"type": "input_text", "text": "what is it?"}
    return [
        responses({"role": "user", "content": [text, image]}),
        responses({"type": "message", "role": "user", "content": [text, bare]}),  # vLLM adds detail
        responses({"role": "user", "content": [{"type": "input_image", "file_id": "file-1", "detail": "auto"}]}),
        responses({"role": "system", "content": [image]}, {"role": "developer", "content": [bare]}),
        responses({"role": "assistant", "content": [{"type": "output_text", "text": "a"}, image]}),
        responses(
            {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [text, image]},
        ),
        responses({"type": "function_call_output", "call_id": "c2", "output": "plain text"}),
        responses({"role": "user", "content": [{"type": "input_file", "file_data": "AAAA", "filename": "a.pdf"}]}),
        responses({"role": "user", "content": [image]}, mm_processor_kwargs={"max_pixels": 1024}),
        ("responses", {"model": "m", "input": "text only", "instructions": "be brief"}),
        (
            "responses",
            {"model": "m", "input": [{"role": "user", "content": [text]}], "previous_input_messages": [chat(image)]},
        ),
    ]


def anthropic_requests() -> list[tuple[str, dict[str, Any]]]:
    def anthropic(*messages: Any) -> tuple[str, dict[str, Any]]:
        return "messages", {"model": "m", "max_tokens": 8, "messages": list(messages)}

    def image(source: dict[str, Any]) -> dict[str, Any]:
        return {"type": "image", "source": source}

    url = image({"type": "url", "url": URL})
    return [
        anthropic({"role": "user", "content": [{"type": "text", "text": "x"}, url]}),
        anthropic({"role": "user", "content": [image({"type": "base64", "media_type": "image/png", "data": "AAAA"})]}),
        anthropic({"role": "user", "content": [image({"type": "base64", "data": "BBBB"})]}),  # vLLM's default type
        anthropic(
            {"role": "user", "content": "look"},
            {"role": "assistant", "content": [{"type": "text", "text": "ok"}, url]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "seen"}, url, image({"type": "url", "url": ""})],
                    }
                ],
            },
        ),
        anthropic(
            {"role": "system", "content": [{"type": "text", "text": "be brief"}]}, {"role": "user", "content": "hi"}
        ),
    ]


def cohere_requests() -> list[tuple[str, dict[str, Any]]]:
    def cohere(*messages: Any) -> tuple[str, dict[str, Any]]:
        return "cohere_chat", {"model": "m", "messages": list(messages)}

    image = {"type": "image_url", "image_url": {"url": URL}}
    return [
        cohere({"role": "user", "content": [{"type": "text", "text": "x"}, image]}),
        cohere({"role": "user", "content": [{"type": "image_url", "image_url": {"url": URL, "detail": "low"}}]}),
        cohere({"role": "user", "content": [{**image, "uuid": "u-1"}]}),
        cohere({"role": "user", "content": [{"image_url": {"url": URL}}]}),
        cohere({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}),
    ]


REQUESTS = chat_requests() + responses_requests() + anthropic_requests() + cohere_requests()


@dataclass(frozen=True)
class Outcome:
    """What the proxy does with a request: the prime bodies it sends, or its refusal."""

    primes: list[dict[str, Any]]
    refused: core.BadRequest | None


def proxy_outcome(route: str, body: dict[str, Any]) -> Outcome:
    try:
        found = core.plan(route, json.dumps(body).encode())
    except core.BadRequest as refused:
        return Outcome([], refused)
    return Outcome([prime_body(p.item, found.model, found.prime_fields) for p in found.parts], None)


def loaded(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items vLLM loads and encodes: media with data (not embeddings, not references)."""
    return [item for item in items if item["modality"] in ENCODED and item["data"] and isinstance(item["data"], str)]


def unloadable(items: list[dict[str, Any]]) -> bool:
    """Whether vLLM's loader fails on an item (data that is no URL): it refuses the request then."""
    return any(item["modality"] in ENCODED and item["data"] and not isinstance(item["data"], str) for item in items)


def unprimeable(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items vLLM would take that no prime can stand for: references (no data, or a PIL image),
    and embeddings without data named by a uuid (whatever vLLM cached under it)."""
    return [
        i
        for i in items
        if i["modality"] == "image_pil"
        or (i["modality"] in ENCODED and not i["data"])
        or (i["modality"] in EMBEDS and not i["data"] and i["uuid"] is not None)
    ]


def test_the_proxy_primes_exactly_what_vllm_loads(vllm_parser: VllmParser):
    outcomes = [proxy_outcome(route, body) for route, body in REQUESTS]
    consumer = vllm_parser.media(REQUESTS)
    primes = [prime for outcome in outcomes for prime in outcome.primes]
    encoder = iter(vllm_parser.media([("chat_completions", prime) for prime in primes]))
    mismatches = []
    for (route, body), outcome, read in zip(REQUESTS, outcomes, consumer, strict=True):
        primed = [next(encoder) for _ in outcome.primes]
        problem = _disagreement(outcome, read, primed)
        if problem:
            mismatches.append(f"{route} {json.dumps(body)}\n    {problem}")
    assert not mismatches, (
        f"{len(mismatches)} request(s) where the proxy and vLLM {vllm_parser.version} disagree:\n"
        + ("\n".join(mismatches[:20]))
    )
    # The corpus holds each outcome: the check above has something to compare.
    refused = [r for r in consumer if not r["ok"]]
    assert refused and any(o.refused for o in outcomes) and len(primes) > 100


def _disagreement(outcome: Outcome, consumer: dict[str, Any], primed: list[dict[str, Any]]) -> str:
    """Why the proxy's outcome is wrong for what vLLM reads (empty: it is right)."""
    if not consumer["ok"]:
        return ""  # vLLM refuses the request itself: nothing is encoded, whatever the proxy did
    items = consumer["items"]
    if unloadable(items):
        return ""  # so does its loader
    if unprimeable(items):
        return (
            "" if outcome.refused else f"vLLM would take {unprimeable(items)}, which no prime stands for: not refused"
        )
    if outcome.refused:
        return f"refused ({outcome.refused}, {outcome.refused.param}) though vLLM loads {loaded(items)}"
    bad_primes = [p for p in primed if not p["ok"]]
    if bad_primes:
        return f"vLLM refuses a prime request: {bad_primes}"
    from_primes = [item for p in primed for item in p["items"]]
    if from_primes != loaded(items):
        return f"the primes give vLLM {from_primes}, the consumer loads {loaded(items)}"
    return ""


def forwarded(route: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """The body as the proxy forwards it (its parts keyed, no weights version), None if refused."""
    try:
        found = core.plan(route, json.dumps(body).encode())
        in_body = keys.in_body(found.body)
        keys.key_parts(
            route, [p.item for p in (*found.parts, *found.embeds) if id(p.item.part) in in_body], None, required=False
        )
    except core.BadRequest:
        return None
    return found.body


def test_every_item_vllm_names_by_a_uuid_is_named_by_its_content_once_forwarded(vllm_parser: VllmParser):
    """vLLM names an item by its uuid alone (its caches, the EC store): in what the proxy forwards,
    every item vLLM takes carries the proxy's key, or no uuid at all (routes whose uuids vLLM drops:
    it hashes the content), and no key names two different contents. The corpus gives many parts
    the same client uuid ("u-1"): vLLM reads them under it as sent."""
    sent = [(route, body) for route, body in REQUESTS if forwarded(route, body) is not None]
    as_sent = vllm_parser.media(sent)
    as_forwarded = vllm_parser.media([(route, forwarded(route, body)) for route, body in sent])
    named: dict[str, set[str]] = {}
    problems = []
    for (route, body), before, after in zip(sent, as_sent, as_forwarded, strict=True):
        if not after["ok"]:
            continue
        for item in after["items"]:
            if item["modality"] not in ENCODED | EMBEDS or not item["data"]:
                continue
            uuid = item["uuid"]
            if uuid is None and route in ("messages", "cohere_chat"):
                continue
            if not (isinstance(uuid, str) and is_key(key_of(uuid))):
                problems.append(f"{route} {json.dumps(body)}: vLLM names {item['modality']} by {uuid!r}")
            else:
                # A video's audio track (use_audio_in_video) is the same content: its uuid too.
                named.setdefault(uuid, set()).add(json.dumps(item["data"], sort_keys=True))
    assert not problems, "\n".join(problems[:20])
    assert {uuid: data for uuid, data in named.items() if len(data) > 1} == {}
    # Unkeyed, one client uuid does name several contents: what the proxy prevents.
    client = {}
    for before in as_sent:
        for item in before.get("items", ()) if before["ok"] else ():
            if item["uuid"] == "u-1" and item["data"]:
                client.setdefault(item["uuid"], set()).add(json.dumps(item["data"], sort_keys=True))
    assert len(client.get("u-1", ())) > 1
    assert len(named) > 10  # keys of many contents and kinds were checked
