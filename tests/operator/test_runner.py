"""The operator process (runner.py): its event loop is uvloop, a runtime dependency on Linux, as
`kopf run` would pick it (docs/performance.md); its memo is shared by every watched object."""

from __future__ import annotations

import copy

import uvloop

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
