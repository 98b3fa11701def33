"""A cross-process lock on a file: one builder or installer at a time."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def file_lock(path: Path, log: Callable[[str], None] = print) -> Iterator[None]:
    """Hold an exclusive flock on `path` for the block, saying so when someone else has it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another process holding {path} ...")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
