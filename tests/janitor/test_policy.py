"""The eviction policy on real stores: real folders and safetensors files on tmpfs."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from epd_operator.ec import janitor
from epd_operator.ec.janitor import EMBEDDING_FILE, evict, is_cache_miss, scan_store, select_evictions

from .store import load, miss, new_store, publish, writing


@pytest.fixture
def store():
    path = new_store()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def plan(store: Path, **policy) -> list[tuple[str, str]]:
    return [(e.entry.name, e.reason) for e in select_evictions(scan_store(str(store)), now=time.time(), **policy)]


def evict_all(store: Path, **policy) -> None:
    for eviction in select_evictions(scan_store(str(store)), now=time.time(), **policy):
        assert evict(str(store), eviction.entry)


def test_scan_sees_what_vllm_wrote(store):
    publish(store, "aaa", age=30)
    writing(store, "bbb")
    miss(store, "ccc", age=30)
    (store / "stray-file").write_text("not an entry")  # only folders are entries
    entries = {e.name: e for e in scan_store(str(store))}
    assert set(entries) == {"aaa", "bbb", "ccc"}
    assert entries["aaa"].complete and entries["aaa"].files == (EMBEDDING_FILE,)
    assert entries["aaa"].bytes == os.stat(store / "aaa" / EMBEDDING_FILE).st_blocks * 512 > 0
    assert time.time() - entries["aaa"].newest_mtime == pytest.approx(30, abs=2)
    assert not entries["bbb"].complete and entries["bbb"].bytes > 0
    assert not entries["ccc"].complete and entries["ccc"].bytes == 0


def test_budget_keeps_the_newest_entries_that_fit(store):
    for i in range(10):
        publish(store, f"h{i}", age=1000 - 10 * i)  # h9 is the newest
    size = scan_store(str(store))[0].bytes
    assert plan(store, max_bytes=4 * size) == [(f"h{i}", "budget") for i in range(6)]
    evict_all(store, max_bytes=4 * size)
    assert sorted(os.listdir(store)) == ["h6", "h7", "h8", "h9"]
    assert sum(e.bytes for e in scan_store(str(store))) <= 4 * size
    assert plan(store, max_bytes=4 * size) == []  # held: nothing more to do


def test_budget_counts_bytes_not_entries(store):
    publish(store, "big-old", rows=4096, age=300)
    for i in range(5):
        publish(store, f"small{i}", age=100 - i)
    entries = scan_store(str(store))
    small = sum(e.bytes for e in entries if e.name.startswith("small"))
    # Evicting the one big, oldest entry is enough.
    assert plan(store, max_bytes=small) == [("big-old", "budget")]


def test_entries_being_written_or_just_written_are_never_evicted(store):
    writing(store, "in-progress")  # temp file only: the rename has not happened yet
    publish(store, "just-primed")  # a consumer is about to read it
    publish(store, "old", age=60)
    # Even with no budget at all, only the settled entry goes.
    assert plan(store, max_bytes=0) == [("old", "budget")]
    evict_all(store, max_bytes=0)
    assert sorted(os.listdir(store)) == ["in-progress", "just-primed"]
    assert (store / "in-progress" / ".tmpQx81Zp").exists()


def test_an_embedding_rewritten_in_place_is_protected_by_its_new_mtime(store):
    """safetensors < 0.8 wrote the file in place: the folder does not change, the file does."""
    folder = publish(store, "rewritten", age=60)
    os.utime(folder / EMBEDDING_FILE)  # the writer is writing it now
    assert plan(store, max_bytes=0) == []


def test_ttl_expires_old_embeddings_even_under_budget(store):
    publish(store, "old", age=500)
    publish(store, "recent", age=50)
    assert plan(store, max_bytes=10**12, ttl_seconds=100) == [("old", "ttl")]
    assert plan(store, max_bytes=10**12) == []


def test_cache_miss_folders_and_abandoned_writes_are_removed_after_the_grace_period(store):
    miss(store, "miss-new")
    miss(store, "miss-old", age=30)
    writing(store, "abandoned", age=30)  # the encoder died mid-write
    publish(store, "kept", age=30)
    assert sorted(plan(store, max_bytes=10**12, grace_seconds=10)) == [("abandoned", "empty"), ("miss-old", "empty")]
    evict_all(store, max_bytes=10**12, grace_seconds=10)
    assert sorted(os.listdir(store)) == ["kept", "miss-new"]


def test_only_a_folder_without_any_file_is_a_consumers_cache_miss(store):
    miss(store, "miss", age=30)
    writing(store, "abandoned", age=30)  # an encoder's failed write: not a consumer's fallback
    publish(store, "primed", age=30)
    assert {e.name: is_cache_miss(e) for e in scan_store(str(store))} == {
        "miss": True,
        "abandoned": False,
        "primed": False,
    }


def test_a_missing_store_is_empty_and_never_created(store):
    missing = store / "not-yet-written"
    assert scan_store(str(missing)) == []
    assert not missing.exists()


def test_a_folder_vanishing_mid_scan_is_skipped(store, monkeypatch):
    for name in ("a", "b", "c"):
        publish(store, name, age=60)
    real = janitor._scan_entry

    def vanish_first(path, name, mtime_ns):
        if name == "b":
            shutil.rmtree(path)  # evicted by someone else between the listing and this look
        return real(path, name, mtime_ns)

    monkeypatch.setattr(janitor, "_scan_entry", vanish_first)
    assert sorted(e.name for e in scan_store(str(store))) == ["a", "c"]


def test_evicting_an_entry_that_is_already_gone_is_a_no_op(store):
    publish(store, "gone", age=60)
    (entry,) = scan_store(str(store))
    shutil.rmtree(store / "gone")
    assert evict(str(store), entry) is False


def test_a_file_written_after_the_scan_survives_its_folders_eviction(store):
    """An encoder re-publishing the image between the scan and the eviction keeps its file."""
    folder = publish(store, "republished", age=60)
    (entry,) = scan_store(str(store))
    (folder / ".tmpNEW123").write_bytes(b"being written")
    assert evict(str(store), entry) is False
    assert os.listdir(folder) == [".tmpNEW123"]  # only what the scan saw was removed


def test_an_open_embedding_stays_readable_after_eviction(store):
    folder = publish(store, "reading", age=60)
    with open(folder / EMBEDDING_FILE, "rb") as reader:
        (entry,) = scan_store(str(store))
        assert evict(str(store), entry)
        assert not folder.exists()
        assert len(reader.read()) > 0


def test_settled_entries_are_reused_until_their_folder_changes(store):
    folder = publish(store, "settled", age=60)
    first = {e.name: e for e in scan_store(str(store))}
    again = scan_store(str(store), first, settled_before=time.time() - 10)
    assert again[0] is first["settled"]
    save_file({"ec_cache": np.zeros((4, 4), dtype=np.float16)}, str(folder / EMBEDDING_FILE))  # renamed in
    rescanned = scan_store(str(store), first, settled_before=time.time() - 10)
    assert rescanned[0] is not first["settled"] and time.time() - rescanned[0].newest_mtime < 5


def test_concurrent_writers_readers_and_evictions_never_break_a_read_or_a_write(store):
    """A real writer (as the connector writes), a reader (as a consumer reads) and the janitor
    with a tiny budget, all at once: the writer never fails and no reader ever sees a partial
    file; an embedding either loads whole or is gone."""
    errors: list[BaseException] = []
    done = threading.Event()
    written: list[int] = []
    reads: list[int] = []

    def writer():
        try:
            for i in range(300):
                folder = store / f"img{i:04d}"
                os.makedirs(folder, exist_ok=True)
                save_file({"ec_cache": np.full((64, 128), i, dtype=np.float16)}, str(folder / EMBEDDING_FILE))
                written.append(i)
                os.makedirs(store / f"miss{i:04d}", exist_ok=True)  # a consumer's cache miss
                time.sleep(0.003)  # spread over several grace periods
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)
        finally:
            done.set()

    def reader():
        while not done.is_set():
            for i in list(written[-5:]):
                try:
                    assert (load(store / f"img{i:04d}" / EMBEDDING_FILE) == i).all()
                    reads.append(i)
                except FileNotFoundError:
                    pass  # evicted: the consumer encodes the image itself
                except BaseException as error:  # noqa: BLE001
                    errors.append(error)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for thread in threads:
        thread.start()
    evicted = {"budget": 0, "empty": 0}
    while not done.is_set():
        for eviction in select_evictions(scan_store(str(store)), now=time.time(), max_bytes=0, grace_seconds=0.2):
            evicted[eviction.reason] += evict(str(store), eviction.entry)
        time.sleep(0.01)
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert reads and evicted["budget"] > 0 and evicted["empty"] > 0, (len(reads), evicted)
