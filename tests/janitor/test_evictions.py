"""Budget evictions and fallback encodes reported to the EPDDeployment: a real janitor's metrics,
parsed, judged and scraped by the operator's coroutine (no cluster: the indexes are plain dicts)."""

from __future__ import annotations

import shutil
import time
import urllib.request

import aiohttp
import kopf
import pytest
import yaml

from epd_dev.paths import REPO
from epd_operator.cli import build_parser
from epd_operator.ec.janitor import scan_store
from epd_operator.ec.scrape import JanitorMetrics, JanitorScraper, eviction_report, fallback_report, parse_metrics
from epd_operator.indexes import DeploymentSummary, Indexes, PodSummary, StatefulSetSummary
from epd_operator.kube import KubeSession
from epd_operator.metrics import OperatorMetrics
from epd_operator.plans import PlanCache
from epd_operator.status_writer import StatusWriter

from .store import miss, new_store, publish
from .test_run import free_port, janitor_thread, wait_for

UNIT = "d-default-0"
KEY = ("ns", "d")
EXAMPLES = REPO / "docs" / "examples"


@pytest.fixture
def store():
    path = new_store()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def janitor(store):
    """A real janitor over a store of 6 embeddings with room for 2 and a consumer's cache miss: it
    evicts 4 for budget and counts 1 fallback encode."""
    for i in range(6):
        publish(store, f"h{i}", age=100 - i)
    size = scan_store(str(store))[0].bytes
    miss(store, "missed", age=50)
    port = free_port()
    with janitor_thread([store], max_bytes=2 * size, interval_seconds=0.05, grace_seconds=0.3, metrics_port=port):
        wait_for(lambda: (m := _metrics(port)) and m.budget_evictions == 4 and m.fallback_encodes == 1)
        yield port, size


def _metrics(port: int) -> JanitorMetrics | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return parse_metrics(response.read().decode())


def test_parses_a_real_janitors_metrics(janitor):
    port, size = janitor
    assert _metrics(port) == JanitorMetrics(
        budget_evictions=4, store_bytes=2 * size, budget_bytes=2 * size, fallback_encodes=1
    )


def test_text_without_janitor_metrics_is_none():
    assert parse_metrics("# TYPE other_total counter\nother_total 3\n") is None


def test_reports_only_growth():
    metrics = JanitorMetrics(budget_evictions=7, store_bytes=3 * 2**20, budget_bytes=4 * 2**20)
    message = eviction_report(UNIT, 4, metrics)
    assert message.startswith(f"unit {UNIT}: 3 EC entries evicted for budget since the last report")
    assert "holds 3.0Mi of its 4.0Mi budget" in message
    assert eviction_report(UNIT, 7, metrics) is None


def test_first_sight_reports_what_the_janitor_counted_if_anything():
    assert eviction_report(UNIT, None, JanitorMetrics(0, 0, 100)) is None
    assert "2 EC entries evicted for budget since its janitor started" in eviction_report(
        UNIT, None, JanitorMetrics(2, 0, 100)
    )


def test_fallback_encodes_report_only_growth_and_say_what_to_do():
    metrics = JanitorMetrics(budget_evictions=0, store_bytes=0, budget_bytes=100, fallback_encodes=5)
    message = fallback_report(UNIT, 2, metrics)
    assert message.startswith(f"unit {UNIT}: 3 images encoded by its consumers themselves since the last report")
    assert "Prime each image on this unit's encoder" in message and "docs/operations.md" in message
    assert fallback_report(UNIT, 5, metrics) is None
    assert "5 images encoded by its consumers themselves since its janitor started" in fallback_report(
        UNIT, None, metrics
    )
    assert ": 1 image encoded" in fallback_report(UNIT, 7, JanitorMetrics(0, 0, 100, fallback_encodes=1))  # new janitor
    # A janitor older than this count exports none: nothing to report, nothing made up.
    assert fallback_report(UNIT, None, JanitorMetrics(0, 0, 100)) is None


def test_a_janitor_without_the_fallback_counter_parses_with_none():
    text = '# TYPE epd_ec_evictions_total counter\nepd_ec_evictions_total{path="/s",reason="budget"} 3\n'
    assert parse_metrics(text) == JanitorMetrics(budget_evictions=3, store_bytes=0, budget_bytes=0)


def test_a_counter_below_the_last_report_is_a_new_janitor():
    assert "1 EC entries evicted for budget since its janitor started" in eviction_report(
        UNIT, 5, JanitorMetrics(1, 0, 100)
    )
    assert eviction_report(UNIT, 5, JanitorMetrics(0, 0, 100)) is None


OWNER_UID = "epd-uid"
UNITS_UID = "statefulset-uid"  # the deployment's own StatefulSet of units (_indexes)


def _pod(name: str, ip: str, controller: str = UNITS_UID) -> PodSummary:
    return PodSummary.of(
        {
            "metadata": {
                "name": name,
                "ownerReferences": [{"kind": "StatefulSet", "uid": controller, "controller": True}],
            },
            "spec": {},
            "status": {"phase": "Running", "podIP": ip, "containerStatuses": [{"name": "janitor", "ready": True}]},
        }
    )


@pytest.fixture
def reported(janitor):
    """A scraper of the test janitor that records the Events it posts and the deployments whose
    status it asks to rewrite."""
    port, _size = janitor
    calls = {"events": [], "status": []}
    calls["scraper"] = JanitorScraper(
        warn=lambda body, reason, message: calls["events"].append((reason, message)),
        changed=calls["status"].append,
        port=port,
    )
    return calls


async def _scrape(reported: dict, pods: list[dict], deployments: dict) -> None:
    scraper = reported["scraper"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3, connect=1)) as session:
        await scraper.scrape(session, _indexes(deployments, {KEY: pods}))


async def test_the_operator_warns_and_rewrites_the_status_when_evictions_grow(reported):
    deployments = {KEY: [_indexed({})]}
    # 192.0.2.1 (TEST-NET-1) never answers, like kwok's simulated pods: skipped without error.
    pods = [_pod(UNIT, "127.0.0.1"), _pod("d-default-1", "192.0.2.1")]
    await _scrape(reported, pods, deployments)
    events = dict(reported["events"])
    assert [reason for reason, _ in reported["events"]] == ["ECEvicted", "ECFallbackEncodes"]
    assert f"unit {UNIT}: 4 EC entries evicted for budget since its janitor started" in events["ECEvicted"]
    assert f"unit {UNIT}: 1 image encoded by its consumers themselves" in events["ECFallbackEncodes"]
    assert reported["status"] == [KEY]
    assert reported["scraper"].evictions(KEY) == {UNIT: 4}
    assert reported["scraper"].fallback_encodes(KEY) == {UNIT: 1}

    # Nothing new: neither an Event nor a status write.
    await _scrape(reported, pods, deployments)
    assert len(reported["events"]) == 2 and reported["status"] == [KEY]

    # The pod is gone: forgotten, and the status is rewritten without its counts.
    await _scrape(reported, [], deployments)
    assert reported["scraper"].evictions(KEY) == {} and reported["scraper"].fallback_encodes(KEY) == {}
    assert reported["status"] == [KEY, KEY]


async def test_only_pods_of_the_deployments_own_statefulsets_are_scraped(reported):
    """Anyone can put the operator's labels on a pod: one another controller made, or one of a
    StatefulSet the deployment does not control, is never scraped."""
    deployments = {KEY: [_indexed({})]}
    await _scrape(reported, [_pod(UNIT, "127.0.0.1", controller="someone-elses")], deployments)
    assert reported["scraper"].evictions(KEY) == {} and reported["events"] == []


async def test_a_round_scrapes_at_most_rate_janitors_a_second(janitor):
    """Thousands of units must not keep the operator busy: the scrapes of a round are spread."""
    port, _size = janitor
    scraper = JanitorScraper(warn=lambda *_: None, changed=lambda _key: None, port=port, rate=20)
    units = [f"d-default-{i}" for i in range(6)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3, connect=1)) as session:
        started = time.monotonic()
        await scraper.scrape(
            session, _indexes({KEY: [_indexed({})]}, {KEY: [_pod(unit, "127.0.0.1") for unit in units]})
        )
        elapsed = time.monotonic() - started
    assert scraper.evictions(KEY) == {unit: 4 for unit in units}  # every one scraped
    assert elapsed >= 5 / 20  # six local scrapes take a few ms unspread


def test_the_scrape_rate_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--janitor-scrape-rate", "0"])
    assert "--janitor-scrape-rate: must be a positive number, not 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="must be positive"):
        JanitorScraper(warn=lambda *_: None, changed=lambda _key: None, rate=0)


async def test_after_an_operator_restart_the_first_round_is_the_baseline(reported):
    """The status keeps each model's sums, not every unit's counts: a process that finds counts
    reported takes its first scrape of each unit as what was told already."""
    status = {"models": [{"name": "default", "ecEvictions": 4, "fallbackEncodes": 1}]}
    deployments = {KEY: [_indexed(status)]}
    await _scrape(reported, [_pod(UNIT, "127.0.0.1")], deployments)
    assert reported["events"] == []  # already reported by the previous process
    assert reported["scraper"].evictions(KEY) == {UNIT: 4}
    assert reported["scraper"].fallback_encodes(KEY) == {UNIT: 1}


async def test_a_status_written_before_fallbacks_were_counted_reports_them_once(reported):
    """An operator upgraded from a version without the count: the status has ecEvictions only."""
    status = {"models": [{"name": "default", "ecEvictions": 4}]}
    deployments = {KEY: [_indexed(status)]}
    await _scrape(reported, [_pod(UNIT, "127.0.0.1")], deployments)
    assert [reason for reason, _ in reported["events"]] == ["ECFallbackEncodes"]


def _indexes(deployments: dict, pods: dict, owner: str = OWNER_UID) -> Indexes:
    units = StatefulSetSummary(name="d-default", spec_hash="h", uid=UNITS_UID, controller_uid=owner)
    return Indexes(
        deployments=deployments, stateful_sets={key: [units] for key in pods}, services={}, budgets={}, pods=pods
    )


def _indexed(status: dict) -> DeploymentSummary:
    return DeploymentSummary.of(
        {
            "apiVersion": "epd.vime.dev/v1alpha1",
            "kind": "EPDDeployment",
            "metadata": {"namespace": "ns", "name": "d", "uid": OWNER_UID},
            "status": status,
        }
    )


async def test_the_counts_reach_the_status_the_reconciler_writes(janitor):
    """The real janitor's counts, scraped, in the status a reconcile writes: per model and in all
    (where `kubectl get` can show them)."""
    port, _size = janitor
    manifest = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())
    manifest["metadata"].update(namespace="ns", uid="uid-1", generation=1)
    body = kopf.Body(manifest)
    key, unit = ("ns", "qwen-vl-regular"), "qwen-vl-regular-default-0"
    patched = []

    class Kube:  # records the status patch instead of sending it
        async def patch_status(self, namespace, name, status):
            patched.append(status)

    scraper = JanitorScraper(warn=lambda *_: None, changed=lambda _key: None, port=port)
    writer = StatusWriter(KubeSession(Kube()), scraper, OperatorMetrics(), warn=lambda *_: None, inform=lambda *_: None)
    indexes = _indexes({key: [DeploymentSummary.of(body)]}, {key: [_pod(unit, "127.0.0.1")]}, owner="uid-1")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3, connect=1)) as session:
        await scraper.scrape(session, indexes)
    await writer.write(key, body, PlanCache(8, "epd-operator:test").plan(body), indexes)

    (status,) = patched
    (model,) = status["models"]
    assert (model["ecEvictions"], model["fallbackEncodes"]) == (4, 1) and status["fallbackEncodes"] == 1


async def test_a_pod_answering_more_than_a_janitor_would_is_not_read(tmp_path):
    """The scrape reads at most 1 MiB of an answer: a pod that streams more is skipped."""
    from aiohttp import web

    async def flood(_request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(_request)
        chunk = b"# " + b"x" * 65534 + b"\n"
        for _ in range(64):  # 4 MiB of comments, then what a janitor would say
            await response.write(chunk)
        await response.write(b'epd_ec_evictions_total{path="/s",reason="budget"} 3\n')
        return response

    app = web.Application()
    app.router.add_get("/metrics", flood)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        scraper = JanitorScraper(warn=lambda *_: None, changed=lambda _key: None, port=port)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10, connect=1)) as session:
            await scraper.scrape(session, _indexes({KEY: [_indexed({})]}, {KEY: [_pod(UNIT, "127.0.0.1")]}))
        assert scraper.evictions(KEY) == {}
    finally:
        await runner.cleanup()
