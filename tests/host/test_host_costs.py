"""Host-thread costs that do not grow with the prompt cache: the view, a
save, a seed lookup in memory and on disk, write-behind and a dirty
eviction.

Costs are counted, never timed: ``_lines`` counts the Python lines the host
runs (a trace function, deterministic for one input), and a cost that does
not depend on the store's size runs the same lines with 10 entries as with
5,000. Before, the view hashed every anonymous entry's tokens at each
admission and end, a save under a shared head compared every sibling, and
a disk lookup compared the prompt with every indexed entry.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from gezel_trio.core.cache_store import CacheStore
from gezel_trio.host import persist
from gezel_trio.host.persist import DiskCache, DiskEntry, DiskIndex
from gezel_trio.host.prompt_cache import CacheBook
from tests.support.fakes import FakeOps, FakeState
from tests.support.prompt_cache import Harness, request

BLOCK = 8
HEAD = tuple(range(1, 1 + BLOCK))  # one whole block every filler shares


@contextmanager
def _lines() -> Iterator[list[int]]:
    """Count the Python lines run inside the block (``[count]``)."""
    count = [0]

    def trace(frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        if event == "line":
            count[0] += 1
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield count
    finally:
        sys.settrace(previous)


def _filled(n: int, *, trimmable: bool = True, disk: Path | None = None) -> Harness:
    """A cache holding ``n`` anonymous entries under one shared head block
    (each its own second block, then a partial third), and as many
    metadata records in the disk index when there is a disk."""
    h = Harness(trimmable=trimmable, disk=disk, block=BLOCK)
    for i in range(n):
        tokens = (*HEAD, *range(100_000 + 16 * i, 100_000 + 16 * i + 11))

        def blocks(ranges: Any, tokens: tuple[int, ...] = tokens) -> list[tuple[Any, int]]:
            return [(tokens[s:e], e - s) for s, e in ranges]

        h.cache.store.add(tokens, blocks, dirty=False)
        if h.disk is not None:
            key = f"anon:filler{i}"
            h.disk.index[key] = DiskEntry(key, tokens, "anonymous", size=1)
    h.cache.delta()  # the fill itself is not what is measured
    return h


def _turn_cost(h: Harness, i: int) -> int:
    """Lines run by one turn of a fresh prompt under the shared head (its
    admission, with the seed lookups in memory and on disk; its save; the
    delta the host then reports)."""
    prompt = (*HEAD, *range(900_000 + 64 * i, 900_000 + 64 * i + 13))
    with _lines() as count:
        h.run(request(prompt))
        h.cache.delta()
    return count[0]


def test_a_turn_costs_the_same_with_10_and_with_5000_entries(tmp_path: Path) -> None:
    for trimmable in (True, False):
        small = _filled(10, trimmable=trimmable, disk=tmp_path / f"s{trimmable}")
        large = _filled(5000, trimmable=trimmable, disk=tmp_path / f"l{trimmable}")
        _turn_cost(small, 0), _turn_cost(large, 0)  # first-use costs (imports, caches)
        a, b = _turn_cost(small, 1), _turn_cost(large, 1)
        # A few lines of slack: the bisections' neighbours may differ.
        assert b <= a + 20, (trimmable, a, b)


def test_a_delta_holds_only_what_changed() -> None:
    h = _filled(5000)
    h.run(request((*HEAD, *range(900_000, 900_013))))
    delta = h.cache.delta()
    # The new entry and the filler it seeded from (touched); none of the others.
    assert len(delta.rows) == 2
    assert delta.totals.entries == 5001


def test_the_view_from_deltas_is_the_full_view_after_every_change(tmp_path: Path) -> None:
    """Names, anonymous saves, prefixes, pins whose ttl passes, evictions,
    renames, disk writes and deletes: after each, the Trio side's book shows
    exactly what a view built from the whole store shows."""
    h = Harness(trimmable=False, budget=3000, disk=tmp_path)
    book = CacheBook()

    def check() -> None:
        book.apply(h.cache.delta())
        full = h.cache.view()
        assert book.entries == full.entries
        assert book.totals == full.totals

    system = tuple(range(40))
    for i in range(12):
        prompt = (*system, *range(1000 + 50 * i, 1000 + 50 * i + 20))
        kw: dict[str, Any] = {"boundaries": (len(system),)}
        if i % 3 == 0:
            kw["cache_id"] = f"s{i}"
        if i % 4 == 1:
            kw["prefix_ids"] = ("sys",)
        h.run(request(prompt, **kw))
        check()
        if i == 5:
            h.cache.flush()
            check()
            h.cache.evict("s3")
            check()
        h.now += 100.0  # pins and time move
        check()
    rid, _, _ = h.start(request((*system, 7, 7, 7), cache_id="s0"))
    check()  # pinned by a live request
    h.cache.cancelled(rid, None)
    check()


def test_a_dirty_eviction_is_written_off_the_host_thread_and_stays_findable(
    tmp_path: Path, monkeypatch: Any
) -> None:
    writers: list[str] = []
    real_seal = DiskCache._seal

    def seal(self: DiskCache, staged: Any) -> Any:
        writers.append(threading.current_thread().name)
        # The eviction's turn returns before this write lands.
        assert gate.wait(60)
        return real_seal(self, staged)

    gate = threading.Event()
    monkeypatch.setattr(DiskCache, "_seal", seal)
    h = Harness(trimmable=True, budget=1500, disk=tmp_path)
    p1 = tuple(range(100))
    h.run(request(p1, cache_id="a"))
    h.run(request(range(1000, 1100), cache_id="b"))  # evicts "a", dirty
    assert h.named("a") is None
    assert h.disk is not None
    # Listed on disk while its write is in flight, not yet written.
    assert "name:a" in h.disk.index
    assert h.disk.writes_in_flight == 1
    assert not list(tmp_path.rglob("*.gzc"))
    gate.set()
    # A lookup finds it and loads it (waiting for the write).
    assert h.run(request((*p1, 500, 501), cache_id="a")) == len(p1)
    assert writers
    assert threading.current_thread().name not in writers
    assert set(writers) == {"gezel-cache-writer"}
    h.cache.close_disk()


def test_an_evicted_entry_whose_write_failed_is_no_longer_listed(
    tmp_path: Path, monkeypatch: Any
) -> None:
    def seal(self: DiskCache, staged: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(DiskCache, "_seal", seal)
    h = Harness(trimmable=True, budget=1500, disk=tmp_path)
    h.run(request(range(100), cache_id="a"))
    h.run(request(range(1000, 1100), cache_id="b"))
    assert h.disk is not None
    h.cache.collect_behind(None)
    assert "name:a" not in h.disk.index
    assert h.run(request((*range(100), 5), cache_id="a")) == 0
    h.cache.close_disk()


def test_write_behind_looks_only_at_dirty_entries(tmp_path: Path) -> None:
    """Finding the next entry to write behind costs the same whatever the
    number of clean entries."""

    def cost(n: int) -> int:
        h = _filled(n, disk=tmp_path / str(n))
        h.run(request((*HEAD, 5, 6, 7)))
        h.cache.write_behind()  # first use: the writer thread starts
        h.cache.collect_behind(None)
        h.run(request((*HEAD, 8, 9, 10)))
        with _lines() as count:
            assert h.cache.write_behind()
        h.cache.close_disk()
        return count[0]

    assert cost(5000) <= cost(10) + 20


def test_the_disk_index_finds_what_a_pass_over_every_entry_finds() -> None:
    """``DiskIndex.best`` against the plain definition, on prefixes, partial
    blocks, divergences inside a block, names to skip and both model kinds."""
    index = DiskIndex(block_tokens=4)
    stored = [
        (1, 2, 3, 4, 5, 6),
        (1, 2, 3, 4),
        (1, 2, 3, 4, 5, 6, 7, 8, 9),
        (1, 2, 9),
        (1, 2, 3, 4, 5, 7, 7, 7),
        (2, 2, 2, 2, 2),
        (1,),
    ]
    for i, tokens in enumerate(stored):
        index[f"anon:{i}" if i % 2 else f"name:{i}"] = DiskEntry(f"k{i}", tokens, "x", size=i)
    assert index.total_bytes == sum(range(len(stored)))
    prompts = [
        (1, 2, 3, 4, 5, 6, 7, 8, 9, 10),
        (1, 2, 3, 4, 5, 6),
        (1, 2, 9, 9, 9),
        (1, 2, 3, 4, 5, 7, 7, 1, 1),
        (2, 2, 2, 2, 2, 2),
        (1, 5),
        (7, 7, 7),
        (1, 2, 3, 4, 5, 6, 7, 8, 9),
    ]
    for skip_names in (False, True):

        def skip(key: str, skip_names: bool = skip_names) -> bool:
            return skip_names and key.startswith("name:")

        for trimmable in (True, False):
            for prompt in prompts:
                for beat in (0, 3):
                    found = index.best(prompt, beat=beat, trimmable=trimmable, skip=skip)
                    want = _plain_best(index, prompt, beat, trimmable, skip)
                    got = _reach(found, prompt, trimmable) if found is not None else None
                    assert got == want, (prompt, beat, trimmable, skip_names)
    del index["anon:1"]
    del index["name:2"]
    assert index.total_bytes == sum(range(len(stored))) - 3
    assert index.best((1, 2, 3, 4, 5), beat=0, trimmable=False, skip=lambda k: False) is not None


def test_the_disk_index_keeps_each_salt_to_itself() -> None:
    """A prompt finds only the disk entries of its own salt; a salt's root
    goes with its last entry."""
    index = DiskIndex(block_tokens=4)
    tokens = (1, 2, 3, 4, 5, 6, 7, 8, 9)
    index["anon:a"] = DiskEntry("anon:a", tokens, "x", salt="tenant-a")
    index["anon:b"] = DiskEntry("anon:b", tokens[:5], "x", salt="tenant-b")
    index["anon:n"] = DiskEntry("anon:n", tokens[:3], "x")

    def best(salt: str) -> str | None:
        found = index.best((*tokens, 10), beat=0, trimmable=True, skip=lambda k: False, salt=salt)
        return None if found is None else found.file_key

    assert (best("tenant-a"), best("tenant-b"), best(""), best("other")) == (
        "anon:a",
        "anon:b",
        "anon:n",
        None,
    )
    del index["anon:a"]
    assert best("tenant-a") is None
    index["anon:a2"] = DiskEntry("anon:a2", tokens[:2], "x", salt="tenant-a")
    assert best("tenant-a") == "anon:a2"


def _reach(entry: DiskEntry, prompt: tuple[int, ...], trimmable: bool) -> int:
    limit = len(prompt) - 1
    n = len(entry.tokens)
    if trimmable:
        shared = 0
        while shared < min(n, len(prompt)) and entry.tokens[shared] == prompt[shared]:
            shared += 1
        return min(limit, shared)
    return n if n <= limit and prompt[:n] == entry.tokens else 0


def _plain_best(
    index: DiskIndex,
    prompt: tuple[int, ...],
    beat: int,
    trimmable: bool,
    skip: Callable[[str], bool],
) -> int | None:
    """How far the best entry seeds, by the old pass over every entry."""
    reach = max((_reach(e, prompt, trimmable) for k, e in index.items() if not skip(k)), default=0)
    return reach if reach > beat else None


def test_the_store_finds_siblings_by_bisection() -> None:
    """The sorted child keys stay in step with the children through adds,
    absorbed partial blocks and removals."""
    store = CacheStore(10**9, trimmable=False, block_tokens=4)

    def blocks(ranges: Any) -> list[tuple[Any, int]]:
        return [(None, e - s) for s, e in ranges]

    saved = [store.add(t, blocks)[0] for t in [(5, 1), (5, 1, 2), (3, 3, 3, 3, 1), (5, 1, 2, 4)]]
    saved.append(store.add((3, 3, 3, 3, 9, 9), blocks)[0])
    for node in _nodes(store.root):
        assert node.keys == sorted(node.children)
    assert store.walk((5, 1, 2, 7))[1] == 3
    assert sorted(e.end for e in store.prefixes((5, 1, 2, 4, 0))) == [2, 3, 4]
    for entry in saved:
        store.remove(entry)
        for node in _nodes(store.root):
            assert node.keys == sorted(node.children)
    assert store.block_count == 0


def _nodes(node: Any) -> Iterator[Any]:
    yield node
    for child in node.children.values():
        yield from _nodes(child)


def test_a_loaded_state_is_what_was_saved(tmp_path: Path) -> None:
    # The disk index as a mapping: a reopened directory lists what was written.
    d = DiskCache(tmp_path, "fp", FakeOps(trimmable=True))
    tokens = tuple(range(30))
    assert d.save("anon:x", tokens, FakeState(tokens, True), kind="anonymous", roster="")
    again = DiskCache(tmp_path, "fp", FakeOps(trimmable=True))
    assert isinstance(again.index, persist.DiskIndex)
    assert again.index["anon:x"].tokens == tokens
    assert again.total_bytes == d.total_bytes > 0
