"""An encoder whose engine core hangs, on the real node: its pod stays Ready (vLLM's /health
asks whether the core died, not whether it answers), and the unit's EPD proxy leaves it out
of priming after its failed prime requests, then takes it back once it answers again; once it
has had a request in flight and finished no step for stallSeconds, its liveness probe fails and
the kubelet restarts it.

The module's unit has two encoders and one regular consumer, and the proxy's outlier detection
tightened so the test is short: one prime attempt may take PRIME_ATTEMPT_SECONDS, FAILURES
failed ones in a row leave an encoder out for EJECTION_SECONDS; an engine stalled for
STALL_SECONDS fails its liveness probe (every 10 s, 3 failures in a row: failureThreshold 1).
The hang is the encoder's EngineCore process stopped (SIGSTOP from the host) while its API
server runs on.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
import urllib.request

import httpx
import pytest
import yaml

from epd_dev.demo_serving import front_service_url
from epd_dev.operator_process import wait_for
from epd_dev.vllm import payloads
from epd_dev.vllm.payloads import image_part, messages
from epd_dev.vllm.real_node import node_manifest
from tests.node.conftest import (
    chat_request,
    container_spec,
    deployed_ready,
    engine_core,
    get,
    kubelet_view,
    pod_ready,
    reference_url,
    scrape,
    sdk,
    server_load,
)

pytestmark = [pytest.mark.node, pytest.mark.cluster, pytest.mark.vllm]

NAME, MODEL = "tiny-outliers", "default"
PRIME_ATTEMPT_SECONDS = 5
FAILURES = 2
EJECTION_SECONDS = 30
PROXY_METRICS_PORT = 9401
# Over the FAILURES x PRIME_ATTEMPT_SECONDS the first test keeps a prime waiting on the hung one.
STALL_SECONDS = 30
LIVENESS_PATIENCE_SECONDS = 3 * 10
# A fresh image for each request, so each is primed.
COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30), (30, 200, 200), (200, 30, 200)]


@pytest.fixture(scope="module")
def deployed(cluster, helm_operator, node_namespace, tiny_model_claim, reference_applied):
    unit = node_manifest(
        NAME,
        tiny_model_claim,
        [{"workerType": "encoder", "numGpus": 2}, {"workerType": "regular", "numGpus": 1}],
        proxy={
            "primeTimeoutSeconds": 60,
            "primeAttemptTimeoutSeconds": PRIME_ATTEMPT_SECONDS,
            "outlierDetection": {"consecutiveFailures": FAILURES, "baseEjectionSeconds": EJECTION_SECONDS},
        },
    )
    unit["spec"]["probes"].update(stallSeconds=STALL_SECONDS, failureThreshold=1)
    cluster.kubectl("apply", "-n", node_namespace, "-f", "-", input=yaml.safe_dump(unit))
    yield deployed_ready(cluster, node_namespace, NAME)
    cluster.kubectl("delete", "epd", NAME, "-n", node_namespace, "--wait=false", check=False)


def unit_pod(cluster, namespace: str) -> dict:
    return dict(get(cluster, "pod", f"{NAME}-{MODEL}-0", "-n", namespace))


def encoder_url(pod: dict, container: str) -> str:
    return f"http://{pod['status']['podIP']}:{container_spec(pod, container)['ports'][0]['containerPort']}"


def health(url: str) -> int:
    with urllib.request.urlopen(url + "/health", timeout=5) as response:
        return int(response.status)


def test_a_hung_encoder_stays_ready_and_the_proxy_leaves_it_out_then_takes_it_back(
    cluster, deployed, node_namespace, reference
):
    pod = unit_pod(cluster, node_namespace)
    view = kubelet_view(pod)
    assert {"encoder-0", "encoder-1"} <= view.keys()
    healthy, hung = encoder_url(pod, "encoder-0"), encoder_url(pod, "encoder-1")
    assert set(deployed.unit.encoder_urls) == {healthy, hung}
    proxy = f"http://{pod['status']['podIP']}:{PROXY_METRICS_PORT}"
    client = sdk(front_service_url(cluster, node_namespace, NAME))
    expected = sdk(reference_url(reference))
    requests = [chat_request(messages(image_part(colour), text="one colour")) for colour in COLOURS]
    answers = [expected.chat.completions.create(**r).choices[0].token_ids for r in requests]

    core = engine_core(cluster.real_node(), view["encoder-1"][0])
    os.kill(core, signal.SIGSTOP)
    try:
        # Four probe periods later the kubelet still sees nothing wrong: what the proxy must catch.
        time.sleep(8)
        assert health(hung) == 200
        assert pod_ready(unit_pod(cluster, node_namespace))
        primed_before = payloads.finished_requests(healthy)
        took = []
        for request, answer in zip(requests, answers, strict=True):
            started = time.monotonic()
            got = client.chat.completions.create(**request)
            took.append(time.monotonic() - started)
            assert got.choices[0].token_ids == answer
        metrics = scrape(proxy)
        # Every image was primed on the healthy encoder; the parts sent to the hung one cost one
        # attempt each until it had failed FAILURES times in a row, and none after that.
        assert payloads.finished_requests(healthy) - primed_before == len(requests)
        slow = [i for i, seconds in enumerate(took) if seconds >= PRIME_ATTEMPT_SECONDS]
        assert len(slow) == FAILURES, took
        assert max(took[slow[-1] + 1 :]) < PRIME_ATTEMPT_SECONDS, took
        assert (metrics["epd_proxy_encoders_ejected"], metrics["epd_proxy_encoder_ejections_total"]) == (1, 1)
        pod = unit_pod(cluster, node_namespace)
        assert pod_ready(pod)
        assert {name: restarts for name, (_, restarts, _) in kubelet_view(pod).items()} == dict.fromkeys(view, 0)
    finally:
        os.kill(core, signal.SIGCONT)

    # Once its time out is over, the encoder gets its turn again, and answers.
    wait_for(lambda: scrape(proxy)["epd_proxy_encoders_ejected"] == 0, EJECTION_SECONDS + 10, "the ejection over")
    primed_before = payloads.finished_requests(hung)
    # Under a weights version of their own: stored under the default one, they would not be primed.
    for request, answer in zip(requests[:2], answers[:2], strict=True):
        again = client.chat.completions.create(**request, extra_headers={"X-EPD-Weights-Version": "after-ejection"})
        assert again.choices[0].token_ids == answer
    assert payloads.finished_requests(hung) - primed_before == 1
    assert scrape(proxy)["epd_proxy_encoder_ejections_total"] == 1


def test_a_hung_engine_core_with_a_request_waiting_fails_its_liveness_probe_and_is_restarted(
    cluster, deployed, node_namespace
):
    pod = unit_pod(cluster, node_namespace)
    view = kubelet_view(pod)
    hung = encoder_url(pod, "encoder-1")
    restarts = {name: restarts for name, (_, restarts, _) in view.items()}
    core = engine_core(cluster.real_node(), view["encoder-1"][0])
    os.kill(core, signal.SIGSTOP)
    stopped = time.monotonic()
    outcome: list[object] = []
    # A prime sent straight to it, as epd_client sends them: it waits in the API server.
    waiting = threading.Thread(
        target=lambda: outcome.append(_answer_or_error(hung, chat_request(messages(image_part((7, 70, 170)))))),
        daemon=True,
    )
    waiting.start()
    try:
        wait_for(
            lambda: kubelet_view(unit_pod(cluster, node_namespace))["encoder-1"][1] == restarts["encoder-1"] + 1,
            STALL_SECONDS + LIVENESS_PATIENCE_SECONDS + 60,
            "the kubelet to restart the stalled encoder",
        )
        took = time.monotonic() - stopped
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone with its container
            os.kill(core, signal.SIGCONT)
    # Not before it had stalled for STALL_SECONDS: /health answered 200 all along.
    assert took >= STALL_SECONDS, took
    waiting.join(timeout=60)
    assert outcome and isinstance(outcome[0], Exception), outcome  # the waiting request was cut, not answered
    # The kubelet's word: why it restarted the container (its Event), and the probe's output (its
    # log; the kubelet's Events of probe failures are rate-limited per pod, so not all are posted).
    name = pod["metadata"]["name"]
    events = get(cluster, "events", "-n", node_namespace, "--field-selector", f"involvedObject.name={name}")
    kills = [e["message"] for e in events["items"] if e["reason"] == "Killing"]
    assert "Init container encoder-1 failed liveness probe" in kills, kills
    kubelet = (cluster.logs / "kubelet.log").read_text()
    stalled = re.findall(
        rf'probeType="Liveness" pod="{node_namespace}/{name}" .*? containerName="encoder-1" probeResult="failure" '
        r"output=<\n\s*engine stalled: requests waited (\d+) s and no step finished",
        kubelet,
    )
    assert stalled and all(int(seconds) >= STALL_SECONDS for seconds in stalled), stalled
    after = {name: restarts for name, (_, restarts, _) in kubelet_view(unit_pod(cluster, node_namespace)).items()}
    assert after == {**restarts, "encoder-1": restarts["encoder-1"] + 1}


def _answer_or_error(url: str, request: dict) -> object:
    try:
        return sdk(url).chat.completions.create(**request)
    except Exception as error:  # noqa: BLE001 - what the waiting client got is the test's subject
        return error


def test_the_in_flight_count_the_check_reads_returns_to_zero_when_clients_leave(cluster, deployed, node_namespace):
    """vLLM's /load, which the liveness check reads: a count that clients leaving mid-answer
    left above zero would have an idle engine restarted once stallSeconds passed. The consumer's
    engine core is stopped while the clients wait (the tiny model answers within a blink), so
    that they leave before their answers end."""
    consumer = deployed.unit.consumer_urls[0]
    core = engine_core(cluster.real_node(), kubelet_view(unit_pod(cluster, node_namespace))["regular-0"][0])
    request = chat_request(messages(text="count"))
    request.update(request.pop("extra_body"))
    os.kill(core, signal.SIGSTOP)
    try:
        # A stream whose answer has begun (vLLM sends its head before the first token), left.
        with httpx.stream("POST", consumer + "/v1/chat/completions", json={**request, "stream": True}) as stream:
            assert stream.status_code == 200
            assert server_load(consumer) == 1  # the tracking is on (rendered for every engine)
        # A client that gives up before its answer (its timeout): the connection closed.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(consumer + "/v1/chat/completions", json=request, timeout=httpx.Timeout(60, read=2))
    finally:
        os.kill(core, signal.SIGCONT)
    wait_for(lambda: server_load(consumer) == 0, 30, "vLLM's /load back to 0 once both clients left")
