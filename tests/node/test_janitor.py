"""The janitor in the operator's unit pod on the real node: a small budget while a real encoder
primes images, and the consumer's silent fallback encodes counted, by the operator too.

The unit is the operator's pod for the tiny model (one encoder, one regular engine) with a budget
of a few embeddings, so evictions start as soon as entries leave the grace period. Its janitor is
the pod's own container (`epd-operator janitor`, the operator's image); the tests read its metrics
at the pod IP, its log with `kubectl logs`, and the store where the kubelet keeps the pod's
/dev/shm on the host. The same unit's engines also give the list of metrics a real vLLM engine
exports (the chart's dashboard is checked against it).
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from epd_dev.demo_serving import post
from epd_dev.operator_process import wait_for
from epd_dev.vllm import payloads, tiny_model
from epd_dev.vllm.real_node import node_manifest
from epd_operator.ec.janitor import EMBEDDING_FILE, GRACE_SECONDS
from tests.helm.dashboard import ENGINE_METRICS, read_metric_names
from tests.node.conftest import Deployed, deployed_ready, get, host_shm, scrape

pytestmark = [pytest.mark.node, pytest.mark.cluster, pytest.mark.vllm]

NAME = "tiny-janitor"
# One embedding of the tiny model: 16 tokens x 128 x bf16 = 4 KiB of data plus a header, two
# pages of tmpfs. The budget holds a few of them.
ENTRY_BYTES = 8192
BUDGET = 5 * ENTRY_BYTES
IMAGES = 30
# A janitor sweep (CLI default interval 2 s) plus slack: an entry older than this has been judged.
SETTLED_AFTER = GRACE_SECONDS + 4.0


class Unit:
    """The module's unit: its pod and the paths and URLs the tests use."""

    def __init__(self, cluster, namespace: str, deployed: Deployed) -> None:
        self.cluster, self.namespace = cluster, namespace
        self.name = deployed.unit.name
        self.pod = get(cluster, "pod", self.name, "-n", namespace)
        (self.encoder,) = deployed.unit.encoder_urls
        (self.consumer,) = deployed.unit.consumer_urls
        self.store = host_shm(self.pod) / Path(deployed.ec_storage_path).relative_to("/dev/shm")
        self.janitor = f"http://{self.pod['status']['podIP']}:9400"

    def logs(self, container: str) -> str:
        return self.cluster.kubectl("logs", "-n", self.namespace, self.name, "-c", container).stdout


@pytest.fixture(scope="module")
def unit(cluster, helm_operator, node_namespace, tiny_model_claim):
    manifest = node_manifest(
        NAME,
        tiny_model_claim,
        [{"workerType": "encoder", "numGpus": 1}, {"workerType": "regular", "numGpus": 1}],
        ecStorage={"maxBytes": BUDGET},
    )
    cluster.kubectl("apply", "-n", node_namespace, "-f", "-", input=yaml.safe_dump(manifest))
    yield Unit(cluster, node_namespace, deployed_ready(cluster, node_namespace, NAME))
    cluster.kubectl("delete", "epd", NAME, "-n", node_namespace, "--wait=false", check=False)


def test_a_small_budget_holds_while_a_real_encoder_primes_and_the_consumer_keeps_answering(unit):
    store, encoder, consumer = unit.store, unit.encoder, unit.consumer
    watcher = StoreWatcher(store)
    watcher.start()
    try:
        for i in range(IMAGES):
            part = payloads.image_part((i * 8 % 256, 255 - i * 8 % 256, 100))
            prime(encoder, part)
            rendered = post(consumer, "/v1/chat/completions/render", payloads.greedy(payloads.messages(part)))
            tokens, _ = payloads.output(post(consumer, "/inference/v1/generate", rendered))
            assert len(tokens) == 6  # the consumer keeps answering
            # The janitor never touches a fresh entry: what was just primed is there to read.
            (mm_hash,) = payloads.image_hashes(rendered)
            assert (store / mm_hash / EMBEDDING_FILE).stat().st_blocks * 512 == ENTRY_BYTES
        # Until every entry has been judged, then the store is within its budget.
        time.sleep(SETTLED_AFTER)
        metrics = scrape(unit.janitor)
    finally:
        watcher.stop()

    assert not watcher.partial_files, watcher.partial_files
    assert watcher.max_settled_bytes <= BUDGET
    assert watcher.entries_seen >= IMAGES
    assert metrics["epd_ec_store_bytes"] <= BUDGET
    assert metrics["epd_ec_store_entries"] <= BUDGET // ENTRY_BYTES
    assert metrics["epd_ec_evictions_total", "budget"] >= IMAGES - BUDGET // ENTRY_BYTES
    assert metrics["epd_ec_eviction_failures_total"] == 0
    assert sum(_du(store).values()) <= BUDGET

    # A consumer's cache miss (an image never primed): vLLM 0.32 encodes it itself, silently,
    # and its existence check leaves an empty folder, which the janitor removes once the grace
    # period is over.
    rendered = post(
        consumer, "/v1/chat/completions/render", payloads.greedy(payloads.messages(payloads.image_part((1, 2, 3))))
    )
    tokens, _ = payloads.output(post(consumer, "/inference/v1/generate", rendered))
    assert len(tokens) == 6
    miss = store / payloads.image_hashes(rendered)[0]
    assert miss.is_dir() and not any(miss.iterdir())
    deadline = time.monotonic() + SETTLED_AFTER + 5
    while miss.exists():
        assert time.monotonic() < deadline, "the cache miss's empty folder was not removed"
        time.sleep(0.5)
    assert scrape(unit.janitor)["epd_ec_evictions_total", "empty"] == 1
    assert "Traceback" not in unit.logs("regular-0")
    assert "Traceback" not in unit.logs("encoder-0")

    lines = [json.loads(line) for line in unit.logs("janitor").splitlines()]
    assert lines[0]["event"] == "started" and lines[0]["max_bytes"] == BUDGET
    budget_lines = [line for line in lines if line["event"] == "evicted" and line["reason"] == "budget"]
    assert budget_lines and all(line["youngest_age_seconds"] >= GRACE_SECONDS for line in budget_lines)


def test_a_request_whose_image_was_not_primed_counts_one_fallback_encode_and_a_primed_one_none(unit):
    """vLLM 0.32 answers both; only the unprimed one leaves the empty folder the janitor counts,
    and the operator, which scrapes the janitor, turns the count into an ECFallbackEncodes Event
    and the unit's status."""
    store, encoder, consumer = unit.store, unit.encoder, unit.consumer
    fallbacks_before = scrape(unit.janitor).get("epd_ec_fallback_encodes_total", 0)
    primed, unprimed = payloads.image_part((10, 200, 30)), payloads.image_part((200, 10, 30))
    prime(encoder, primed)
    hashes = {}
    for label, part in (("primed", primed), ("unprimed", unprimed)):
        rendered = post(consumer, "/v1/chat/completions/render", payloads.greedy(payloads.messages(part)))
        tokens, _ = payloads.output(post(consumer, "/inference/v1/generate", rendered))
        assert len(tokens) == 6  # both answered: the fallback is silent
        (hashes[label],) = payloads.image_hashes(rendered)
    assert payloads.ec_entries(store)[hashes["primed"]] == [EMBEDDING_FILE]
    assert payloads.ec_entries(store)[hashes["unprimed"]] == []

    deadline = time.monotonic() + SETTLED_AFTER + 5
    while (store / hashes["unprimed"]).exists():
        assert time.monotonic() < deadline, "the unprimed image's empty folder was not judged"
        time.sleep(0.5)
    time.sleep(3)  # at least one more sweep: the primed entry has settled too, and was judged
    metrics = scrape(unit.janitor)
    assert metrics["epd_ec_fallback_encodes_total"] - fallbacks_before == 1
    reported = [json.loads(line) for line in unit.logs("janitor").splitlines() if '"fallback_encodes"' in line]
    assert hashes["unprimed"] in [h for line in reported for h in line["mm_hashes"]]
    assert hashes["primed"] not in [h for line in reported for h in line["mm_hashes"]]

    def event() -> str | None:
        events = get(unit.cluster, "events", "-n", unit.namespace, "--field-selector", f"involvedObject.name={NAME}")
        found = [e["message"] for e in events["items"] if e["reason"] == "ECFallbackEncodes"]
        return found[-1] if found else None

    message = wait_for(event, 60, "the operator's ECFallbackEncodes Event")
    assert message.startswith(f"unit {unit.name}: ") and "encoded by its consumers themselves" in message

    def counted() -> bool:
        model = get(unit.cluster, "epd", NAME, "-n", unit.namespace)["status"]["models"][0]
        return bool(model.get("fallbackEncodes") == metrics["epd_ec_fallback_encodes_total"])

    wait_for(counted, 60, "the model's status to count its one unit's fallback encodes")


def test_the_engines_export_the_metrics_the_dashboard_may_name(unit):
    """Every metric name recorded in tests/helm (which the chart's dashboard is checked against)
    is one the real engines export; UPDATE_GOLDEN=1 records what they export now."""
    encoder, consumer = unit.encoder, unit.consumer
    part = payloads.image_part((5, 6, 7))
    prime(encoder, part)  # every engine has served a request: its request metrics have samples
    post(
        consumer,
        "/inference/v1/generate",
        post(consumer, "/v1/chat/completions/render", payloads.greedy(payloads.messages(part))),
    )
    exported = set()
    for engine in (encoder, consumer):
        with urllib.request.urlopen(engine + "/metrics", timeout=10) as response:
            text = response.read().decode()
        exported |= {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:num_requests_running"} <= exported
    if os.environ.get("UPDATE_GOLDEN") == "1":
        ENGINE_METRICS.write_text("".join(f"{name}\n" for name in sorted(exported)))
    recorded = read_metric_names(ENGINE_METRICS)
    assert recorded <= exported, (
        f"{sorted(recorded - exported)} are recorded in {ENGINE_METRICS.name} but not exported by vLLM now: "
        "rerun with UPDATE_GOLDEN=1 and fix the dashboard panels that name them"
    )


def prime(encoder: str, part: dict) -> None:
    """Vime's prime_encoder request for one image: an image-only message, one token."""
    post(
        encoder,
        "/v1/chat/completions",
        {
            "model": tiny_model.SERVED_NAME,
            "max_tokens": 1,
            "stream": False,
            "messages": [{"role": "user", "content": [part]}],
        },
    )


def _du(store: Path, older_than: float = 0.0) -> dict[str, int]:
    """Bytes of each entry last changed more than `older_than` seconds ago, measured here."""
    now, sizes = time.time(), {}
    for folder in list(store.glob("*")):
        try:
            stats = [folder.stat(), *(f.stat() for f in folder.iterdir())]
        except FileNotFoundError:
            continue  # evicted meanwhile
        if now - max(s.st_mtime for s in stats) > older_than:
            sizes[folder.name] = sum(s.st_blocks * 512 for s in stats[1:])
    return sizes


def _complete(path: Path) -> bool:
    """A whole safetensors file: 8-byte header length, the JSON header, every tensor's bytes."""
    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    end = max(t["data_offsets"][1] for k, t in header.items() if k != "__metadata__")
    return len(data) == 8 + length + end


class StoreWatcher(threading.Thread):
    """Looks at the store every few milliseconds, as consumers do: every embedding file visible
    must be complete, and settled entries must fit in the budget."""

    def __init__(self, store: Path) -> None:
        super().__init__(daemon=True)
        self.store, self.partial_files, self.max_settled_bytes = store, [], 0
        self.seen: set[str] = set()
        self._stop_event = threading.Event()

    @property
    def entries_seen(self) -> int:
        return len(self.seen)

    def run(self) -> None:
        while not self._stop_event.wait(0.02):
            for path in self.store.glob(f"*/{EMBEDDING_FILE}"):
                try:
                    if not _complete(path):
                        self.partial_files.append(str(path))
                    self.seen.add(path.parent.name)
                except FileNotFoundError:
                    pass  # evicted between the listing and the read
            self.max_settled_bytes = max(self.max_settled_bytes, sum(_du(self.store, SETTLED_AFTER).values()))

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)
