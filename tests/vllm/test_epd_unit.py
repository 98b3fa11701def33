"""Real EPD on CPU, end to end: the operator's unit pod, run with real vLLM and vllm-router.

An EPDDeployment (the tiny LLaVA model, one encoder and two regular engines, so the unit gets
the real vllm-router) is applied to the real control plane; the operator creates the
StatefulSet and kwok "runs" its pod; unit_runner.py then runs that pod's containers here as
the kubelet would. The client is epd_client with the endpoints of the EPDDeployment's status
(pod IP mapped to 127.0.0.1): prime -> /v1/chat/completions/render -> /inference/v1/generate,
as the seed's rollout does.

The engines start once for the module (the two consumers load together); the reference
output is conftest's `aggregated` engine.

The last tests are an ordinary client's: the official openai SDK through the EPD proxy
(`epd-operator proxy`) in front of the unit's router, knowing nothing of encoders.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
import uuid
from pathlib import Path

import openai
import pytest
import yaml

from epd_client import Endpoints, EPDClient, prime_encoder
from epd_dev.operator_process import get_json, wait_for
from epd_dev.proxy_process import ProxyProcess
from epd_dev.vllm import payloads, tiny_model
from epd_dev.vllm.payloads import EMBEDDING_FILE, image_part, messages
from epd_dev.vllm.serving import discover_ready, localized, tiny_manifest
from epd_dev.vllm.unit_runner import UnitRunner
from tests.vllm.conftest import start_unit

pytestmark = [pytest.mark.vllm, pytest.mark.cluster]

NAME = "tiny-epd"
MODEL = "default"


@dataclasses.dataclass
class RunningUnit:
    runner: UnitRunner
    endpoints: Endpoints  # from the operator's status, reachable here
    store: Path  # the model's EC store, as the status names it

    @property
    def encoder_url(self) -> str:
        (url,) = self.endpoints.model(MODEL).units[0].encoder_urls
        return url

    @property
    def entry_url(self) -> str:
        return self.endpoints.model(MODEL).units[0].entry_url

    def post(self, path: str, body: dict) -> dict:
        """Through the unit's router, as the client's render and generate go."""
        return self.runner.router.post(path, body)


@pytest.fixture(scope="module")
def vllm_namespace(cluster):
    """A namespace for the module (the `namespace` fixture is per test; engines are not)."""
    name = f"vllm-e2e-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    wait_for(
        lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
        60,
        f"the default ServiceAccount of {name}",
    )
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def unit(cluster, vllm_namespace, epd_operator, tiny_model_dir, tmp_path_factory):
    manifest = tiny_manifest(
        NAME,
        tiny_model_dir,
        [
            {"workerType": "encoder", "numGpus": 1},
            {"workerType": "regular", "numGpus": 2},
        ],
    )
    cluster.kubectl("apply", "-n", vllm_namespace, "-f", "-", input=yaml.safe_dump(manifest))

    def ready_status():
        obj = get_json(cluster, "epd", NAME, "-n", vllm_namespace)
        return obj["status"] if obj and obj.get("status", {}).get("phase") == "Ready" else None

    status = wait_for(ready_status, 120, f"epd/{NAME} to become Ready", lambda: epd_operator.tail(40))
    endpoints = discover_ready(cluster.kubeconfig, NAME, vllm_namespace)
    (found,) = endpoints.model(MODEL).units
    pod = get_json(cluster, "pod", found.name, "-n", vllm_namespace)
    runner = UnitRunner(pod, tmp_path_factory.mktemp("unit-logs"))
    with start_unit(runner, "encoder + 2 regular + router (operator's pod)"):
        yield RunningUnit(runner, localized(endpoints, runner, MODEL), Path(status["models"][0]["ecStoragePath"]))


def test_the_operators_pod_runs_as_one_unit(unit):
    runner = unit.runner
    assert [e.name for e in runner.sidecars] == ["encoder-0"]
    assert [e.name for e in runner.consumers] == ["regular-0", "regular-1"]
    # The router fronts the consumers only; the status points clients at it.
    router_args = runner.router.argv
    assert [a for a in router_args if a.startswith("http://")] == [e.url for e in runner.consumers]
    assert unit.entry_url == runner.router.url
    assert unit.encoder_url == runner.sidecars[0].url
    assert unit.store == Path(runner.ec_storage_path) and unit.store.name.startswith("vime-ec-")


async def test_prime_then_generate_through_the_router(unit, vllm_timings):
    red, green = image_part((200, 30, 30)), image_part((30, 160, 40))
    msgs = messages(red, green, red)  # two distinct images, one of them twice
    before = {
        name: payloads.served_requests(e.url)
        for name, e in [("encoder", unit.runner.sidecars[0]), *((e.name, e) for e in unit.runner.consumers)]
    }

    start = time.monotonic()
    await prime_encoder(unit.endpoints, msgs, model_name=MODEL)
    vllm_timings["prime 3 images (2 distinct)"] = time.monotonic() - start
    rendered = unit.post("/v1/chat/completions/render", payloads.greedy(msgs))
    hashes = payloads.image_hashes(rendered)
    assert len(hashes) == 3 and hashes[0] == hashes[2] != hashes[1]
    # One <mm_hash> entry per distinct image, named by the hash the consumer computes itself.
    assert payloads.ec_entries(unit.store) == {h: [EMBEDDING_FILE] for h in hashes}

    start = time.monotonic()
    async with EPDClient(unit.endpoints) as client:
        result = await client.generate(payloads.greedy(msgs, max_tokens=8), model_name=MODEL)
    vllm_timings["EPDClient.generate (prime, render, 8 tokens)"] = time.monotonic() - start
    tokens, logprobs = payloads.output(result)
    assert len(tokens) == 8 and len(logprobs) == 8

    after = {
        name: payloads.served_requests(e.url)
        for name, e in [("encoder", unit.runner.sidecars[0]), *((e.name, e) for e in unit.runner.consumers)]
    }
    primed = after["encoder"].get("/v1/chat/completions", 0) - before["encoder"].get("/v1/chat/completions", 0)
    assert primed == 6  # one image-only request per image part, for each of the two calls
    assert set(after["encoder"]) == {"/v1/chat/completions"}  # never rendered or generated on
    generated = sum(
        after[c].get("/inference/v1/generate", 0) - before[c].get("/inference/v1/generate", 0)
        for c in ("regular-0", "regular-1")
    )
    assert generated == 1  # the router sent generate to a consumer


async def test_consumer_reads_the_primed_embeddings(unit):
    """Swap proof: Y's embedding file replaced by X's makes Y generate exactly as X."""
    x, y, z = (image_part(rgb) for rgb in ((250, 250, 20), (20, 20, 250), (120, 20, 120)))
    rendered = {}
    for name, part in (("x", x), ("y", y), ("z", z)):
        await prime_encoder(unit.endpoints, messages(part), model_name=MODEL)
        rendered[name] = unit.post("/v1/chat/completions/render", payloads.greedy(messages(part)))
    files = {n: unit.store / payloads.image_hashes(r)[0] / EMBEDDING_FILE for n, r in rendered.items()}
    assert all(f.is_file() for f in files.values()), files

    # Atomic replace, so a consumer can never read half a file.
    tmp = files["y"].with_name(f".swap-{uuid.uuid4().hex}")
    shutil.copyfile(files["x"], tmp)
    tmp.replace(files["y"])

    # Y is generated for the first time here: no consumer has its embedding cached.
    out = {name: payloads.output(unit.post("/inference/v1/generate", r)) for name, r in rendered.items()}
    assert out["y"] == out["x"], "the consumer did not read Y's embeddings from the EC store"
    assert out["z"] != out["x"], "different images must give different outputs"


async def test_epd_output_equals_an_aggregated_engine(unit, aggregated):
    msgs = messages(image_part((10, 200, 200)), image_part((200, 100, 0)), text="two pictures")
    async with EPDClient(unit.endpoints) as client:
        epd_tokens, epd_logprobs = payloads.output(
            await client.generate(payloads.greedy(msgs, max_tokens=8), model_name=MODEL)
        )
    reference = aggregated.post(
        "/inference/v1/generate", aggregated.post("/v1/chat/completions/render", payloads.greedy(msgs, max_tokens=8))
    )
    ref_tokens, ref_logprobs = payloads.output(reference)
    assert epd_tokens == ref_tokens
    assert epd_logprobs == pytest.approx(ref_logprobs, abs=1e-3)


async def test_text_only_requests_bypass_the_encoder(unit):
    encoder_before = payloads.served_requests(unit.encoder_url)
    store_before = payloads.ec_entries(unit.store)
    async with EPDClient(unit.endpoints) as client:
        result = await client.generate(
            payloads.greedy([{"role": "user", "content": "no picture here"}]), model_name=MODEL
        )
    assert len(payloads.output(result)[0]) == 6
    assert payloads.served_requests(unit.encoder_url) == encoder_before
    assert payloads.ec_entries(unit.store) == store_before


def test_cache_miss_is_encoded_by_the_consumer_leaving_an_empty_folder(unit, aggregated):
    """Documents vLLM 0.32: an image nobody primed is not an error. The consumer encodes it
    itself (same output as the aggregated engine) and its existence check leaves an EMPTY
    <mm_hash> folder behind (fixed in 0.33). This is why epd_client never skips priming."""
    msgs = messages(image_part((77, 77, 177)))
    encoder_before = payloads.served_requests(unit.encoder_url)
    rendered = unit.post("/v1/chat/completions/render", payloads.greedy(msgs))
    (mm_hash,) = payloads.image_hashes(rendered)
    assert mm_hash not in payloads.ec_entries(unit.store)

    out = payloads.output(unit.post("/inference/v1/generate", rendered))

    assert payloads.ec_entries(unit.store)[mm_hash] == []
    assert payloads.served_requests(unit.encoder_url) == encoder_before
    reference = aggregated.post(
        "/inference/v1/generate", aggregated.post("/v1/chat/completions/render", payloads.greedy(msgs))
    )
    assert out[0] == payloads.output(reference)[0]


# --------------------------------------------------------------------------- through the EPD proxy


@pytest.fixture(scope="module")
def front(unit, tmp_path_factory):
    """The URL an ordinary client calls: the EPD proxy in front of the unit's router, priming on
    the unit's encoder, run as the unit's proxy container runs it. Once the operator puts the
    proxy into the pod, this fixture returns the front Service's URL instead; the tests stay."""
    with ProxyProcess(unit.entry_url, [unit.encoder_url], tmp_path_factory.mktemp("proxy-logs")) as proxy:
        yield proxy.url


@dataclasses.dataclass
class EncoderLoad:
    """What the encoder served between two looks: finished requests, chat requests, EC entries."""

    finished: int
    chats: int
    entries: dict[str, list[str]]

    @classmethod
    def of(cls, unit: RunningUnit) -> EncoderLoad:
        served = payloads.served_requests(unit.encoder_url)
        return cls(
            payloads.finished_requests(unit.encoder_url),
            served.get("/v1/chat/completions", 0),
            payloads.ec_entries(unit.store),
        )


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat_request(msgs: list[dict], **extra: object) -> dict:
    """Greedy and of fixed length, with token ids and logprobs (vLLM's extras through extra_body)."""
    return {
        "model": tiny_model.SERVED_NAME,
        "messages": msgs,
        "max_tokens": 8,
        "temperature": 0,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
        **extra,
    }


def new_entries(before: EncoderLoad, after: EncoderLoad) -> dict[str, list[str]]:
    return {h: files for h, files in after.entries.items() if h not in before.entries}


def test_an_openai_client_through_the_proxy_gets_the_aggregated_answer(unit, front, aggregated, vllm_timings):
    msgs = messages(image_part((40, 90, 220)), image_part((220, 90, 40)), text="two colours")
    before = EncoderLoad.of(unit)
    start = time.monotonic()
    answer = sdk(front).chat.completions.create(**chat_request(msgs, logprobs=True))
    vllm_timings["openai SDK through the proxy (prime 2 images, 8 tokens)"] = time.monotonic() - start
    after = EncoderLoad.of(unit)
    reference = sdk(aggregated.url).chat.completions.create(**chat_request(msgs, logprobs=True))

    (choice,), (expected,) = answer.choices, reference.choices
    assert choice.token_ids == expected.token_ids and len(choice.token_ids) == 8
    assert choice.message.content == expected.message.content
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(
        [t.logprob for t in expected.logprobs.content], abs=1e-3
    )
    # The encoder ran exactly one prime per image, and the consumer read what it wrote: a miss
    # would have left an empty <mm_hash> folder instead of the embedding file.
    assert (after.finished - before.finished, after.chats - before.chats) == (2, 2)
    assert new_entries(before, after) and all(f == [EMBEDDING_FILE] for f in new_entries(before, after).values())
    assert len(new_entries(before, after)) == 2


def test_a_stream_through_the_proxy_gives_the_same_tokens(unit, front):
    msgs = messages(image_part((130, 200, 60)), text="one colour")
    before = EncoderLoad.of(unit)
    whole = sdk(front).chat.completions.create(**chat_request(msgs))
    middle = EncoderLoad.of(unit)
    stream = sdk(front).chat.completions.create(**chat_request(msgs), stream=True)
    chunks = [c for c in stream if c.choices]
    after = EncoderLoad.of(unit)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert [t for c in chunks for t in (getattr(c.choices[0], "token_ids", None) or [])] == whole.choices[0].token_ids
    assert len(chunks) > 2  # streamed, not one answer
    # Primed for each request (a stream too), one embedding in the store for the one image.
    assert (middle.finished - before.finished, after.finished - middle.finished) == (1, 1)
    assert len(new_entries(before, after)) == 1


def test_responses_input_images_are_primed_through_the_proxy(unit, front, aggregated):
    part = {"type": "input_image", "image_url": payloads.png_data_url((240, 240, 240)), "detail": "auto"}
    request = {
        "model": tiny_model.SERVED_NAME,
        "input": [{"role": "user", "content": [part, {"type": "input_text", "text": "describe"}]}],
        "max_output_tokens": 8,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    before = EncoderLoad.of(unit)
    answer = sdk(front).responses.create(**request)
    after = EncoderLoad.of(unit)
    assert answer.output_text == sdk(aggregated.url).responses.create(**request).output_text
    assert after.finished - before.finished == 1
    assert [f for f in new_entries(before, after).values()] == [[EMBEDDING_FILE]]


def test_text_only_through_the_proxy_never_reaches_the_encoder(unit, front, aggregated):
    before = EncoderLoad.of(unit)
    request = chat_request([{"role": "user", "content": "no picture here"}])
    answer = sdk(front).chat.completions.create(**request)
    assert answer.choices[0].token_ids == sdk(aggregated.url).chat.completions.create(**request).choices[0].token_ids
    assert [m.id for m in sdk(front).models.list()] == [tiny_model.SERVED_NAME]  # passed through
    assert EncoderLoad.of(unit) == before
