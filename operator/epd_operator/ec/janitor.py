"""EC store janitor: keeps a model's encoder-cache store under its byte budget.

vLLM's ECExampleConnector writes `<store>/<mm_hash>/encoder_cache.safetensors` and never deletes
anything; in the unit's memory-backed /dev/shm the store would grow until the kubelet evicts the
pod. `epd-operator janitor` runs as a container in every unit with encoders and removes whole
`<mm_hash>` folders: abandoned ones, expired ones, then the oldest until the store fits. It also
counts the consumers' silent fallback encodes (`is_cache_miss`): vLLM 0.32 answers a request
whose embedding is not in the store by encoding the image itself, leaving an empty folder.

Pure: the eviction policy (`select_evictions`, `is_cache_miss`). Imperative: `scan_store`,
`evict` and the loop `run_janitor` (Prometheus metrics, JSON log lines). The budget it enforces
comes from `budget.py`; docs/ec-storage.md explains the design and its limits.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from . import leases
from .leases import EMBEDDING_FILE

# A folder changed this recently is never touched: a write may be in progress (safetensors
# writes a `.tmpXXXXXX` file beside the embedding, then renames it; older releases wrote the
# file in place), or a consumer is about to read what was just primed.
GRACE_SECONDS = 10.0
REASONS = ("empty", "ttl", "budget")


# --------------------------------------------------------------------------- policy (pure)


@dataclass(frozen=True, slots=True)  # slots: a big store has tens of thousands of entries
class Entry:
    """One `<mm_hash>` folder of the store, as a scan saw it."""

    name: str
    bytes: int  # memory its files hold (allocated blocks: what tmpfs charges)
    newest_mtime: float  # the latest change of the folder or of any file in it
    complete: bool  # holds encoder_cache.safetensors (safetensors renames it into place whole)
    files: tuple[str, ...] = ()  # the regular files seen: the only ones `evict` removes
    folder_mtime_ns: int = 0  # lets the next scan reuse this entry while the folder is unchanged


class Eviction(NamedTuple):
    entry: Entry
    reason: str  # one of REASONS


def select_evictions(
    entries: Sequence[Entry],
    *,
    now: float,
    max_bytes: int,
    ttl_seconds: float | None = None,
    grace_seconds: float = GRACE_SECONDS,
    leased: AbstractSet[str] = frozenset(),
) -> list[Eviction]:
    """Which whole folders to remove, oldest first.

    Nothing changed within `grace_seconds` is ever chosen, even over budget, nor any folder of
    `leased` (an EPD proxy relies on it until its request is done: leases.py). Of the rest:
    `empty`: no embedding (the folder a 0.32 consumer's cache miss leaves, or a writer's
    abandoned temp file); `ttl`: an embedding older than `ttl_seconds`; `budget`: then the
    oldest embeddings until everything left fits in `max_bytes`.
    """
    settled = sorted(
        (e for e in entries if now - e.newest_mtime >= grace_seconds and e.name not in leased),
        key=lambda e: (e.newest_mtime, e.name),
    )
    evictions = []
    for entry in settled:
        if not entry.complete:
            evictions.append(Eviction(entry, "empty"))
        elif ttl_seconds is not None and now - entry.newest_mtime >= ttl_seconds:
            evictions.append(Eviction(entry, "ttl"))
    chosen = {e.entry.name for e in evictions}
    left = sum(e.bytes for e in entries) - sum(e.entry.bytes for e in evictions)
    for entry in settled:
        if left <= max_bytes:
            break
        if entry.name not in chosen:
            evictions.append(Eviction(entry, "budget"))
            left -= entry.bytes
    return evictions


def is_cache_miss(entry: Entry) -> bool:
    """A folder holding no file at all: a vLLM 0.32 consumer's existence check created it, found
    no embedding and encoded the image itself (a fallback encode), and no encoder wrote into it
    since. Only meaningful for a settled entry: a fresh one may be an encoder's that is about
    to write. An abandoned temp file is an encoder's failed write, not a consumer's miss.
    """
    return not entry.files


# --------------------------------------------------------------------------- filesystem


def scan_store(root: str, known: Mapping[str, Entry] | None = None, *, settled_before: float = 0.0) -> list[Entry]:
    """A snapshot of the store. Folders that vanish while it is taken are left out; a missing
    store is empty (the connector creates it on its first write, the janitor never does).

    An entry of `known` (the previous snapshot) is reused when its folder is unchanged and it had
    settled (newest change before `settled_before`): writers create and rename files, which
    changes the folder, so a settled entry costs one stat instead of a listing and a stat per file.
    """
    known = known or {}
    try:
        listing = os.scandir(root)
    except FileNotFoundError:
        return []
    entries = []
    with listing:
        for folder in listing:
            try:
                if not folder.is_dir(follow_symlinks=False):
                    continue
                mtime_ns = folder.stat(follow_symlinks=False).st_mtime_ns
                before = known.get(folder.name)
                if before and before.folder_mtime_ns == mtime_ns and before.newest_mtime < settled_before:
                    entries.append(before)
                else:
                    entries.append(_scan_entry(folder.path, folder.name, mtime_ns))
            except FileNotFoundError:
                continue
    return entries


def _scan_entry(path: str, name: str, folder_mtime_ns: int) -> Entry:
    newest, total, files = folder_mtime_ns / 1e9, 0, []
    with os.scandir(path) as listing:
        for item in listing:
            try:
                info = item.stat(follow_symlinks=False)
            except FileNotFoundError:  # e.g. a temp file renamed into place meanwhile
                continue
            if stat.S_ISREG(info.st_mode):  # vLLM writes nothing else; anything else is left alone
                files.append(item.name)
                total += info.st_blocks * 512
                newest = max(newest, info.st_mtime)
    return Entry(name, total, newest, EMBEDDING_FILE in files, tuple(files), folder_mtime_ns)


def evict(root: str, entry: Entry) -> bool:
    """Removes the files the scan saw, then the folder; False if it is gone or got new files.

    Not shutil.rmtree: a file written after the scan (an encoder re-publishing this image) is
    never deleted; the folder then stays and the next scan judges it again. A consumer that
    already opened the embedding keeps reading it (unlinked files live on while open).
    Other OSErrors (e.g. permissions) are raised.
    """
    folder = os.path.join(root, entry.name)
    for name in entry.files:
        try:
            os.unlink(os.path.join(folder, name))
        except FileNotFoundError:
            pass
    try:
        os.rmdir(folder)
    except FileNotFoundError:
        return False
    except OSError as error:
        if error.errno == errno.ENOTEMPTY:  # written to since the scan
            return False
        raise
    return True


# --------------------------------------------------------------------------- loop


class StoreMetrics:
    def __init__(self, paths: Iterable[str], max_bytes: int) -> None:
        self.registry = CollectorRegistry()
        labels = ["path"]
        self.bytes = Gauge("epd_ec_store_bytes", "Bytes the EC store holds.", labels, registry=self.registry)
        self.entries = Gauge(
            "epd_ec_store_entries", "<mm_hash> folders in the EC store.", labels, registry=self.registry
        )
        self.budget = Gauge("epd_ec_store_budget_bytes", "The EC store's byte budget.", labels, registry=self.registry)
        self.leased = Gauge(
            "epd_ec_store_leased_entries",
            "Entries the last sweep left alone because an EPD proxy leases them (its request is not done).",
            labels,
            registry=self.registry,
        )
        self.evictions = Counter(
            "epd_ec_evictions", "Folders evicted, by reason.", [*labels, "reason"], registry=self.registry
        )
        self.failures = Counter(
            "epd_ec_eviction_failures", "Evictions that failed (see the logs).", labels, registry=self.registry
        )
        self.fallbacks = Counter(
            "epd_ec_fallback_encodes",
            "Images a consumer encoded itself: EC cache misses (empty <mm_hash> folders).",
            labels,
            registry=self.registry,
        )
        for path in paths:  # every series exists from the start, so rate() and alerts see the first one
            self.budget.labels(path).set(max_bytes)
            self.bytes.labels(path)
            self.entries.labels(path)
            self.leased.labels(path)
            self.failures.labels(path)
            self.fallbacks.labels(path)
            for reason in REASONS:
                self.evictions.labels(path, reason)


def _log(event: str, level: str = "info", **fields: Any) -> None:
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")
    sys.stdout.write(json.dumps({"time": now, "level": level, "event": event, **fields}) + "\n")
    sys.stdout.flush()


@dataclass
class StoreState:
    """What one store's sweep hands to the next."""

    known: dict[str, Entry] = field(default_factory=dict)  # the last snapshot, by folder name
    # Cache-miss folders already counted and still there (a removal that failed is retried on
    # the next sweep, and must not count the same miss again).
    counted_misses: set[str] = field(default_factory=set)


def sweep(
    path: str,
    metrics: StoreMetrics,
    state: StoreState,
    *,
    max_bytes: int,
    ttl_seconds: float | None,
    grace_seconds: float,
) -> None:
    """One scan-and-evict pass over one store."""
    now = time.time()
    entries = scan_store(path, state.known, settled_before=now - grace_seconds)
    evicted: dict[str, list[Entry]] = {}
    failed: list[tuple[str, str]] = []
    misses: list[str] = []
    # The leases are read, and the evictions done, under the store's lock: no proxy checks an
    # entry in between (leases.py).
    with leases.exclusive(path):
        leased = leases.leased_entries((e.name for e in entries), leases.fresh_keys(path, now))
        for entry, reason in select_evictions(
            entries, now=now, max_bytes=max_bytes, ttl_seconds=ttl_seconds, grace_seconds=grace_seconds, leased=leased
        ):
            # Counted when judged, not when removed: the consumer encoded the image either way.
            if is_cache_miss(entry) and entry.name not in state.counted_misses:
                misses.append(entry.name)
                state.counted_misses.add(entry.name)
            try:
                if evict(path, entry):
                    evicted.setdefault(reason, []).append(entry)
            except OSError as error:
                failed.append((entry.name, str(error)))
    metrics.leased.labels(path).set(len(leased))
    gone = {e.name for group in evicted.values() for e in group}
    kept = [e for e in entries if e.name not in gone]
    state.known = {e.name: e for e in kept}
    # A folder of the same name made later is another miss: forget the ones that are gone.
    state.counted_misses.intersection_update(state.known)
    metrics.bytes.labels(path).set(sum(e.bytes for e in kept))
    metrics.entries.labels(path).set(len(kept))
    for reason, group in evicted.items():
        metrics.evictions.labels(path, reason).inc(len(group))
        # The youngest age tells whether budget evictions come close to what consumers still read.
        _log(
            "evicted",
            path=path,
            reason=reason,
            entries=len(group),
            bytes=sum(e.bytes for e in group),
            youngest_age_seconds=round(now - max(e.newest_mtime for e in group), 1),
        )
    if misses:
        metrics.fallbacks.labels(path).inc(len(misses))
        # The mm_hashes let a client find which requests were not primed (docs/operations.md).
        _log("fallback_encodes", "warning", path=path, entries=len(misses), mm_hashes=misses[:10])
    if failed:
        metrics.failures.labels(path).inc(len(failed))
        _log("eviction_failed", "error", path=path, entries=len(failed), first=failed[0][0], error=failed[0][1])


def run_janitor(
    *,
    paths: Sequence[str],
    max_bytes: int,
    ttl_seconds: float | None = None,
    interval_seconds: float = 2.0,
    metrics_port: int = 0,
    grace_seconds: float = GRACE_SECONDS,
    stop: threading.Event | None = None,
) -> None:
    """Sweep every store every `interval_seconds` until `stop` is set (or SIGTERM, when run as
    the main thread); serve /metrics on `metrics_port` unless it is 0."""
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        # As a container's PID 1 the process ignores SIGTERM unless it handles it, and the pod's
        # shutdown would wait out its whole grace period.
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    metrics = StoreMetrics(paths, max_bytes)
    server = start_http_server(metrics_port, registry=metrics.registry)[0] if metrics_port else None
    _log(
        "started",
        paths=list(paths),
        max_bytes=max_bytes,
        ttl_seconds=ttl_seconds,
        grace_seconds=grace_seconds,
        interval_seconds=interval_seconds,
    )
    states = {path: StoreState() for path in paths}
    for path in paths:
        try:  # before the first sweep: from here on no proxy's lease can go unseen
            leases.prepare(path)
        except OSError as error:
            _log("leases_unavailable", "warning", path=path, error=str(error))
    try:
        while True:
            for path in paths:
                sweep(
                    path,
                    metrics,
                    states[path],
                    max_bytes=max_bytes,
                    ttl_seconds=ttl_seconds,
                    grace_seconds=grace_seconds,
                )
            if stop.wait(interval_seconds):
                return
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        _log("stopped")
