"""A STAND-IN for an EC store as vLLM's ECExampleConnector keeps it on a unit's /dev/shm, and
for what its engines do with it, NOT vLLM: for tests that race the janitor's evictions against
requests thousands of times (a real engine takes a second a request here).

What it copies from vLLM 0.32 (docs/ec-storage.md; vllm/v1/core/sched/scheduler.py):
- An item's name is its part's ``uuid`` when given, else a hash of its content.
- A producer (encoder) that encodes an item writes `<root>/<name>/encoder_cache.safetensors`
  (a temporary file renamed into place, as safetensors does); it encodes only what its own
  memory does not hold (``memory``: vLLM's encoder cache is asked before the EC store), so an
  item whose file the janitor evicted is not written again while the encoder remembers it.
- A consumer looks each item's file up when it schedules the request: there, it reads it (a
  hit); missing, it encodes the item itself (a miss: what EPD must never let happen) and leaves
  an empty `<name>` folder behind, as vLLM 0.32's existence check does.
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading
from pathlib import Path
from typing import Any

EMBEDDING_FILE = "encoder_cache.safetensors"
EMBEDDING = b"\0" * 4096  # about what the tiny model's embedding of one picture takes


def item_names(body: Any) -> list[str]:
    """The names of the media items of a chat request or prime: each part's uuid, else a hash
    of its URL (a stand-in for vLLM's hash of the decoded picture)."""
    names = []
    conversation = [*(body.get("messages") or []), *(body["input"] if isinstance(body.get("input"), list) else [])]
    for message in conversation:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            if not isinstance(part, dict) or part.get("type") not in ("image_url", "input_image"):
                continue
            url = part["image_url"] if part["type"] == "input_image" else (part.get("image_url") or {}).get("url")
            if isinstance(url, str):
                names.append(str(part["uuid"]) if part.get("uuid") else hashlib.sha256(url.encode()).hexdigest())
    return names


class FileStore:
    """One unit's EC store folder, and the producer's memory of what it encoded."""

    def __init__(
        self, root: Path, *, encoder_memory: bool = True, memory_size: int | None = None, own_names: bool = False
    ) -> None:
        self.root = root
        self.encoder_memory = encoder_memory
        self.memory_size = memory_size  # vLLM's encoder cache is bounded: the oldest goes first
        # A model whose processor hashes on its own (vLLM's h2ovl): no entry is named by the uuid.
        self.own_names = own_names
        self.memory: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.encoded: list[str] = []  # by the producer, in order
        self.hits = 0
        self.misses: list[str] = []  # items a consumer encoded itself
        self._lock = threading.Lock()
        root.mkdir(parents=True, exist_ok=True)

    def name(self, name: str) -> str:
        return hashlib.sha256(name.encode()).hexdigest()[:40] if self.own_names else name

    def produce(self, names: list[str]) -> None:
        for name in map(self.name, names):
            with self._lock:
                if self.encoder_memory and name in self.memory:
                    self.memory.move_to_end(name)
                    continue  # vLLM: the encoder cache holds it, nothing is encoded or saved
                self.memory[name] = None
                if self.memory_size is not None and len(self.memory) > self.memory_size:
                    self.memory.popitem(last=False)
                self.encoded.append(name)
            folder = self.root / name
            folder.mkdir(exist_ok=True)
            temp = folder / f".tmp{os.getpid()}{threading.get_ident()}"
            temp.write_bytes(EMBEDDING)
            temp.rename(folder / EMBEDDING_FILE)

    def consume(self, names: list[str]) -> None:
        for name in map(self.name, names):
            try:
                with open(self.root / name / EMBEDDING_FILE, "rb") as embedding:
                    embedding.read()
                with self._lock:
                    self.hits += 1
            except FileNotFoundError:
                (self.root / name).mkdir(exist_ok=True)
                with self._lock:
                    self.misses.append(name)

    def forget(self) -> None:
        """The encoder's memory is lost (its engine restarted)."""
        with self._lock:
            self.memory.clear()
