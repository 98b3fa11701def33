"""A work queue of object keys, as controller-runtime's: event handlers only add a key; a fixed
number of workers reconcile keys, reading the latest state from the indexes.

- A key waiting in the queue is there once, however many events named it meanwhile.
- A key is never reconciled by two workers at once; added while being reconciled, it is
  reconciled once more afterwards (the events may have come after its state was read).
- A failed key is retried with exponential backoff (capped: however many failures); any
  success resets its count.
- A worker that dies of something else (a bug in the queue's own bookkeeping) is replaced at
  once and the failure logged; `alive` says how many run, for the liveness probe.
- A delayed add (a status refresh after pod events, a retry) is one timer per key, at the
  earliest time asked; none is set for a key already waiting, which will read the same state.
- Urgent keys (an object whose spec has not been reconciled yet) go before the others (status
  refreshes after child and pod events): in a burst of new objects, creating their children
  does not wait behind the status updates of the ones created first.

Handlers return at once, so kopf's per-object workers (and the event bodies they hold) do not
pile up behind the API calls: 1,000 new objects cost 1,000 keys, not 1,000 suspended handlers.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)


class WorkQueue(Generic[K]):
    def __init__(self, reconcile: Callable[[K], Awaitable[None]], *, workers: int, max_backoff: float = 60.0) -> None:
        self._reconcile = reconcile
        self._max_backoff = max_backoff
        self._urgent: collections.deque[K] = collections.deque()
        self._normal: collections.deque[K] = collections.deque()
        self._entries = asyncio.Semaphore(0)  # counts the entries of both deques
        self._dirty: set[K] = set()  # waiting: in a deque, or to be re-queued when done
        self._dirty_urgent: set[K] = set()
        self._processing: set[K] = set()
        self._failures: dict[K, int] = {}
        self._timers: dict[K, asyncio.TimerHandle] = {}
        self._closing = False
        self.workers = workers
        self._workers: set[asyncio.Task[None]] = set()
        for _ in range(workers):
            self._start_worker()

    @property
    def alive(self) -> int:
        """Workers running now (the liveness probe compares it with `workers`)."""
        return sum(not w.done() for w in self._workers)

    def backoff(self, failures: int) -> float:
        """Seconds before the retry after `failures` failures in a row: 2, 4, 8, ... up to the
        maximum (the exponent is capped: 2.0 ** 1024 overflows)."""
        return min(self._max_backoff, 2.0 ** min(failures, 62))

    def _start_worker(self) -> None:
        worker = asyncio.create_task(self._work())
        self._workers.add(worker)
        worker.add_done_callback(self._worker_done)

    def _worker_done(self, worker: asyncio.Task[None]) -> None:
        self._workers.discard(worker)
        if self._closing or worker.cancelled():
            return
        logger.error("a work queue worker died; starting another", exc_info=worker.exception())
        self._start_worker()

    def add(self, key: K, *, urgent: bool = False) -> None:
        if key in self._dirty and (not urgent or key in self._dirty_urgent):
            return
        self._dirty.add(key)
        if urgent:
            self._dirty_urgent.add(key)
        if key not in self._processing:
            self._push(key)  # an urgent add of a key waiting as normal leaves a stale entry, skipped

    def _push(self, key: K) -> None:
        (self._urgent if key in self._dirty_urgent else self._normal).append(key)
        self._entries.release()

    def add_after(self, key: K, delay: float) -> None:
        if key in self._dirty:
            return  # waiting: its next reconcile starts later, and reads the indexes then
        loop = asyncio.get_running_loop()
        waiting = self._timers.get(key)
        if waiting is not None:
            if waiting.when() <= loop.time() + delay:
                return
            waiting.cancel()
        self._timers[key] = loop.call_later(delay, self._fire, key)

    def _fire(self, key: K) -> None:
        del self._timers[key]
        self.add(key)

    def forget(self, key: K) -> None:
        """The object is gone: drop its failure count (a queued key still runs, and finds nothing)."""
        self._failures.pop(key, None)

    def __len__(self) -> int:
        return len(self._dirty)

    async def join(self) -> None:
        """Until nothing waits and nothing runs (tests; timers not counted)."""
        while self._dirty or self._processing:
            await asyncio.sleep(0.01)

    async def aclose(self) -> None:
        self._closing = True
        for timer in self._timers.values():
            timer.cancel()
        workers = list(self._workers)
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)

    async def _work(self) -> None:
        while True:
            await self._entries.acquire()
            key = self._urgent.popleft() if self._urgent else self._normal.popleft()
            if key not in self._dirty or key in self._processing:
                continue  # stale: promoted to urgent and already taken from there
            self._dirty.discard(key)
            self._dirty_urgent.discard(key)
            self._processing.add(key)
            try:
                await self._reconcile(key)
                self._failures.pop(key, None)
            except Exception as error:  # noqa: BLE001 - whatever failed, the key is retried with backoff
                failures = self._failures[key] = self._failures.get(key, 0) + 1
                delay = self.backoff(failures)
                logger.warning(f"reconciling {key} failed ({error}); retrying in {delay:.0f}s")
                self.add_after(key, delay)
            finally:
                self._processing.discard(key)
                if key in self._dirty:  # added again while it ran
                    self._push(key)
