"""The EPD proxy as a real process (`epd-dataplane proxy`), as a unit's container runs it: the
tests with real vLLM and the proxy benchmark start it this way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from .operator_process import free_port, wait_for


class ProxyProcess:
    """``epd-dataplane proxy --upstream U --encoder E ... [args]`` on free ports (``url``,
    ``metrics_url``); its log goes to ``log_path``. Use as a context manager."""

    def __init__(
        self,
        upstream: str,
        encoders: Sequence[str],
        log_dir: Path,
        *,
        args: Sequence[str] = (),
        python: Path | str = sys.executable,
    ) -> None:
        self.upstream = upstream
        self.encoders = list(encoders)
        self.args = list(args)
        self.python = str(python)
        self.log_path = Path(log_dir) / "proxy.log"
        self.port = self.metrics_port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    @property
    def command(self) -> list[str]:
        encoders = [a for url in self.encoders for a in ("--encoder", url)]
        return [
            *(self.python, "-m", "epd_dataplane.cli", "proxy", "--host", "127.0.0.1"),
            *("--port", str(self.port), "--metrics-port", str(self.metrics_port)),
            *("--upstream", self.upstream, *encoders, *self.args),
        ]

    def start(self, timeout: float = 30) -> Self:
        self.port, self.metrics_port = free_port(), free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as log:
            log.write(f"\n===== start {time.strftime('%H:%M:%S')} =====\n")
            log.flush()
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self._healthy, timeout, "the proxy's /health", self.tail)
        return self

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"the proxy exited with {self.proc.returncode}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(self.metrics_url + "/health", timeout=1) as response:
                status: int = response.status
                return status == 200
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url + "/metrics", timeout=5) as response:
            text: bytes = response.read()
            return text.decode()

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM, as the kubelet stops a container; its exit code (None if it had to be killed)."""
        if self.proc is None:
            return None
        code = self.proc.poll()
        if code is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        return code

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no proxy log)"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
