"""Cache planning and the in-memory store, alone (no MLX)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gezel_trio.cache_plan import (
    SeedPlan,
    common_prefix,
    plan_seed,
    snapshot_cut,
    snapshot_is_sound,
    split_segments,
)
from gezel_trio.cache_store import CacheStore, Entry


@given(st.lists(st.integers(0, 3), max_size=2000), st.lists(st.integers(0, 3), max_size=2000))
def test_common_prefix_matches_the_obvious_loop(a: list[int], b: list[int]) -> None:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common_prefix(a, b) == n


def test_plan_extends_a_cached_prefix() -> None:
    assert plan_seed([1, 2, 3], [1, 2, 3, 4, 5], trimmable=False) == SeedPlan(
        "extend", reuse=3, cached_len=3, lcp=3
    )


def test_plan_trims_a_divergent_trimmable_state() -> None:
    assert plan_seed([1, 2, 3, 9, 9], [1, 2, 3, 4], trimmable=True) == SeedPlan(
        "trim", reuse=3, trim=2, cached_len=5, lcp=3
    )


def test_plan_refuses_a_divergent_untrimmable_state() -> None:
    plan = plan_seed([1, 2, 3, 9], [1, 2, 3, 4], trimmable=False)
    assert (plan.mode, plan.reuse, plan.lcp) == ("divergent", 0, 3)


def test_plan_always_leaves_one_token_to_prefill() -> None:
    assert plan_seed([1, 2, 3], [1, 2, 3], trimmable=True) == SeedPlan(
        "trim", reuse=2, trim=1, cached_len=3, lcp=3
    )
    assert plan_seed([1, 2, 3], [1, 2, 3], trimmable=False).mode == "divergent"
    assert plan_seed(None, [1], trimmable=True).mode == "fresh"
    assert plan_seed([5], [1, 2], trimmable=True).mode == "fresh"


def test_segments_split_at_inner_cuts_only() -> None:
    prompt = list(range(10))
    assert split_segments(prompt, 2, [0, 2, 5, 8, 10, 12]) == [[2, 3, 4], [5, 6, 7], [8, 9]]
    assert split_segments(prompt, 0, []) == [prompt]


def test_snapshot_cut_keeps_the_margin_and_must_advance() -> None:
    assert snapshot_cut(100, 0) == 84
    assert snapshot_cut(100, 84) is None
    assert snapshot_cut(10, 0) is None


def test_snapshot_soundness_checks_tokens_and_offsets() -> None:
    prompt = [1, 2, 3, 4, 5]
    assert snapshot_is_sound([1, 2, 3], prompt, 3, [3, None, 3])
    assert not snapshot_is_sound([1, 2, 4], prompt, 3, [3])
    assert not snapshot_is_sound([1, 2, 3], prompt, 3, [2])
    assert not snapshot_is_sound([1, 2], prompt, 3, [3])


def entry(key: str, nbytes: int, tokens: tuple[int, ...] = (1,)) -> Entry:
    return Entry(key=key, tokens=tokens, state=None, nbytes=nbytes)


def test_lru_eviction_down_to_80_percent() -> None:
    store = CacheStore(budget_bytes=100)
    for key in "abcd":
        assert store.put(entry(key, 30)) == [] or key == "d"
    # a, b, c = 90 bytes; d pushed to 120 > 100 -> evict LRU down to <= 80.
    assert sorted(e.key for e in store) == ["c", "d"]


def test_recent_use_protects_an_entry() -> None:
    store = CacheStore(budget_bytes=100)
    for key in "abc":
        store.put(entry(key, 30))
    store.get("a")
    evicted = store.put(entry("d", 30))
    assert [e.key for e in evicted] == ["b", "c"]


def test_never_evicts_the_only_entry_or_a_pinned_one() -> None:
    store = CacheStore(budget_bytes=10)
    assert store.put(entry("big", 500)) == []
    store.pin("big")
    evicted = store.put(entry("new", 20))
    assert [e.key for e in evicted] == []
    store.unpin("big")
    store.unpin("big")  # a double release stays harmless
    assert not store.pinned("big")
    assert [e.key for e in store.put(entry("newer", 20))] == ["big", "new"]


def test_pins_are_counted() -> None:
    store = CacheStore(budget_bytes=10)
    store.pin("x")
    store.pin("x")
    store.unpin("x")
    assert store.pinned("x")
    store.unpin("x")
    assert not store.pinned("x")
    assert store.pin_count == 0


def test_longest_prefix_respects_whole_entry_rule() -> None:
    store = CacheStore(budget_bytes=10**9)
    store.put(entry("short", 1, (1, 2)))
    store.put(entry("long-divergent", 1, (1, 2, 3, 9)))
    prompt = (1, 2, 3, 4, 5)
    found = store.longest_prefix(prompt, whole_entry=False)
    assert found is not None
    assert (found[0].key, found[1]) == ("long-divergent", 3)
    found = store.longest_prefix(prompt, whole_entry=True)
    assert found is not None
    assert (found[0].key, found[1]) == ("short", 2)
    assert store.longest_prefix((7,), whole_entry=False) is None
