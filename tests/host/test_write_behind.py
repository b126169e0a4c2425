"""Write-behind: dirty cache entries reach the disk through the writer
thread soon after they are saved, in order per file key, and a flush or a
shutdown finds little or nothing left to write."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from gezel_trio import EngineConfig, open_engine
from gezel_trio.host.persist import DiskCache
from tests.support.fakes import FakeOps, FakeState
from tests.support.prompt_cache import P1, Harness, request

TOKENS = tuple(range(50))
HANG = 120


def test_a_write_behind_lands_indexed_and_loads(tmp_path: Path) -> None:
    d = DiskCache(tmp_path, "fp", FakeOps(trimmable=True))
    state = FakeState(TOKENS, True)
    assert d.save_behind("name:s", TOKENS, state, kind="session", roster="r", tag="t")
    assert d.writes_in_flight == 1
    assert d.collect(None) == [("t", True)]
    assert d.writes_in_flight == 0
    assert d.index["name:s"].tokens == TOKENS
    loaded = d.load("name:s")
    assert loaded is not None
    assert loaded.state == state
    d.close()


def test_writes_of_one_key_land_in_order_and_a_delete_waits_for_them(tmp_path: Path) -> None:
    d = DiskCache(tmp_path, "fp", FakeOps(trimmable=True))
    short, long = TOKENS[:10], TOKENS
    assert d.save_behind("name:s", short, FakeState(short, True), kind="session", roster="")
    # A synchronous save of the same key waits for the write in flight:
    # the older state never lands over the newer one.
    assert d.save("name:s", long, FakeState(long, True), kind="session", roster="")
    loaded = d.load("name:s")
    assert loaded is not None
    assert loaded.tokens == long
    # Nor does a write in flight bring a deleted file back.
    assert d.save_behind("name:s", short, FakeState(short, True), kind="session", roster="", tag=2)
    assert d.delete("name:s")
    assert not d.exists("name:s")
    assert "name:s" not in d.index
    # The writes a save or a delete waited for are still reported.
    assert d.collect() == [(None, True), (2, True)]
    assert d.writes_in_flight == 0
    d.close()
    assert list(tmp_path.rglob("*.gzc")) == []
    assert list(tmp_path.rglob(".*.tmp.*")) == []


def test_write_behind_makes_the_flush_find_nothing(tmp_path: Path) -> None:
    h = Harness(trimmable=True, disk=tmp_path)
    h.run(request(P1, cache_id="a"))
    h.run(request(range(500, 520)))
    assert h.cache.write_behind()  # the named entry first
    assert h.cache.write_behind()  # then the anonymous one
    assert not h.cache.write_behind()  # nothing more, or two in flight
    # Each hand-over first collects the writes that landed already (a race
    # with the writer thread), so how many this last collect counts varies:
    # what matters is that none is left in flight and both entries are clean.
    h.cache.collect_behind(None)
    assert h.cache.writes_behind == 0
    assert not h.cache.write_behind()
    assert all(not e.dirty for e in h.cache.store)
    assert h.cache.flush() == 0
    assert h.disk is not None
    assert sorted(e.kind for e in h.disk.index.values()) == ["anonymous", "session"]
    h.cache.close_disk()


def test_an_entry_renamed_while_its_write_is_in_flight_stays_dirty(tmp_path: Path) -> None:
    h = Harness(trimmable=True, disk=tmp_path)
    h.run(request(range(500, 520)))
    assert h.cache.write_behind()
    (entry,) = list(h.cache.store)
    h.cache.store.rename(entry, "later", "session", "")
    h.cache.collect_behind(None)
    # The file written holds the anonymous key: the name is still unwritten.
    assert entry.dirty
    assert h.cache.flush() == 1
    assert h.disk is not None
    assert h.disk.exists("name:later")
    h.cache.close_disk()


def test_an_entry_evicted_while_its_write_is_in_flight_is_not_waited_for_again(
    tmp_path: Path,
) -> None:
    h = Harness(trimmable=True, disk=tmp_path)
    h.run(request(P1, cache_id="a"))
    assert h.cache.write_behind()
    assert h.cache.evict("a") == (True, True)  # the delete waited for the write
    h.cache.collect_behind()
    assert h.cache.writes_behind == 0  # an idle host may sleep again
    assert list(tmp_path.rglob("*.gzc")) == []
    h.cache.close_disk()


async def test_an_idle_engine_writes_a_finished_turn_behind(
    dense_model: Path, tmp_path: Path
) -> None:
    """The real engine: after a turn the host writes its entry while idle;
    the stats say clean without any flush, and the flush finds nothing."""
    config = EngineConfig.from_flags(model=dense_model, persist_dir=tmp_path, write_behind=True)
    with trio.fail_after(HANG):
        async with open_engine(config) as engine:
            handle = await engine.chat(
                [{"role": "user", "content": "Hello there."}], max_tokens=4, cache_id="s"
            )
            with handle:
                async for _ in handle:
                    pass
            await engine.wait_until(
                lambda _: (
                    any(e.cache_id == "s" for e in engine.cache_view)
                    and not any(e.dirty for e in engine.cache_view)
                )
            )
            assert engine.cache_totals.disk_entries >= 1
            assert await engine.flush() == 0
    files = await trio.to_thread.run_sync(lambda: list(tmp_path.rglob("*.gzc")))
    assert files


def test_a_failing_disk_pauses_write_behind_instead_of_retrying_in_a_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(trimmable=True, disk=tmp_path)
    h.run(request(P1, cache_id="a"))

    def full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(h.ops, "dump_state", full)
    assert not h.cache.write_behind()
    assert h.disk is not None
    assert h.disk.problem == "No space left on device"
    monkeypatch.undo()
    # Paused: the idle host goes idle rather than spinning on the disk...
    assert not h.cache.write_behind()
    # ...while a flush still writes (and clears the trouble).
    assert h.cache.flush() == 1
    assert h.disk.problem is None


def test_at_most_two_writes_behind_are_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(trimmable=True, disk=tmp_path)
    for name in "abc":
        h.run(request(range(100 * ord(name), 100 * ord(name) + 40), cache_id=name))
    assert h.disk is not None
    slow_disk = threading.Event()
    seal = h.disk._seal

    def held(job: Any) -> Any:
        slow_disk.wait()
        return seal(job)

    monkeypatch.setattr(h.disk, "_seal", held)
    assert h.cache.write_behind()
    assert h.cache.write_behind()
    assert not h.cache.write_behind(), "a third waits for the slow disk"
    slow_disk.set()
    assert h.cache.collect_behind(None) == 2
    assert h.cache.write_behind()  # the third
    assert h.cache.collect_behind(None) == 1
    assert h.cache.flush() == 0
    h.cache.close_disk()
