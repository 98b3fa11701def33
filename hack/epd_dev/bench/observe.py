"""What the benchmarks observe the cluster with: watch streams timed on arrival, first-seen
times per object, a process's CPU and memory, and the API server's own request metrics."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ..localcluster import LocalCluster
from .kit import Api, log, tls_context

PROGRESS_SECONDS = 30

# ---------------------------------------------------------------------------- watching


class Watch(threading.Thread):
    """One watch stream; ``on_event(type, object, arrival)`` runs on this thread, with the
    arrival time (time.monotonic) taken before the event is even decoded."""

    def __init__(self, cluster: LocalCluster, path: str, on_event: Callable[[str, dict, float], None], **params: str):
        super().__init__(daemon=True, name=f"watch {path}")
        self.cluster, self.path, self.on_event, self.params = cluster, path, on_event, params
        self.established = threading.Event()
        self.error: BaseException | None = None
        self._socket: socket.socket | None = None
        self._stopping = False

    def run(self) -> None:
        version = ""  # resume from the last event seen when the server ends the stream
        try:
            with httpx.Client(
                base_url=self.cluster.server, verify=tls_context(self.cluster), timeout=httpx.Timeout(30, read=None)
            ) as http:
                while not self._stopping:
                    params = {"watch": "1", **self.params, **({"resourceVersion": version} if version else {})}
                    with http.stream("GET", self.path, params=params) as response:
                        if response.status_code == 429:  # a new CRD's storage is still initializing
                            time.sleep(1)
                            continue
                        response.raise_for_status()
                        self._socket = response.extensions["network_stream"].get_extra_info("socket")
                        self.established.set()  # headers arrived: the server is watching
                        for line in response.iter_lines():
                            arrival = time.monotonic()
                            event = json.loads(line)
                            if event["type"] == "ERROR":
                                raise RuntimeError(f"watch error: {event['object'].get('message')}")
                            version = event["object"]["metadata"]["resourceVersion"]
                            self.on_event(event["type"], event["object"], arrival)
        except BaseException as error:  # noqa: BLE001 - reported to the waiting thread
            if not self._stopping:
                self.error = error
        finally:
            self.established.set()

    def stop(self) -> None:
        """End the stream from another thread. Only a shutdown: closing the socket here would
        free its descriptor while this thread still reads it, and a new connection given the
        same number would have its TLS records stolen."""
        self._stopping = True
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.shutdown(socket.SHUT_RDWR)
        self.join(10)


Stream = tuple[str, Callable[[str, dict, float], None], dict[str, str]]  # path, on_event, query


@contextlib.contextmanager
def watching(cluster: LocalCluster, *streams: Stream) -> Iterator[list[Watch]]:
    watches = [Watch(cluster, path, on_event, **params) for path, on_event, params in streams]
    for watch in watches:
        watch.start()
    for watch in watches:
        watch.established.wait(30)
        if watch.error:
            raise RuntimeError(f"watch {watch.path} failed: {watch.error}")
    try:
        yield watches
    finally:
        for watch in watches:
            watch.stop()


class Recorder:
    """First-seen times per (what, name), shared by watch threads and the waiting thread."""

    def __init__(self) -> None:
        self.times: dict[str, dict[str, float]] = collections.defaultdict(dict)
        self.children: dict[str, set[str]] = collections.defaultdict(set)
        self._changed = threading.Condition()

    def mark(self, what: str, name: str, at: float) -> None:
        with self._changed:
            self.times[what].setdefault(name, at)
            self._changed.notify_all()

    def child(self, owner: str, name: str, at: float) -> None:
        with self._changed:
            if name not in self.children[owner]:
                self.children[owner].add(name)
                self.times["child"][owner] = max(at, self.times["child"].get(owner, at))
            self._changed.notify_all()

    def wait(
        self,
        done: Callable[[], bool],
        timeout: float,
        what: str,
        watches: list[Watch],
        progress: Callable[[], str] | None = None,
    ) -> None:
        deadline = time.monotonic() + timeout
        next_report = time.monotonic() + PROGRESS_SECONDS
        with self._changed:
            while not done():
                if progress and time.monotonic() >= next_report:
                    log(f"  ... {progress()}")
                    next_report += PROGRESS_SECONDS
                broken = [w for w in watches if w.error]
                if broken:
                    raise RuntimeError(f"watch {broken[0].path} failed: {broken[0].error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
                self._changed.wait(min(left, 1.0))


def settle(rec: Recorder, names: list[str], what: str, timeout: float, watches: list[Watch]) -> list[str]:
    """Wait until every name is marked ``what``; the names that are not after ``timeout``."""
    with contextlib.suppress(TimeoutError):
        rec.wait(
            lambda: len(rec.times[what]) == len(names),
            timeout,
            f"{len(names)} {what}",
            watches,
            progress=lambda: f"{len(rec.times[what])}/{len(names)} {what}",
        )
    return [x for x in names if x not in rec.times[what]]


def cpu_seconds(pid: int) -> float:
    """CPU time of a process (every thread, live or ended), to the nanosecond: /proc/<pid>/stat
    counts 10 ms clock ticks, more than a short run of a few requests uses. The clock is Linux's
    process CPU clock of another process (clock_getcpuclockid's encoding: ~pid << 3 | SCHED)."""
    return time.clock_gettime(((~pid) << 3) | 2)


async def closed_loop(
    client: Callable[[int, float], Awaitable[None]], *, clients: int, seconds: float, pid: int
) -> tuple[float, float]:
    """Runs ``clients`` copies of ``client(index, deadline)`` until the deadline, ``seconds`` from
    now on the loop's clock; returns the time they took and process ``pid``'s CPU seconds in it.

    The load's own cyclic collections stay out of the run, as timeit keeps them out: with 512
    clients in flight a full one paused this process for 13 to 24 ms, and landed on whichever
    path was measured then (measured with gc callbacks; the p99s at 512 spread 3 to 11 ms)."""
    loop = asyncio.get_running_loop()
    gc.collect()
    gc.disable()
    try:
        cpu = cpu_seconds(pid)
        started = loop.time()
        await asyncio.gather(*(client(i, started + seconds) for i in range(clients)))
        return loop.time() - started, cpu_seconds(pid) - cpu
    finally:
        gc.enable()


def memory_mb(pid: int, key: str) -> float:
    """VmHWM (peak RSS) or VmRSS of a process, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def apiserver_requests(api: Api) -> dict[tuple[str, str], tuple[float, float]]:
    """The API server's own request metrics: (count, seconds) per (verb, resource[/subresource]),
    watches left out (they last as long as the client keeps them)."""
    totals: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    text = api.http.get("/metrics").raise_for_status().text
    for line in text.splitlines():
        metric, _, rest = line.partition("{")
        if metric not in ("apiserver_request_duration_seconds_count", "apiserver_request_duration_seconds_sum"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if labels.get("verb") in ("WATCH", "CONNECT"):
            continue
        resource = labels.get("resource", "") + (f"/{labels['subresource']}" if labels.get("subresource") else "")
        totals[(labels.get("verb", ""), resource)][metric.endswith("_sum")] += float(line.rsplit(" ", 1)[1])
    return {key: (count, seconds) for key, (count, seconds) in totals.items()}


def request_delta(
    before: dict[tuple[str, str], tuple[float, float]], after: dict[tuple[str, str], tuple[float, float]]
) -> dict[tuple[str, str], tuple[float, float]]:
    zero = (0.0, 0.0)
    delta = {k: (c - before.get(k, zero)[0], s - before.get(k, zero)[1]) for k, (c, s) in after.items()}
    return {k: v for k, v in delta.items() if v[0] > 0}


# ----------------------------------------------------------------------------- profiling


@dataclass
class Profile:
    path: Path
    lines: list[str] = field(default_factory=list)


@contextlib.contextmanager
def recording(pid: int, output: Path | None) -> Iterator[None]:
    """py-spy records ``pid`` into ``output`` while the block runs (a flame graph for ``.svg``,
    else raw collapsed stacks; non-blocking, 200 samples a second); nothing without ``output``."""
    if output is None:
        yield
        return
    kind = "flamegraph" if output.suffix == ".svg" else "raw"
    spy = subprocess.Popen(
        [str(Path(sys.executable).with_name("py-spy")), "record", "-o", str(output), "-f", kind]
        + ["-p", str(pid), "-r", "200", "--nonblocking"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(60)


@contextlib.contextmanager
def py_spy(pid: int, folder: Path | None, name: str) -> Iterator[Profile | None]:
    """Sample ``pid`` with py-spy while the block runs (non-blocking: the operator is not
    paused per sample); afterwards the hottest functions, by own and by total samples."""
    if folder is None:
        yield None
        return
    binary = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    folder.mkdir(parents=True, exist_ok=True)
    profile = Profile(folder / f"operator-{name}.txt")
    spy = subprocess.Popen(
        [
            binary,
            "record",
            "--pid",
            str(pid),
            "--rate",
            "100",
            "--nonblocking",
            "--format",
            "raw",
            "--output",
            str(profile.path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield profile
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        _, err = spy.communicate(timeout=60)
        if profile.path.exists():
            profile.lines = hottest(profile.path)
        else:
            profile.lines = [f"py-spy wrote nothing: {err.strip()[-300:]}"]


def hottest(collapsed: Path, top: int = 15) -> list[str]:
    """Summarise py-spy's collapsed stacks ("frame;frame;... count") by function."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit() or not stack.endswith(")") or stack[:1].isspace():
            continue  # py-spy now and then reads a frame name from garbage (a string holding newlines)
        # "function (path/file.py:line)" -> "function (file.py)": lines would split a function
        frames = [re.sub(r" \((?:.*/)?([^/:]*)(?::\d+)?\)$", r" (\1)", f) for f in stack.split(";") if f]
        weight = int(count)
        samples += weight
        if frames:
            own[frames[-1]] += weight
        for frame in set(frames):
            total[frame] += weight
    lines = [f"py-spy: {samples} samples at 100 Hz ({collapsed})", "own %  total %  function"]
    for frame, own_samples in own.most_common(top):
        lines.append(f"{100 * own_samples / samples:5.1f}  {100 * total[frame] / samples:7.1f}  {frame}")
    lines.append("by total (inclusive):")
    for frame, total_samples in total.most_common(top + 10):
        lines.append(f"       {100 * total_samples / samples:7.1f}  {frame}")
    return lines
