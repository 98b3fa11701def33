"""Debian packages the dev tools need on this host (the real node's runtime, the image
builder's tools): which are missing, and apt-get for them."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence

from .progress import CommandFailed, format_seconds, run_with_progress


def missing_packages(packages: Sequence[str]) -> list[str]:
    """Those of `packages` dpkg does not have installed."""
    missing = []
    for package in packages:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True, check=False)
        if out.returncode != 0 or not out.stdout.endswith(" installed"):
            missing.append(package)
    return missing


def install_packages(packages: Sequence[str], log: Callable[[str], None], *, needed_by: str) -> None:
    """apt-get those of `packages` that are missing (as root); CommandFailed when it cannot."""
    missing = missing_packages(packages)
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise CommandFailed(f"{needed_by} needs the Debian packages {', '.join(missing)} and there is no apt-get here")
    log(f"installing Debian packages for {needed_by}: {' '.join(missing)} (apt-get)")
    started = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]):
        run_with_progress(cmd, f"running {' '.join(cmd[:2])}", log, env=env)
    log(f"installed {' '.join(missing)} in {format_seconds(time.monotonic() - started)}")
