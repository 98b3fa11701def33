"""Where things live: the repo's Go wrapper modules and the binary cache."""

from __future__ import annotations

import os
from pathlib import Path

# Folder (relative to the repo root) holding the Go wrapper modules.
GO_MODULES = Path("tests/controlplane/go")


def repo_root() -> Path:
    """The clone this package belongs to.

    The Go modules are not part of the installed package, so an installed copy
    finds them through EPD_REPO_ROOT or the current directory instead.
    """
    env = os.environ.get("EPD_REPO_ROOT")
    if env:
        return Path(env).resolve()
    for start in (Path(__file__).resolve().parent, Path.cwd().resolve()):
        for candidate in (start, *start.parents):
            if (candidate / GO_MODULES).is_dir():
                return candidate
    raise FileNotFoundError(
        f"cannot find {GO_MODULES} above {Path(__file__).parent} or {Path.cwd()}; "
        "run from the epd-operator clone or set EPD_REPO_ROOT"
    )


def cache_root() -> Path:
    """Binary cache outside the clone, shared by every clone and worktree."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "epd-operator" / "controlplane"
