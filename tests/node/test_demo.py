"""`make demo`'s REAL part on the real node, headless (hack/epd_dev/demo_serving.py): the tiny
model's encoder + prefill + decode unit behind vllm-router, made by the Helm-installed operator
and run by epd-real-0's kubelet, answers the two-image request exactly as the aggregated engine
(the session's reference pod); the kubelet started the containers in the order EPD needs; what
the demo prints for exploring works as printed, its failure recipe included (the encoder stopped:
the openai SDK gets the proxy's 502, no consumer is asked).
"""

from __future__ import annotations

import datetime as dt
import io
import json
import struct
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import yaml

from epd_client import Endpoints, prime_encoder
from epd_dev import demo_serving
from epd_dev.demo_serving import MAX_TOKENS, PICTURES, demo_request, print_explore
from epd_dev.localcluster import node
from epd_dev.vllm import payloads, tiny_model
from epd_dev.vllm.payloads import image_part, messages
from tests.node.conftest import host_shm

pytestmark = [pytest.mark.node, pytest.mark.cluster, pytest.mark.vllm]

INFERENCE_POOL_CRD = (
    Path(__file__).resolve().parents[2] / "charts/epd-operator/files/inference.networking.k8s.io_inferencepools.yaml"
)


@pytest.fixture(scope="module")
def served(cluster, helm_operator, node_namespace, tiny_model_claim, reference_applied, tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    # What `make demo`'s chart values add: the InferencePool CRD (removed afterwards: the session's
    # other tests see a cluster without it).
    cluster.kubectl("apply", "--server-side", "-f", str(INFERENCE_POOL_CRD))
    demo_serving.apply(cluster, root, node_namespace, tiny_model_claim, names=(demo_serving.NAME,))
    out = io.StringIO()
    try:
        with redirect_stdout(out):
            answer = demo_serving.serve(cluster, node_namespace)
        yield answer, out.getvalue()
    finally:
        cluster.kubectl("delete", "epd", demo_serving.NAME, "-n", node_namespace, "--wait=false", check=False)
        objects = yaml.safe_dump_all(demo_serving.envoy_objects(node_namespace))
        cluster.kubectl("delete", "-n", node_namespace, "-f", "-", "--ignore-not-found", input=objects, check=False)
        cluster.kubectl("delete", "-f", str(INFERENCE_POOL_CRD), "--ignore-not-found", check=False)


def started_at(status: dict) -> dt.datetime:
    return dt.datetime.fromisoformat(status["state"]["running"]["startedAt"])


def test_the_answer_through_epd_client_equals_the_aggregated_engines(served, reference):
    answer, printed = served
    # Checked here against the reference pod independently of the demo's own check.
    url = reference.unit.consumer_urls[0]
    rendered = demo_serving.post(url, "/v1/chat/completions/render", demo_request())
    ref_ids, ref_logprobs = payloads.output(demo_serving.post(url, "/inference/v1/generate", rendered))
    assert len(answer.token_ids) == MAX_TOKENS and answer.token_ids == ref_ids
    assert answer.logprobs == pytest.approx(ref_logprobs, abs=1e-3)
    assert "identical: yes" in printed and answer.text and repr(answer.text) in printed
    # Every stage where EPD puts it: one prime per picture on the encoder only, the PD router's
    # two generate stages on prefill and decode; one embedding per picture in the pod's EC store.
    assert answer.served["encoder-0"].keys() == {"/v1/chat/completions"}
    assert answer.served["encoder-0"]["/v1/chat/completions"][0] == len(PICTURES)
    assert answer.served["prefill-0"]["/inference/v1/generate"][0] == 1
    assert answer.served["decode-0"]["/inference/v1/generate"][0] == 1
    assert len(set(answer.image_hashes)) == len(PICTURES)
    assert {h: [f for f, _ in files] for h, files in answer.ec_files.items()} == {
        h: [payloads.EMBEDDING_FILE] for h in answer.image_hashes
    }
    assert answer.kv_files, "prefill handed no KV cache to decode"


def test_the_same_picture_eight_times_through_the_front_door_costs_one_encoder_request(served, reference):
    answer, printed = served
    repeats = answer.repeats
    assert repeats is not None
    # Eight sends through the gateway and the unit's proxy: one prime; a new weights version: one more.
    assert (repeats.primes, repeats.primes_new_version) == (1, 1)
    # The same answer each time, the aggregated engine's.
    url = reference.unit.consumer_urls[0]
    content = [demo_serving.REPEATED.part, {"type": "text", "text": "what is this?"}]
    request = payloads.greedy([{"role": "user", "content": content}], max_tokens=8)
    rendered = demo_serving.post(url, "/v1/chat/completions/render", request)
    expected, _ = payloads.output(demo_serving.post(url, "/inference/v1/generate", rendered))
    assert all(tokens == expected for tokens in repeats.answers) and len(expected) == 8
    assert f"sends 1-{demo_serving.REPEATS}  encoder requests: 1" in printed
    assert f"X-EPD-Weights-Version: {demo_serving.NEW_VERSION}: encoder requests: 1" in printed


def test_two_pictures_under_one_client_uuid_each_get_their_own_answer_through_the_front_door(served, reference):
    answer, printed = served
    shared = answer.shared_uuid
    assert shared is not None
    # Each the aggregated engine's answer for that picture (asked here, without a uuid), and the two
    # differ: had the second been answered from the first's embedding, its answer would be the first's.
    url = reference.unit.consumer_urls[0]
    expected = []
    for picture in demo_serving.SHARED_UUID_PICTURES:
        request = payloads.greedy(
            [{"role": "user", "content": [picture.part, {"type": "text", "text": "what is this?"}]}], max_tokens=8
        )
        rendered = demo_serving.post(url, "/v1/chat/completions/render", request)
        expected.append(payloads.output(demo_serving.post(url, "/inference/v1/generate", rendered))[0])
    assert shared.answers == expected and expected[0] != expected[1]
    assert "each its own: yes" in printed


def test_a_standalone_envoy_asking_the_inference_pools_picker_costs_one_encoder_request_a_picture(served):
    """Issue 69's acceptance: the model's InferencePool, and Envoy configured as GAIE's charts
    configure it, pointed at the pool's picker, serving the openai SDK."""
    answer, printed = served
    envoy = answer.envoy
    assert envoy is not None
    pool = envoy.pool["spec"]
    assert pool["endpointPickerRef"]["name"] == f"{demo_serving.NAME}-default-epp"
    assert (
        pool["targetPorts"] == [{"number": 8000}]
        and pool["selector"]["matchLabels"]["app.kubernetes.io/component"] == "unit"
    )
    assert envoy.primes == 1
    assert all(tokens == envoy.reference for tokens in envoy.answers) and len(envoy.reference) == 8
    assert (
        f"sends 1-{demo_serving.REPEATS}  encoder requests: 1"
        in printed.split("Envoy and the model's InferencePool")[1]
    )


def test_the_kubelet_started_the_encoder_first_and_the_router_after_the_consumers(served):
    answer, printed = served
    pod = answer.pod
    assert pod["spec"]["nodeName"] == node.NAME
    statuses = {s["name"]: s for s in demo_serving.containers(pod)}
    assert set(statuses) == {"encoder-0", "prefill-0", "decode-0", "router", "proxy", "janitor"}
    assert all(s["containerID"].startswith("containerd://") for s in statuses.values())
    assert all(s["restartCount"] == 0 and s["ready"] for s in statuses.values())
    # The main containers start only once the sidecar passed its startupProbe: vLLM loads for
    # many seconds, so the gap is that long. The router comes after the consumers in the pod
    # spec, and the kubelet starts main containers in that order.
    encoder = started_at(statuses["encoder-0"])
    consumers = [started_at(statuses[name]) for name in ("prefill-0", "decode-0")]
    assert all((c - encoder).total_seconds() >= 5 for c in consumers)
    assert started_at(statuses["router"]) >= max(consumers)
    # The printed table is the kubelet's.
    for status in statuses.values():
        assert demo_serving.short_id(status["containerID"]) in printed


def test_the_pd_router_fronts_prefill_and_decode(served):
    answer, _ = served
    spec = {c["name"]: c for c in [*answer.pod["spec"]["initContainers"], *answer.pod["spec"]["containers"]]}
    router = [*spec["router"].get("command", []), *spec["router"].get("args", [])]
    assert "--vllm-pd-disaggregation" in router
    # Inside the pod, at the engines' ports (the status names the same ports at the pod IP).
    for flag, engine in (("--prefill", "prefill-0"), ("--decode", "decode-0")):
        assert router[router.index(flag) + 1] == "http://127.0.0.1:" + answer.engine_urls[engine].rsplit(":", 1)[1]
    assert "ec_consumer" in " ".join(spec["prefill-0"]["args"])
    assert "--ec-transfer-config" not in spec["decode-0"]["args"]


def kv_entries(store: Path) -> set[str]:
    return {d.name for d in store.iterdir()} if store.is_dir() else set()


async def test_decode_continues_from_the_prefills_kv_cache(served, reference):
    """Proof the KV cache crosses over: zeroing the prefill's KV blocks before decode runs
    changes the decode's output; left alone (the demo's request), it equals the aggregated one."""
    answer, _ = served
    kv_store = host_shm(answer.pod) / Path(demo_serving.KV_STORE).relative_to("/dev/shm")
    msgs = messages(image_part((200, 200, 30)), text=demo_serving.QUESTION)
    endpoints = Endpoints.from_urls(
        [answer.engine_urls["encoder-0"]], answer.engine_urls["proxy"], served_model_name=tiny_model.SERVED_NAME
    )
    await prime_encoder(endpoints, msgs)
    rendered = demo_serving.post(answer.engine_urls["proxy"], "/v1/chat/completions/render", payloads.greedy(msgs))
    kv_before = kv_entries(kv_store)
    # The router's first stage by hand: prefill computes the prompt and stores its KV blocks.
    demo_serving.post(
        answer.engine_urls["prefill-0"],
        "/inference/v1/generate",
        {**rendered, "sampling_params": {**rendered["sampling_params"], "max_tokens": 1}},
    )
    (entry,) = kv_entries(kv_store) - kv_before
    layers = list((kv_store / entry).iterdir())
    assert layers and all(f.name.endswith(".safetensors") and f.stat().st_size > 1024 for f in layers)
    for layer in layers:
        zero_tensor_data(layer)

    corrupted = payloads.output(demo_serving.post(answer.engine_urls["decode-0"], "/inference/v1/generate", rendered))

    url = reference.unit.consumer_urls[0]
    expected = payloads.output(
        demo_serving.post(
            url, "/inference/v1/generate", demo_serving.post(url, "/v1/chat/completions/render", payloads.greedy(msgs))
        )
    )
    assert corrupted[0] != expected[0]


def zero_tensor_data(path: Path) -> None:
    """Zero a safetensors file's tensor bytes, keeping its header (8-byte length + JSON)."""
    data = bytearray(path.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]
    data[start:] = bytes(len(data) - start)
    path.write_bytes(data)


def test_what_the_demo_prints_for_exploring_works_as_printed(served, cluster, node_namespace):
    answer, _ = served
    out = io.StringIO()
    with redirect_stdout(out):
        print_explore(answer, cluster, node_namespace)
    printed = [line.strip() for line in out.getvalue().splitlines()]
    failure_at = next(i for i, line in enumerate(printed) if line.startswith(demo_serving.FAILURE_HEADING))
    lines, failure = printed[:failure_at], printed[failure_at:]
    # One line per engine, the reference among them, each URL at a pod IP of the real node.
    block = lines[: next(i for i, line in enumerate(lines) if line.startswith("A second request"))]
    engines = {line.split()[0]: line.split()[1] for line in block if line.split()[1:2] and "http://10.88.0." in line}
    assert set(engines) == {"encoder-0", "prefill-0", "decode-0", "proxy", "aggregated"}
    (base_url,) = [line.split("OpenAI base URL: ")[1].split()[0] for line in lines if "OpenAI base URL: " in line]
    assert base_url == answer.front_url + "/v1" and answer.front_url.startswith("http://10.96.")
    (envoy_url,) = [line.split()[1] for line in lines if line.startswith("envoy ")]
    assert envoy_url == answer.envoy.url + "/v1"
    (export,) = [line.split("kubectl", 1)[1].strip().split(";")[0] for line in lines if "export KUBECONFIG=" in line]
    kubectl_lines = [line.split(None, 1)[1] for line in lines if line.split()[:1] in (["logs"], ["exec"], ["operator"])]
    assert kubectl_lines and all(line.startswith(f"kubectl -n {node_namespace} ") for line in kubectl_lines)

    def bash(*commands: str) -> subprocess.CompletedProcess[str]:
        script = "\n".join([export, *commands])
        return subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script], check=False, capture_output=True, text=True, timeout=180
        )

    image, curl, sdk_line, messages_line, client_line = [
        line for line in lines if line.startswith(("IMG=", "curl ", sys.executable))
    ]
    before = payloads.finished_requests(answer.engine_urls["encoder-0"])
    ran = bash(image, curl, sdk_line, messages_line, client_line, *kubectl_lines)
    assert ran.returncode == 0, ran.stderr
    chat, sdk, messages_text, client, *kubectl_out = ran.stdout.strip().splitlines()
    # curl and the openai SDK through the front Service give the same greedy answer.
    assert repr(json.loads(chat)["choices"][0]["message"]["content"]) == sdk
    assert messages_text.startswith("'")  # the anthropic SDK's answer text
    # curl primed the picture; the openai SDK's same picture was found in the unit's EC store (not
    # primed); the anthropic SDK's block carries no key (vLLM drops it), and epd_client given the
    # encoder's URL primes it itself: 3 encoder requests for 4 doors.
    assert payloads.finished_requests(answer.engine_urls["encoder-0"]) - before == 3
    assert len(json.loads(client)) == 8
    assert any("Application startup complete" in line for line in kubectl_out)  # prefill-0's log

    # The failure recipe: with the encoder's engine stopped, the SDK gets the proxy's 502 naming the
    # picture, no consumer is asked; once it runs again the same request is answered as before.
    stop, refused_sdk, start = [line for line in failure if line.startswith(("kubectl ", sys.executable))]
    consumers = {name: answer.engine_urls[name] for name in ("prefill-0", "decode-0")}
    served = {name: payloads.served_requests(url) for name, url in consumers.items()}
    try:
        assert bash(stop).returncode == 0
        refused = bash(image, refused_sdk)
    finally:
        assert bash(start).returncode == 0
    assert refused.returncode != 0 and "openai.InternalServerError: Error code: 502" in refused.stderr
    assert "could not be encoded by the encoders, so the request was not forwarded" in refused.stderr
    assert "messages[0].content[0]" in refused.stderr
    assert {name: payloads.served_requests(url) for name, url in consumers.items()} == served
    again = bash(image, sdk_line)
    assert again.returncode == 0 and again.stdout.strip() == sdk, again.stderr
