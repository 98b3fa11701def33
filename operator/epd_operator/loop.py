"""The event loop of the operator's long-running commands (`run`, `proxy`)."""

from __future__ import annotations

import asyncio


def event_loop() -> asyncio.Runner:
    """uvloop's event loop where installed (a dependency on Linux), as `kopf run` picks it:
    every watch event, API call and proxied request passes through the loop (docs/performance.md)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)
