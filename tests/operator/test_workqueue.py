"""The reconcile work queue: one entry per key, never two workers on one key, retries."""

from __future__ import annotations

import asyncio
import itertools

from epd_operator.workqueue import WorkQueue


async def blocked_queue() -> tuple[WorkQueue, list[str], asyncio.Event]:
    """A one-worker queue whose worker holds "blocker" until `gate` is set, so that keys added
    meanwhile wait; and the keys reconciled, in order."""
    seen: list[str] = []
    gate = asyncio.Event()

    async def reconcile(key):
        await gate.wait()
        seen.append(key)

    queue = WorkQueue(reconcile, workers=1)
    queue.add("blocker")
    await asyncio.sleep(0)  # the worker takes "blocker" and waits
    return queue, seen, gate


async def test_a_key_added_many_times_while_waiting_is_reconciled_once():
    queue, seen, gate = await blocked_queue()
    for _ in range(5):
        queue.add("a")
    queue.add("b")
    assert len(queue) == 2
    gate.set()
    await queue.join()
    assert seen == ["blocker", "a", "b"]
    await queue.aclose()


async def test_a_key_added_while_it_runs_runs_again_afterwards_never_concurrently():
    running: set[str] = set()
    overlaps, runs = [], []

    async def reconcile(key):
        if key in running:
            overlaps.append(key)
        running.add(key)
        runs.append(key)
        await asyncio.sleep(0.02)
        running.discard(key)

    queue = WorkQueue(reconcile, workers=4)
    queue.add("a")
    await asyncio.sleep(0.005)  # "a" is running
    queue.add("a")
    queue.add("a")
    await queue.join()
    assert overlaps == [] and runs == ["a", "a"]
    await queue.aclose()


async def test_a_failing_key_is_retried_with_backoff_until_it_succeeds():
    attempts: list[float] = []
    loop = asyncio.get_running_loop()

    async def reconcile(key):
        attempts.append(loop.time())
        if len(attempts) < 3:
            raise RuntimeError("API server away")

    queue = WorkQueue(reconcile, workers=2, max_backoff=0.05)
    queue.add("a")
    while len(attempts) < 3:
        await asyncio.sleep(0.01)
    await queue.join()
    assert len(attempts) == 3
    assert all(later - earlier >= 0.04 for earlier, later in itertools.pairwise(attempts))
    assert queue._failures == {}  # success resets the count
    await queue.aclose()


async def test_urgent_keys_go_first_and_a_waiting_key_can_be_promoted():
    queue, order, gate = await blocked_queue()
    queue.add("status-a")
    queue.add("status-b")
    queue.add("new-c", urgent=True)
    queue.add("status-b", urgent=True)  # its spec changed while it waited
    gate.set()
    await queue.join()
    assert order == ["blocker", "new-c", "status-b", "status-a"]  # each once
    await queue.aclose()


async def test_delayed_adds_of_a_key_are_one_timer_at_the_earliest_time_asked():
    runs: list[float] = []
    loop = asyncio.get_running_loop()

    async def reconcile(key):
        runs.append(loop.time())

    queue = WorkQueue(reconcile, workers=2)
    start = loop.time()
    queue.add_after("a", 0.2)
    for _ in range(5):  # a burst of pod events
        queue.add_after("a", 0.2)
    queue.add_after("a", 0.05)  # an earlier one moves the timer
    queue.add_after("a", 1.0)  # a later one is covered by it
    await asyncio.sleep(0.3)
    await queue.join()
    assert len(runs) == 1 and runs[0] - start < 0.15
    await queue.aclose()


async def test_a_delayed_add_of_a_waiting_key_adds_nothing():
    queue, runs, gate = await blocked_queue()
    queue.add("a")  # waits behind "blocker"
    queue.add_after("a", 0.01)  # its coming reconcile reads the indexes after this event anyway
    await asyncio.sleep(0.05)
    gate.set()
    await queue.join()
    await asyncio.sleep(0.05)
    await queue.join()
    assert runs == ["blocker", "a"]
    await queue.aclose()


def test_backoff_grows_to_its_maximum_and_never_overflows():
    async def run() -> list[float]:
        queue: WorkQueue[str] = WorkQueue(lambda key: asyncio.sleep(0), workers=1, max_backoff=60)
        try:
            return [queue.backoff(n) for n in (1, 2, 5, 6, 1024, 10**6)]
        finally:
            await queue.aclose()

    assert asyncio.run(run()) == [2, 4, 32, 60, 60, 60]


async def test_a_worker_that_dies_is_replaced_and_the_keys_still_run():
    done: list[str] = []

    class Fatal(BaseException):
        """Not an Exception: it gets past the retry and kills the worker, as a bug in the queue would."""

    async def reconcile(key: str) -> None:
        if key == "poison":
            raise Fatal
        done.append(key)

    queue: WorkQueue[str] = WorkQueue(reconcile, workers=2)
    try:
        queue.add("poison")
        await asyncio.sleep(0.05)
        assert queue.alive == 2  # replaced at once
        queue.add("a")
        queue.add("b")
        await queue.join()
        assert sorted(done) == ["a", "b"]
    finally:
        await queue.aclose()
    assert queue.alive == 0
