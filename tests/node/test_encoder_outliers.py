"""An encoder whose engine core hangs, on the real node: its pod stays Ready (vLLM's /health
asks whether the core died, not whether it answers), and the unit's EPD proxy leaves it out
of priming after its failed prime requests, then takes it back once it answers again.

The module's unit has two encoders and one regular consumer, and the proxy's outlier detection
tightened so the test is short: one prime attempt may take PRIME_ATTEMPT_SECONDS, FAILURES
failed ones in a row leave an encoder out for EJECTION_SECONDS. The hang is the encoder's
EngineCore process stopped (SIGSTOP from the host) while its API server runs on.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import pytest
import yaml

from epd_dev.demo_serving import front_service_url
from epd_dev.operator_process import wait_for
from epd_dev.vllm import payloads
from epd_dev.vllm.payloads import image_part, messages
from epd_dev.vllm.real_node import node_manifest
from tests.node.conftest import (
    chat_request,
    deployed_ready,
    engine_core,
    get,
    kubelet_view,
    pod_ready,
    reference_url,
    scrape,
    sdk,
)

pytestmark = [pytest.mark.node, pytest.mark.cluster, pytest.mark.vllm]

NAME, MODEL = "tiny-outliers", "default"
PRIME_ATTEMPT_SECONDS = 5
FAILURES = 2
EJECTION_SECONDS = 30
PROXY_METRICS_PORT = 9401
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
    cluster.kubectl("apply", "-n", node_namespace, "-f", "-", input=yaml.safe_dump(unit))
    yield deployed_ready(cluster, node_namespace, NAME)
    cluster.kubectl("delete", "epd", NAME, "-n", node_namespace, "--wait=false", check=False)


def unit_pod(cluster, namespace: str) -> dict:
    return dict(get(cluster, "pod", f"{NAME}-{MODEL}-0", "-n", namespace))


def encoder_url(pod: dict, container: str) -> str:
    (spec,) = [c for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"] if c["name"] == container]
    return f"http://{pod['status']['podIP']}:{spec['ports'][0]['containerPort']}"


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
    for request, answer in zip(requests[:2], answers[:2], strict=True):
        assert client.chat.completions.create(**request).choices[0].token_ids == answer
    assert payloads.finished_requests(hung) - primed_before == 1
    assert scrape(proxy)["epd_proxy_encoder_ejections_total"] == 1
