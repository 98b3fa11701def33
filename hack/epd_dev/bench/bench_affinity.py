"""Each picture once per weights version, at scale: 1,000 four-turn conversations and GRPO
groups over 8 units, through the EPD gateway and the units' real EPD proxies, against the
same traffic spread at random over the units (what kube-proxy does behind a plain Service).

Every unit is a STAND-IN encoder and consumer (epd_dev/standins, not vLLM) sharing an EC store
folder with ECExampleConnector's file semantics (standins/ec_files.py: vLLM's encoder memory
included), behind the product's own proxy (its store lookup, single flight and leases); the
gateway is the product's own. Stand-ins, because the point is the placement of thousands of
requests, which real engines on this machine serve at a request a second.

Printed, for each placement:
- encoder requests (primes) per distinct picture (1.0 is the goal: each picture encoded once
  per weights version) and the units' store hit ratio (parts found stored / parts received);
- affinity misses: requests the gateway sent away from their key's unit (load bound);
- the busiest unit's load over the mean: requests served, and requests in flight (sampled);
- consumer misses (a consumer that would encode a picture itself): must be 0.

Run: ``make bench-affinity`` (``python -m epd_dev.bench.bench_affinity --help``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from epd_client import Primer, RetryPolicy, Unit
from epd_dataplane.encoders import Encoders
from epd_dataplane.gateway import Gateway, UnitsView
from epd_dataplane.metrics import ProxyMetrics
from epd_dataplane.server import Proxy, ProxyConfig, serve

from ..standins.ec_files import FileStore
from ..standins.vllm_server import StandinServer

CHAT = "/v1/chat/completions"
# The bench's pictures are at images.test, which no DNS here knows: a STAND-IN resolver answers
# for it with a public address (the stand-in encoders fetch nothing), so the proxies' media URL
# policy lets them through as it would real public hosts.
PUBLIC = "93.184.216.34"


async def public_hosts(host: str) -> list[str]:
    return [PUBLIC]


RETRY = RetryPolicy(max_attempts=3, backoff=0.01, max_backoff=0.05, attempt_timeout=30, deadline=60)


@dataclass
class UnitSet:
    names: list[str]
    proxies: dict[str, Proxy]
    urls: dict[str, str]
    encoders: dict[str, StandinServer]
    consumers: dict[str, StandinServer]
    files: dict[str, FileStore]


class RandomView(UnitsView):
    """kube-proxy's placement behind a plain Service: any unit, at random."""

    def place(self, key: str | None) -> tuple[Unit, bool]:
        assert self.endpoints is not None
        return random.choice(list(self.endpoints.units)), False


@dataclass
class Arm:
    name: str
    requests: int = 0
    seconds: float = 0.0
    samples: list[dict[str, int]] = field(default_factory=list)


async def start(stack: contextlib.AsyncExitStack, server: Any) -> tuple[str, str]:
    stop, ready = asyncio.Event(), asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve(server, host="127.0.0.1", port=0, metrics_port=0, shutdown_timeout=5, stop=stop, ready=ready)
    )
    stack.push_async_callback(lambda: task)
    stack.callback(stop.set)
    port, admin = await asyncio.wait_for(ready, 10)
    return f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"


async def units(stack: contextlib.AsyncExitStack, root: Path, count: int, args: argparse.Namespace) -> UnitSet:
    found = UnitSet([], {}, {}, {}, {}, {})
    for i in range(count):
        name = f"bench-actor-{i}"
        files = FileStore(root / name, memory_size=args.encoder_memory)
        encoder = stack.enter_context(StandinServer(files=files, ec_role="producer", delay=args.encode_seconds))
        consumer = stack.enter_context(StandinServer(files=files, ec_role="consumer", delay=args.generate_seconds))
        metrics = ProxyMetrics()
        primer = await stack.enter_async_context(Primer(retry=RETRY))
        proxy = await stack.enter_async_context(
            Proxy(
                ProxyConfig(consumer.url, ec_store=str(files.root)),
                Encoders(metrics, [encoder.url]),
                primer,
                metrics,
                public_hosts,
            )
        )
        found.urls[name], _ = await start(stack, proxy)
        found.names.append(name)
        found.proxies[name], found.encoders[name], found.consumers[name], found.files[name] = (
            proxy,
            encoder,
            consumer,
            files,
        )
    return found


def picture(conversation: int, turn: int) -> dict[str, Any]:
    url = f"https://images.test/c{conversation}/t{turn}.png"
    return {"type": "image_url", "image_url": {"url": url}}


async def conversation(http: aiohttp.ClientSession, url: str, index: int, turns: int, arm: Arm) -> None:
    """A multi-turn conversation: each turn adds a picture and resends every earlier one."""
    history: list[dict[str, Any]] = []
    for turn in range(turns):
        history.append({"role": "user", "content": [picture(index, turn), {"type": "text", "text": f"turn {turn}"}]})
        await ask(http, url, {"model": "bench", "messages": history, "max_tokens": 8}, arm)
        history.append({"role": "assistant", "content": "..."})


async def group(http: aiohttp.ClientSession, url: str, index: int, samples: int, arm: Arm) -> None:
    """A GRPO group: one prompt with two pictures, ``samples`` times at once."""
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": [picture(10_000 + index, 0), picture(10_000 + index, 1)]}],
        "max_tokens": 8,
    }
    await asyncio.gather(*(ask(http, url, body, arm) for _ in range(samples)))


async def ask(http: aiohttp.ClientSession, url: str, body: dict[str, Any], arm: Arm) -> None:
    async with http.post(url + CHAT, data=json.dumps(body).encode(), headers={"content-type": "application/json"}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {(await r.text())[:300]}")
    arm.requests += 1


async def sample_loads(view: UnitsView, arm: Arm, every: float) -> None:
    while True:
        arm.samples.append(dict(view.loads))
        await asyncio.sleep(every)


async def run_arm(
    name: str, args: argparse.Namespace, *, affinity: bool, balance: float | None = None
) -> dict[str, Any]:
    arm = Arm(name)
    async with contextlib.AsyncExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="epd-bench-affinity-")))
        found = await units(stack, root, args.units, args)
        view = UnitsView.fixed("bench", found.urls)
        view.balance = balance
        if not affinity:
            view = RandomView("bench", view.endpoints, synced=True)
        metrics = ProxyMetrics()
        primer = await stack.enter_async_context(Primer(retry=RETRY))
        gateway = await stack.enter_async_context(
            Gateway(ProxyConfig("http://gateway.invalid"), Encoders(metrics), primer, metrics, public_hosts, units=view)
        )
        url, _ = await start(stack, gateway)
        sampler = asyncio.create_task(sample_loads(view, arm, 0.01))
        slots = asyncio.Semaphore(args.concurrency)
        connector = aiohttp.TCPConnector(limit=args.concurrency * 2)

        async def limited(job: Any) -> None:
            async with slots:
                await job

        started = time.monotonic()
        async with aiohttp.ClientSession(connector=connector) as http:
            jobs = [conversation(http, url, i, args.turns, arm) for i in range(args.conversations)]
            jobs += [group(http, url, i, args.group_size, arm) for i in range(args.groups)]
            random.Random(7).shuffle(jobs)
            await asyncio.gather(*(limited(job) for job in jobs))
        arm.seconds = time.monotonic() - started
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        return report(arm, found, gateway, args)


def report(arm: Arm, found: UnitSet, gateway: Gateway, args: argparse.Namespace) -> dict[str, Any]:
    pictures = args.conversations * args.turns + args.groups * 2
    primes = sum(len(found.encoders[n].requests(CHAT)) for n in found.names)
    parts_received = sum(
        len(
            [
                p
                for m in r.body["messages"]
                for p in (m["content"] if isinstance(m["content"], list) else [])
                if p.get("type") == "image_url"
            ]
        )
        for n in found.names
        for r in found.consumers[n].records
    )
    served = [len(found.consumers[n].records) for n in found.names]
    busy = [s for s in arm.samples if sum(s.values())]
    mean_flight = {n: statistics.fmean(s.get(n, 0) for s in busy) for n in found.names} if busy else {}
    flight_mean = statistics.fmean(mean_flight.values()) if mean_flight else 0.0
    misses = sum(
        s.value
        for family in gateway.metrics.registry.collect()
        for s in family.samples
        if s.name == "epd_gateway_affinity_misses_total"
    )
    return {
        "placement": arm.name,
        "requests": arm.requests,
        "seconds": arm.seconds,
        "pictures": pictures,
        "primes": primes,
        "primes_per_picture": primes / pictures,
        "hit_ratio": 1 - primes / parts_received if parts_received else 0.0,
        "affinity_misses": "-" if isinstance(gateway.units, RandomView) else int(misses),
        "served_max_over_mean": max(served) / statistics.fmean(served),
        "in_flight_max_over_mean": max(mean_flight.values()) / flight_mean if flight_mean else 0.0,
        "consumer_misses": sum(len(found.files[n].misses) for n in found.names),
        "served": served,
    }


def print_table(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\n{args.conversations} conversations of {args.turns} turns and {args.groups} GRPO groups of "
        f"{args.group_size} samples (2 pictures each), {args.concurrency} at a time, over {args.units} units "
        f"(stand-in encode {args.encode_seconds * 1000:g} ms, generate {args.generate_seconds * 1000:g} ms)\n"
    )
    columns = [
        ("placement", "{}"),
        ("requests", "{}"),
        ("pictures", "{}"),
        ("primes", "{}"),
        ("primes_per_picture", "{:.2f}"),
        ("hit_ratio", "{:.3f}"),
        ("affinity_misses", "{}"),  # "-": a random placement has no key to miss
        ("served_max_over_mean", "{:.2f}"),
        ("in_flight_max_over_mean", "{:.2f}"),
        ("consumer_misses", "{}"),
        ("seconds", "{:.1f}"),
    ]
    rows = [[c for c, _ in columns]] + [[f.format(r[c]) for c, f in columns] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    for row in rows:
        print("  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
    for r in results:
        print(f"  {r['placement']}: requests served per unit {r['served']}")
    gateway = results[0]
    ok = gateway["in_flight_max_over_mean"] <= 1.25 and gateway["consumer_misses"] == 0
    print(
        f"\n  the gateway: busiest unit's requests in flight over the mean {gateway['in_flight_max_over_mean']:.2f} "
        f"(bound 1.25): {'within' if ok else 'OVER'}; consumer misses {gateway['consumer_misses']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--units", type=int, default=8, help="units behind the gateway")
    parser.add_argument("--conversations", type=int, default=1000, help="four-turn conversations")
    parser.add_argument("--turns", type=int, default=4, help="turns of each conversation")
    parser.add_argument("--groups", type=int, default=100, help="GRPO groups: one prompt, --group-size samples")
    parser.add_argument("--group-size", type=int, default=8, help="samples of each group, sent at once")
    parser.add_argument("--concurrency", type=int, default=64, help="conversations and groups under way at once")
    parser.add_argument("--encode-seconds", type=float, default=0.02, help="a stand-in encoder's time per prime")
    parser.add_argument("--generate-seconds", type=float, default=0.05, help="a stand-in consumer's time per request")
    parser.add_argument(
        "--encoder-memory", type=int, default=64, help="embeddings a stand-in encoder remembers (vLLM's encoder cache)"
    )
    parser.add_argument(
        "--balance",
        type=float,
        action="append",
        default=[],
        help="also run the gateway with this bound (a unit's most over the mean of requests in flight; "
        "the product's is 1.25); repeatable",
    )
    args = parser.parse_args(argv)

    async def both() -> list[dict[str, Any]]:
        results = [await run_arm("gateway (affinity)", args, affinity=True)]
        for balance in args.balance:
            results.append(await run_arm(f"gateway, bound {balance:g}", args, affinity=True, balance=balance))
        results.append(await run_arm("random (kube-proxy)", args, affinity=False))
        return results

    results = asyncio.run(both())
    print_table(results, args)
    return 0 if results[0]["consumer_misses"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
