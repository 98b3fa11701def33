"""An EPD unit of the tiny model on the real node: the kubelet runs the operator's pod with real vLLM in its
containers, and says when each container started and is ready; then the faults a node brings.

The operator runs in a pod too, installed by Helm (conftest). The module's unit (one encoder, two regular
consumers, so vllm-router in front of them; a small EC budget; the dev-mode endpoints an RL loop uses) starts
beside the session's aggregated reference; every test shares them. Rollout clients (epd_client) reach the
engines at the status's pod IPs; any OpenAI client (the official openai SDK) goes through the front Service to
the unit's EPD proxy, which primes its pictures on the encoder first. The EC store is read where the kubelet
keeps the pod's /dev/shm emptyDir on the host (the tests run as root). The faults come last, each leaving
the unit Ready again: the node's kubelet and containerd restarted, a drain the PodDisruptionBudget holds, the
encoder's and then a consumer's engine killed inside its container; the last test deletes the unit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import yaml

from epd_client import EPDClient, prime_encoder, vime_rollout_args
from epd_dev.demo_serving import containers, front_service, front_service_url, post
from epd_dev.images import recipes
from epd_dev.localcluster import node
from epd_dev.operator_process import wait_for
from epd_dev.vllm import payloads, tiny_model
from epd_dev.vllm.payloads import EMBEDDING_FILE, image_part, messages
from epd_dev.vllm.real_node import SHM, node_manifest
from epd_operator.ec.janitor import GRACE_SECONDS
from epd_operator.ec.quantity import parse_quantity
from epd_operator.resources import UNIT_UID
from tests.node.conftest import (
    RESTRICTED_CONTAINER,
    Deployed,
    chat_request,
    container_spec,
    deployed_ready,
    engine_core,
    get,
    host_shm,
    kubelet_view,
    pod_ready,
    reference_url,
    sdk,
    server_load,
    wait_ready,
)

pytestmark = [pytest.mark.node, pytest.mark.cluster, pytest.mark.vllm]

UNIT, MODEL = "tiny-unit", "default"
# One embedding of the tiny model on tmpfs: 4.1 KiB of data in two pages.
ENTRY_BYTES = 8192
# Eight embeddings: more than the module's tests before the janitor's own keep (a fresh entry is
# never evicted anyway), fewer than they and it prime.
BUDGET = 8 * ENTRY_BYTES
# Greedy outputs of these two differ on the tiny model.
X, Y = (250, 250, 20), (120, 20, 120)


@pytest.fixture(scope="module")
def deployed(cluster, helm_operator, node_namespace, tiny_model_claim, reference_applied):
    unit = node_manifest(
        UNIT,
        tiny_model_claim,
        [{"workerType": "encoder", "numGpus": 1}, {"workerType": "regular", "numGpus": 2}],
        ecStorage={"maxBytes": BUDGET},
        serverDevMode=True,
        # Priming gives up after 15 s (retries included): the frozen encoder's test waits that long.
        proxy={"primeTimeoutSeconds": 15},
    )
    cluster.kubectl("apply", "-n", node_namespace, "-f", "-", input=yaml.safe_dump(unit))
    yield deployed_ready(cluster, node_namespace, UNIT)
    cluster.kubectl("delete", "epd", UNIT, "-n", node_namespace, "--wait=false", check=False)


def unit_pod(cluster, namespace: str) -> dict:
    """The unit's pod (the first unit's, while the drain test scales to two)."""
    return dict(get(cluster, "pod", f"{UNIT}-{MODEL}-0", "-n", namespace))


def started_at(status: dict) -> dt.datetime:
    return dt.datetime.fromisoformat(status["state"]["running"]["startedAt"])


def exec_in(cluster, namespace: str, pod: str, container: str, *argv: str) -> str:
    return cluster.kubectl("exec", "-n", namespace, pod, "-c", container, "--", *argv, timeout=120).stdout


def front_endpoints(cluster, namespace: str) -> list[dict]:
    """The endpoints of the unit's front Service, from its EndpointSlices."""
    front = front_service(cluster, namespace, UNIT)["metadata"]["name"]
    slices = get(cluster, "endpointslices", "-n", namespace, "-l", f"kubernetes.io/service-name={front}")["items"]
    return [e for s in slices for e in s.get("endpoints") or []]


def ready_addresses(cluster, namespace: str) -> list[str]:
    return [a for e in front_endpoints(cluster, namespace) if e["conditions"].get("ready") for a in e["addresses"]]


def test_the_unit_is_ready_on_the_real_node_by_the_kubelets_word(cluster, deployed, helm_operator, node_namespace):
    nodes = {n["metadata"]["name"]: n for n in get(cluster, "nodes")["items"]}
    real = nodes[node.NAME]
    assert real["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert {c["type"]: c["status"] for c in real["status"]["conditions"]}["Ready"] == "True"
    assert set(nodes) == {node.NAME, *cluster.node_names}
    # The operator itself runs in a pod there, under its ServiceAccount.
    assert helm_operator["spec"]["nodeName"] == node.NAME
    assert helm_operator["spec"]["serviceAccountName"] == "epd-epd-operator"
    pod = unit_pod(cluster, node_namespace)
    assert pod["spec"]["nodeName"] == node.NAME and pod_ready(pod)
    assert {name: ready for name, (_, _, ready) in kubelet_view(pod).items()} == {
        "encoder-0": True,
        "regular-0": True,
        "regular-1": True,
        "router": True,
        "proxy": True,
        "janitor": True,
    }
    assert all(restarts == 0 for _, restarts, _ in kubelet_view(pod).values())
    assert ready_addresses(cluster, node_namespace) == [pod["status"]["podIP"]]


def test_the_encoder_passes_its_startup_probe_before_the_consumers_start_and_the_router_last(
    cluster, deployed, node_namespace
):
    pod = unit_pod(cluster, node_namespace)
    (encoder,) = pod["status"]["initContainerStatuses"]
    main = {s["name"]: s for s in pod["status"]["containerStatuses"]}
    assert encoder["started"]
    # Main containers start once the sidecar passed its startupProbe: vLLM takes many seconds to
    # load the model, so the gap is that long, not a moment. The kubelet then starts them in the
    # pod spec's order, the router after the consumers.
    consumers = [started_at(main[name]) for name in ("regular-0", "regular-1")]
    assert all((c - started_at(encoder)).total_seconds() >= 5 for c in consumers)
    assert started_at(main["router"]) >= max(consumers)
    # The router fronts the consumers only; the status points clients at it.
    (router,) = [c for c in pod["spec"]["containers"] if c["name"] == "router"]
    urls = [a for a in [*router.get("command", []), *router.get("args", [])] if a.startswith("http://")]
    unit = deployed.unit
    # Behind the EPD proxy (the front port, 8000) the router serves the pod's loopback only.
    assert len(urls) == 2 and unit.entry_url is not None and unit.entry_url.endswith(":8000")
    assert unit.router_url is None
    assert [u.rsplit(":", 1)[1] for u in urls] == [u.rsplit(":", 1)[1] for u in unit.consumer_urls]


def store(cluster, namespace: str, deployed: Deployed) -> Path:
    """The unit's EC store as the host sees it: inside the kubelet's folder of the pod's /dev/shm."""
    path = Path(deployed.ec_storage_path)
    return host_shm(unit_pod(cluster, namespace)) / path.relative_to("/dev/shm")


def encoder_url(deployed: Deployed) -> str:
    (url,) = deployed.unit.encoder_urls
    return url


def front_post(deployed: Deployed, path: str, body: dict) -> dict:
    """Through the unit's front door: the EPD proxy passes render and generate on to the router."""
    assert deployed.unit.entry_url is not None
    return post(deployed.unit.entry_url, path, body)


async def test_prime_then_generate_through_the_router(cluster, deployed, node_namespace):
    red, green = image_part((200, 30, 30)), image_part((30, 160, 40))
    msgs = messages(red, green, red)  # two distinct images, one of them twice
    endpoints = deployed.endpoints
    urls = {e.name: e.url for e in endpoints.model(MODEL).units[0].engines if e.url}
    before = {name: payloads.served_requests(url) for name, url in urls.items()}

    await prime_encoder(endpoints, msgs, model_name=MODEL)
    rendered = front_post(deployed, "/v1/chat/completions/render", payloads.greedy(msgs))
    hashes = payloads.image_hashes(rendered)
    assert len(hashes) == 3 and hashes[0] == hashes[2] != hashes[1]
    # One <mm_hash> entry per distinct image, named by the hash the consumer computes itself.
    assert payloads.ec_entries(store(cluster, node_namespace, deployed)) == {h: [EMBEDDING_FILE] for h in hashes}

    async with EPDClient(endpoints) as client:
        result = await client.generate(payloads.greedy(msgs, max_tokens=8), model_name=MODEL)
    tokens, logprobs = payloads.output(result)
    assert len(tokens) == 8 and len(logprobs) == 8

    after = {name: payloads.served_requests(url) for name, url in urls.items()}
    primed = after["encoder-0"].get("/v1/chat/completions", 0) - before["encoder-0"].get("/v1/chat/completions", 0)
    # One image-only request per distinct image: prime_encoder primed through the unit's EPD proxy,
    # which primed the repeated image once; generate's prime found both in the unit's EC store.
    assert primed == 2
    assert set(after["encoder-0"]) == {"/v1/chat/completions"}  # never rendered or generated on
    generated = sum(
        after[c].get("/inference/v1/generate", 0) - before[c].get("/inference/v1/generate", 0)
        for c in ("regular-0", "regular-1")
    )
    assert generated == 1  # the router sent generate to a consumer


async def test_consumer_reads_the_primed_embeddings(cluster, deployed, node_namespace):
    """Swap proof: Y's embedding file replaced by X's makes Y generate exactly as X."""
    x, y, z = (image_part(rgb) for rgb in ((250, 250, 20), (20, 20, 250), (120, 20, 120)))
    endpoints = deployed.endpoints
    rendered = {}
    for name, part in (("x", x), ("y", y), ("z", z)):
        primed = messages(part)  # prime_encoder writes each part's key into it: render it as primed
        await prime_encoder(endpoints, primed, model_name=MODEL)
        rendered[name] = front_post(deployed, "/v1/chat/completions/render", payloads.greedy(primed))
    ec = store(cluster, node_namespace, deployed)
    files = {n: ec / payloads.image_hashes(r)[0] / EMBEDDING_FILE for n, r in rendered.items()}
    assert all(f.is_file() for f in files.values()), files

    replace_atomically(files["y"], files["x"])

    # Y is generated for the first time here: no consumer has its embedding cached.
    out = {name: payloads.output(front_post(deployed, "/inference/v1/generate", r)) for name, r in rendered.items()}
    assert out["y"] == out["x"], "the consumer did not read Y's embeddings from the EC store"
    assert out["z"] != out["x"], "different images must give different outputs"


def replace_atomically(target: Path, source: Path) -> None:
    """`target`'s bytes become `source`'s, in one rename (a consumer never reads half a file); the
    file keeps the engines' uid, so the janitor may still delete it."""
    tmp = target.with_name(f".swap-{uuid.uuid4().hex}")
    shutil.copyfile(source, tmp)
    stat = target.stat()
    os.chown(tmp, stat.st_uid, stat.st_gid)
    tmp.replace(target)


def test_dev_shm_is_the_pods_memory_emptydir(cluster, deployed, node_namespace):
    pod = unit_pod(cluster, node_namespace)
    name = pod["metadata"]["name"]
    marker = f"epd-node-test-{uuid.uuid4().hex}"
    exec_in(cluster, node_namespace, name, "encoder-0", "python3", "-c", f"open('/dev/shm/{marker}', 'w').write('x')")
    assert exec_in(cluster, node_namespace, name, "regular-0", "cat", f"/dev/shm/{marker}") == "x"
    assert not (Path("/dev/shm") / marker).exists(), "the pod's /dev/shm must not be the host's"
    mounts = exec_in(cluster, node_namespace, name, "regular-0", "cat", "/proc/mounts")
    (shm,) = [line.split() for line in mounts.splitlines() if line.split()[1] == "/dev/shm"]
    assert shm[2] == "tmpfs" and f"size={parse_quantity(SHM) // 1024}k" in shm[3], shm  # the sizeLimit
    # On the host it is the kubelet's tmpfs for this pod's emptyDir (the last test sees it go).
    assert (host_shm(pod) / marker).read_text() == "x"


def test_logs_exec_and_the_restricted_uid(cluster, deployed, node_namespace):
    pod = unit_pod(cluster, node_namespace)
    name = pod["metadata"]["name"]
    logs = cluster.kubectl("logs", "-n", node_namespace, name, "-c", "encoder-0").stdout
    assert "Application startup complete" in logs
    assert exec_in(cluster, node_namespace, name, "regular-0", "id", "-u").strip() == str(UNIT_UID)
    # The model came from the claim, read-only.
    assert "config.json" in exec_in(cluster, node_namespace, name, "regular-0", "ls", "/models/tiny-llava")


async def test_epd_client_answers_as_one_aggregated_engine(deployed, reference):
    """prime -> render -> generate against the pod IPs discover finds, as users' clients do."""
    endpoints = deployed.endpoints
    msgs = messages(image_part((10, 200, 200)), image_part((200, 100, 0)), text="two pictures")
    async with EPDClient(endpoints) as client:
        epd = payloads.output(await client.generate(payloads.greedy(msgs, max_tokens=8), model_name=MODEL))
    (ref_unit,) = reference.endpoints.model(MODEL).units
    assert ref_unit.entry_url is not None
    rendered = post(ref_unit.entry_url, "/v1/chat/completions/render", payloads.greedy(msgs, max_tokens=8))
    expected = payloads.output(post(ref_unit.entry_url, "/inference/v1/generate", rendered))
    assert epd[0] == expected[0]
    assert epd[1] == pytest.approx(expected[1], abs=1e-3)


async def test_text_only_requests_bypass_the_encoder(cluster, deployed, node_namespace):
    encoder_before = payloads.served_requests(encoder_url(deployed))
    store_before = payloads.ec_entries(store(cluster, node_namespace, deployed))
    async with EPDClient(deployed.endpoints) as client:
        result = await client.generate(
            payloads.greedy([{"role": "user", "content": "no picture here"}]), model_name=MODEL
        )
    assert len(payloads.output(result)[0]) == 6
    assert payloads.served_requests(encoder_url(deployed)) == encoder_before
    assert payloads.ec_entries(store(cluster, node_namespace, deployed)) == store_before


# --------------------------------------------------------------------------- any OpenAI client, through the front Service


@dataclasses.dataclass(frozen=True)
class EncoderLoad:
    """What the encoder served, and what the store and the janitor saw, at one look."""

    finished: int
    chats: int
    entries: dict[str, list[str]]
    fallback_encodes: float

    @classmethod
    def of(cls, cluster, namespace: str, deployed: Deployed) -> EncoderLoad:
        url = encoder_url(deployed)
        return cls(
            payloads.finished_requests(url),
            payloads.served_requests(url).get("/v1/chat/completions", 0),
            payloads.ec_entries(store(cluster, namespace, deployed)),
            janitor_metrics(unit_pod(cluster, namespace))["epd_ec_fallback_encodes_total"],
        )

    def new_entries(self, after: EncoderLoad) -> dict[str, list[str]]:
        return {h: files for h, files in after.entries.items() if h not in self.entries}


def test_an_openai_client_through_the_front_service_gets_the_aggregated_answer(
    cluster, deployed, node_namespace, reference
):
    msgs = messages(image_part((40, 90, 220)), image_part((220, 90, 40)), text="two colours")
    before = EncoderLoad.of(cluster, node_namespace, deployed)
    answer = sdk(front_service_url(cluster, node_namespace, UNIT)).chat.completions.create(
        **chat_request(msgs, logprobs=True)
    )
    # Read at once: the entries epd_client primed in the tests before are still leased to it (a prime's
    # grant lasts 30 s), so over the small budget the janitor may evict one of these two once settled.
    answered = EncoderLoad.of(cluster, node_namespace, deployed)
    # The janitor judges an entry once it is GRACE_SECONDS old, at its next sweep (every 2 s).
    time.sleep(GRACE_SECONDS + 5)
    after = EncoderLoad.of(cluster, node_namespace, deployed)
    expected = sdk(reference_url(reference)).chat.completions.create(**chat_request(msgs, logprobs=True))

    (choice,), (ref,) = answer.choices, expected.choices
    assert choice.token_ids == ref.token_ids and len(choice.token_ids) == 8
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(
        [t.logprob for t in ref.logprobs.content], abs=1e-3
    )
    # One prime per image on the encoder, and the consumer read what it wrote: a miss would have
    # left an empty <mm_hash> folder and counted a fallback encode in the janitor.
    assert (after.finished - before.finished, after.chats - before.chats) == (2, 2)
    assert list(before.new_entries(answered).values()) == [[EMBEDDING_FILE], [EMBEDDING_FILE]]
    assert after.fallback_encodes == before.fallback_encodes


def test_a_stream_through_the_front_service_gives_the_same_tokens(cluster, deployed, node_namespace):
    client = sdk(front_service_url(cluster, node_namespace, UNIT))
    msgs = messages(image_part((130, 200, 60)), text="one colour")
    before = EncoderLoad.of(cluster, node_namespace, deployed)
    whole = client.chat.completions.create(**chat_request(msgs))
    middle = EncoderLoad.of(cluster, node_namespace, deployed)
    chunks = [c for c in client.chat.completions.create(**chat_request(msgs), stream=True) if c.choices]
    after = EncoderLoad.of(cluster, node_namespace, deployed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert [t for c in chunks for t in (getattr(c.choices[0], "token_ids", None) or [])] == whole.choices[0].token_ids
    assert len(chunks) > 2  # streamed, not one answer
    # Primed for the first request; the stream's picture was in the unit's EC store already, so
    # the proxy did not prime it again. One embedding in the store for the one image.
    assert (middle.finished - before.finished, after.finished - middle.finished) == (1, 0)
    assert len(before.new_entries(after)) == 1


def test_responses_input_images_are_primed_through_the_front_service(cluster, deployed, node_namespace, reference):
    part = {"type": "input_image", "image_url": payloads.png_data_url((240, 240, 240)), "detail": "auto"}
    request = {
        "model": tiny_model.SERVED_NAME,
        "input": [{"role": "user", "content": [part, {"type": "input_text", "text": "describe"}]}],
        "max_output_tokens": 8,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    before = EncoderLoad.of(cluster, node_namespace, deployed)
    answer = sdk(front_service_url(cluster, node_namespace, UNIT)).responses.create(**request)
    after = EncoderLoad.of(cluster, node_namespace, deployed)
    assert answer.output_text == sdk(reference_url(reference)).responses.create(**request).output_text
    assert after.finished - before.finished == 1
    assert list(before.new_entries(after).values()) == [[EMBEDDING_FILE]]


def test_anthropic_messages_images_are_primed_through_the_front_service(cluster, deployed, node_namespace, reference):
    """The official anthropic SDK, as Claude-style clients talk to vLLM's Messages API: its image
    block is primed as the image_url part vLLM makes of it, and the consumer reads the embedding."""
    media_type, data = payloads.png_data_url((30, 160, 200)).removeprefix("data:").split(";base64,")
    request = {
        "model": tiny_model.SERVED_NAME,
        "max_tokens": 8,
        "extra_body": {"temperature": 0},  # the SDK no longer takes sampling parameters; vLLM does
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}},
                    {"type": "text", "text": "describe"},
                ],
            }
        ],
    }

    def client(url: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300)

    before = EncoderLoad.of(cluster, node_namespace, deployed)
    answer = client(front_service_url(cluster, node_namespace, UNIT)).messages.create(**request)
    time.sleep(GRACE_SECONDS + 5)  # the janitor's verdict on the new entry, as above
    after = EncoderLoad.of(cluster, node_namespace, deployed)
    expected = client(reference_url(reference)).messages.create(**request)
    assert answer.usage.output_tokens > 0
    assert answer.content == expected.content
    assert after.finished - before.finished == 1
    assert list(before.new_entries(after).values()) == [[EMBEDDING_FILE]]
    assert after.fallback_encodes == before.fallback_encodes


def test_text_only_through_the_front_service_never_reaches_the_encoder(cluster, deployed, node_namespace, reference):
    client = sdk(front_service_url(cluster, node_namespace, UNIT))
    before = EncoderLoad.of(cluster, node_namespace, deployed)
    request = chat_request([{"role": "user", "content": "no picture here"}])
    answer = client.chat.completions.create(**request)
    expected = sdk(reference_url(reference)).chat.completions.create(**request)
    assert answer.choices[0].token_ids == expected.choices[0].token_ids
    assert [m.id for m in client.models.list()] == [tiny_model.SERVED_NAME]  # passed through
    after = EncoderLoad.of(cluster, node_namespace, deployed)
    # The janitor may evict older entries meanwhile (the store is over its budget): nothing new.
    assert (after.finished, after.chats, after.fallback_encodes) == (
        before.finished,
        before.chats,
        before.fallback_encodes,
    )
    assert before.new_entries(after) == {}


# --------------------------------------------------------------------------- the NetworkPolicy, enforced by kube-router

# Each target host:port -> whether a TCP connection opened within 20 s. It retries: kube-router
# admits a new pod's address only once it has seen the pod (its ipsets follow pod events).
CONNECT = """
import json, socket, sys, threading, time

found = {}

def attempt(target):
    host, port = target.rsplit(":", 1)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            sock.settimeout(2)
            try:
                sock.connect((host, int(port)))
                found[target] = True
                return
            except OSError:
                time.sleep(0.5)
    found[target] = False

threads = [threading.Thread(target=attempt, args=(t,)) for t in sys.argv[1:]]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps(found))
"""


def reachable_from(cluster, namespace: str, targets: list[str]) -> dict[str, bool]:
    """Which `targets` a pod of `namespace` on the real node can connect to (a restricted pod of
    the operator's image, which has python3)."""
    name = f"probe-{uuid.uuid4().hex[:6]}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": dict(node.NODE_SELECTOR),
            "tolerations": node.TOLERATIONS,
            "containers": [
                {
                    "name": "probe",
                    "image": recipes.OPERATOR_REF,
                    "imagePullPolicy": "Never",
                    "command": ["python3", "-c", CONNECT, *targets],
                    "securityContext": RESTRICTED_CONTAINER,
                    "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}},
                }
            ],
        },
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))
    try:
        wait_for(
            lambda: get(cluster, "pod", name, "-n", namespace)["status"].get("phase") in ("Succeeded", "Failed"),
            120,
            f"probe pod {name} to finish",
        )
        found: dict[str, bool] = json.loads(cluster.kubectl("logs", "-n", namespace, name).stdout)
        return found
    finally:
        cluster.kubectl("delete", "pod", name, "-n", namespace, "--wait=false", check=False)


def test_the_network_policy_admits_only_the_namespace_to_the_serving_ports(cluster, deployed, node_namespace):
    pod = unit_pod(cluster, node_namespace)
    ip = pod["status"]["podIP"]
    front, encoder = f"{ip}:8000", encoder_url(deployed).removeprefix("http://")
    janitor, proxy_metrics = f"{ip}:9400", f"{ip}:9401"
    service = front_service_url(cluster, node_namespace, UNIT).removeprefix("http://")
    # The unit's namespace (its clients by default; the operator runs there too, so the janitor's
    # metrics port is open to it): the front door and the engines, not the proxy's metrics.
    assert reachable_from(cluster, node_namespace, [front, service, encoder, janitor, proxy_metrics]) == {
        front: True,
        service: True,
        encoder: True,
        janitor: True,
        proxy_metrics: False,
    }
    # Another team's namespace reaches nothing: no prime under a key this unit reads.
    other = f"epd-other-{uuid.uuid4().hex[:5]}"
    cluster.kubectl("create", "namespace", other)
    try:
        targets = [front, service, encoder, janitor, proxy_metrics]
        assert reachable_from(cluster, other, targets) == dict.fromkeys(targets, False)
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)
    # The node itself (the kubelet's probes, these tests) still reaches every port.
    assert janitor_metrics(pod)["epd_ec_store_budget_bytes"] == BUDGET


def test_cache_miss_is_encoded_by_the_consumer_leaving_an_empty_folder(cluster, deployed, node_namespace, reference):
    """Documents vLLM 0.32: an image nobody primed is not an error. The consumer encodes it
    itself (same output as the aggregated engine) and its existence check leaves an EMPTY
    <mm_hash> folder behind (fixed in 0.33). This is why epd_client never skips priming."""
    msgs = messages(image_part((77, 77, 177)))
    ec = store(cluster, node_namespace, deployed)
    encoder_before = payloads.served_requests(encoder_url(deployed))
    rendered = front_post(deployed, "/v1/chat/completions/render", payloads.greedy(msgs))
    (mm_hash,) = payloads.image_hashes(rendered)
    assert mm_hash not in payloads.ec_entries(ec)

    out = payloads.output(front_post(deployed, "/inference/v1/generate", rendered))

    assert payloads.ec_entries(ec)[mm_hash] == []
    assert payloads.served_requests(encoder_url(deployed)) == encoder_before
    assert out[0] == aggregated(reference, msgs)[0]


def aggregated(reference: Deployed, msgs: list[dict]) -> tuple[list[int], list[float]]:
    """The reference pod's greedy answer to `msgs`."""
    url = reference.unit.consumer_urls[0]
    return payloads.output(
        post(url, "/inference/v1/generate", post(url, "/v1/chat/completions/render", payloads.greedy(msgs)))
    )


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


def is_paused(url: str) -> bool:
    with urllib.request.urlopen(url + "/is_paused", timeout=10) as resp:
        return bool(json.loads(resp.read())["is_paused"])


async def test_a_vime_rollout_runs_unchanged_against_vime_args(deployed, reference):
    """Vime's default multimodal generate: prime_encoder(args, messages) with no model name,
    then render and generate at the model's router address from vllm_model_routers."""
    args = vime_rollout_args(deployed.endpoints)
    assert args.vllm_model_encoder_endpoints == {MODEL: (tiny_model.SERVED_NAME, [encoder_url(deployed)])}
    ip, port = args.vllm_model_routers[MODEL]
    assert (args.vllm_router_ip, args.vllm_router_port) == (ip, port)
    assert f"http://{ip}:{port}" == deployed.unit.entry_url
    msgs = messages(image_part((10, 200, 200)), image_part((200, 100, 0)), text="two pictures")
    before = payloads.served_requests(encoder_url(deployed)).get("/v1/chat/completions", 0)

    await prime_encoder(args, msgs)
    output = await render_and_generate(f"http://{ip}:{port}", msgs)

    assert payloads.served_requests(encoder_url(deployed)).get("/v1/chat/completions", 0) - before == 2
    assert_same(output, aggregated(reference, msgs))


def liveness_check(cluster, namespace: str, pod: dict, container: str) -> subprocess.CompletedProcess[str]:
    """The container's liveness check as its probe runs it, allowing no stall at all (its own
    record, not the kubelet's probe's)."""
    *command, _, _ = container_spec(pod, container)["livenessProbe"]["exec"]["command"]
    check = [*command, "0", "/tmp/epd-liveness-check.json"]
    return cluster.kubectl("exec", "-n", namespace, pod["metadata"]["name"], "-c", container, "--", *check, check=False)


async def test_pause_and_resume_hold_every_engine(cluster, deployed, node_namespace):
    async with EPDClient(deployed.endpoints) as client:
        engines = client.engines(MODEL)
        assert [e.name for e in engines] == ["encoder-0", "regular-0", "regular-1"]
        await client.pause(MODEL)
        assert all(is_paused(e.url) for e in engines if e.url)
        text_only = payloads.greedy([{"role": "user", "content": "no picture here"}])
        held = asyncio.create_task(client.generate(text_only))
        await asyncio.sleep(2.0)
        assert not held.done(), "a paused engine generated"
        # The engine holding it waits by design: its liveness check, which fails an engine whose
        # requests wait while no step finishes, passes it (vLLM's /is_paused says why).
        waiting = [e.name for e in engines if e.url and server_load(e.url) > 0]
        assert len(waiting) == 1, waiting
        pod = unit_pod(cluster, node_namespace)
        checks = [await asyncio.to_thread(liveness_check, cluster, node_namespace, pod, waiting[0]) for _ in range(2)]
        assert [c.returncode for c in checks] == [0, 0], [(c.stdout, c.stderr) for c in checks]

        await client.resume(MODEL)
        assert not any(is_paused(e.url) for e in engines if e.url)
        assert len(payloads.output(await asyncio.wait_for(held, 60))[0]) == 6


async def test_a_new_weights_version_never_reads_old_embeddings(cluster, deployed, node_namespace, reference):
    ec = store(cluster, node_namespace, deployed)
    consumer = deployed.unit.consumer_urls[0]
    ref_x, ref_y = aggregated(reference, messages(image_part(X))), aggregated(reference, messages(image_part(Y)))
    assert ref_x[0] != ref_y[0]

    async with EPDClient(deployed.endpoints, weights_version="step-1") as client:
        # Step 1: X is generated (its embedding now cached by a consumer too), Y primed.
        assert_same(payloads.output(await client.generate(payloads.greedy(messages(image_part(X))))), ref_x)
        x_step1, y_step1 = messages(image_part(X)), messages(image_part(Y))
        await prime_encoder(client, x_step1)
        await prime_encoder(client, y_step1)
        key_x1, key_y1 = x_step1[0]["content"][0]["uuid"], y_step1[0]["content"][0]["uuid"]
        # vLLM keys the EC store by the part's uuid, verbatim.
        entries = payloads.ec_entries(ec)
        assert entries[key_x1] == entries[key_y1] == [EMBEDDING_FILE]

        # The weight update: pause (which empties every engine's caches), new weights, resume.
        # The new weights are simulated by giving X's entry other bytes of the same shape: Y's
        # embedding, as if the encoder's weights had changed.
        await client.pause(MODEL)
        stale = ec / key_x1 / EMBEDDING_FILE
        replace_atomically(stale, ec / key_y1 / EMBEDDING_FILE)
        await client.resume(MODEL)

        # The old version's key: the encoder finds the entry and does not encode again, the
        # consumer reads it: X is answered with the other embedding.
        x_again = messages(image_part(X))
        await prime_encoder(client, x_again)
        assert x_again[0]["content"][0]["uuid"] == key_x1
        old = await render_and_generate(consumer, x_again)
        assert old[0] == ref_y[0] != ref_x[0]
        assert stale.read_bytes() == (ec / key_y1 / EMBEDDING_FILE).read_bytes()

        # The next version: a new key, encoded afresh, equal to the aggregated engine.
        client.weights_version = "step-2"
        x_step2 = messages(image_part(X))
        await prime_encoder(client, x_step2)
        key_x2 = x_step2[0]["content"][0]["uuid"]
        assert key_x2 != key_x1 and payloads.ec_entries(ec)[key_x2] == [EMBEDDING_FILE]
        assert_same(await render_and_generate(consumer, x_step2), ref_x)
        # EPDClient.generate keys its own copy of the request alike.
        assert_same(payloads.output(await client.generate(payloads.greedy(messages(image_part(X))))), ref_x)


def janitor_metrics(pod: dict) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:9400/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if match := re.match(r"^(epd_ec_\w+?)(?:\{[^}]*reason=\"(\w+)\"[^}]*\}|\{[^}]*\})? ([0-9.e+]+)$", line):
            name, reason, value = match.groups()
            key = f"{name}:{reason}" if reason else name
            found[key] = found.get(key, 0.0) + float(value)
    return found


async def test_the_janitor_trims_the_store_to_its_budget(cluster, deployed, node_namespace):
    pod = unit_pod(cluster, node_namespace)
    assert janitor_metrics(pod)["epd_ec_store_budget_bytes"] == BUDGET
    colours = [(i * 37 % 256, 90, 255 - i * 29 % 256) for i in range(10)]
    await prime_encoder(deployed.endpoints, messages(*(image_part(c) for c in colours)))

    ec = store(cluster, node_namespace, deployed)

    def trimmed() -> dict[str, float] | None:
        found, entries = janitor_metrics(pod), payloads.ec_entries(ec)
        within = 0 < len(entries) <= BUDGET // ENTRY_BYTES and found["epd_ec_store_bytes"] <= BUDGET
        return found if found.get("epd_ec_evictions_total:budget") and within else None

    # Fresh entries are left alone for the janitor's grace period (10 s), then trimmed.
    found = wait_for(trimmed, 90, "the janitor to trim the EC store to its budget")
    # The consumer sees the store as the host does: one tmpfs, the pod's.
    listed = exec_in(cluster, node_namespace, pod["metadata"]["name"], "regular-0", "ls", deployed.ec_storage_path)
    assert sorted(listed.split()) == sorted(payloads.ec_entries(ec))
    assert found["epd_ec_store_entries"] <= BUDGET // ENTRY_BYTES


# --------------------------------------------------------------------------- faults


def unscraped(models: list[dict]) -> list[dict]:
    """The models' status without the janitors' counters, which move by themselves (an earlier
    test's cache miss is judged, entries are evicted) while the node restarts."""
    scraped = ("ecEvictions", "fallbackEncodes")
    return [
        {
            **{k: v for k, v in model.items() if k not in scraped},
        }
        for model in models
    ]


def test_restarting_the_kubelet_and_containerd_leaves_the_engines_serving(cluster, deployed, node_namespace):
    before_pod, before_status = (
        unit_pod(cluster, node_namespace),
        get(cluster, "epd", UNIT, "-n", node_namespace)["status"],
    )
    for component in ("kubelet", "containerd"):
        cluster.restart(component)
        # The engines answer throughout; the kubelet finds its containers again.
        for url in (
            *deployed.unit.encoder_urls,
            *deployed.unit.consumer_urls,
        ):
            with urllib.request.urlopen(url + "/health", timeout=10) as resp:
                assert resp.status == 200
    wait_for(lambda: pod_ready(unit_pod(cluster, node_namespace)), 120, "the unit pod Ready after the restarts")
    wait_ready(cluster, node_namespace, UNIT, timeout=120)
    after = unit_pod(cluster, node_namespace)
    assert kubelet_view(after) == kubelet_view(before_pod), "no container was restarted or replaced"
    status = get(cluster, "epd", UNIT, "-n", node_namespace)["status"]
    assert unscraped(status["models"]) == unscraped(before_status["models"])


def test_a_drain_waits_while_the_disruption_budget_is_spent(cluster, deployed, node_namespace):
    """The unit's budget allows one unit down: with a second unit Pending (the node cordoned by the
    drain), evicting the running one would spend it, so the drain cannot evict and gives up."""
    pod = unit_pod(cluster, node_namespace)
    cluster.kubectl("cordon", node.NAME)
    try:
        cluster.kubectl("patch", "epd", UNIT, "-n", node_namespace, "--type=merge", "-p", '{"spec":{"replicas":2}}')
        (pdb,) = get(cluster, "pdb", "-n", node_namespace, "-l", f"epd.vime.dev/deployment={UNIT}")["items"]
        wait_for(
            lambda: (
                (s := get(cluster, "pdb", pdb["metadata"]["name"], "-n", node_namespace)["status"]).get("expectedPods")
                == 2
                and s.get("disruptionsAllowed") == 0
            ),
            60,
            "the budget spent by the second, Pending unit",
        )
        drain = cluster.kubectl(
            "drain",
            node.NAME,
            f"--pod-selector=epd.vime.dev/deployment={UNIT}",
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--timeout=20s",
            check=False,
            timeout=90,
        )
        assert drain.returncode != 0, drain.stdout
        assert "disruption budget" in drain.stderr + drain.stdout
        assert kubelet_view(unit_pod(cluster, node_namespace)) == kubelet_view(pod), "the unit was not disturbed"
    finally:
        cluster.kubectl("patch", "epd", UNIT, "-n", node_namespace, "--type=merge", "-p", '{"spec":{"replicas":1}}')
        cluster.kubectl("uncordon", node.NAME)
    wait_for(
        lambda: len(get(cluster, "pods", "-n", node_namespace, "-l", f"epd.vime.dev/deployment={UNIT}")["items"]) == 1,
        120,
        "the second unit gone",
    )
    assert not get(cluster, "node", node.NAME)["spec"].get("unschedulable")


def kill_engine(cluster, namespace: str, container: str) -> None:
    """SIGKILL the engine core inside `container`: vLLM's API server then answers /health with
    503 and exits, as after a crash."""
    pod = unit_pod(cluster, namespace)["metadata"]["name"]
    exec_in(cluster, namespace, pod, container, "pkill", "-KILL", "-f", "EngineCore")


def test_an_encoder_that_stops_answering_takes_the_unit_out_and_comes_back_after_its_restart(
    cluster, deployed, node_namespace
):
    """The encoder is frozen (containerd pauses its cgroup), so it stays down for as long as the
    test needs: a crashed engine is back within the proxy's priming window on a quiet machine."""
    pod = unit_pod(cluster, node_namespace)
    ip = pod["status"]["podIP"]
    encoder = kubelet_view(pod)["encoder-0"][0].removeprefix("containerd://")
    real = cluster.real_node()
    real.ctr("task", "pause", encoder)
    try:
        wait_for(lambda: not pod_ready(unit_pod(cluster, node_namespace)), 90, "the unit pod unready")
        wait_for(lambda: ready_addresses(cluster, node_namespace) == [], 60, "the unit out of the front Service")
        # Meanwhile a picture sent to the unit's own proxy (at its pod IP: the Service sends nothing
        # now) is refused, naming the part, and never reaches a consumer to be encoded there.
        consumers = deployed.unit.consumer_urls
        served = [payloads.served_requests(url) for url in consumers]
        with pytest.raises(openai.APIStatusError) as refused:
            sdk(f"http://{ip}:8000").chat.completions.create(**chat_request(messages(image_part((9, 9, 9)))))
        assert refused.value.status_code == 502
        assert "could not be encoded by the encoders, so the request was not forwarded" in str(refused.value)
        assert "messages[0].content[0]" in str(refused.value)
        assert [payloads.served_requests(url) for url in consumers] == served
        # The engine core dies as the encoder thaws (the signal waits for it): its API server
        # answers /health with 503 and exits, as after a crash.
        os.kill(engine_core(real, encoder), signal.SIGKILL)
    finally:
        real.ctr("task", "resume", encoder)
    # The kubelet restarts the sidecar; once it passed its startup probe again, the unit is back.
    wait_for(lambda: kubelet_view(unit_pod(cluster, node_namespace))["encoder-0"][1] == 1, 120, "the encoder restarted")
    wait_for(lambda: pod_ready(unit_pod(cluster, node_namespace)), 600, "the unit pod Ready again")
    wait_for(lambda: ready_addresses(cluster, node_namespace) == [ip], 60, "the unit back in the front Service")
    restarts = {name: restarts for name, (_, restarts, _) in kubelet_view(unit_pod(cluster, node_namespace)).items()}
    assert restarts == {"encoder-0": 1, "regular-0": 0, "regular-1": 0, "router": 0, "proxy": 0, "janitor": 0}


def test_a_killed_consumer_is_restarted_and_the_status_and_events_say_so(cluster, deployed, node_namespace):
    since = dt.datetime.now(dt.UTC).replace(microsecond=0)
    kill_engine(cluster, node_namespace, "regular-0")

    def model_status() -> dict:
        return dict(get(cluster, "epd", UNIT, "-n", node_namespace)["status"]["models"][0])

    def unready() -> dict | None:
        """The unit as the status lists it among the units not ready (None: it is not there)."""
        return next((u for u in model_status().get("unready") or [] if u["name"] == f"{UNIT}-{MODEL}-0"), None)

    down = wait_for(unready, 60, "the status to say the unit is down")
    assert down["reason"] in ("EngineUnready", "EngineStarting") and "regular-0" in down["message"]
    wait_for(
        lambda: unready() is None and model_status()["readyUnits"] == 1,
        600,
        "the status to say the unit is Ready again",
    )
    (regular,) = [s for s in containers(unit_pod(cluster, node_namespace)) if s["name"] == "regular-0"]
    assert regular["restartCount"] == 1 and regular["ready"]

    def reasons() -> list[tuple[str, str]]:
        """(reason, message) of the deployment's Events since the kill, in order."""
        events = get(cluster, "events", "-n", node_namespace, "--field-selector", f"involvedObject.name={UNIT}")
        created = sorted(
            (dt.datetime.fromisoformat(e["metadata"]["creationTimestamp"]), e["reason"], e["message"])
            for e in events["items"]
        )
        # The units' own story; the janitor's ECEvicted reports go on meanwhile.
        return [(reason, message) for when, reason, message in created if when >= since and reason.startswith("Unit")]

    def story() -> list[tuple[str, str]] | None:
        """From the UnitUnready naming regular-0 on, once a UnitReady came (the previous test's
        UnitReady may be posted within the second this one began)."""
        found = reasons()
        down = [i for i, (reason, message) in enumerate(found) if reason == "UnitUnready" and "regular-0" in message]
        return found[down[0] :] if down and found[-1][0] == "UnitReady" else None

    found = wait_for(story, 60, "UnitUnready naming regular-0, then UnitReady")
    assert [reason for reason, _ in found] == ["UnitUnready", "UnitReady"], found


def test_deleting_the_unit_removes_its_dev_shm(cluster, deployed, node_namespace):
    pod = unit_pod(cluster, node_namespace)
    shm = host_shm(pod)
    assert shm.is_dir() and str(shm) in Path("/proc/self/mountinfo").read_text()
    cluster.kubectl("delete", "epd", UNIT, "-n", node_namespace, "--wait=false")
    wait_for(
        lambda: not get(cluster, "pods", "-n", node_namespace, "-l", f"epd.vime.dev/deployment={UNIT}")["items"],
        180,
        "the unit pod deleted",
    )
    wait_for(lambda: not shm.exists(), 60, "the pod's /dev/shm emptyDir gone from the host")
    assert str(shm) not in Path("/proc/self/mountinfo").read_text()
