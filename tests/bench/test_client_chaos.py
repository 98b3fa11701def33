"""The client under faults: many primes through fault-injecting proxies (5xx, slow answers,
TCP resets, in a random order) in front of two encoders.

The encoders are STAND-INs (epd_dev/standins/vllm_server.py), not vLLM: a real vLLM encoder on
CPU takes about a second per image, and this needs hundreds of requests to hit every fault
while others are in flight. What is checked is the client's own contract:

- every prime returns or raises PrimeError, within its deadline (plus scheduling slack, and
  however late the event loop was at its worst);
- afterwards no asyncio task is left, and once the client is closed neither the proxies nor
  the encoders hold a connection open.
"""

from __future__ import annotations

import asyncio
import random
import time
from contextlib import ExitStack

from epd_client import Endpoints, EPDClient, PrimeError, RetryPolicy, prime_encoder
from epd_dev.standins.fault_proxy import FaultProxy, delay, http_status, reset
from epd_dev.standins.vllm_server import StandinServer

POLICY = RetryPolicy(max_attempts=4, backoff=0.01, max_backoff=0.05, attempt_timeout=0.3, deadline=1.0)
SLACK = 0.5  # event-loop and thread scheduling on a busy 2-core machine
PRIMES = 150
LONGEST_FAULT = 1.5


class CountingProxy(FaultProxy):
    """FaultProxy with a count of open client connections (proposed upstream)."""

    def __init__(self, upstream: str) -> None:
        self.open_connections = 0
        super().__init__(upstream)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open_connections += 1
        try:
            await super()._handle(reader, writer)
        finally:
            self.open_connections -= 1


def random_faults(proxy: FaultProxy, rng: random.Random, count: int) -> None:
    """The next ``count`` requests each get one of: forwarded as is (half of them), a 5xx, a
    delay (some past the attempt timeout), a reset; later ones are all forwarded."""
    for _ in range(count):
        proxy.add(
            rng.choice(
                [
                    delay(0),
                    delay(0),
                    delay(0),  # forwarded untouched, holding their place in the sequence
                    http_status(rng.choice([500, 502, 503])),
                    delay(rng.choice([0.05, 0.2, 0.5, LONGEST_FAULT])),
                    reset(),
                ]
            )
        )


def messages(images: int, sample: int) -> list[dict]:
    parts = [
        {"type": "image_url", "image_url": {"url": f"https://images.test/{sample}/{i}.png"}} for i in range(images)
    ]
    return [{"role": "user", "content": parts}]


async def until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


class LoopLag:
    """The longest the event loop was late for a 10 ms tick: the stand-ins and proxies run in
    threads of this process, and under a loaded CI machine they hold the GIL for hundreds of
    milliseconds at times; no prime can end before its loop runs again."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            due = time.monotonic() + 0.01
            await asyncio.sleep(0.01)
            self.worst = max(self.worst, time.monotonic() - due)

    def stop(self) -> float:
        self._task.cancel()
        return self.worst


async def test_primes_end_in_time_and_leave_nothing_open() -> None:
    rng = random.Random(20261129)
    lag = LoopLag()
    with ExitStack() as stack:
        encoders = [stack.enter_context(StandinServer(delay=0.01)) for _ in range(2)]
        proxies = [stack.enter_context(CountingProxy(e.url)) for e in encoders]
        for proxy in proxies:
            random_faults(proxy, rng, 400)
        client = EPDClient(
            Endpoints.from_urls([p.url for p in proxies], served_model_name="m"), retry=POLICY, max_concurrency=32
        )
        outcomes: list[str] = []
        late: list[float] = []  # how long each prime took

        async def prime(sample: int) -> None:
            started = time.monotonic()
            try:
                await prime_encoder(client, messages(rng.randint(1, 4), sample))
                outcomes.append("ok")
            except PrimeError:
                outcomes.append("failed")
            late.append(time.monotonic() - started)

        async with asyncio.TaskGroup() as group:  # any other exception fails the test
            for sample in range(PRIMES):
                group.create_task(prime(sample))
                await asyncio.sleep(rng.uniform(0, 0.01))  # arrivals spread over about a second
        await client.aclose()
        worst_lag = lag.stop()
        await asyncio.sleep(0)  # let the ticker's cancellation land

        assert len(outcomes) == PRIMES
        limit = POLICY.deadline + SLACK + worst_lag
        assert max(late) <= limit, (
            f"primes past their {POLICY.deadline} s deadline (+{SLACK} s slack, +{worst_lag:.2f} s the loop "
            f"was late): {sorted(late)[-5:]}"
        )
        faults = {f for p in proxies for f in p.faults()}
        assert {"status", "delay", "reset"} <= faults
        assert outcomes.count("ok") > PRIMES // 4, outcomes.count("ok")  # retries get many through
        assert asyncio.all_tasks() == {asyncio.current_task()}
        # A proxy answering a request the client gave up on finishes within the longest delay.
        assert await until(lambda: all(p.open_connections == 0 for p in proxies), LONGEST_FAULT + 2), [
            p.open_connections for p in proxies
        ]
        assert await until(lambda: all(e.open_connections == 0 for e in encoders), 2), [
            e.open_connections for e in encoders
        ]
