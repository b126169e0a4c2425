"""The prompt-cache service with a fake state type: the cascade, snapshot and
save rules, cancellation saves and pins, deterministic and MLX-free."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from gezel_trio.backend import Captured
from gezel_trio.cache_plan import SNAPSHOT_MARGIN
from gezel_trio.persist import DiskCache
from gezel_trio.prompt_cache import PromptCache
from gezel_trio.request import CacheRequest, GenerationRequest


@attrs.frozen
class FakeState:
    """Stands for a KV state holding exactly ``tokens``."""

    tokens: tuple[int, ...]
    trimmable: bool


class FakeOps:
    def __init__(self, trimmable: bool) -> None:
        self.trimmable = trimmable

    def state_nbytes(self, state: Any) -> int:
        return 10 * len(state.tokens)

    def state_offsets(self, state: Any) -> list[int | None]:
        return [len(state.tokens), None]

    def can_trim(self, state: Any) -> bool:
        return bool(state.trimmable)

    def trimmed(self, state: Any, n: int) -> Any:
        assert state.trimmable
        return FakeState(state.tokens[: len(state.tokens) - n], True)

    # a codec, so DiskCache can use the same fake
    def dump_state(self, state: Any, metadata: dict[str, str], path: Path) -> None:
        import json

        data = {"tokens": list(state.tokens), "t": state.trimmable, "meta": metadata}
        path.write_text(json.dumps(data))

    def load_state(self, payload: bytes) -> tuple[Any, dict[str, str]]:
        import json

        data = json.loads(payload)
        return FakeState(tuple(data["tokens"]), data["t"]), data["meta"]


def cap(tokens: tuple[int, ...], trimmable: bool) -> Captured:
    return Captured(FakeState(tuple(tokens), trimmable), tuple(tokens))


def request(prompt: range | tuple[int, ...], **cache: Any) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), max_tokens=4, cache=CacheRequest(**cache))


class Harness:
    """Drives a PromptCache the way the host thread does."""

    def __init__(self, trimmable: bool, budget: int = 10**9, disk: Path | None = None) -> None:
        self.ops = FakeOps(trimmable)
        self.disk = DiskCache(disk, "fp", self.ops) if disk is not None else None
        self.cache = PromptCache(
            self.ops, model_trimmable=trimmable, budget_bytes=budget, disk=self.disk
        )
        self.trimmable = trimmable
        self.rid = 0

    def start(self, req: GenerationRequest) -> tuple[int, Any, Any]:
        self.rid += 1
        adm, seed = self.cache.admit(self.rid, req)
        return self.rid, adm, seed

    def prefill(self, rid: int, adm: Any, upto: int | None = None) -> None:
        """Run prefill segment by segment, capturing where the cache asks."""
        done = 0
        for seg in adm.segments:
            done += len(seg)
            if upto is not None and adm.seed_tokens.__len__() + done > upto:
                return
            if self.cache.wants_capture(rid, done):
                held = adm.request.prompt[: len(adm.seed_tokens) + done]
                self.cache.captured(rid, done, cap(held, self.trimmable))

    def run(self, req: GenerationRequest, generated: tuple[int, ...] = (900, 901)) -> int:
        """A whole turn; returns the reused token count."""
        rid, adm, seed = self.start(req)
        self.prefill(rid, adm)
        final = req.prompt + generated  # each returned token was fed in its step
        self.cache.finished(rid, cap(final, self.trimmable))
        return int(seed.reuse)


P1 = tuple(range(100))
P2 = (*P1, 500, 501, *range(200, 240))  # the next turn re-renders the reply


def test_dense_session_saves_post_generation_state_and_trims() -> None:
    h = Harness(trimmable=True)
    assert h.run(request(P1, cache_id="s")) == 0
    entry = h.cache.store.peek("s")
    assert entry is not None
    assert entry.tokens == (*P1, 900, 901)
    # The next prompt shares the prompt, not the generated token: trim to it.
    assert h.run(request(P2, cache_id="s")) == len(P1)


def test_hybrid_session_keeps_post_generation_state_and_the_snapshot() -> None:
    h = Harness(trimmable=False)
    rid, adm, _ = h.start(request(P1, cache_id="s"))
    assert [len(s) for s in adm.segments] == [len(P1) - SNAPSHOT_MARGIN, SNAPSHOT_MARGIN]
    h.prefill(rid, adm)
    h.cache.finished(rid, cap((*P1, 900), False))
    entry = h.cache.store.peek("s")
    assert entry is not None
    assert entry.tokens == (*P1, 900)
    assert [t for t, _ in entry.alternates] == [P1[: len(P1) - SNAPSHOT_MARGIN]]
    # A tool loop replays the reply exactly: the post-generation state serves.
    replay = (*P1, 900, *range(300, 340))
    assert h.run(request(replay, cache_id="s")) == len(P1) + 1


def test_hybrid_turn_that_rerenders_the_reply_uses_the_snapshot() -> None:
    h = Harness(trimmable=False)
    h.run(request(P1, cache_id="s"))
    assert h.run(request(P2, cache_id="s")) == len(P1) - SNAPSHOT_MARGIN


def test_older_snapshots_serve_a_turn_that_rewrites_history() -> None:
    h = Harness(trimmable=False)
    h.run(request(P1, cache_id="s"))
    h.run(request(P2, cache_id="s"))
    # A new user message re-renders turn 1's reply (reasoning dropped): the
    # prompt now diverges inside turn 1, before turn 2's snapshot - but after
    # turn 1's, which the entry still holds.
    rewritten = (*P1[:90], 4242, *range(600, 700))
    assert h.run(request(rewritten, cache_id="s")) == len(P1) - SNAPSHOT_MARGIN


def test_unsound_snapshot_is_never_kept() -> None:
    h = Harness(trimmable=False)
    h.run(request(P1, cache_id="s"))
    rid, adm, _ = h.start(request(P2, cache_id="s"))
    boundary = len(adm.seed_tokens) + len(adm.segments[0])
    wrong = (*P2[: boundary - 1], 7777)  # a state that is not the prompt's prefix
    h.cache.captured(rid, len(adm.segments[0]), cap(wrong, False))
    h.cache.finished(rid, cap((*P2, 1), False))
    entry = h.cache.store.peek("s")
    assert entry is not None
    assert all(t != wrong for t, _ in entry.alternates)
    # Turn 1's snapshot, still a prefix of this prompt, stays as the fallback.
    assert [len(t) for t, _ in entry.alternates] == [len(P1) - SNAPSHOT_MARGIN]


def test_divergent_untrimmable_entry_falls_back_to_the_prefix() -> None:
    h = Harness(trimmable=False)
    h.run(request(P1, cache_id="a", prefix_ids=("shared",)))
    assert "shared" in h.cache.store  # seeded from the session, once
    other = (*P1[:50], 4242, *range(300, 360))
    # A new session diverging at token 50: the session entry is useless, the
    # prefix entry too (untrimmable, longer than 50) - so nothing is reused.
    assert h.run(request(other, cache_id="a", prefix_ids=("shared",))) == 0


def test_prefix_entry_is_never_replaced_by_a_longer_one() -> None:
    h = Harness(trimmable=True)
    h.run(request(P1[:40], cache_id="a", prefix_ids=("p",)))
    first = h.cache.store.peek("p")
    assert first is not None
    h.cache._seeded_prefixes.clear()  # a new process would try again
    h.run(request(P1, cache_id="b", prefix_ids=("p",)))
    assert h.cache.store.peek("p") is first


def test_band_snapshot_is_published_as_the_prefix() -> None:
    h = Harness(trimmable=False)
    band_end = 60
    rid, adm, _ = h.start(request(P1, cache_id="a", prefix_ids=("band",), band_end=band_end))
    h.prefill(rid, adm)
    h.cache.finished(rid, cap((*P1, 1), False))
    band = h.cache.store.peek("band")
    assert band is not None
    assert band.tokens == P1[: band_end - SNAPSHOT_MARGIN]
    session = h.cache.store.peek("a")
    assert session is not None
    assert session.tokens == (*P1, 1)
    assert [len(t) for t, _ in session.alternates] == [len(P1) - SNAPSHOT_MARGIN]
    # A sibling sharing only the band reuses it.
    sibling = (*P1[:band_end], *range(700, 780))
    assert h.run(request(sibling, cache_id="b", prefix_ids=("band",), band_end=band_end)) == (
        band_end - SNAPSHOT_MARGIN
    )


def test_plain_requests_reuse_the_longest_cached_prefix() -> None:
    h = Harness(trimmable=True)
    h.run(request(P1))
    assert h.run(request(P2)) == len(P1)
    anon = [e for e in h.cache.store if e.kind == "anonymous"]
    assert len(anon) == 1, "a conversation keeps one anonymous entry"


@pytest.mark.parametrize("trimmable", [True, False])
def test_cancel_mid_prefill_saves_the_last_proven_edge(trimmable: bool) -> None:
    h = Harness(trimmable)
    rid, _, _ = h.start(request(P1, cache_id="s"))
    h.cache.cancelled(rid, cap(P1[:48], trimmable))
    entry = h.cache.store.peek("s")
    assert entry is not None
    assert entry.tokens == P1[:48]
    assert h.run(request(P1, cache_id="s")) == 48


def test_cancel_keeps_the_snapshot_when_decode_state_cannot_rewind() -> None:
    h = Harness(trimmable=False)
    rid, adm, _ = h.start(request(P1, cache_id="s"))
    h.prefill(rid, adm)
    h.cache.cancelled(rid, cap((*P1, 5, 6), False))  # decoding: not a prompt prefix
    entry = h.cache.store.peek("s")
    assert entry is not None
    assert entry.tokens == P1[: len(P1) - SNAPSHOT_MARGIN]


def test_cancel_that_extends_nothing_saves_nothing() -> None:
    h = Harness(trimmable=True)
    h.run(request(P1, cache_id="s"))
    before = h.cache.store.peek("s")
    rid, _, seed = h.start(request(P2, cache_id="s"))
    h.cache.cancelled(rid, None)  # withdrawn while still queued in the batch
    assert h.cache.store.peek("s") is before
    assert seed.reuse == len(P1)


def test_pins_are_held_while_live_and_released_exactly_once() -> None:
    h = Harness(trimmable=True, budget=10)
    h.run(request(P1, cache_id="a"))
    rid, _, _ = h.start(request(P2, cache_id="a"))
    assert h.cache.store.pinned("a")
    h.run(request(range(1000, 1100), cache_id="b"))  # over budget: "a" is pinned
    assert "a" in h.cache.store
    h.cache.cancelled(rid, None)
    h.cache.cancelled(rid, None)  # a second ending is ignored
    assert h.cache.store.pin_count == 0
    h.run(request(range(2000, 2100), cache_id="c"))
    assert "a" not in h.cache.store


def test_eviction_writes_dirty_entries_to_disk_first(tmp_path: Path) -> None:
    h = Harness(trimmable=True, budget=1500, disk=tmp_path)
    h.run(request(P1, cache_id="a"))
    h.run(request(range(1000, 1100), cache_id="b"))  # evicts "a"
    assert "a" not in h.cache.store
    assert h.disk is not None
    assert h.disk.exists("a")
    assert h.run(request(P2, cache_id="a")) == len(P1)  # a disk hit


def test_flush_writes_dirty_entries_once(tmp_path: Path) -> None:
    h = Harness(trimmable=True, disk=tmp_path)
    h.run(request(P1, cache_id="a"))
    h.run(request(P1[:20]))  # anonymous: never persisted
    assert h.cache.flush() == 1
    assert h.cache.flush() == 0
    assert h.disk is not None
    assert [n for n, _, _ in h.disk.files()] == [h.disk.path_for("a").name]


def test_evict_removes_memory_and_disk(tmp_path: Path) -> None:
    h = Harness(trimmable=True, disk=tmp_path)
    h.run(request(P1, cache_id="a"))
    h.cache.flush()
    assert h.cache.evict("a") == (True, True)
    assert h.cache.evict("a") == (False, False)
    assert h.run(request(P1, cache_id="a")) == 0


def test_a_restart_keeps_the_snapshot_fallback(tmp_path: Path) -> None:
    h = Harness(trimmable=False, disk=tmp_path)
    h.run(request(P1, cache_id="s"))
    assert h.cache.flush() == 1
    restarted = Harness(trimmable=False, disk=tmp_path)
    # The reply is re-rendered differently: only the snapshot still fits.
    assert restarted.run(request(P2, cache_id="s")) == len(P1) - SNAPSHOT_MARGIN
    assert restarted.cache.evict("s") == (True, True)
    assert list(tmp_path.rglob("*.gzc")) == []
