"""Real EC stores for the janitor tests: folders and safetensors files as vLLM writes them.

ECExampleConnector.save_caches does `os.makedirs(<store>/<mm_hash>)` then
`safetensors.torch.save_file({"ec_cache": tensor}, <folder>/encoder_cache.safetensors)`;
safetensors (>= 0.8) writes a `.tmpXXXXXX` file beside it and renames it into place. The numpy
binding used here is the same Rust writer.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from epd_operator.ec.janitor import EMBEDDING_FILE


def new_store() -> Path:
    """An empty folder on the same kind of filesystem as production: tmpfs (/dev/shm)."""
    path = Path(f"/dev/shm/epd-janitor-test-{uuid.uuid4().hex[:12]}")
    path.mkdir()
    return path


def publish(store: Path, name: str, *, rows: int = 16, age: float = 0.0) -> Path:
    """An embedding as an encoder publishes it, last changed `age` seconds ago."""
    folder = store / name
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"ec_cache": np.full((rows, 128), 0.5, dtype=np.float16)}, str(folder / EMBEDDING_FILE))
    set_age(folder, age)
    return folder


def writing(store: Path, name: str, *, age: float = 0.0) -> Path:
    """A folder whose embedding is being written: only safetensors' temp file, half written."""
    folder = store / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".tmpQx81Zp").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{" + b"\0" * 4000)
    set_age(folder, age)
    return folder


def miss(store: Path, name: str, *, age: float = 0.0) -> Path:
    """The empty folder a vLLM 0.32 consumer's cache miss leaves (its existence check creates it)."""
    folder = store / name
    folder.mkdir(parents=True, exist_ok=True)
    set_age(folder, age)
    return folder


def set_age(folder: Path, age: float) -> None:
    when = time.time() - age
    for item in folder.iterdir():
        os.utime(item, (when, when))
    os.utime(folder, (when, when))  # last: touching the files does not change it, creating them did


def load(path: Path) -> np.ndarray:
    return load_file(str(path))["ec_cache"]
