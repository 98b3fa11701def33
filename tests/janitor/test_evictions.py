"""Budget evictions reported to the EPDDeployment: a real janitor's metrics, parsed, judged and
scraped by the operator's coroutine (no cluster: the indexes are plain dicts)."""

from __future__ import annotations

import shutil
import urllib.request

import aiohttp
import kopf
import pytest

from epd_operator.ec.scrape import JanitorMetrics, JanitorScraper, eviction_report, parse_metrics
from epd_operator.ec.janitor import scan_store

from .store import new_store, publish
from .test_run import free_port, janitor_thread, wait_for

UNIT = "d-default-0"
KEY = ("ns", "d")


@pytest.fixture
def store():
    path = new_store()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def janitor(store):
    """A real janitor over a store of 6 embeddings with room for 2: it evicts 4 for budget."""
    for i in range(6):
        publish(store, f"h{i}", age=100 - i)
    size = scan_store(str(store))[0].bytes
    port = free_port()
    with janitor_thread([store], max_bytes=2 * size, interval_seconds=0.05, grace_seconds=0.3, metrics_port=port):
        wait_for(lambda: (m := _metrics(port)) and m.budget_evictions == 4)
        yield port, size


def _metrics(port: int) -> JanitorMetrics | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return parse_metrics(response.read().decode())


def test_parses_a_real_janitors_metrics(janitor):
    port, size = janitor
    assert _metrics(port) == JanitorMetrics(budget_evictions=4, store_bytes=2 * size, budget_bytes=2 * size)


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
        UNIT, None, JanitorMetrics(2, 0, 100))


def test_a_counter_below_the_last_report_is_a_new_janitor():
    assert "1 EC entries evicted for budget since its janitor started" in eviction_report(
        UNIT, 5, JanitorMetrics(1, 0, 100))
    assert eviction_report(UNIT, 5, JanitorMetrics(0, 0, 100)) is None


def _pod(name: str, ip: str) -> dict:
    return {"name": name, "metadata": {}, "spec": {},
            "status": {"phase": "Running", "podIP": ip, "containerStatuses": [{"name": "janitor", "ready": True}]}}


@pytest.fixture
def reported(janitor):
    """A scraper of the test janitor that records the Events it posts and the deployments whose
    status it asks to rewrite."""
    port, _size = janitor
    calls = {"events": [], "status": []}
    calls["scraper"] = JanitorScraper(warn=lambda body, reason, message: calls["events"].append((reason, message)),
                                      changed=calls["status"].append, port=port)
    return calls


async def _scrape(reported: dict, pods: list[dict], deployments: dict) -> None:
    scraper = reported["scraper"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3, connect=1)) as session:
        await scraper.scrape(session, deployments, {KEY: pods})


async def test_the_operator_warns_and_rewrites_the_status_when_evictions_grow(reported):
    deployments = {KEY: [kopf.Body({"metadata": {"namespace": "ns", "name": "d"}, "status": {}})]}
    # 192.0.2.1 (TEST-NET-1) never answers, like kwok's simulated pods: skipped without error.
    pods = [_pod(UNIT, "127.0.0.1"), _pod("d-default-1", "192.0.2.1")]
    await _scrape(reported, pods, deployments)
    assert reported["events"] == [("ECEvicted", reported["events"][0][1])]
    assert f"unit {UNIT}: 4 EC entries evicted for budget since its janitor started" in reported["events"][0][1]
    assert reported["status"] == [KEY]
    assert reported["scraper"].evictions(KEY) == {UNIT: 4}

    # Nothing new: neither an Event nor a status write.
    await _scrape(reported, pods, deployments)
    assert len(reported["events"]) == 1 and reported["status"] == [KEY]

    # The pod is gone: forgotten, and the status is rewritten without its count.
    await _scrape(reported, [], deployments)
    assert reported["scraper"].evictions(KEY) == {} and reported["status"] == [KEY, KEY]


async def test_after_an_operator_restart_the_status_is_the_baseline(reported):
    status = {"models": [{"name": "default", "units": [{"name": UNIT, "ecEvictions": 4}]}]}
    deployments = {KEY: [kopf.Body({"metadata": {"namespace": "ns", "name": "d"}, "status": status})]}
    await _scrape(reported, [_pod(UNIT, "127.0.0.1")], deployments)
    assert reported["events"] == []  # already reported by the previous process
    assert reported["scraper"].evictions(KEY) == {UNIT: 4}
