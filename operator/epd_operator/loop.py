"""The event loop of the operator's long-running commands (`run`, `proxy`, `gateway`)."""

from __future__ import annotations

import asyncio
import signal


def event_loop() -> asyncio.Runner:
    """uvloop's event loop where installed (a dependency on Linux), as `kopf run` picks it:
    every watch event, API call and proxied request passes through the loop (docs/performance.md)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM (the kubelet stopping the pod) or SIGINT: serve until it is set."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
