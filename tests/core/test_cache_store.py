"""The content-addressed store alone: blocks, seeds, sharing, eviction, pins.

Blocks here are the token tuples themselves (16 bytes a token), so every
seed can be checked by concatenating its nodes' payloads: the store must
hand out exactly the tokens it claims to hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gezel_trio.core.cache_store import CacheStore, Entry, Seed

B = 4  # a small block, so short token lists cross several blocks


def blocks_of(tokens: Sequence[int]) -> Any:
    def make(ranges: Sequence[tuple[int, int]]) -> list[tuple[Any, int]]:
        return [(tuple(tokens[s:e]), 16 * (e - s)) for s, e in ranges]

    return make


def add(store: CacheStore, tokens: Sequence[int], **kw: Any) -> tuple[Entry, list[Entry]]:
    return store.add(tokens, blocks_of(tokens), **kw)


def seeded_tokens(seed: Seed) -> tuple[int, ...]:
    held = tuple(t for node in seed.nodes for t in node.block)
    return held[: seed.reuse]


def live_bytes(store: CacheStore) -> int:
    seen: dict[int, int] = {}
    for entry in store:
        for node in entry.path:
            seen[id(node)] = node.nbytes
    return sum(seen.values()) + sum(e.rest_nbytes for e in store)


def test_a_shared_prefix_is_stored_once() -> None:
    store = CacheStore(10**9, trimmable=True, block_tokens=B)
    system = tuple(range(100, 140))  # 40 tokens: 10 full blocks
    for i in range(4):
        add(store, (*system, 1000 + i, 2000 + i))
    # 10 shared blocks, then one partial block per conversation.
    assert store.block_count == 10 + 4
    assert store.total_bytes == 16 * (40 + 4 * 2)
    assert sum(e.nbytes for e in store) == 4 * 16 * 42
    assert store.total_bytes == live_bytes(store)


def test_trimmable_seed_is_any_prefix_cut_inside_a_block() -> None:
    store = CacheStore(10**9, trimmable=True, block_tokens=B)
    add(store, tuple(range(10)))
    seed = store.seed((0, 1, 2, 3, 4, 5, 99, 98))
    assert seed is not None
    assert seed.reuse == 6
    assert seeded_tokens(seed) == (0, 1, 2, 3, 4, 5)
    assert store.seed((7, 8)) is None


def test_a_seed_always_leaves_one_token_to_prefill() -> None:
    store = CacheStore(10**9, trimmable=True, block_tokens=B)
    add(store, tuple(range(10)))
    seed = store.seed(tuple(range(10)))
    assert seed is not None
    assert seed.reuse == 9


def test_untrimmable_seed_is_the_deepest_entry_end_that_fits() -> None:
    store = CacheStore(10**9, trimmable=False, block_tokens=B)
    add(store, tuple(range(5)), rest="five")
    add(store, tuple(range(9)), rest="nine")
    add(store, (*range(9), 50, 51), rest="diverges")
    seed = store.seed((*range(12), 7))
    assert seed is not None
    assert (seed.reuse, seed.entry.rest) == (9, "nine")
    assert seeded_tokens(seed) == tuple(range(9))
    seed = store.seed((*range(7), 42))
    assert seed is not None
    assert (seed.reuse, seed.entry.rest) == (5, "five")


def test_trimmable_store_drops_an_anonymous_entry_a_longer_one_covers() -> None:
    store = CacheStore(10**9, trimmable=True, block_tokens=B)
    first, _ = add(store, tuple(range(6)))
    add(store, tuple(range(4)), key="named")
    second, _ = add(store, tuple(range(10)))
    assert first not in list(store)  # turn 1's state is a prefix of turn 2's
    assert store.named("named") is not None  # a name is kept
    assert second in list(store)
    assert store.total_bytes == live_bytes(store)


def test_identical_tokens_are_one_entry_and_a_name_adopts_it() -> None:
    store = CacheStore(10**9, trimmable=False, block_tokens=B)
    anon, _ = add(store, tuple(range(6)), rest="r")
    again, _ = add(store, tuple(range(6)), rest="r2")
    assert again is anon
    named, _ = add(store, tuple(range(6)), key="s", kind="session", rest="r3")
    assert named is anon
    assert (anon.key, anon.kind) == ("s", "session")
    assert len(store) == 1


def test_a_name_moves_to_its_new_state_and_the_old_one_goes() -> None:
    store = CacheStore(10**9, trimmable=False, block_tokens=B)
    old, _ = add(store, tuple(range(6)), key="s", kind="session")
    new, _ = add(store, (*range(6), 9, 9), key="s", kind="session")
    assert store.named("s") is new
    assert old not in list(store)
    assert store.total_bytes == live_bytes(store) == 16 * 8


def test_eviction_order_weighs_names_and_reuse_before_recency() -> None:
    store = CacheStore(16 * 40, trimmable=False, block_tokens=B)
    add(store, tuple(range(0, 10)), key="named")
    reused, _ = add(store, tuple(range(100, 110)))
    store.touch(reused, hit=True)
    fresh_old, _ = add(store, tuple(range(200, 210)))
    fresh_new, _ = add(store, tuple(range(300, 310)))
    _, evicted = add(store, tuple(range(400, 410)))
    # 50 tokens > 40: down to 32 tokens' worth - the two never-reused
    # anonymous entries go first, oldest first, though "named" is older.
    assert evicted == [fresh_old, fresh_new]
    assert {e.key or e.tokens[0] for e in store} == {"named", 100, 400}


def test_never_evicts_a_pinned_entry_the_new_one_or_the_only_one() -> None:
    store = CacheStore(16 * 10, trimmable=True, block_tokens=B)
    big, evicted = add(store, tuple(range(50)))
    assert evicted == []  # the only entry, though over budget
    store.pin(big)
    _, evicted = add(store, tuple(range(100, 120)))
    assert evicted == []
    store.unpin(big)
    store.unpin(big)  # a double release stays harmless
    assert big.pins == 0
    _, evicted = add(store, tuple(range(200, 205)))
    assert big in evicted


def test_the_eviction_hook_sees_the_victim_with_its_blocks() -> None:
    seen: list[tuple[int, ...]] = []

    def hook(entry: Entry) -> None:
        seen.append(tuple(t for node in entry.path for t in node.block))

    store = CacheStore(16 * 10, trimmable=True, block_tokens=B, before_evict=hook)
    add(store, tuple(range(8)))
    add(store, tuple(range(100, 108)))
    assert seen == [tuple(range(8))]


def test_name_pins_are_counted() -> None:
    store = CacheStore(10, trimmable=True)
    store.pin_name("x")
    store.pin_name("x")
    store.unpin_name("x")
    assert store.name_pinned("x")
    store.unpin_name("x")
    assert not store.name_pinned("x")
    assert store.pin_count == 0


def test_a_failing_block_copy_changes_nothing() -> None:
    store = CacheStore(10**9, trimmable=True, block_tokens=B)
    add(store, tuple(range(8)))

    def broken(_: Sequence[tuple[int, int]]) -> list[tuple[Any, int]]:
        raise RuntimeError("out of memory")

    before = (store.total_bytes, store.block_count, len(store))
    with pytest.raises(RuntimeError):
        store.add((*range(8), 9, 9, 9), broken)
    assert (store.total_bytes, store.block_count, len(store)) == before


token_lists = st.lists(st.integers(0, 3), min_size=1, max_size=24)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(token_lists, st.booleans()), min_size=1, max_size=12),
    token_lists,
    st.booleans(),
)
def test_store_matches_a_brute_force_model(
    saves: list[tuple[list[int], bool]], prompt: list[int], trimmable: bool
) -> None:
    """Whatever is saved and removed, the store's bytes are its live blocks
    counted once, every entry's path holds its tokens, and a seed is the
    deepest reuse a brute-force search over the kept entries finds."""
    store = CacheStore(10**9, trimmable=trimmable, block_tokens=B)
    for tokens, drop in saves:
        entry, _ = add(store, tokens, rest=tuple(tokens) if not trimmable else None)
        if drop and len(store) > 1:
            store.remove(entry)
    for entry in store:
        held = tuple(t for node in entry.path for t in node.block)
        assert held[: entry.end] == entry.tokens
        assert entry.path[-1].start < entry.end <= entry.path[-1].end
        assert entry.path_nbytes == sum(n.nbytes for n in entry.path)
    stack = [store.root]
    while stack:  # no partial block is a prefix of a sibling: it would be a copy
        node = stack.pop()
        kids = list(node.children.values())
        for a in kids:
            assert not any(b is not a and b.tokens[: len(a.tokens)] == a.tokens for b in kids)
        stack += kids
    assert store.total_bytes == live_bytes(store)
    limit = len(prompt) - 1
    best = 0
    for entry in store:
        n = 0
        while n < min(entry.end, len(prompt)) and entry.tokens[n] == prompt[n]:
            n += 1
        if trimmable:
            best = max(best, min(n, limit))
        elif n == entry.end and entry.end <= limit:
            best = max(best, entry.end)
    seed = store.seed(prompt)
    assert (seed.reuse if seed else 0) == best
    if seed is not None:
        assert seeded_tokens(seed) == tuple(prompt[: seed.reuse])
        if not trimmable:
            assert seed.entry.rest == tuple(prompt[: seed.reuse])


@pytest.mark.parametrize("trimmable", [True, False])
def test_salted_paths_never_share_a_node(trimmable: bool) -> None:
    store = CacheStore(10**9, trimmable=trimmable, block_tokens=B)
    prompt = tuple(range(30))
    mine, _ = add(store, prompt[:20], salt="alice")
    assert store.seed(prompt, salt="bob") is None
    assert store.seed(prompt) is None  # nor the unsalted paths
    assert store.exact(prompt[:20], salt="bob") == []
    assert store.prefixes(prompt, salt="bob") == []
    seed = store.seed(prompt, salt="alice")
    assert seed is not None
    assert (seed.entry, seed.reuse) == (mine, 20)
    # The same tokens under another salt are stored again, not shared.
    theirs, _ = add(store, prompt[:20], salt="bob")
    assert theirs is not mine
    assert store.block_count == 2 * 5
    assert store.total_bytes == live_bytes(store)
    # A salt's root goes with its last entry: client-chosen salts leave nothing.
    store.remove(mine)
    assert store.root_of("alice").children == {}
    assert "alice" not in store._salted
    assert store.seed(prompt, salt="bob") is not None
