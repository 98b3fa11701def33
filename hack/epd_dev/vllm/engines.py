"""Start, watch and stop real vLLM engine processes in tests and `make demo` (standard library only).

Each engine runs in its own process group (vLLM forks an engine core and workers), logs to
a file, and is stopped as a group, so nothing outlives the test even when it fails. Should
pytest itself be killed, every engine gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and
shuts its own children down. `make demo` leaves its engines running after it exits
(`die_with_parent=False`) and stops them later from another process (`stop_recorded`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

# Environment every CPU engine needs (docs/testing.md, "Serving vLLM on CPU").
CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


class EngineFailed(RuntimeError):
    pass


# Engines started and not yet stopped: failure reports attach their log tails.
RUNNING: list[Engine] = []

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the test process dies."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Engine:
    """One server process: `argv` is run as is, with `env` added to os.environ."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        *,
        port: int,
        log_dir: Path,
        env: dict[str, str] | None = None,
        health_path: str = "/health",
        host: str = "127.0.0.1",
        die_with_parent: bool = True,
    ) -> None:
        self.name, self.argv, self.port, self.host = name, [str(a) for a in argv], port, host
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(log_dir) / f"{name}.log"
        self.health_path = health_path
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.ready_after_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Engine:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - handed to the engine process, closed once it has it
        log.write(("$ " + " ".join(self.argv) + "\n").encode())
        log.flush()
        self.started_at = time.monotonic()
        # A new session makes the engine's children one process group we can kill whole.
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
            # Only prctl runs between fork and exec (no lock taken): safe beside threads.
            preexec_fn=_die_with_parent if self.die_with_parent else None,  # noqa: PLW1509
        )
        log.close()
        RUNNING.append(self)
        return self

    def log_tail(self, lines: int = 80) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def fail(self, why: str) -> EngineFailed:
        return EngineFailed(f"{self.name}: {why}\n--- last lines of {self.log_path} ---\n{self.log_tail()}")

    def wait_healthy(self, timeout: float = 300.0) -> float:
        """Polls /health until 200; returns seconds since start. Raises with the log tail."""
        assert self.proc is not None, "start() first"
        deadline = self.started_at + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise self.fail(f"exited with code {code} before becoming healthy")
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=5) as resp:
                    if resp.status == 200:
                        self.ready_after_s = round(time.monotonic() - self.started_at, 1)
                        return self.ready_after_s
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass  # refused while the model loads; 503 while unhealthy
            if time.monotonic() > deadline:
                raise self.fail(f"not healthy after {timeout:.0f}s")
            time.sleep(0.5)

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the server (as a kubelet would), let its group drain, then SIGKILL it.

        The server shuts its engine core and workers down itself (killing them at once), and
        the multiprocessing resource tracker left behind then unlinks their shared memory in
        /dev/shm (hundreds of MB per engine): it must not be killed before it is done. The
        group kill only catches stragglers.
        """
        if self in RUNNING:
            RUNNING.remove(self)
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        _wait_group_gone(pgid, timeout=10)
        _signal_group(pgid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    # -- HTTP (JSON in, JSON out) ------------------------------------------------------

    def post(self, path: str, body: dict, timeout: float = 120.0) -> dict:
        data = json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:2000]
            raise self.fail(f"POST {path} -> {err.code}: {detail}") from None


def start_ticks(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot, /proc/<pid>/stat field 22), None if no such
    process: recorded with a pid, it tells the process from a later one reusing the pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # after the name, which may hold spaces


def _running(pid: int) -> bool:
    """Neither gone nor a zombie waiting for its parent (which may never reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def group_members(pgid: int) -> list[int]:
    """Running processes of process group `pgid` (zombies left out)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def stop_recorded(pid: int, ticks: int, grace: float = 20.0) -> bool:
    """Engine.stop for an engine another process started: `pid` leads its own session, `ticks`
    is its start_ticks. Returns False when that process is gone already (a pid reused since
    is never signalled)."""
    if start_ticks(pid) != ticks:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while group_members(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    _signal_group(pid, signal.SIGKILL)
    return True


def _wait_group_gone(pgid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
