"""The operator process (runner.py): its event loop is uvloop, a runtime dependency on Linux, as
`kopf run` would pick it (docs/performance.md); its memo is shared by every watched object; kopf's
indexing gate wakes its waiters once (indexing_gate.py); its watch streams decode with orjson
(watch_decoding.py)."""

from __future__ import annotations

import asyncio
import copy
import inspect
import json

import uvloop
from kopf._cogs.aiokits import aiotoggles
from kopf._cogs.clients import api as kopf_api
from kopf._core.reactor import orchestration

from epd_operator import indexing_gate, watch_decoding
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
    indexing_gate.install()
    assert aiotoggles.ToggleSet is QuietToggleSet
    # kopf's orchestration builds the gate from the module's attribute, at run time.
    assert "aiotoggles.ToggleSet(all)" in inspect.getsource(orchestration)


def test_kopf_decodes_its_watch_streams_with_orjson_once_installed(monkeypatch):
    monkeypatch.setattr(kopf_api, "json", json)  # undone after the test
    watch_decoding.install()
    assert kopf_api.json.loads is watch_decoding.loads
    # kopf's watch stream calls its module's `json.loads`, at run time, on each line it reads.
    assert "json.loads(line.decode('utf-8'))" in inspect.getsource(kopf_api.stream)


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
