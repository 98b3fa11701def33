"""The EPD proxy's cost: text-only chat completions through `epd-dataplane proxy` and to the
router alone, side by side in one run.

As in a unit pod, the proxy forwards to the real vllm-router (from `make vllm-envs`, with the
flags the operator renders for it), and the router to its engine. The engine is a fast
STAND-IN (epd_dev/standins/fast_upstream.py, not vLLM) in a process of its own; the proxy is
the real `epd-dataplane proxy` process, started as a unit runs it (epd_dev.proxy_process). This
process is the load: ``clients`` closed-loop clients, each sending its next request when the
last is answered, aiohttp on uvloop. The paths:

- ``router``: the client, the router, the engine: what the front Service gives without the
  proxy, the baseline of every ``added_*`` and ``*_ratio`` key;
- ``proxy``: the client, the proxy, the router, the engine: the unit's front door;
- ``relay`` (whole answers only): a byte relay (STAND-IN, epd_dev/standins/byte_relay.py) in
  the proxy's place, a process that copies bytes and parses nothing: the floor of one extra
  hop on the machine. What the proxy adds beyond it is the proxy's own code;
- ``engine`` (whole answers only): the stand-in engine alone, to show what the router itself
  costs (``router_added_*``).

At each level the stand-in takes ``clients / rate`` seconds per request (the request's
``x-standin-delay``), so every level runs at about ``--rate`` requests a second: the levels
differ in concurrency (open connections, requests in flight), not in the CPU the machine has
left, and the figures are what the proxy adds, not queueing behind a saturated core. Clients
start spread over one service time, so requests do not arrive in waves. One more run at
64 clients with no service time at all saturates the machine: its throughput ratio and the
proxy's CPU per request bound what one proxy process can forward.

At one client the stand-in's service time (2.5 ms at 400/s) is shorter than any answer of a
real engine, so the same chain is measured once more with the real vLLM 0.32 engine (the CPU
build serving the tiny model of the node tests, epd_dev/vllm/tiny_model.py) in the stand-in's
place: one client asking for the shortest answer vLLM gives (one token), router, relay and proxy
in front of it as above (keys ``real_*``; ``--no-real-engine`` leaves it out).

Per level: latency to the whole answer (p50, p99) and throughput, and for streamed answers
the time to the first body byte (the stand-in sends its first event after the service time
and the rest one service time later, so a buffering proxy would double it). Each statistic is
the median over ``--repeats`` runs, the paths interleaved so that other load on the machine
hits both alike; the throughput ratio's lowest and highest of those rounds (each the proxy's
run over the router's of the same round) come with it (``throughput_ratio_min_*``,
``throughput_ratio_max_*``). The proxy's RSS is read from /proc at the end.

Run: ``make bench-proxy`` (or ``python -m epd_dev.bench.bench_proxy --help``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from epd_dev.bench.observe import closed_loop, recording
from epd_dev.operator_process import free_port, wait_for
from epd_dev.proxy_process import ProxyProcess
from epd_dev.vllm import envs, tiny_model
from epd_operator.loop import event_loop
from epd_operator.render import render
from epd_operator.validation import validate

# The targets (docs/proxy.md, "Cost"): what the proxy adds at one and 64 clients, its throughput
# ratio at one client against the real engine, and what one proxy process forwards saturated.
# key: (limit, whether the value must be at least the limit rather than at most).
TARGETS = {
    "added_p50_ms_1": (1.0, False),
    "added_p50_ms_64": (1.0, False),
    "real_throughput_ratio_1": (0.9, True),
    "saturated_proxy_rps": (1000.0, True),
}
PATHS = ("engine", "router", "relay", "proxy")
STREAMED_PATHS = ("router", "proxy")  # the relay and the engine alone are context for whole answers only
STANDIN_MODEL = "standin"  # the stand-in answers any name
REAL_MODEL = "tiny"  # the real engine's --served-model-name


@dataclass
class Run:
    seconds: float
    latencies: list[float] = field(default_factory=list)
    first_bytes: list[float] = field(default_factory=list)
    proxy_cpu: float = 0.0  # CPU seconds the proxy process spent during the run

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.seconds


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rss_mb(pid: int) -> tuple[float, float]:
    """(current, peak) resident set of a process, in MiB."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(status["VmRSS"].split()[0]) / 1024, int(status["VmHWM"].split()[0]) / 1024


async def load(
    http: aiohttp.ClientSession,
    url: str,
    *,
    clients: int,
    seconds: float,
    delay: float,
    stream: bool,
    proxy_pid: int,
    model: str = STANDIN_MODEL,
) -> Run:
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1, "stream": stream}
    ).encode()
    headers = {"content-type": "application/json"}
    if delay:
        headers["x-standin-delay"] = f"{delay:.6f}"
    loop = asyncio.get_running_loop()
    run = Run(seconds)

    async def client(index: int, deadline: float) -> None:
        await asyncio.sleep(delay * index / clients)  # spread over one service time
        while loop.time() < deadline:
            started = time.perf_counter()
            async with http.post(url, data=body, headers=headers) as response:
                first = None
                async for _ in response.content.iter_any():
                    first = first or time.perf_counter()
                response.raise_for_status()
            done = time.perf_counter()
            run.latencies.append(done - started)
            run.first_bytes.append((first or done) - started)

    run.seconds, run.proxy_cpu = await closed_loop(client, clients=clients, seconds=seconds, pid=proxy_pid)
    return run


@dataclass
class Level:
    clients: int
    delay: float
    runs: dict[tuple[str, bool], list[Run]]  # (path, streamed) -> one per repeat

    def median(self, path: str, streamed: bool, stat: str) -> float:
        runs = self.runs[(path, streamed)]
        if stat == "throughput":
            return statistics.median(r.throughput for r in runs)
        q = 0.99 if stat.endswith("p99") else 0.5
        values = "first_bytes" if stat.startswith("ttfb") else "latencies"
        return statistics.median(percentile(getattr(r, values), q) for r in runs)

    def cpu_per_request(self, path: str) -> float:
        """The proxy's CPU seconds per request while ``path`` was loaded, whole answers (median)."""
        return statistics.median(r.proxy_cpu / len(r.latencies) for r in self.runs[(path, False)])

    def round_ratios(self, path: str, over: str) -> list[float]:
        """``path``'s throughput over ``over``'s in each round, whole answers: the two ran seconds
        apart, so the machine's drift from round to round cancels in each ratio, and their spread
        shows how far one run of the bench can be trusted."""
        pairs = zip(self.runs[(path, False)], self.runs[(over, False)], strict=True)
        return [mine.throughput / theirs.throughput for mine, theirs in pairs]

    def whole(self, path: str) -> dict[str, float]:
        """p50, p99 and throughput of a path's whole (not streamed) answers."""
        return {stat: self.median(path, False, stat) for stat in ("p50", "p99", "throughput")}


def compared(level: Level) -> dict[str, float]:
    """Whole answers at one level: what the proxy and the relay add to the router alone, and the
    router to the engine alone (keys without their level's suffix)."""
    engine, router, relay, proxy = (level.whole(path) for path in PATHS)
    rounds = level.round_ratios("proxy", "router")
    return {
        "added_p50_ms": (proxy["p50"] - router["p50"]) * 1e3,
        "added_p99_ms": (proxy["p99"] - router["p99"]) * 1e3,
        "throughput_ratio": proxy["throughput"] / router["throughput"],
        "relay_added_p50_ms": (relay["p50"] - router["p50"]) * 1e3,
        "relay_added_p99_ms": (relay["p99"] - router["p99"]) * 1e3,
        "relay_throughput_ratio": relay["throughput"] / router["throughput"],
        "throughput_ratio_over_relay": proxy["throughput"] / relay["throughput"],
        "router_added_p50_ms": (router["p50"] - engine["p50"]) * 1e3,
        "router_added_p99_ms": (router["p99"] - engine["p99"]) * 1e3,
        "throughput_ratio_min": min(rounds),
        "throughput_ratio_max": max(rounds),
    }


def paths(streamed: bool) -> tuple[str, ...]:
    return STREAMED_PATHS if streamed else PATHS


async def measure(urls: dict[str, str], proxy: ProxyProcess, cli: argparse.Namespace) -> tuple[list[Level], Level]:
    assert proxy.proc is not None
    pid = proxy.proc.pid
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
        plans = [(n, n / cli.rate, streamed) for n in cli.levels for streamed in (False, True)]
        plans.append((64, 0.0, False))  # saturation
        runs: dict[tuple[int, float, str, bool], list[Run]] = {}
        for clients, delay, streamed in plans:  # warm connections and code paths on every path
            for path in paths(streamed):
                await load(
                    http, urls[path] + "/v1/chat/completions", clients=clients, seconds=min(1.0, cli.seconds),
                    delay=delay, stream=streamed, proxy_pid=pid,
                )  # fmt: skip
        for repeat in range(cli.repeats):
            print(f"stand-in engine: round {repeat + 1} of {cli.repeats} over every level and path", flush=True)
            for clients, delay, streamed in plans:
                for path in paths(streamed):
                    run = await load(
                        http, urls[path] + "/v1/chat/completions", clients=clients, seconds=cli.seconds,
                        delay=delay, stream=streamed, proxy_pid=pid,
                    )  # fmt: skip
                    runs.setdefault((clients, delay, path, streamed), []).append(run)
    levels = [
        Level(n, d, {(p, s): runs[(n, d, p, s)] for s in (False, True) for p in paths(s)})
        for n, d in dict.fromkeys((n, d) for n, d, _ in plans[:-1])
    ]
    saturated = Level(64, 0.0, {(p, False): runs[(64, 0.0, p, False)] for p in paths(False)})
    return levels, saturated


async def measure_real(urls: dict[str, str], proxy: ProxyProcess, cli: argparse.Namespace) -> Level:
    """One client, whole answers, against the real engine: every path in turn, ``--repeats`` times."""
    assert proxy.proc is not None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        runs: dict[tuple[str, bool], list[Run]] = {(path, False): [] for path in PATHS}
        for repeat in range(cli.repeats + 1):  # round 0 warms every path and is not counted
            seconds = cli.seconds if repeat else min(1.0, cli.seconds)
            print(f"real engine: {len(PATHS)} paths, {seconds:g} s each", flush=True)
            for path in PATHS:
                run = await load(
                    http, urls[path] + "/v1/chat/completions", clients=1, seconds=seconds, delay=0.0,
                    stream=False, proxy_pid=proxy.proc.pid, model=REAL_MODEL,
                )  # fmt: skip
                if repeat:
                    runs[(path, False)].append(run)
    return Level(1, 0.0, runs)


def report_real(level: Level) -> dict[str, float]:
    stats = {path: level.whole(path) for path in PATHS}
    keys = {"real_engine_p50_ms_1": stats["engine"]["p50"] * 1e3, "real_router_p50_ms_1": stats["router"]["p50"] * 1e3}
    keys |= {f"real_{key}_1": value for key, value in compared(level).items()}
    keys["real_proxy_cpu_us_per_request_1"] = level.cpu_per_request("proxy") * 1e6
    print(
        f"one client against the real engine ({envs.ENVS['serve'].summary}, the tiny model, one-token answers), "
        f"whole answers\n"
        f"{'path':>6} | {'p50 ms':>7} {'p99 ms':>7} | {'req/s':>6} | {'added p50 ms':>12} {'added p99 ms':>12} | "
        f"{'ratio':>5}"
    )
    against_router = {"relay": "real_relay_", "proxy": "real_"}  # the key prefixes of what they add
    for path in PATHS:
        row, prefix = stats[path], against_router.get(path)
        added = ("", "", "") if prefix is None else (
            f"{keys[f'{prefix}added_p50_ms_1']:.2f}", f"{keys[f'{prefix}added_p99_ms_1']:.2f}",
            f"{keys[f'{prefix}throughput_ratio_1']:.3f}",
        )  # fmt: skip
        print(
            f"{path:>6} | {row['p50'] * 1e3:>7.2f} {row['p99'] * 1e3:>7.2f} | {row['throughput']:>6.1f} | "
            f"{added[0]:>12} {added[1]:>12} | {added[2]:>5}"
        )
    print(f"the proxy's CPU per request: {keys['real_proxy_cpu_us_per_request_1']:.0f} us\n")
    return keys


def report(
    levels: list[Level],
    saturated: Level,
    proxy_rss: tuple[float, float],
    load_before: float,
    cli: argparse.Namespace,
    real: Level | None,
) -> dict[str, float]:
    print(
        f"\ntext-only /v1/chat/completions, closed-loop clients at about {cli.rate:g} requests/s (service time = "
        f"clients / rate), {cli.seconds:g} s per run, median of {cli.repeats} runs; {os.cpu_count()} cores shared, "
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; Python {platform.python_version()}, "
        f"aiohttp {aiohttp.__version__}; the router is {envs.ENVS['router'].summary}\n"
        f"through the proxy (client -> proxy -> router -> engine) against the router alone (client -> router -> engine)"
    )
    print(
        f"{'clients':>7} {'service ms':>10} | {'p50 ms':>15} {'p99 ms':>15} | {'added p50':>9} {'added p99':>9} | "
        f"{'req/s':>13} {'ratio':>5} | {'first byte ms':>15} {'ratio':>5}"
    )
    print(f"{'':>7} {'':>10} | {'router  proxy':>15} {'router  proxy':>15} | {'ms':>9} {'ms':>9} | "
          f"{'router proxy':>13} {'':>5} | {'router  proxy':>15} {'':>5}")  # fmt: skip
    keys: dict[str, float] = {}
    for level in levels:
        rt, px = level.whole("router"), level.whole("proxy")
        ttfb = {p: level.median(p, True, "ttfb_p50") for p in STREAMED_PATHS}
        n = level.clients
        keys |= {f"{key}_{n}": value for key, value in compared(level).items()}
        keys[f"first_byte_ratio_{n}"] = ttfb["proxy"] / ttfb["router"]
        keys[f"proxy_cpu_us_per_request_{n}"] = level.cpu_per_request("proxy") * 1e6
        print(
            f"{n:>7} {level.delay * 1e3:>10.1f} | {rt['p50'] * 1e3:>7.2f} {px['p50'] * 1e3:>7.2f} "
            f"{rt['p99'] * 1e3:>7.2f} {px['p99'] * 1e3:>7.2f} | {keys[f'added_p50_ms_{n}']:>9.2f} "
            f"{keys[f'added_p99_ms_{n}']:>9.2f} | {rt['throughput']:>6.0f} {px['throughput']:>6.0f} "
            f"{keys[f'throughput_ratio_{n}']:>5.2f} | {ttfb['router'] * 1e3:>7.2f} {ttfb['proxy'] * 1e3:>7.2f} "
            f"{keys[f'first_byte_ratio_{n}']:>5.2f}"
        )
    print(
        f"\nthe floor of one extra hop: a byte relay (stand-in) in the proxy's place, whole answers; what the\n"
        f"router itself adds to the engine alone; and the proxy's CPU per request (the same work at every level:\n"
        f"it costs more after a longer idle gap, when the cores' caches no longer hold the proxy's code and data)\n"
        f"{'clients':>7} | {'relay: added p50 ms':>19} {'added p99 ms':>12} | {'ratio':>5} | {'proxy / relay':>13} | "
        f"{'router: added p50 ms':>20} {'added p99 ms':>12} | {'proxy CPU us/req':>16}"
    )
    for level in levels:
        n = level.clients
        print(
            f"{n:>7} | {keys[f'relay_added_p50_ms_{n}']:>19.2f} {keys[f'relay_added_p99_ms_{n}']:>12.2f} | "
            f"{keys[f'relay_throughput_ratio_{n}']:>5.2f} | {keys[f'throughput_ratio_over_relay_{n}']:>13.2f} | "
            f"{keys[f'router_added_p50_ms_{n}']:>20.2f} {keys[f'router_added_p99_ms_{n}']:>12.2f} | "
            f"{keys[f'proxy_cpu_us_per_request_{n}']:>16.0f}"
        )
    rates = {path: saturated.median(path, False, "throughput") for path in PATHS}
    cpu = saturated.cpu_per_request("proxy")
    keys["saturated_throughput_ratio"] = rates["proxy"] / rates["router"]
    keys["saturated_relay_throughput_ratio"] = rates["relay"] / rates["router"]
    keys["saturated_engine_rps"] = rates["engine"]
    keys["saturated_router_rps"] = rates["router"]
    keys["saturated_proxy_rps"] = rates["proxy"]
    keys["proxy_cpu_us_per_request"] = cpu * 1e6
    keys["proxy_rss_mb"], keys["proxy_peak_rss_mb"] = proxy_rss
    print(
        f"\nsaturated (64 clients, no service time, every process on the same 2 cores): the engine alone "
        f"{rates['engine']:.0f} req/s, the router alone {rates['router']:.0f} req/s, through the proxy "
        f"{rates['proxy']:.0f} req/s (ratio {keys['saturated_throughput_ratio']:.2f}), through the byte relay "
        f"{rates['relay']:.0f} req/s (ratio {keys['saturated_relay_throughput_ratio']:.2f}); "
        f"the proxy spends {cpu * 1e6:.0f} us of CPU per request"
    )
    print(f"proxy RSS {proxy_rss[0]:.1f} MiB at the end, {proxy_rss[1]:.1f} MiB at its peak\n")
    if real is not None:
        keys |= report_real(real)
    verdicts = []
    for key, (limit, at_least) in TARGETS.items():
        if key not in keys:  # a level or the real engine left out of this run
            continue
        value = keys[key]
        met = value >= limit if at_least else value <= limit
        spread = ""
        if key.startswith(("throughput_ratio", "real_throughput_ratio")):
            low, high = (keys[key.replace("throughput_ratio", f"throughput_ratio_{end}")] for end in ("min", "max"))
            spread = f", rounds {low:.2f} to {high:.2f}"
        verdicts.append(
            f"{key} {value:.2f} ({'met' if met else 'MISSED'}: {'at least' if at_least else 'at most'} {limit:g}{spread})"
        )
    print("targets: " + "; ".join(verdicts) + "\n")
    for key, value in keys.items():
        print(f"{key}={value:.3f}")
    return keys


def router_command(port: int, engine: str) -> list[str]:
    """vllm-router's argv as the operator renders it in a unit of two regular engines behind the
    proxy, listening on ``port`` and sending to the one ``engine``, its metrics on a free port."""
    checked = validate(
        {
            "image": "vllm/vllm-openai:v0.33.0",
            "models": [
                {
                    "name": "bench",
                    "model": "standin",
                    "serverGroups": [
                        {"workerType": "encoder", "numGpus": 1},
                        {"workerType": "regular", "numGpus": 2},
                    ],
                }
            ],
        }
    )
    (plan,) = render(checked, namespace="bench", name="bench", uid="bench")
    assert plan.router is not None and plan.proxy is not None, "two regular engines behind the proxy get a router"
    args = list(plan.router.args)
    args[args.index("--port") + 1] = str(port)
    workers = args.index("--worker-urls") + 1
    rendered_workers = next((i for i in range(workers, len(args)) if args[i].startswith("--")), len(args))
    # Its metrics port too: the default (29000) is fixed, so a second router on the machine would collide.
    metrics = ("--prometheus-port", str(free_port()))
    return [str(envs.router_binary()), *args[1:workers], engine, *args[rendered_workers:], *metrics]


def start_router(started: list[subprocess.Popen[str]], engine: str, log: Path) -> str:
    """Start vllm-router (added to ``started``) in front of ``engine``; its URL once it answers."""
    port = free_port()
    with log.open("w") as out:
        process = subprocess.Popen(router_command(port, engine), stdout=out, stderr=subprocess.STDOUT, text=True)
    started.append(process)
    url = f"http://127.0.0.1:{port}"

    wait_for(lambda: answers(process, url, log, "vllm-router"), 60, "vllm-router healthy")
    return url


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", type=lambda t: [int(n) for n in t.split(",")], default=[1, 64, 512])
    parser.add_argument("--rate", type=float, default=400.0, help="requests a second each level runs at")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of one run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--no-real-engine",
        dest="real_engine",
        action="store_false",
        help="leave out the one-client runs against the real vLLM engine (they start it: about a minute)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="record the proxy with py-spy: a flamegraph (.svg) or collapsed stacks",
    )
    cli = parser.parse_args(argv)
    load_before = os.getloadavg()[0]  # other work on the machine moves every figure

    started: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory() as logs:
        try:
            engine = start_standin(started, "fast_upstream")
            router = start_router(started, engine, Path(logs) / "router.log")
            relay = start_standin(started, "byte_relay", "--upstream", router)
            # The encoder is never asked (text only); the engine's URL satisfies the flag.
            with ProxyProcess(router, [engine], Path(logs)) as proxy:
                assert proxy.proc is not None
                urls = {"engine": engine, "router": router, "relay": relay, "proxy": proxy.url}
                # uvloop, as the proxy's: neither side is handicapped
                with recording(proxy.proc.pid, cli.profile), event_loop() as runner:
                    levels, saturated = runner.run(measure(urls, proxy, cli))
                rss = rss_mb(proxy.proc.pid)
        finally:
            stop(started)
        real = measure_with_real_engine(cli, Path(logs)) if cli.real_engine else None
    return report(levels, saturated, rss, load_before, cli, real)


def stop(started: list[subprocess.Popen[str]]) -> None:
    for process in started:
        process.terminate()
    for process in started:
        process.wait()
    started.clear()


def measure_with_real_engine(cli: argparse.Namespace, logs: Path) -> Level:
    """The one-client runs with the real engine in the stand-in's place (its own router, relay
    and proxy), once the stand-ins' runs are over and their processes gone."""
    started: list[subprocess.Popen[str]] = []
    try:
        engine = start_engine(started, logs / "engine.log")
        router = start_router(started, engine, logs / "real-router.log")
        relay = start_standin(started, "byte_relay", "--upstream", router)
        with ProxyProcess(router, [engine], logs / "real") as proxy:
            urls = {"engine": engine, "router": router, "relay": relay, "proxy": proxy.url}
            with event_loop() as runner:
                return runner.run(measure_real(urls, proxy, cli))
    finally:
        stop(started)


def start_engine(started: list[subprocess.Popen[str]], log: Path, timeout: float = 300) -> str:
    """Start the real vLLM engine (the serving venv's, on the CPU) with the tiny model, as
    docs/testing.md "Serving vLLM on CPU" says (added to ``started``); its URL once it answers."""
    python, model = envs.serving_python(), tiny_model.tiny_model_path()  # both fail loudly with how to install
    port = free_port()
    command = [
        *(str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)),
        *("--served-model-name", REAL_MODEL, "--host", "127.0.0.1", "--port", str(port)),
        *("--max-model-len", "512", "--dtype", "bfloat16", "--enforce-eager"),
    ]
    environment = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    print(f"starting the real vLLM engine ({envs.ENVS['serve'].summary}) with the tiny model", flush=True)
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True, env=environment)
    started.append(process)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: answers(process, url, log, "the vLLM engine"), timeout, "the vLLM engine healthy")
    return url


def answers(process: subprocess.Popen[str], url: str, log: Path, what: str) -> bool:
    """Whether ``url``/health answers 200; SystemExit with the log's tail once ``process`` exited."""
    if process.poll() is not None:
        raise SystemExit(f"{what} exited with code {process.returncode}; its log:\n{log.read_text()[-3000:]}")
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def start_standin(started: list[subprocess.Popen[str]], module: str, *args: str) -> str:
    """Start ``epd_dev.standins.<module>`` on a free port (added to ``started``): its URL."""
    command = [sys.executable, "-m", f"epd_dev.standins.{module}", "--port", "0", *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    started.append(process)
    assert process.stdout is not None
    url = process.stdout.readline().strip()
    if not url.startswith("http://"):
        raise SystemExit(f"the stand-in {module} did not start (exit code {process.poll()})")
    return url


if __name__ == "__main__":
    main()
