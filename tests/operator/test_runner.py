"""The operator process (runner.py): its event loop is uvloop, a runtime dependency on Linux, as
`kopf run` would pick it (docs/performance.md); its memo is shared by every watched object; kopf's
indexing gate wakes its waiters once (indexing_gate.py); its watch streams decode with orjson
(watch_decoding.py)."""

from __future__ import annotations

import asyncio
import copy
import importlib.metadata
import inspect
import json
import logging

import pytest
import uvloop
from kopf._cogs.aiokits import aiotoggles
from kopf._cogs.clients import api as kopf_api
from kopf._core.reactor import orchestration
from packaging.requirements import Requirement

from epd_operator import indexing_gate, kopf_source, watch_decoding
from epd_operator.indexing_gate import QuietToggleSet
from epd_operator.loop import event_loop
from epd_operator.runner import SharedMemo


def test_the_operator_runs_on_uvloop():
    with event_loop() as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)


def test_every_watched_object_shares_the_one_memo():
    # kopf makes each object's memo with copy.copy(memobase): a copy per object is memory per object.
    memo = SharedMemo(reconciler="the reconciler")
    assert copy.copy(memo) is memo
    assert memo.reconciler == "the reconciler"  # still kopf's attribute-style Memo


async def test_the_indexing_gate_wakes_its_waiters_only_when_it_opens(monkeypatch):
    """kopf holds every listed object's worker on one ToggleSet until every index is filled;
    kopf's own set wakes them all on each of its n changes (n^2 at a restart beside thousands of
    objects), this one on the one change they wait for."""
    gate = QuietToggleSet(all)
    blocker = await gate.make_toggle(name="orchestration blocker")
    wakeups = 0
    notify_all = gate._condition.notify_all

    def counted() -> None:
        nonlocal wakeups
        wakeups += len(gate._condition._waiters)
        notify_all()

    monkeypatch.setattr(gate._condition, "notify_all", counted)
    waiters = [asyncio.create_task(gate.wait_for(True)) for _ in range(500)]
    await asyncio.sleep(0)  # every waiter waits
    toggles = [await gate.make_toggle(name=f"object {i}") for i in range(500)]
    for toggle in toggles:
        await gate.drop_toggle(toggle)
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters) and wakeups == 0  # still closed: nobody woken
    await gate.drop_toggle(blocker)
    await asyncio.wait_for(asyncio.gather(*waiters), 5)  # open: every waiter through, woken once
    assert wakeups == 500


def test_kopf_makes_its_gates_of_the_quiet_kind_once_installed(monkeypatch):
    monkeypatch.setattr(aiotoggles, "ToggleSet", aiotoggles.ToggleSet)  # undone after the test
    assert indexing_gate.install()
    assert aiotoggles.ToggleSet is QuietToggleSet
    # kopf's orchestration builds the gate from the module's attribute, at run time.
    assert "aiotoggles.ToggleSet(all)" in inspect.getsource(orchestration)


def test_kopf_decodes_its_watch_streams_with_orjson_once_installed(monkeypatch):
    monkeypatch.setattr(kopf_api, "json", json)  # undone after the test
    assert watch_decoding.install()
    assert kopf_api.json.loads is watch_decoding.loads
    # kopf's watch stream calls its module's `json.loads`, at run time, on each line it reads, and
    # nothing else in the module uses the name (the replacement has only `loads`).
    source = inspect.getsource(kopf_api)
    assert "json.loads(line.decode('utf-8'))" in inspect.getsource(kopf_api.stream)
    assert source.count(" json.") == source.count("json.loads(line.decode('utf-8'))") == 1


@pytest.mark.parametrize(
    ("module", "tested"),
    [(aiotoggles, indexing_gate.AIOTOGGLES_SHA256), (kopf_api, watch_decoding.API_SHA256)],
    ids=["aiotoggles", "api"],
)
def test_the_kopf_modules_the_operator_patches_are_the_ones_it_was_written_against(module, tested):
    """Fails when a kopf release (pyproject.toml allows the tested minor's patch releases) changes
    a module the operator replaces a name in: re-read the patch against the new code, then
    record the new digest and version in indexing_gate.py / watch_decoding.py and kopf_source.py."""
    assert kopf_source.digest(module) == tested, (
        f"kopf {importlib.metadata.version('kopf')} changed {module.__name__} since kopf "
        f"{kopf_source.TESTED_KOPF}: check the patch against it"
    )


def test_kopf_is_pinned_to_the_minor_the_patches_were_tested_with():
    (pin,) = [r for r in map(Requirement, importlib.metadata.requires("epd-operator") or []) if r.name == "kopf"]
    major, minor, patch = (int(n) for n in kopf_source.TESTED_KOPF.split("."))
    allowed = {
        f"{major}.{minor - 1}.99",
        kopf_source.TESTED_KOPF,
        f"{major}.{minor}.{patch + 1}",
        f"{major}.{minor + 1}.0",
    }
    assert set(pin.specifier.filter(allowed)) == {kopf_source.TESTED_KOPF, f"{major}.{minor}.{patch + 1}"}


def test_a_changed_kopf_module_is_left_unpatched_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(aiotoggles, "ToggleSet", aiotoggles.ToggleSet)
    monkeypatch.setattr(kopf_api, "json", json)
    monkeypatch.setattr(indexing_gate, "AIOTOGGLES_SHA256", "0" * 64)
    monkeypatch.setattr(watch_decoding, "API_SHA256", "0" * 64)
    with caplog.at_level(logging.WARNING):
        assert not indexing_gate.install()
        assert not watch_decoding.install()
    assert aiotoggles.ToggleSet is not QuietToggleSet and kopf_api.json is json
    assert "the quiet indexing gate is not installed: kopf's kopf._cogs.aiokits.aiotoggles differs" in caplog.text
    assert "orjson decoding of watch streams is not installed" in caplog.text


def test_a_watch_line_decodes_to_what_the_standard_library_gives():
    event = {
        "type": "MODIFIED",
        "object": {
            "metadata": {"name": "épd-0", "labels": {"a": "b"}, "generation": 3},
            "spec": {"replicas": 2, "ratio": 0.25, "empty": {}, "none": None, "flag": True},
            "status": {"conditions": [{"type": "Ready", "status": "True", "message": '☃ "quoted"\n'}]},
        },
    }
    line = json.dumps(event)
    assert watch_decoding.loads(line) == json.loads(line) == event


def test_a_line_orjson_refuses_is_decoded_by_the_standard_library():
    # orjson refuses a lone surrogate, json takes it: a watch must not stop on such an object.
    line = '{"type": "ADDED", "object": {"metadata": {"annotations": {"note": "\\ud800"}}}}'
    assert watch_decoding.loads(line)["object"]["metadata"]["annotations"]["note"] == "\ud800"
