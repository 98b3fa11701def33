"""Leases on EC store entries (ec/leases.py): the janitor evicts nothing a proxy leases, trusts
fresh leases only, and takes the store's lock so that no proxy checks an entry in between."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from epd_client import key_generation
from epd_operator.ec import janitor, leases

KEY = "epd-" + "ab" * 16


def entry(store: Path, name: str, age: float = 100.0) -> None:
    folder = store / name
    folder.mkdir(parents=True)
    (folder / leases.EMBEDDING_FILE).write_bytes(b"\0" * 4096)
    then = time.time() - age
    os.utime(folder / leases.EMBEDDING_FILE, (then, then))
    os.utime(folder, (then, then))


def sweep(store: Path, max_bytes: int = 0) -> janitor.StoreMetrics:
    metrics = janitor.StoreMetrics([str(store)], max_bytes)
    janitor.sweep(str(store), metrics, janitor.StoreState(), max_bytes=max_bytes, ttl_seconds=None, grace_seconds=10)
    return metrics


def test_a_leased_key_keeps_every_generation_of_its_entry_and_others_go(tmp_path: Path) -> None:
    store = tmp_path / "vime-ec-x"
    for name in (KEY, key_generation(KEY, 2), "epd-" + "cd" * 16, "vllm-content-hash"):
        entry(store, name)
    held = leases.Leases(str(store), "proxy-1")
    held.hold(KEY)
    metrics = sweep(store)
    assert sorted(p.name for p in store.iterdir()) == [KEY, key_generation(KEY, 2)]
    assert metrics.leased.labels(str(store))._value.get() == 2
    held.release(KEY)
    sweep(store)
    assert list(store.iterdir()) == []
    # The lease files live beside the store: never an entry, never a fallback encode.
    assert sorted(p.name for p in Path(leases.lease_dir(str(store))).iterdir()) == [leases.LOCK]
    held.close()


def test_leases_are_counted_and_the_last_release_removes_the_file(tmp_path: Path) -> None:
    store = str(tmp_path / "s")
    held = leases.Leases(store, "p")
    held.hold(KEY)
    held.hold(KEY)
    held.release(KEY)
    assert leases.fresh_keys(store) == {KEY} and held.held() == 1
    held.release(KEY)
    assert leases.fresh_keys(store) == set() and held.held() == 0
    with pytest.raises(ValueError):
        leases.Leases(store, "a@b")


def test_a_dead_holders_lease_goes_stale_is_ignored_then_removed_and_a_live_one_is_renewed(tmp_path: Path) -> None:
    store = str(tmp_path / "s")
    dead, alive = leases.Leases(store, "dead"), leases.Leases(store, "alive")
    dead.hold(KEY)
    alive.hold("epd-" + "ef" * 16)
    later = time.time() + leases.STALE_SECONDS + 1
    assert leases.fresh_keys(store, later) == set()  # neither renewed: both stale by then
    alive.renew(later)  # the live one touches its own, and removes the dead one's
    assert leases.fresh_keys(store, later) == {"epd-" + "ef" * 16}
    assert not os.path.exists(os.path.join(leases.lease_dir(store), f"{KEY}@dead"))


def test_a_proxy_cannot_check_while_the_janitor_evicts(tmp_path: Path) -> None:
    store = str(tmp_path / "s")
    held = leases.Leases(store, "p")
    evicting, done = threading.Event(), threading.Event()

    def janitor_holds_the_lock() -> None:
        with leases.exclusive(store) as locked:
            assert locked
            evicting.set()
            done.wait(5)

    thread = threading.Thread(target=janitor_holds_the_lock)
    thread.start()
    evicting.wait(5)
    assert not held.try_shared()  # the proxy waits its turn
    done.set()
    thread.join()
    assert held.try_shared()
    held.unlock()


def test_without_a_lock_file_the_janitor_sweeps_unlocked(tmp_path: Path) -> None:
    with leases.exclusive(str(tmp_path / "nothing")) as locked:
        assert locked is False
    janitor.run_janitor(
        paths=[str(tmp_path / "store")], max_bytes=1, interval_seconds=0.01, stop=_stopped()
    )  # prepares the lease folder at its start
    assert os.path.exists(os.path.join(leases.lease_dir(str(tmp_path / "store")), leases.LOCK))


def _stopped() -> threading.Event:
    stop = threading.Event()
    stop.set()
    return stop
