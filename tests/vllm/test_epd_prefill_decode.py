"""Encoder + prefill + decode on CPU, through the real vllm-router's prefill/decode mode.

The unit is rendered from a real EPDDeployment (no cluster needed) and run by unit_runner.py:
the encoder writes embeddings to the EC store, the prefill engine reads them and computes the
prompt's KV cache, the decode engine gets that KV cache and generates. vllm-router
(`--vllm-pd-disaggregation`, as rendered) sends each request to prefill (one token), then to
decode.

The KV connector is the only substitution, made with the group overrides the API offers
(`epd_dev.vllm.serving.prefill_decode_groups` says which and why).
"""

from __future__ import annotations

import shutil
import struct
import uuid
from pathlib import Path

import pytest

from epd_client import Endpoints, EPDClient, prime_encoder
from epd_dev.vllm import payloads, tiny_model
from epd_dev.vllm.payloads import image_part, messages
from epd_dev.vllm.serving import prefill_decode_groups, tiny_manifest
from epd_dev.vllm.unit_runner import UnitRunner
from tests.vllm.conftest import start_unit

pytestmark = pytest.mark.vllm

MODEL = "default"
# Long enough for two 32-token KV blocks that cover the image's 16 placeholder tokens.
TEXT = (
    "describe this picture in many words: colours, shapes, the ground, numbers "
    "1 2 3 4 5 6 7 8 9 10 42 and the quick brown fox"
)
KV_FILE_SUFFIX = ".safetensors"


@pytest.fixture(scope="module")
def kv_store():
    path = Path(f"/dev/shm/epd-test-kv-{uuid.uuid4().hex[:12]}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def unit(tiny_model_dir, kv_store, tmp_path_factory):
    manifest = tiny_manifest("tiny-epd-pd", tiny_model_dir, prefill_decode_groups(kv_store))
    runner = UnitRunner.from_manifest(manifest, tmp_path_factory.mktemp("pd-logs"), uid=str(uuid.uuid4()))
    with start_unit(runner, "encoder + prefill + decode + PD router (rendered)"):
        yield runner


@pytest.fixture(scope="module")
def endpoints(unit) -> Endpoints:
    return Endpoints.from_urls(
        [unit.sidecars[0].url], unit.router.url, model_name=MODEL, served_model_name=tiny_model.SERVED_NAME
    )


def reference(aggregated, msgs: list[dict]) -> tuple[list[int], list[float]]:
    rendered = aggregated.post("/v1/chat/completions/render", payloads.greedy(msgs))
    return payloads.output(aggregated.post("/inference/v1/generate", rendered))


def kv_entries(store: Path) -> set[str]:
    return {d.name for d in store.iterdir()} if store.is_dir() else set()


def test_the_rendered_unit_has_a_pd_router_in_front_of_prefill_and_decode(unit):
    assert [e.name for e in unit.engines] == ["encoder-0", "prefill-0", "decode-0", "router"]
    prefill, decode = unit.consumers
    argv = unit.router.argv
    assert argv[argv.index("--prefill") + 1] == prefill.url
    assert argv[argv.index("--decode") + 1] == decode.url
    assert "--vllm-pd-disaggregation" in argv
    assert "ec_consumer" in " ".join(prefill.argv) and "--ec-transfer-config" not in decode.argv


async def test_prime_render_generate_through_the_pd_router_equals_aggregated(unit, endpoints, kv_store, aggregated):
    prefill, decode = unit.consumers
    msgs = messages(image_part((10, 30, 230)), text=TEXT)
    before = {e.name: payloads.served_requests(e.url) for e in (prefill, decode)}
    kv_before = kv_entries(kv_store)

    async with EPDClient(endpoints) as client:
        result = await client.generate(payloads.greedy(msgs), model_name=MODEL)

    tokens, logprobs = payloads.output(result)
    ref_tokens, ref_logprobs = reference(aggregated, msgs)
    assert tokens == ref_tokens and logprobs == pytest.approx(ref_logprobs, abs=1e-3)
    for engine in (prefill, decode):  # the router ran both stages
        after = payloads.served_requests(engine.url).get("/inference/v1/generate", 0)
        assert after == before[engine.name].get("/inference/v1/generate", 0) + 1, engine.name
    (entry,) = kv_entries(kv_store) - kv_before  # the prefill's KV blocks of this prompt
    layers = list((kv_store / entry).iterdir())
    assert layers and all(f.name.endswith(KV_FILE_SUFFIX) and f.stat().st_size > 1024 for f in layers)


async def test_decode_continues_from_the_prefills_kv_cache(unit, endpoints, kv_store, aggregated):
    """Proof the KV cache crosses over: zeroing the prefill's KV blocks before decode runs
    changes the decode's output; left alone (previous test), it equals the aggregated one."""
    prefill, decode = unit.consumers
    msgs = messages(image_part((200, 200, 30)), text=TEXT)
    await prime_encoder(endpoints, msgs, model_name=MODEL)
    rendered = unit.router.post("/v1/chat/completions/render", payloads.greedy(msgs))
    kv_before = kv_entries(kv_store)
    # The router's first stage by hand: prefill computes the prompt and stores its KV blocks.
    prefill.post(
        "/inference/v1/generate", {**rendered, "sampling_params": {**rendered["sampling_params"], "max_tokens": 1}}
    )
    (entry,) = kv_entries(kv_store) - kv_before
    for layer in (kv_store / entry).iterdir():
        _zero_tensor_data(layer)

    corrupted = payloads.output(decode.post("/inference/v1/generate", rendered))

    assert corrupted[0] != reference(aggregated, msgs)[0]


def _zero_tensor_data(path: Path) -> None:
    """Zero a safetensors file's tensor bytes, keeping its header (8-byte length + JSON)."""
    data = bytearray(path.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]
    data[start:] = bytes(len(data) - start)
    path.write_bytes(data)
