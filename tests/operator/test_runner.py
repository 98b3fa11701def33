"""The operator process's event loop (runner.py): uvloop, a runtime dependency on Linux, as
`kopf run` would pick it (docs/performance.md)."""

from __future__ import annotations

import uvloop

from epd_operator.runner import event_loop


def test_the_operator_runs_on_uvloop():
    with event_loop() as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)
