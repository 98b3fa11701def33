"""buildah (Debian's 1.28) with a storage of the project's own: vfs driver, under the cache.

vfs copies layers instead of overlaying them: slower and bigger, but it needs neither fuse nor
an overlay-capable filesystem under the storage, and works as root in this VM.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from ..progress import CommandFailed, run_with_progress


class BuildError(CommandFailed):
    pass


class Buildah:
    """One buildah storage (`root`, state in `runroot`); `log` gets progress lines."""

    def __init__(self, root: Path, runroot: Path, log: Callable[[str], None]) -> None:
        self.root, self.runroot, self.log = root, runroot, log

    def _argv(self, *args: str | os.PathLike[str]) -> list[str]:
        return ["buildah", "--root", str(self.root), "--runroot", str(self.runroot), "--storage-driver", "vfs"] + [
            str(a) for a in args
        ]

    def __call__(self, *args: str | os.PathLike[str]) -> str:
        out = subprocess.run(self._argv(*args), capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise BuildError(f"buildah {' '.join(map(str, args))} failed ({out.returncode}): {out.stderr.strip()}")
        return out.stdout.strip()

    def long(self, what: str, *args: str | os.PathLike[str]) -> str:
        """A buildah command that may take minutes, with progress lines."""
        return run_with_progress(self._argv(*args), what, self.log)

    def exists(self, ref: str) -> bool:
        return (
            subprocess.run(self._argv("inspect", "--type", "image", ref), capture_output=True, check=False).returncode
            == 0
        )

    def remove_image(self, ref: str) -> None:
        subprocess.run(self._argv("rmi", "--force", ref), capture_output=True, check=False)

    def remove_containers(self) -> None:
        subprocess.run(self._argv("rm", "--all"), capture_output=True, check=False)
