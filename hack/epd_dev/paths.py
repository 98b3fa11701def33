"""Where the dev tools find things: the clone they belong to, and the one cache root.

The dev tools are installed editable from the clone (`make venv`), so the clone is found from
this file, never from the current directory.
"""

from __future__ import annotations

import os
from pathlib import Path

HACK = Path(__file__).resolve().parents[1]
REPO = HACK.parent
# The control plane's Go wrapper modules (one folder per built project).
GO_MODULES = HACK / "go"


def cache_root() -> Path:
    """Big builds and venvs, outside the clone and shared by every clone: $EPD_CACHE, else
    $XDG_CACHE_HOME/epd-operator, else ~/.cache/epd-operator."""
    explicit = os.environ.get("EPD_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "epd-operator"
