"""Client overhead: prime_encoder against raw httpx and a Vime-style loop.

All methods prime the same images against one fast STAND-IN server
(epd_dev/standins/vllm_server.py, not vLLM) running in its own process, so the server never shares the
measured client's event loop. The work is ``--samples`` samples of ``--images-per-sample``
images, ``--concurrency`` samples in flight. An image's latency is the time until its whole
sample is primed, which is what a rollout waits for.

- prime_encoder(client): this library, one EPDClient for the run.
- prime_encoder(args): this library with a Vime args object: a short-lived pool per call.
- raw httpx: one shared AsyncClient, asyncio.gather of the same POSTs, no retry logic;
  and the same with the connections split into pools of 8, as EPDClient does.
- Vime-style: a new httpx.AsyncClient per request, up to 60 tries with fixed 1 s sleeps.

Run: ``make bench-client`` (or ``python -m epd_dev.bench.bench_client --help``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from epd_client import Endpoints, EPDClient, prime_encoder

MODEL = "bench-model"
PrimeSample = Callable[[list[dict]], Awaitable[object]]


@dataclass
class Result:
    wall: float
    cpu: float  # of this process only: the server runs in another
    images: int
    latencies: list[float]


def sample_messages(sample: int, images: int) -> list[dict]:
    parts = [
        {"type": "image_url", "image_url": {"url": f"https://images.test/{sample}/{i}.png"}} for i in range(images)
    ]
    return [{"role": "user", "content": [{"type": "text", "text": "describe"}, *parts]}]


def prime_body(part: dict) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": [part]}],
        "max_tokens": 1,
        "stream": False,
    }


async def raw_post(http: httpx.AsyncClient, url: str, part: dict) -> None:
    response = await http.post(
        url + "/v1/chat/completions",
        json=prime_body(part),
        headers={"x-request-id": uuid.uuid4().hex},
    )
    response.raise_for_status()


async def vime_style_post(url: str, part: dict) -> None:
    for attempt in range(60):
        try:
            async with httpx.AsyncClient(timeout=None) as http:
                await raw_post(http, url, part)
                return
        except Exception:
            if attempt == 59:
                raise
            await asyncio.sleep(1)


def parts_of(messages: list[dict]) -> list[dict]:
    return [p for p in messages[0]["content"] if p["type"] == "image_url"]


async def run(prime: PrimeSample, samples: int, images: int, concurrency: int) -> Result:
    """Prime all samples, ``concurrency`` at a time."""
    latencies: list[float] = []
    queue = iter(range(samples))

    async def worker() -> None:
        for sample in queue:
            messages = sample_messages(sample, images)
            started = time.perf_counter()
            await prime(messages)
            latencies.extend([time.perf_counter() - started] * images)

    gc.collect()
    started, cpu_started = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Result(
        time.perf_counter() - started,
        time.process_time() - cpu_started,
        samples * images,
        latencies,
    )


async def measure(url: str, cli: argparse.Namespace) -> dict[str, list[Result]]:
    endpoints = Endpoints.from_urls([url], served_model_name=MODEL)
    args = argparse.Namespace(vllm_model_encoder_endpoints={"default": (MODEL, [url])})
    http = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=cli.pool))
    # The same connections split into pools of 8, as EPDClient does: isolates what the
    # library adds (retry, deadline, task group) from httpcore's cost per pooled connection.
    shards = [
        httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=8)) for _ in range(max(1, cli.pool // 8))
    ]
    next_shard = itertools.cycle(shards)
    client = EPDClient(endpoints, max_concurrency=cli.pool)

    async def raw(messages: list[dict]) -> None:
        await asyncio.gather(*(raw_post(http, url, p) for p in parts_of(messages)))

    async def raw_sharded(messages: list[dict]) -> None:
        await asyncio.gather(*(raw_post(next(next_shard), url, p) for p in parts_of(messages)))

    async def vime(messages: list[dict]) -> None:
        await asyncio.gather(*(vime_style_post(url, p) for p in parts_of(messages)))

    methods: dict[str, tuple[PrimeSample, int]] = {
        "raw httpx (shared client, gather)": (raw, cli.samples),
        "raw httpx (pools of 8, gather)": (raw_sharded, cli.samples),
        "prime_encoder(EPDClient)": (lambda m: prime_encoder(client, m), cli.samples),
        "prime_encoder(vime args)": (lambda m: prime_encoder(args, m), cli.samples),
        "Vime-style loop (client per call)": (vime, cli.vime_samples),
    }
    results: dict[str, list[Result]] = {name: [] for name in methods}
    for prime, samples in methods.values():  # warm connections, caches and code
        await run(prime, max(cli.concurrency, samples // 20), cli.images_per_sample, cli.concurrency)
    for _ in range(cli.repeats):  # interleaved, so load from elsewhere hits all methods alike
        for name, (prime, samples) in methods.items():
            results[name].append(await run(prime, samples, cli.images_per_sample, cli.concurrency))
    await asyncio.gather(http.aclose(), client.aclose(), *(shard.aclose() for shard in shards))
    return results


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(results: dict[str, list[Result]], cli: argparse.Namespace) -> None:
    print(
        f"\n{cli.samples} samples x {cli.images_per_sample} images, {cli.concurrency} samples in "
        f"flight, pool {cli.pool}; Vime-style: {cli.vime_samples} samples; median of "
        f"{cli.repeats} runs; {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"httpx {httpx.__version__}\n"
    )
    print(
        f"{'method':36} {'images/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'CPU us/img':>10} {'time/raw':>8} {'CPU/raw':>7}"
    )
    baseline = None
    for name, runs in results.items():
        # The repetition with the median throughput; CPU per image as a median on its own,
        # as it is the figure least disturbed by other load on the machine.
        run = sorted(runs, key=lambda r: r.images / r.wall)[len(runs) // 2]
        rate = run.images / run.wall
        cpu = statistics.median(r.cpu / r.images for r in runs)
        baseline = baseline or (rate, cpu)  # the first row is raw httpx
        print(
            f"{name:36} {rate:8.0f} {percentile(run.latencies, 0.5) * 1e3:7.1f} "
            f"{percentile(run.latencies, 0.99) * 1e3:7.1f} {cpu * 1e6:10.0f} "
            f"{baseline[0] / rate:7.2f}x {cpu / baseline[1]:6.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--vime-samples", type=int, default=50)
    parser.add_argument("--images-per-sample", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--pool", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    cli = parser.parse_args()

    server = subprocess.Popen(
        [sys.executable, "-m", "epd_dev.standins.vllm_server", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None  # stdout=PIPE
        url = server.stdout.readline().strip()
        if not url.startswith("http://"):
            raise SystemExit(f"stand-in server did not start (exit code {server.poll()})")
        report(asyncio.run(measure(url, cli)), cli)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
