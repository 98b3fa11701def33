"""Leases on EC store entries: how a unit's EPD proxy keeps the janitor from evicting an entry
it relies on, from the moment it finds (or primes) it until the consumer has read it.

vLLM's ECExampleConnector keeps no lock of its own, and vLLM 0.32's consumer encodes an image
itself when its file is missing. So a proxy that checks `<store>/<name>/encoder_cache.safetensors`,
skips the prime and forwards the request must be sure that the file is still there when the
consumer reads it. The protocol, between processes of one pod sharing its /dev/shm:

- Beside the store, `<store>.leases/` holds `.lock` and one file `<key>@<holder>` per key a
  process (a proxy, `holder`) relies on. A key covers every generation of its store name
  (`epd_client._media.key_of`).
- The proxy, holding `.lock` shared (flock), creates its lease file for the key and then checks
  the entry; it releases the lock right after. It removes the lease file once its request is
  done, and touches the lease files it holds every RENEW_SECONDS.
- The janitor, holding `.lock` exclusively, lists the fresh lease files (touched within
  STALE_SECONDS: a holder that died stops renewing) and evicts no entry they cover; it releases
  the lock once its evictions are done.

Whichever takes the lock first, an entry is never evicted between a proxy's check and its
request's end: either the lease file was there when the janitor looked, or the entry was gone
before the proxy checked (and the proxy primes it again). Lease files are not store entries, so
the janitor never counts one as a fallback encode. Every container of a unit runs as the pod's
user, so each may create, touch and remove what the others made.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterable, Iterator
from typing import TextIO

from epd_client import key_of

# What ECExampleConnector writes in each `<store>/<name>/` folder.
EMBEDDING_FILE = "encoder_cache.safetensors"
LEASES_SUFFIX = ".leases"
LOCK = ".lock"
SEPARATOR = "@"
RENEW_SECONDS = 10.0
# A lease not touched for this long is its dead holder's: ignored, and removed by the proxies.
STALE_SECONDS = 60.0


def lease_dir(store: str) -> str:
    """Where the leases on `store` live: beside it, never in it (the janitor reads every folder
    of the store as an entry)."""
    return store.rstrip("/") + LEASES_SUFFIX


def prepare(store: str) -> str:
    """Make the lease folder and its lock file if missing (the janitor at its start, the proxy
    at its own: either may come first); the lock file's path."""
    folder = lease_dir(store)
    os.makedirs(folder, exist_ok=True)
    lock = os.path.join(folder, LOCK)
    with open(lock, "a"):
        pass
    return lock


def fresh_keys(store: str, now: float | None = None) -> set[str]:
    """The keys some holder leases now: lease files touched within STALE_SECONDS."""
    now = time.time() if now is None else now
    keys: set[str] = set()
    try:
        listing = os.scandir(lease_dir(store))
    except FileNotFoundError:
        return keys
    with listing:
        for lease in listing:
            key, separator, _holder = lease.name.rpartition(SEPARATOR)
            if not separator:
                continue  # the lock file
            try:
                if now - lease.stat().st_mtime < STALE_SECONDS:
                    keys.add(key)
            except FileNotFoundError:
                continue  # released meanwhile
    return keys


def leased_entries(names: Iterable[str], keys: set[str]) -> set[str]:
    """The entry names (store folders) some lease covers."""
    return {name for name in names if key_of(name) in keys}


@contextlib.contextmanager
def exclusive(store: str) -> Iterator[bool]:
    """The janitor's side: hold the store's lock exclusively for the body (True), so no proxy
    checks an entry or takes a lease meanwhile; False, without locking, where no lock file
    exists (nothing can hold a lease: no proxy runs beside this store)."""
    lock = os.path.join(lease_dir(store), LOCK)
    try:
        handle: TextIO = open(lock)  # noqa: SIM115  # held across the yield
    except FileNotFoundError:
        yield False
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class Leases:
    """A process's leases on one store's keys (the proxy's side), counted: several requests may
    rely on one key, and its lease file goes with the last of them. Not thread-safe: one event
    loop uses it."""

    def __init__(self, store: str, holder: str) -> None:
        if SEPARATOR in holder or "/" in holder:
            raise ValueError(f"a lease holder's name has neither {SEPARATOR!r} nor '/': {holder!r}")
        self.store = store.rstrip("/")
        self.folder = lease_dir(store)
        self.holder = holder
        self._lock = open(prepare(store))  # noqa: SIM115  # open for the process's life
        self._held: dict[str, int] = {}

    def close(self) -> None:
        for key in list(self._held):
            self._remove(key)
        self._held.clear()
        self._lock.close()

    def try_shared(self) -> bool:
        """Take the store's lock shared without waiting; False while the janitor holds it. The
        caller's checks and ``hold`` calls go between this and ``unlock``, with no await in
        between: one process's coroutines share its one lock."""
        try:
            fcntl.flock(self._lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def unlock(self) -> None:
        fcntl.flock(self._lock, fcntl.LOCK_UN)

    def hold(self, key: str) -> None:
        """Lease ``key`` (one more holder of it): its file exists from now on."""
        count = self._held.get(key, 0)
        if count == 0:
            path = self._path(key)
            with open(path, "a"):
                pass
            os.utime(path)
        self._held[key] = count + 1

    def release(self, key: str) -> None:
        count = self._held.get(key, 0)
        if count <= 1:
            self._held.pop(key, None)
            self._remove(key)
        else:
            self._held[key] = count - 1

    def held(self) -> int:
        """Keys this process leases now."""
        return len(self._held)

    def renew(self, now: float | None = None) -> None:
        """Touch every lease file held (so the janitor keeps trusting them), make again any that
        went missing, and remove other holders' stale ones (holders that died)."""
        now = time.time() if now is None else now
        for key in self._held:
            path = self._path(key)
            with open(path, "a"):
                pass
            os.utime(path, (now, now))
        with contextlib.suppress(FileNotFoundError), os.scandir(self.folder) as listing:
            for lease in listing:
                if SEPARATOR not in lease.name or lease.name.endswith(SEPARATOR + self.holder):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    if now - lease.stat().st_mtime >= STALE_SECONDS:
                        os.unlink(lease.path)

    def _path(self, key: str) -> str:
        return os.path.join(self.folder, f"{key}{SEPARATOR}{self.holder}")

    def _remove(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(key))
