"""Long commands of the dev tools (Go builds, image builds, apt-get) run with a progress line
every 30 s, so a cold machine's minutes of work never look hung."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

INTERVAL_SECONDS = 30


class CommandFailed(RuntimeError):
    """A command exited non-zero: the message names it and ends with its output's tail."""


def format_seconds(seconds: float) -> str:
    return f"{int(seconds // 60)}m{seconds % 60:04.1f}s" if seconds >= 60 else f"{seconds:.1f}s"


def run_with_progress(
    cmd: Sequence[str | os.PathLike[str]],
    what: str,
    log: Callable[[str], None],
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> str:
    """Run `cmd`, logging `... still <what> (30.0s)` every INTERVAL_SECONDS; return its output
    (stdout and stderr); raise CommandFailed with its tail on failure. Interrupted, it stops the
    command first."""
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as output:
        proc = subprocess.Popen(
            [str(c) for c in cmd], stdout=output, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd
        )
        while True:
            try:
                proc.wait(timeout=INTERVAL_SECONDS)
                break
            except subprocess.TimeoutExpired:
                log(f"  ... still {what} ({format_seconds(time.monotonic() - started)})")
            except BaseException:
                proc.terminate()
                proc.wait()
                raise
        output.seek(0)
        text = output.read()
    if proc.returncode != 0:
        tail = "\n".join(text.splitlines()[-40:])
        raise CommandFailed(f"{what} failed ({proc.returncode}): {' '.join(map(str, cmd))}\n{tail}")
    return text
