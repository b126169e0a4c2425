"""The prompt-cache service with a fake state type: seeding from the shared
store, checkpoints, saves on every ending, names, pins, eviction and disk -
deterministic and MLX-free.

A ``FakeState`` is the tuple of tokens a KV state would hold. Blocks are
token tuples and the rest state of an untrimmable model is the whole token
tuple, so ``join_state`` can check that every seed the cache assembles holds
exactly the tokens it claims (it raises otherwise, failing the test).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gezel_trio.core.backend import Captured
from gezel_trio.core.request import GenerationRequest, Pin
from gezel_trio.host import prompt_cache
from tests.support.fakes import FakeState
from tests.support.prompt_cache import P1, Harness, cap, request

SYSTEM = tuple(range(1000, 1100))


HEADER = (7,)  # what a template puts before the reply: the generation prompt


def conversation(i: int, turns: int) -> tuple[int, ...]:
    """Conversation ``i``'s prompt at turn ``turns``: a shared system prompt,
    then per turn a user message, the header and the reply generated for it
    (exactly as ``Harness.run`` generates it: 900), and at the end the last
    user message and the header."""
    out = SYSTEM
    for t in range(turns):
        out = (*out, *range(2000 + 100 * i + 10 * t, 2000 + 100 * i + 10 * t + 5), *HEADER)
        if t < turns - 1:
            out = (*out, 900)
    return out


def turn(i: int, turns: int) -> GenerationRequest:
    """What the renderer would say: the system turn and the history end."""
    prompt = conversation(i, turns)
    return request(prompt, boundaries=(len(SYSTEM), len(prompt) - len(HEADER)))


P2 = (*P1, 500, 501, *range(200, 240))  # the next turn re-renders the reply


def test_dense_session_saves_post_generation_state_and_trims() -> None:
    h = Harness(trimmable=True)
    assert h.run(request(P1, cache_id="s")) == 0
    assert h.named("s") == (*P1, 900)
    # The next prompt shares the prompt, not the generated token: trim to it.
    assert h.run(request(P2, cache_id="s")) == len(P1)


@pytest.mark.parametrize("trimmable", [True, False])
def test_interleaved_conversations_without_ids_each_reuse_their_own_turn(
    trimmable: bool,
) -> None:
    h = Harness(trimmable)
    for t in range(1, 4):
        for i in range(4):
            reused = h.run(turn(i, t))
            # A first turn shares the system prompt with the conversations
            # before it (a checkpoint at the system turn's end on a model
            # whose caches cannot rewind); a later one its own previous turn
            # and the reply's token.
            first = len(SYSTEM) if i else 0
            assert reused == (first if t == 1 else len(conversation(i, t - 1)) + 1), (t, i)


@pytest.mark.parametrize("trimmable", [True, False])
def test_a_shared_system_prompt_is_stored_once(trimmable: bool) -> None:
    h = Harness(trimmable, block=10)
    for i in range(4):
        h.run(turn(i, 1))
    totals = h.cache.view().totals
    # Four conversations of 106 prompt tokens + 1 generated: the 100-token
    # system prompt is held once, each conversation's own 7 tokens apart
    # (and, on a hybrid model, one fixed-size rest state per checkpoint).
    rest = 0 if trimmable else 7 * totals.entries
    assert totals.bytes - rest == 10 * (100 + 4 * 7)
    assert totals.logical_bytes > 3 * totals.bytes


def test_hybrid_keeps_checkpoints_at_boundaries_and_before_the_last_token() -> None:
    h = Harness(trimmable=False)
    rid, adm, _ = h.start(request(P1, boundaries=(40, 80)))
    assert [len(s) for s in adm.segments] == [40, 40, 19, 1]
    h.prefill(rid, adm)
    h.cache.finished(rid, cap((*P1, 900), False))
    ends = sorted(e.end for e in h.cache.store)
    assert ends == [40, 80, 99, 101]
    # The same prompt again (a retry, a regenerate): all but the last token.
    assert h.run(request(P1, boundaries=(40, 80))) == 99
    # A next turn re-rendering the reply: the end of the history.
    assert h.run(request((*P1[:80], 7, 7, 7, *range(300, 320)), boundaries=(40, 110))) == 80


@pytest.mark.parametrize("finish", [True, False])
def test_a_retry_checkpoint_next_to_a_boundary_is_kept_only_for_a_cancel(finish: bool) -> None:
    h = Harness(trimmable=False)
    rid, adm, _ = h.start(request(P1, boundaries=(40, 95)))
    h.prefill(rid, adm)
    if finish:
        h.cache.finished(rid, cap((*P1, 900), False))
    else:
        h.cache.cancelled(rid, cap((*P1, 900), False))
    ends = sorted(e.end for e in h.cache.store)
    # A finished turn's regenerate prefills 4 more tokens from the boundary;
    # a client that left gets its retry at once.
    assert ends == ([40, 95, 101] if finish else [40, 95, 99, 101])


def test_hybrid_turns_prune_the_checkpoints_they_supersede() -> None:
    """Each turn keeps what the renderer still calls a boundary; the older
    turns' retry and post-generation states inside the prompt go."""
    h = Harness(trimmable=False)
    h.run(turn(0, 1))
    for t in range(2, 6):
        h.run(turn(0, t))
    ends = sorted(e.end for e in h.cache.store)
    last = conversation(0, 5)
    # The system turn's end, this turn's history end (which is also its retry
    # point: the header is one token) and its post-generation state - however
    # long the conversation grew.
    assert ends == [len(SYSTEM), len(last) - 1, len(last) + 1]
    # A turn that rewrites the history still finds the system turn's end.
    assert h.run(request((*SYSTEM, 5, 5, 5), boundaries=(len(SYSTEM),))) == len(SYSTEM)


def test_a_boundary_inside_the_reused_part_keeps_the_checkpoint_before_it() -> None:
    """Turn 1 cut at the end of its first user message; later turns place
    the 'a new user turn rewrites history from here' boundary a little after
    it (inside what they reused, where nothing is cut): the turn-1 checkpoint
    is what such a rewrite would use, so it stays."""
    h = Harness(trimmable=False)
    first = conversation(0, 1)
    h.run(request(first, boundaries=(len(SYSTEM), len(first) - 1)))
    for t in range(2, 5):
        prompt = conversation(0, t)
        h.run(request(prompt, boundaries=(len(SYSTEM), len(first), len(prompt) - 1)))
    assert len(first) - 1 in {e.end for e in h.cache.store}
    rewrite = (*first[:-1], 5, 5, 5)
    assert h.run(request(rewrite, boundaries=(len(SYSTEM),))) == len(first) - 1


def test_hybrid_without_boundaries_falls_back_to_the_margin() -> None:
    h = Harness(trimmable=False)
    h.run(request(P1))
    assert h.run(request(P2[:84] + (5,) * 30)) == 84  # len(P1) - 16


def test_a_tool_loop_that_replays_the_reply_reuses_everything() -> None:
    h = Harness(trimmable=False)
    h.run(request(P1, cache_id="s"), generated=(900, 901))
    replay = (*P1, 900, *range(300, 340))
    assert h.run(request(replay, cache_id="s")) == len(P1) + 1


def test_unsound_snapshot_is_never_kept() -> None:
    h = Harness(trimmable=False)
    rid, _, _ = h.start(request(P1, cache_id="s", boundaries=(50,)))
    wrong = (*P1[:49], 7777)  # a state that is not the prompt's prefix
    h.cache.captured(rid, 50, cap(wrong, False))
    h.cache.captured(rid, 50, Captured(FakeState(P1[:50], False), P1[:51]))  # tokens lie
    assert all(e.tokens != wrong for e in h.cache.store)
    assert len(h.cache.store) == 0
    h.cache.cancelled(rid, None)


def test_a_diverged_session_entry_falls_back_to_what_still_fits() -> None:
    h = Harness(trimmable=False)
    h.run(request(P1, cache_id="a", boundaries=(30,)))
    other = (*P1[:50], 4242, *range(300, 360))
    # The session's own states (post-generation, retry) are useless now; its
    # checkpoint at the system turn's end still fits.
    assert h.run(request(other, cache_id="a")) == 30


def test_prefix_entry_is_never_replaced_by_a_longer_one() -> None:
    h = Harness(trimmable=True)
    h.run(request(P1[:40], cache_id="a", prefix_ids=("p",)))
    first = h.named("p")
    assert first == (*P1[:40], 900)
    h.cache._seeded_prefixes.clear()  # a new process would try again
    h.run(request(P1, cache_id="b", prefix_ids=("p",)))
    assert h.named("p") == first


def test_the_seeded_prefix_ids_a_process_remembers_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prompt_cache, "SEEDED_PREFIXES_KEPT", 3)
    h = Harness(trimmable=True)
    for i in range(6):
        h.run(request(P1[:40], cache_id=f"s{i}", prefix_ids=(f"p{i}",)))
    # The oldest are forgotten, the newest kept, and each prefix was seeded.
    assert list(h.cache._seeded_prefixes) == ["p3", "p4", "p5"]
    assert all(h.named(f"p{i}") is not None for i in range(6))


def test_band_snapshot_is_published_as_the_prefix() -> None:
    h = Harness(trimmable=False)
    band_end = 60
    h.run(request(P1, cache_id="a", prefix_ids=("band",), band_end=band_end))
    assert h.named("band") == P1[: band_end - 16]
    assert h.named("a") == (*P1, 900)
    # A sibling sharing only the band reuses it.
    sibling = (*P1[:band_end], *range(700, 780))
    assert h.run(request(sibling, cache_id="b", prefix_ids=("band",), band_end=band_end)) == (
        band_end - 16
    )


@pytest.mark.parametrize("trimmable", [True, False])
def test_cancel_mid_prefill_saves_the_chunk_edge_without_an_id(trimmable: bool) -> None:
    h = Harness(trimmable)
    rid, _, _ = h.start(request(P1))
    h.cache.cancelled(rid, cap(P1[:48], trimmable))
    assert [e.tokens for e in h.cache.store] == [P1[:48]]
    assert h.run(request(P1)) == 48


@pytest.mark.parametrize("trimmable", [True, False])
def test_cancel_during_decode_then_retry_reuses_the_whole_prompt(trimmable: bool) -> None:
    h = Harness(trimmable)
    rid, adm, _ = h.start(request(P1))
    h.prefill(rid, adm)
    h.cache.cancelled(rid, cap((*P1, 5, 6), trimmable))
    assert h.run(request(P1)) == len(P1) - 1


def test_cancel_that_extends_nothing_saves_nothing() -> None:
    h = Harness(trimmable=True)
    h.run(request(P1, cache_id="s"))
    before = list(h.cache.store)
    rid, _, seed = h.start(request(P2, cache_id="s"))
    h.cache.cancelled(rid, None)  # withdrawn while still queued in the batch
    assert list(h.cache.store) == before
    assert seed.reuse == len(P1)


def test_pins_are_held_while_live_and_released_exactly_once() -> None:
    h = Harness(trimmable=True, budget=10)
    h.run(request(P1, cache_id="a"))
    rid, _, _ = h.start(request(P2, cache_id="a"))
    assert h.cache.pinned("a")
    h.run(request(range(1000, 1100), cache_id="b"))  # over budget: "a" is pinned
    assert h.named("a") is not None
    h.cache.cancelled(rid, None)
    h.cache.cancelled(rid, None)  # a second ending is ignored
    assert h.cache.store.pin_count == 0
    h.run(request(range(2000, 2100), cache_id="c"))
    assert h.named("a") is None


def test_eviction_under_a_small_budget_never_takes_a_pinned_entry() -> None:
    h = Harness(trimmable=True, budget=10 * 300)
    h.run(request(range(0, 100)))
    rid, _, seed = h.start(request((*range(0, 100), 5, 5)))
    assert seed.reuse == 100
    for i in range(1, 6):  # 500 more tokens of other conversations
        h.run(request(range(1000 * i, 1000 * i + 100)))
        assert any(e.tokens[:100] == tuple(range(100)) for e in h.cache.store)
    assert h.cache.view().totals.bytes <= 10 * 300 + 10 * 101
    h.cache.cancelled(rid, None)
    # Released, and reused once (tier 1): it outlives never-reused entries,
    # then goes when nothing colder is left.
    h.run(request(range(9000, 9100)))
    assert any(e.tokens[:100] == tuple(range(100)) for e in h.cache.store)
    for i in range(10, 13):
        h.run(request(range(1000 * i, 1000 * i + 100)))
        h.run(request((*range(1000 * i, 1000 * i + 100), 3, 3)))  # reused: tier 1
    assert not any(e.tokens[:100] == tuple(range(100)) for e in h.cache.store)


def test_eviction_writes_dirty_entries_to_disk_first(tmp_path: Path) -> None:
    h = Harness(trimmable=True, budget=1500, disk=tmp_path)
    h.run(request(P1, cache_id="a"))
    h.run(request(range(1000, 1100), cache_id="b"))  # evicts "a"
    assert h.named("a") is None
    assert h.disk is not None
    assert h.disk.exists("name:a")
    assert h.run(request(P2, cache_id="a")) == len(P1)  # a disk hit


def test_anonymous_entries_are_found_on_disk_by_content(tmp_path: Path) -> None:
    h = Harness(trimmable=False, disk=tmp_path)
    h.run(request(P1, boundaries=(60,)))
    assert h.cache.flush() == 3  # the checkpoints at 60 and 99, the state at 101
    restarted = Harness(trimmable=False, disk=tmp_path)
    assert restarted.run(request(P1)) == 99
    assert restarted.run(request((*P1[:60], 1, 2, 3))) == 60


def test_flush_writes_named_entries_first_and_each_once(tmp_path: Path) -> None:
    h = Harness(trimmable=True, disk=tmp_path)
    h.run(request(P1, cache_id="a"))
    h.run(request(range(500, 520)))
    assert h.cache.flush() == 2
    assert h.cache.flush() == 0
    assert h.disk is not None
    assert sorted(e.kind for e in h.disk.index.values()) == ["anonymous", "session"]


def test_evict_removes_a_name_its_alternates_and_their_files(tmp_path: Path) -> None:
    h = Harness(trimmable=False, disk=tmp_path)
    h.run(request(P1, cache_id="a", boundaries=(40,)))
    h.cache.flush()
    assert h.cache.evict("a") == (True, True)
    assert h.cache.evict("a") == (False, False)
    assert len(h.cache.store) == 0
    assert list(tmp_path.rglob("*.gzc")) == []
    assert h.run(request(P1, cache_id="a")) == 0


def test_a_restart_keeps_the_session_and_its_fallbacks(tmp_path: Path) -> None:
    h = Harness(trimmable=False, disk=tmp_path)
    h.run(request(P1, cache_id="s", boundaries=(70,)))
    h.cache.flush()
    restarted = Harness(trimmable=False, disk=tmp_path)
    # The last turn is re-rendered differently: the history checkpoint fits.
    assert restarted.run(request((*P1[:90], 4242, 4243), cache_id="s")) == 70
    # The retry checkpoint came back too.
    assert restarted.run(request(P2, cache_id="s")) == 99
    assert restarted.cache.inspect("s") is not None


def test_a_rewritten_history_drops_the_abandoned_branch() -> None:
    """A new user message that re-renders the history (reasoning dropped)
    leaves the conversation's old branch: its checkpoints, never seeded
    from, go once the rewritten turn saved its own."""
    h = Harness(trimmable=False)
    first = conversation(0, 1)
    for t in range(1, 5):
        prompt = conversation(0, t)
        h.run(request(prompt, boundaries=(len(SYSTEM), len(first) - 1, len(prompt) - 1)))
    old = {e.tokens for e in h.cache.store}
    assert any(len(t) > 120 for t in old)  # the old branch's latest states
    rewrite = (*first[:-1], 4242, *range(3000, 3040), *HEADER)
    reused = h.run(request(rewrite, boundaries=(len(SYSTEM), len(first) - 1, len(rewrite) - 1)))
    assert reused == len(first) - 1
    left = sorted(e.end for e in h.cache.store)
    assert left == [len(SYSTEM), len(first) - 1, len(rewrite) - 1, len(rewrite) + 1]


# --- cache_control pins -------------------------------------------------------

PINNED = tuple(range(5000, 5100))  # a system prompt pinned through its end


def pinned_turn(tail: int, seconds: float = 300.0) -> GenerationRequest:
    prompt = (*PINNED, *range(tail, tail + 20))
    return request(prompt, pins=(Pin(len(PINNED), seconds),), boundaries=(len(PINNED),))


def _holds_pin(h: Harness) -> bool:
    return any(e.tokens == PINNED and e.held_until > h.now for e in h.cache.store)


@pytest.mark.parametrize("trimmable", [True, False])
def test_a_pin_survives_budget_pressure_that_evicts_unpinned_entries(trimmable: bool) -> None:
    h = Harness(trimmable, budget=10 * 400)
    h.run(pinned_turn(100))
    assert _holds_pin(h)
    for i in range(1, 8):  # far more than the budget of other conversations
        h.run(request(range(10_000 * i, 10_000 * i + 120)))
    assert _holds_pin(h)
    assert not any(e.tokens[:120] == tuple(range(10_000, 10_120)) for e in h.cache.store)
    # The pinned prefix still seeds a new conversation that shares it.
    assert h.run(pinned_turn(300)) >= len(PINNED)


@pytest.mark.parametrize("trimmable", [True, False])
def test_a_pin_expires_after_its_ttl(trimmable: bool) -> None:
    h = Harness(trimmable, budget=10 * 400)
    h.run(pinned_turn(100, seconds=300))
    h.now += 299
    h.run(request(range(10_000, 10_120)))
    assert _holds_pin(h)
    h.now += 2  # past its ttl: the next pressure may take it
    for i in range(2, 8):
        h.run(request(range(10_000 * i, 10_000 * i + 120)))
    assert not any(e.tokens == PINNED for e in h.cache.store)


@pytest.mark.parametrize("trimmable", [True, False])
def test_the_same_prefix_refreshes_its_pin(trimmable: bool) -> None:
    h = Harness(trimmable, budget=10 * 400)
    h.run(pinned_turn(100, seconds=300))
    h.now += 250
    _, _, seed = h.start(pinned_turn(200, seconds=300))  # refreshed at admission
    h.now += 250  # 500 s after it was made, 250 after the refresh
    assert _holds_pin(h)
    view = {v.cache_id: v for v in h.cache.view().entries}
    (row,) = [v for v in view.values() if v.kind == "pin"]
    assert row.tokens == len(PINNED)
    assert row.pin_expires_in == 50
    assert seed.pinned_5m == seed.pinned_1h == 0  # read, not written


def test_pin_writes_are_counted_once_by_ttl() -> None:
    h = Harness(trimmable=True)
    prompt = (*PINNED, *range(100, 160))
    pins = (Pin(40, 3600.0), Pin(len(PINNED), 300.0), Pin(len(PINNED), 300.0))
    _, _, seed = h.start(request(prompt, pins=pins))
    assert (seed.pinned_5m, seed.pinned_1h) == (len(PINNED) - 40, 40)
