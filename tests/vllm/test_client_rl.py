"""epd_client in an RL loop, on real vLLM.

One unit rendered from a real EPDDeployment (no cluster needed): one encoder and one regular
engine, with spec.serverDevMode (the operator renders VLLM_SERVER_DEV_MODE=1; vLLM serves /pause and
/resume only then). Its endpoints are built here as discover gives them, engine list included;
the reference output is conftest's `aggregated` engine.

- a Vime rollout runs against vime_rollout_args(endpoints) as Vime's default generate does;
- pause/resume reach every engine, the encoder included, and really hold generation;
- after a weight update (simulated: X's embedding in the EC store replaced by Y's), the old
  weights version serves the stale embedding, a new one does not.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.request
import uuid
from pathlib import Path

import httpx
import pytest

from epd_client import Endpoints, Engine, EPDClient, ModelEndpoints, Unit, prime_encoder, vime_rollout_args
from epd_dev.vllm import payloads, tiny_model
from epd_dev.vllm.payloads import EMBEDDING_FILE, image_part, messages
from epd_dev.vllm.serving import tiny_manifest
from epd_dev.vllm.unit_runner import UnitRunner
from tests.vllm.conftest import start_unit

pytestmark = pytest.mark.vllm

MODEL = "default"
# Greedy outputs of these two differ on the tiny model (test_epd_unit's swap test).
X, Y = (250, 250, 20), (120, 20, 120)


@pytest.fixture(scope="module")
def unit(tiny_model_dir, tmp_path_factory):
    manifest = tiny_manifest(
        "tiny-rl",
        tiny_model_dir,
        [{"workerType": "encoder", "numGpus": 1}, {"workerType": "regular", "numGpus": 1}],
        serverDevMode=True,
    )
    runner = UnitRunner.from_manifest(manifest, tmp_path_factory.mktemp("rl-logs"), uid=str(uuid.uuid4()))
    with start_unit(runner, "encoder + regular, dev mode (rendered)"):
        yield runner


@pytest.fixture(scope="module")
def endpoints(unit) -> Endpoints:
    """The unit's endpoints as discover gives them (engines listed)."""
    assert unit.router is None  # one consumer: render and generate go to it directly
    engines = [*unit.sidecars, *unit.consumers]
    found = Unit(
        name=unit.name,
        encoder_urls=tuple(e.url for e in unit.sidecars),
        consumer_urls=tuple(e.url for e in unit.consumers),
        engines=tuple(Engine(unit.name, e.name, e.name.rsplit("-", 1)[0], e.url) for e in engines),
    )
    return Endpoints((ModelEndpoints(MODEL, (found,), tiny_model.SERVED_NAME),))


def reference(aggregated, msgs: list[dict]) -> tuple[list[int], list[float]]:
    rendered = aggregated.post("/v1/chat/completions/render", payloads.greedy(msgs))
    return payloads.output(aggregated.post("/inference/v1/generate", rendered))


def assert_same(output: tuple[list[int], list[float]], ref: tuple[list[int], list[float]]) -> None:
    assert output[0] == ref[0]
    assert output[1] == pytest.approx(ref[1], abs=1e-3)


async def render_and_generate(base_url: str, msgs: list[dict]) -> tuple[list[int], list[float]]:
    """What a Vime rollout does after priming, with the messages exactly as primed."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        rendered = await http.post("/v1/chat/completions/render", json=payloads.greedy(msgs))
        rendered.raise_for_status()
        generated = await http.post("/inference/v1/generate", json=rendered.json())
        generated.raise_for_status()
    return payloads.output(generated.json())


def primes_served(unit) -> int:
    (encoder,) = unit.sidecars
    return payloads.served_requests(encoder.url).get("/v1/chat/completions", 0)


def is_paused(url: str) -> bool:
    with urllib.request.urlopen(url + "/is_paused", timeout=10) as resp:
        return json.loads(resp.read())["is_paused"]


async def test_a_vime_rollout_runs_unchanged_against_vime_args(unit, endpoints, aggregated):
    """Vime's default multimodal generate: prime_encoder(args, messages) with no model name,
    then render and generate at the model's router address from vllm_model_routers."""
    args = vime_rollout_args(endpoints)
    assert args.vllm_model_encoder_endpoints == {MODEL: (tiny_model.SERVED_NAME, [e.url for e in unit.sidecars])}
    ip, port = args.vllm_model_routers[MODEL]
    assert (args.vllm_router_ip, args.vllm_router_port) == (ip, port)
    msgs = messages(image_part((10, 200, 200)), image_part((200, 100, 0)), text="two pictures")
    before = primes_served(unit)

    await prime_encoder(args, msgs)
    output = await render_and_generate(f"http://{ip}:{port}", msgs)

    assert primes_served(unit) - before == 2  # both images primed, no model name needed
    assert_same(output, reference(aggregated, msgs))


async def test_pause_and_resume_hold_every_engine(unit, endpoints):
    engines = [*unit.sidecars, *unit.consumers]
    async with EPDClient(endpoints) as client:
        assert [e.name for e in client.engines(MODEL)] == ["encoder-0", "regular-0"]
        await client.pause(MODEL)
        assert all(is_paused(e.url) for e in engines)
        text_only = payloads.greedy([{"role": "user", "content": "no picture here"}])
        held = asyncio.create_task(client.generate(text_only))
        await asyncio.sleep(2.0)
        assert not held.done(), "a paused engine generated"

        await client.resume(MODEL)
        assert not any(is_paused(e.url) for e in engines)
        assert len(payloads.output(await asyncio.wait_for(held, 60))[0]) == 6


async def test_a_new_weights_version_never_reads_old_embeddings(unit, endpoints, aggregated):
    store = Path(unit.ec_storage_path)
    (consumer,) = unit.consumers
    ref_x, ref_y = reference(aggregated, messages(image_part(X))), reference(aggregated, messages(image_part(Y)))
    assert ref_x[0] != ref_y[0]

    async with EPDClient(endpoints, weights_version="step-1") as client:
        # Step 1: X is generated (its embedding now cached by the consumer too), Y primed.
        assert_same(payloads.output(await client.generate(payloads.greedy(messages(image_part(X))))), ref_x)
        x_step1, y_step1 = messages(image_part(X)), messages(image_part(Y))
        await prime_encoder(client, x_step1)
        await prime_encoder(client, y_step1)
        key_x1, key_y1 = x_step1[0]["content"][0]["uuid"], y_step1[0]["content"][0]["uuid"]
        # vLLM keys the EC store by the part's uuid, verbatim.
        entries = payloads.ec_entries(store)
        assert entries[key_x1] == entries[key_y1] == [EMBEDDING_FILE]

        # The weight update: pause (which empties every engine's caches), new weights,
        # resume. The new weights are simulated by giving X's entry other bytes of the same
        # shape: Y's embedding, as if the encoder's weights had changed.
        await client.pause(MODEL)
        stale = store / key_x1 / EMBEDDING_FILE
        tmp = stale.with_name(f".swap-{uuid.uuid4().hex}")
        shutil.copyfile(store / key_y1 / EMBEDDING_FILE, tmp)
        tmp.replace(stale)  # atomic: a reader never sees half a file
        await client.resume(MODEL)

        # The old version's key: the encoder finds the entry and does not encode again, the
        # consumer reads it: X is answered with the other embedding.
        x_again = messages(image_part(X))
        await prime_encoder(client, x_again)
        assert x_again[0]["content"][0]["uuid"] == key_x1
        old = await render_and_generate(consumer.url, x_again)
        assert old[0] == ref_y[0] != ref_x[0]
        assert stale.read_bytes() == (store / key_y1 / EMBEDDING_FILE).read_bytes()

        # The next version: a new key, encoded afresh, equal to the aggregated engine.
        client.weights_version = "step-2"
        x_step2 = messages(image_part(X))
        await prime_encoder(client, x_step2)
        key_x2 = x_step2[0]["content"][0]["uuid"]
        assert key_x2 != key_x1 and payloads.ec_entries(store)[key_x2] == [EMBEDDING_FILE]
        assert_same(await render_and_generate(consumer.url, x_step2), ref_x)
        # EPDClient.generate keys its own copy of the request alike.
        assert_same(payloads.output(await client.generate(payloads.greedy(messages(image_part(X))))), ref_x)
