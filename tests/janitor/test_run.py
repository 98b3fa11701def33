"""The janitor loop: real sweeps in a thread, its /metrics endpoint, its JSON logs, its CLI."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epd_operator.ec.janitor import run_janitor, scan_store

from .store import miss, new_store, publish, writing


@pytest.fixture
def store():
    path = new_store()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the endpoint, keyed by (name, sorted labels without `path`)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "path"))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def wait_for(condition, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except urllib.error.URLError:  # the endpoint is not up yet
            value = None
        if value:
            return value
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@contextmanager
def janitor_thread(paths: list[Path], **options):
    stop = threading.Event()
    thread = threading.Thread(
        target=run_janitor, kwargs={"paths": [str(p) for p in paths], "stop": stop, **options}, daemon=True
    )
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_sweeps_hold_the_budget_and_report_it(store, capsys):
    for i in range(8):
        publish(store, f"h{i}", age=100 - i)
    size = scan_store(str(store))[0].bytes
    port = free_port()
    budget = 3 * size
    with janitor_thread([store], max_bytes=budget, interval_seconds=0.05, grace_seconds=0.3, metrics_port=port):
        metrics = wait_for(lambda: (m := scrape(port))[("epd_ec_evictions_total", (("reason", "budget"),))] and m)
        assert sorted(os.listdir(store)) == ["h5", "h6", "h7"]
        assert metrics[("epd_ec_evictions_total", (("reason", "budget"),))] == 5
        assert metrics[("epd_ec_store_bytes", ())] == budget
        assert metrics[("epd_ec_store_entries", ())] == 3
        assert metrics[("epd_ec_store_budget_bytes", ())] == budget

        # A consumer's cache miss, then new embeddings: cleaned up and evicted on later sweeps.
        miss(store, "miss")
        publish(store, "new")
        wait_for(lambda: scrape(port)[("epd_ec_evictions_total", (("reason", "empty"),))] == 1)
        metrics = wait_for(lambda: (m := scrape(port))[("epd_ec_evictions_total", (("reason", "budget"),))] == 6 and m)
        assert sorted(os.listdir(store)) == ["h6", "h7", "new"]
        assert metrics[("epd_ec_evictions_total", (("reason", "ttl"),))] == 0
        assert metrics[("epd_ec_eviction_failures_total", ())] == 0

    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["event"] == "started" and lines[0]["max_bytes"] == budget
    assert lines[-1]["event"] == "stopped"
    evicted = [line for line in lines if line["event"] == "evicted"]
    assert sum(line["entries"] for line in evicted if line["reason"] == "budget") == 6
    assert all(line["path"] == str(store) and line["youngest_age_seconds"] >= 0.3 for line in evicted)


def test_ttl_evictions_are_counted(store):
    publish(store, "stale", age=120)
    publish(store, "fresh", age=1)
    port = free_port()
    with janitor_thread([store], max_bytes=10**12, ttl_seconds=60, interval_seconds=0.05, metrics_port=port):
        wait_for(lambda: scrape(port)[("epd_ec_evictions_total", (("reason", "ttl"),))] == 1)
    assert os.listdir(store) == ["fresh"]


def test_a_store_not_written_yet_is_watched_but_never_created(store):
    missing = store / "vime-ec-model"
    port = free_port()
    with janitor_thread([missing], max_bytes=1, interval_seconds=0.05, metrics_port=port):
        wait_for(lambda: scrape(port))
        time.sleep(0.3)
        assert scrape(port)[("epd_ec_store_entries", ())] == 0
        assert not missing.exists()
        # The connector creates it on its first write: the janitor picks it up from then on.
        publish(missing, "first", age=60)
        wait_for(lambda: scrape(port)[("epd_ec_evictions_total", (("reason", "budget"),))] == 1)


def test_failed_evictions_are_counted_and_logged_and_the_loop_goes_on(store, monkeypatch, capsys):
    publish(store, "locked", age=60)  # e.g. written by an engine running as another user
    real_unlink = os.unlink

    def denied(path, *args, **kwargs):
        if "/locked/" in path:
            raise PermissionError(13, "Permission denied", path)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", denied)
    port = free_port()
    with janitor_thread([store], max_bytes=0, interval_seconds=0.05, metrics_port=port):
        wait_for(lambda: scrape(port)[("epd_ec_eviction_failures_total", ())] >= 2)  # still sweeping
    failures = [json.loads(line) for line in capsys.readouterr().out.splitlines() if '"eviction_failed"' in line]
    assert failures[0]["level"] == "error" and failures[0]["first"] == "locked"
    assert "Permission denied" in failures[0]["error"]


FALLBACKS = ("epd_ec_fallback_encodes_total", ())
EMPTY = ("epd_ec_evictions_total", (("reason", "empty"),))


def test_each_cache_miss_is_counted_once_as_a_fallback_encode(store, monkeypatch, capsys):
    """A consumer's cache miss leaves an empty folder: counted once when it has settled, whether
    its removal works at once, fails and is retried, or the folder comes back as a new miss."""
    port = free_port()
    real_rmdir = os.rmdir
    stuck = {"fail": True}

    def rmdir(path, *args, **kwargs):
        if path.endswith("/stuck") and stuck["fail"]:
            raise PermissionError(13, "Permission denied", path)
        return real_rmdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", rmdir)
    with janitor_thread([store], max_bytes=10**12, interval_seconds=0.05, grace_seconds=0.3, metrics_port=port):
        wait_for(lambda: scrape(port))
        miss(store, "a")
        miss(store, "stuck")
        writing(store, "abandoned")  # an encoder died mid-write: removed, but not a consumer's miss
        publish(store, "primed")
        wait_for(lambda: scrape(port)[EMPTY] == 2 and scrape(port)[("epd_ec_eviction_failures_total", ())] >= 3)
        metrics = scrape(port)
        assert metrics[FALLBACKS] == 2  # a and stuck, though stuck failed on every sweep since
        assert sorted(os.listdir(store)) == ["primed", "stuck"]

        stuck["fail"] = False  # its removal works now: still the same miss
        wait_for(lambda: not (store / "stuck").exists())
        miss(store, "a")  # the same image missed again later: another fallback encode
        wait_for(lambda: scrape(port)[EMPTY] == 4)
        assert scrape(port)[FALLBACKS] == 3

    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    reported = [line for line in lines if line["event"] == "fallback_encodes"]
    assert all(line["level"] == "warning" and line["path"] == str(store) for line in reported)
    assert sorted(h for line in reported for h in line["mm_hashes"]) == ["a", "a", "stuck"]
    assert sum(line["entries"] for line in reported) == 3


def test_the_cli_stops_promptly_on_sigterm(store):
    """As a container's PID 1 the janitor must handle SIGTERM itself, or the pod's shutdown hangs."""
    cli = Path(sys.executable).with_name("epd-operator")
    proc = subprocess.Popen(
        [str(cli), "janitor", "--path", str(store), "--max-bytes", "1000", "--interval", "0.1"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert json.loads(proc.stdout.readline())["event"] == "started"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert json.loads(proc.stdout.read().splitlines()[-1])["event"] == "stopped"
    finally:
        proc.kill()
        proc.wait()
