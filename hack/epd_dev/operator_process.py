"""The operator as a real process (`epd-operator run`) against a cluster: tests, benchmarks and
`make demo` all start it this way."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from .paths import REPO

CRD = REPO / "crds" / "epddeployments.epd.vime.dev.yaml"


# Ports are picked under the kernel's ephemeral range: a process restarted on its port (the
# operator after kill -9) finds it free, where an ephemeral one may meanwhile have become some
# outgoing connection's local port ("address already in use", seen under load).
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000


def free_port() -> int:
    ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    for port in random.sample(range(LOWEST_PORT, ephemeral_low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port between {LOWEST_PORT} and {ephemeral_low} after 200 tries")


def install_crd(cluster: Any) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    wait_established(cluster.kubectl, "epddeployments.epd.vime.dev")


def wait_established(kubectl: Callable[..., Any], crd: str, timeout: float = 60) -> None:
    """Until the CRD is served, through any cluster's `kubectl`. (`kubectl wait
    --for=condition=Established` just after the apply fails at once while the CRD has no
    conditions yet: "<nil> is of the type <nil>".)"""
    query = '{.status.conditions[?(@.type=="Established")].status}'
    wait_for(
        lambda: kubectl("get", "crd", crd, "-o", f"jsonpath={query}", check=False).stdout.strip() == "True",
        timeout,
        f"crd/{crd} Established",
    )


class OperatorProcess:
    """`epd-operator run` as a subprocess; logs go to a file that failures print."""

    _instances: ClassVar[weakref.WeakSet[OperatorProcess]] = weakref.WeakSet()

    @classmethod
    def running(cls, kubeconfig: Path) -> list[OperatorProcess]:
        """Operators of this session alive on a cluster (tests that need to be the only one stop them)."""
        return [
            o for o in cls._instances if o.kubeconfig == kubeconfig and o.proc is not None and o.proc.poll() is None
        ]

    def __init__(
        self,
        kubeconfig: Path,
        log_dir: Path,
        *,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        python: Path | str = sys.executable,
    ):
        self.kubeconfig = kubeconfig
        self.python = str(python)
        self.log_path = log_dir / "operator.log"
        self.extra_args = extra_args or ["--all-namespaces"]
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.metrics_port = 0
        self.liveness_port = 0

    def start(self, timeout: float = 60) -> OperatorProcess:
        self.metrics_port, self.liveness_port = free_port(), free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("a")
        log.write(f"\n===== start {time.strftime('%H:%M:%S')} =====\n")
        log.flush()
        peering = [] if any(a.startswith("--peering") for a in self.extra_args) else ["--standalone"]
        cmd = [
            self.python,
            "-m",
            "epd_operator.cli",
            "run",
            *self.extra_args,
            *peering,
            "--metrics-port",
            str(self.metrics_port),
            "--liveness",
            f"http://127.0.0.1:{self.liveness_port}/healthz",
        ]
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), **self.env}
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        OperatorProcess._instances.add(self)
        wait_for(self._live, timeout, "operator liveness endpoint", self.tail)
        return self

    def _live(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"operator exited with {self.proc.returncode}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no operator log)"


def wait_for(check: Callable[[], Any], timeout: float, what: str, context: Callable[[], str] = lambda: "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{context()}")
        time.sleep(0.2)


def get_json(cluster: Any, *args: str) -> Any:
    out = cluster.kubectl("get", *args, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


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
