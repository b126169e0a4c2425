"""Two processes on one persist dir: a supervisor's restart overlapping the
old process's shutdown flush. The newcomer leaves the old one's temp files
and entries alone while it lives (the directory's lock, held per open file,
so two caches in one process stand in for the two processes), and takes the
lock, with the old one's last writes, once it is gone."""

from __future__ import annotations

import os
from pathlib import Path

import trio

from gezel_trio.host.persist import DiskCache
from gezel_trio.http.response_store import ResponseStore, StoredResponse, _file_name
from tests.support.fakes import FakeOps, FakeState

TOKENS = tuple(range(50))


def disk(root: Path) -> DiskCache:
    return DiskCache(root, "m", FakeOps(trimmable=True))


def save(d: DiskCache, key: str) -> None:
    assert d.save(key, TOKENS, FakeState(TOKENS, True), kind="session", roster="r")


def test_a_second_cache_on_the_dir_neither_sweeps_nor_prunes_the_firsts_files(
    tmp_path: Path,
) -> None:
    old = disk(tmp_path)
    for key in ("a", "b", "c"):
        save(old, key)
    # A write of the old process's in flight: its temp file, named with its pid.
    writing = old.dir / f".{'x' * 64}.{os.getpid()}.0a1b2c3d.tmp.safetensors"
    writing.write_bytes(b"half a state")
    new = disk(tmp_path)
    assert writing.exists(), "a live process's temp file is not swept"
    assert new.prune(1) == [], "only the lock's holder prunes"
    save(old, "final")  # the old process's shutdown flush, after the new one opened
    assert "name:final" not in new.index
    old.lock.release()  # the old process exits
    new.prune(1 << 30)  # the newcomer takes the lock, and reads the index again
    assert new.lock.held
    assert "final" in new.index
    assert new.load("final") is not None
    assert all(key in new.index for key in ("a", "b", "c"))


async def _read_back(directory: Path) -> ResponseStore:
    store = ResponseStore(1, directory)  # a budget below any record: all beyond it
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        nursery.cancel_scope.cancel()
    return store


def test_a_second_response_store_removes_nothing_of_the_firsts(tmp_path: Path) -> None:
    directory = tmp_path / "responses"
    directory.mkdir()
    first = trio.run(_read_back, directory)
    record = directory / _file_name("r1")
    record.write_bytes(StoredResponse("r1", {"id": "r1"}, [], "r1").to_json())
    writing = directory / f".{record.stem}.{os.getpid()}.0a1b2c3d.tmp"
    writing.write_bytes(b"{")
    trio.run(_read_back, directory)
    assert record.exists(), "a record beyond the budget is kept while the lock is another's"
    assert writing.exists()
    assert first._lock is not None
    first._lock.release()
    trio.run(_read_back, directory)
    assert not record.exists(), "the lock's holder prunes by budget"
