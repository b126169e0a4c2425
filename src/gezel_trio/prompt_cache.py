"""The prompt-cache service: lookup cascade, seeding, snapshots, saves.

Lives on the engine's host thread beside the backend whose opaque states it
keeps; it touches those states only through the backend's cache operations,
so the same logic serves the MLX backend and the scripted testing backend.

For each admitted sequence it decides (SPEC C1-C9):

* where to start: memory -> disk (same id) -> prefix ids in order -> the
  longest cached prefix of any entry (C9) -> fresh. The lookup runs at
  admission, on this thread, so a prefix a sibling published while this
  request waited is already seen (the "late re-check" of C2 is structural).
* where to cut: on models whose caches cannot rewind, a session snapshot at
  ``len(prompt) - SNAPSHOT_MARGIN`` (see ``cache_plan``) and, on a turn that
  starts below the shared band, a band snapshot at ``band_end - margin``.
* what to save when it ends: the post-generation state where caches rewind,
  else the proven snapshot; on cancellation (C7) the best proven state it
  reached, if that extends what it was seeded with.

Every decision is one log line on ``gezel_trio.cache`` (O4).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from .backend import Admission, Captured
from .cache_plan import (
    SNAPSHOT_MARGIN,
    SeedPlan,
    plan_seed,
    snapshot_cut,
    snapshot_is_sound,
    split_segments,
)
from .cache_store import CacheStore, Entry, EntryKind
from .persist import DiskCache
from .request import CacheRequest, GenerationRequest

__all__ = ["CacheOps", "CacheView", "PromptCache", "SeedInfo"]

log = logging.getLogger("gezel_trio.cache")

# Anonymous (no cache id) states kept for C9 reuse; each conversation's
# lineage reuses one key, and the oldest beyond this count are dropped.
MAX_ANONYMOUS = 16


class CacheOps(Protocol):
    def state_nbytes(self, state: Any) -> int: ...
    def state_offsets(self, state: Any) -> list[int | None]: ...
    def can_trim(self, state: Any) -> bool: ...
    def trimmed(self, state: Any, n: int) -> Any: ...


@attrs.frozen
class SeedInfo:
    """What admission decided, for usage (``reuse`` is ``cached_tokens``) and logs."""

    reuse: int
    source: str
    mode: str


@attrs.frozen
class CacheView:
    """One entry as ``/v1/cache/stats`` shows it."""

    cache_id: str
    tokens: int
    bytes: int
    kind: str
    last_used: float
    dirty: bool
    pinned: bool


@attrs.define
class _Seq:
    prompt: tuple[int, ...]
    cache: CacheRequest
    save_key: str | None
    reuse: int
    pins: list[str]
    cuts: dict[int, set[str]]
    snapshot: Captured | None = None
    band: Captured | None = None
    warned: bool = False


MAX_ALTERNATES = 3


def _spread(main: Captured, alternates: Sequence[Captured]) -> list[Captured]:
    """Up to ``MAX_ALTERNATES`` distinct alternates shorter than ``main``: the
    longest ones (this turn's snapshot) and the shortest (the oldest turn)."""
    seen = {len(main.tokens)}
    unique = []
    for alt in sorted(alternates, key=lambda a: -len(a.tokens)):
        if len(alt.tokens) not in seen and len(alt.tokens) < len(main.tokens):
            seen.add(len(alt.tokens))
            unique.append(alt)
    if len(unique) <= MAX_ALTERNATES:
        return unique
    return [*unique[: MAX_ALTERNATES - 1], unique[-1]]


def _companion(key: str) -> str:
    """The disk id of an entry's snapshot alternate (hashed like any id)."""
    return key + "\x00snapshot"


def _short(key: str) -> str:
    return key if len(key) <= 64 else key[:61] + "..."


class PromptCache:
    def __init__(
        self,
        ops: CacheOps,
        *,
        model_trimmable: bool,
        budget_bytes: int,
        disk: DiskCache | None = None,
        disk_budget_bytes: int = 0,
        decode: Any = None,
    ) -> None:
        self._ops = ops
        self._model_trimmable = model_trimmable
        self.store = CacheStore(budget_bytes)
        self.disk = disk
        self._disk_budget = disk_budget_bytes
        self._seqs: dict[int, _Seq] = {}
        self._seeded_prefixes: set[str] = set()
        self._used_at: dict[str, float] = {}
        # Token decoder for divergence previews in logs (optional).
        self._decode = decode
        self.version = 0

    # --- admission ---------------------------------------------------------

    def admit(self, rid: int, request: GenerationRequest) -> tuple[Admission, SeedInfo]:
        cr = request.cache or CacheRequest()
        prompt = request.prompt
        entry, plan, source, variant = self._choose(cr, prompt)
        pins = [k for k in {cr.cache_id, entry.key if entry else None} if k]
        for key in pins:
            self.store.pin(key)
        if pins:
            self.version += 1
        seed_state: Any = None
        seed_tokens: tuple[int, ...] = ()
        reuse = plan.reuse if entry is not None else 0
        if entry is not None and reuse > 0:
            seed_state = variant if plan.trim == 0 else self._ops.trimmed(variant, plan.trim)
            seed_tokens = prompt[:reuse]
        cuts = self._plan_cuts(cr, prompt, reuse)
        save_key = cr.cache_id
        if save_key is None and entry is not None and entry.kind == "anonymous":
            save_key = entry.key  # the same conversation keeps one anonymous entry
        self._seqs[rid] = _Seq(prompt, cr, save_key, reuse, pins, cuts)
        segments = tuple(tuple(s) for s in split_segments(prompt, reuse, cuts))
        mode = plan.mode if entry is not None else "fresh"
        if cr.cache_id or reuse:
            log.info(
                "seed cache_id=%s source=%s mode=%s reused=%d prefill=%d cuts=%s",
                _short(cr.cache_id or "-"),
                source,
                mode,
                reuse,
                len(prompt) - reuse,
                sorted(cuts) or "-",
            )
        return (
            Admission(rid, request, segments, seed_state, seed_tokens),
            SeedInfo(reuse, source, mode),
        )

    def _choose(
        self, cr: CacheRequest, prompt: tuple[int, ...]
    ) -> tuple[Entry | None, SeedPlan, str, Any]:
        """The entry, plan, source and state variant to seed from."""
        best: tuple[Entry | None, SeedPlan, str, Any] = (None, SeedPlan("fresh"), "fresh", None)
        if cr.cache_id:
            entry, source = self._lookup(cr.cache_id)
            if entry is not None:
                plan, variant = self._plan(entry, prompt)
                best = (entry, plan, source, variant)
                if plan.mode == "divergent":
                    self._log_divergence(cr.cache_id, entry.tokens, prompt, plan)
        for pid in cr.prefix_ids:
            if best[1].reuse > 0 and best[1].mode != "divergent" and best[1].trim == 0:
                break  # the session entry extends cleanly: nothing beats it here
            entry, source = self._lookup(pid)
            if entry is None:
                continue
            plan, variant = self._plan(entry, prompt)
            if plan.reuse > best[1].reuse:
                if best[0] is not None:
                    log.info(
                        "seed fallback cache_id=%s session-mode=%s -> prefix=%s reused=%d",
                        _short(cr.cache_id or "-"),
                        best[1].mode,
                        _short(pid),
                        plan.reuse,
                    )
                best = (entry, plan, f"prefix:{source}", variant)
            break  # the most specific existing prefix decides
        if best[1].reuse == 0:
            found = self.store.longest_prefix(prompt, whole_entry=not self._model_trimmable)
            if found is not None:
                entry = self.store.get(found[0].key)
                assert entry is not None
                plan, variant = self._plan(entry, prompt)
                if plan.reuse > 0:
                    best = (entry, plan, "shared-prefix", variant)
        return best

    def _plan(self, entry: Entry, prompt: tuple[int, ...]) -> tuple[SeedPlan, Any]:
        """The best way to seed ``prompt`` from ``entry``: its main state or,
        for states that cannot rewind, an alternate that is still a prefix."""
        best: tuple[SeedPlan, Any] | None = None
        for tokens, state in ((entry.tokens, entry.state), *entry.alternates):
            plan = plan_seed(tokens, prompt, trimmable=self._ops.can_trim(state))
            if best is None or plan.reuse > best[0].reuse:
                best = (plan, state)
        assert best is not None
        return best

    def _plan_cuts(
        self, cr: CacheRequest, prompt: tuple[int, ...], reuse: int
    ) -> dict[int, set[str]]:
        cuts: dict[int, set[str]] = {}
        session = None
        if cr.snapshot_at is not None:
            session = cr.snapshot_at if reuse < cr.snapshot_at < len(prompt) else None
        elif not self._model_trimmable:
            session = snapshot_cut(len(prompt), reuse)
        if session is not None:
            cuts.setdefault(session, set()).add("session")
        if cr.band_end is not None and cr.prefix_ids:
            band = cr.band_end - SNAPSHOT_MARGIN
            if reuse < band < len(prompt):
                cuts.setdefault(band, set()).add("band")
        return cuts

    # --- during a sequence -------------------------------------------------

    def wants_capture(self, rid: int, done: int) -> bool:
        seq = self._seqs.get(rid)
        return seq is not None and (seq.reuse + done) in seq.cuts

    def captured(self, rid: int, done: int, cap: Captured) -> None:
        seq = self._seqs.get(rid)
        if seq is None:
            return
        boundary = seq.reuse + done
        roles = seq.cuts.get(boundary, set())
        if not snapshot_is_sound(
            cap.tokens, seq.prompt, boundary, self._ops.state_offsets(cap.state)
        ):
            if not seq.warned:
                seq.warned = True
                log.warning(
                    "snapshot dropped cache_id=%s boundary=%d tokens=%d offsets=%s",
                    _short(seq.cache.cache_id or "-"),
                    boundary,
                    len(cap.tokens),
                    self._ops.state_offsets(cap.state),
                )
            return
        if "session" in roles:
            seq.snapshot = cap
        if "band" in roles:
            seq.band = cap

    # --- endings -----------------------------------------------------------

    def finished(self, rid: int, cap: Captured | None) -> None:
        """The sequence ended normally; ``cap`` is its final state."""
        seq = self._seqs.pop(rid, None)
        if seq is None:
            return
        try:
            self._save_finished(rid, seq, cap)
        finally:
            self._release(seq)

    def cancelled(self, rid: int, cap: Captured | None) -> None:
        """The caller left (or the engine shut down): keep what was paid for."""
        seq = self._seqs.pop(rid, None)
        if seq is None:
            return
        try:
            self._save_cancelled(seq, cap)
        finally:
            self._release(seq)

    def _save_finished(self, rid: int, seq: _Seq, cap: Captured | None) -> None:
        cr = seq.cache
        key = cr.cache_id if cr.cache_id is not None else (seq.save_key or f"anonymous-{rid}")
        kind: EntryKind = "session" if cr.cache_id is not None else "anonymous"
        main: Captured | None
        alternates: list[Captured] = []
        if cr.snapshot_at is not None:
            main = seq.snapshot  # a warm: the entry is the shared boundary
        elif cap is not None and self._ops.can_trim(cap.state):
            main = cap  # rewinds: the next turn trims it to whatever it shares
        else:
            # Cannot rewind: the post-generation state serves a next prompt that
            # replays this reply exactly (a tool loop); the prompt snapshot, and
            # older proven states, serve one that re-renders it differently.
            main = cap or seq.snapshot
            if seq.snapshot is not None and main is not seq.snapshot:
                alternates.append(seq.snapshot)
            alternates += self._older_prefixes(key, seq.prompt)
        if main is not None:
            self._save(key, main, kind, cr, alternates=alternates)
        trimmable = cap is not None and self._ops.can_trim(cap.state)
        self._publish_prefix(seq, main if trimmable else seq.snapshot)

    def _older_prefixes(self, key: str, prompt: tuple[int, ...]) -> list[Captured]:
        """The states already saved under ``key`` that are still prefixes of
        ``prompt``: older turns' snapshots stay useful when a later turn
        re-renders history (a new user message drops earlier reasoning)."""
        entry = self.store.peek(key)
        if entry is None:
            return []
        return [
            Captured(state, tokens)
            for tokens, state in ((entry.tokens, entry.state), *entry.alternates)
            if len(tokens) < len(prompt) and tokens == prompt[: len(tokens)]
        ]

    def _save_cancelled(self, seq: _Seq, cap: Captured | None) -> None:
        key = seq.cache.cache_id
        if key is None:
            return
        best = seq.snapshot
        if cap is not None and len(cap.tokens) > (len(best.tokens) if best else 0):
            n = len(cap.tokens)
            if self._ops.can_trim(cap.state):
                if (
                    tuple(cap.tokens[: min(n, len(seq.prompt))])
                    == seq.prompt[: min(n, len(seq.prompt))]
                ):
                    best = cap
            elif snapshot_is_sound(cap.tokens, seq.prompt, n, self._ops.state_offsets(cap.state)):
                best = cap  # stopped mid-prefill at a chunk edge, proven above
        if best is None or len(best.tokens) <= seq.reuse:
            log.info(
                "cancelled cache_id=%s: nothing beyond the %d seeded tokens to save",
                _short(key),
                seq.reuse,
            )
            return
        older = [] if self._ops.can_trim(best.state) else self._older_prefixes(key, seq.prompt)
        self._save(key, best, "session", seq.cache, alternates=older)
        log.info(
            "saved cancelled cache_id=%s tokens=%d (was seeded with %d)",
            _short(key),
            len(best.tokens),
            seq.reuse,
        )

    def _publish_prefix(self, seq: _Seq, state: Captured | None) -> None:
        """Seed the most specific prefix id from this session (C6), once per
        process; a prefix entry is never replaced by a longer one."""
        cr = seq.cache
        if not cr.prefix_ids:
            return
        pid = cr.prefix_ids[0]
        if pid in self._seeded_prefixes:
            return
        candidate = seq.band
        if candidate is None:
            if cr.band_end is not None and not self._model_trimmable:
                return  # a longer untrimmable entry is no use to siblings
            candidate = state
        if candidate is None:
            return
        existing, _ = self._lookup(pid)
        if existing is not None and len(existing.tokens) <= len(candidate.tokens):
            self._seeded_prefixes.add(pid)
            log.info(
                "prefix-keep %s: existing %d tokens, not replaced by %d",
                _short(pid),
                len(existing.tokens),
                len(candidate.tokens),
            )
            return
        self._seeded_prefixes.add(pid)
        self._save(pid, candidate, "prefix", cr, persist_now=True)
        log.info("prefix-seeded %s tokens=%d", _short(pid), len(candidate.tokens))

    def _release(self, seq: _Seq) -> None:
        for key in seq.pins:
            self.store.unpin(key)
        if seq.pins:
            self.version += 1  # the published view shows pins
        seq.pins = []

    # --- storage -----------------------------------------------------------

    def _save(
        self,
        key: str,
        cap: Captured,
        kind: EntryKind,
        cr: CacheRequest,
        *,
        persist_now: bool = False,
        alternates: Sequence[Captured] = (),
    ) -> None:
        kept = _spread(cap, alternates)
        entry = Entry(
            key=key,
            tokens=tuple(cap.tokens),
            state=cap.state,
            nbytes=self._ops.state_nbytes(cap.state)
            + sum(self._ops.state_nbytes(a.state) for a in kept),
            alternates=tuple((tuple(a.tokens), a.state) for a in kept),
            kind=kind,
            roster=cr.roster,
            dirty=kind != "anonymous",
        )
        evicted = self.store.put(entry)
        self._used_at[key] = time.time()
        self.version += 1
        log.info(
            "save cache_id=%s kind=%s tokens=%d bytes=%d",
            _short(key),
            kind,
            len(entry.tokens),
            entry.nbytes,
        )
        if (persist_now or cr.persist) and kind != "anonymous":
            self._write(entry)
        self._drop(evicted)
        if kind == "anonymous":
            self._limit_anonymous()

    def _drop(self, evicted: Sequence[Entry]) -> None:
        for victim in evicted:
            self._used_at.pop(victim.key, None)
            if victim.dirty:
                self._write(victim)
            log.info(
                "evicted cache_id=%s tokens=%d bytes=%d (LRU, memory budget)",
                _short(victim.key),
                len(victim.tokens),
                victim.nbytes,
            )
        if evicted:
            self.version += 1

    def _limit_anonymous(self) -> None:
        anon = sorted((e for e in self.store if e.kind == "anonymous"), key=lambda e: e.last_use)
        for entry in anon[: max(0, len(anon) - MAX_ANONYMOUS)]:
            if not self.store.pinned(entry.key):
                self.store.remove(entry.key)
                self._used_at.pop(entry.key, None)

    def _write(self, entry: Entry) -> None:
        if self.disk is None:
            return
        if entry.alternates:
            # The longest alternate (this turn's snapshot) goes first, under a
            # companion id, so a restart keeps the fallback too; the main file
            # is written last.
            tokens, state = entry.alternates[0]
            self.disk.save(_companion(entry.key), tokens, state, kind="snapshot", roster="")
        if self.disk.save(
            entry.key, entry.tokens, entry.state, kind=entry.kind, roster=entry.roster
        ):
            entry.dirty = False
            self.version += 1
            self._prune_disk()

    def _prune_disk(self) -> None:
        if self.disk is None or self._disk_budget <= 0:
            return
        pinned = [e.key for e in self.store if self.store.pinned(e.key)]
        pinned += [_companion(k) for k in pinned]
        for name in self.disk.prune(self._disk_budget, protect=pinned):
            log.info("disk-evicted %s (disk budget)", name)

    def _lookup(self, key: str) -> tuple[Entry | None, str]:
        entry = self.store.get(key)
        if entry is not None:
            self._used_at[key] = time.time()
            return entry, "memory"
        if self.disk is None:
            return None, "miss"
        loaded = self.disk.load(key)
        if loaded is None:
            return None, "miss"
        alternates: tuple[tuple[tuple[int, ...], Any], ...] = ()
        companion = self.disk.load(_companion(key)) if self.disk.exists(_companion(key)) else None
        if companion is not None and loaded.tokens[: len(companion.tokens)] == companion.tokens:
            alternates = ((companion.tokens, companion.state),)
        entry = Entry(
            key=key,
            tokens=loaded.tokens,
            state=loaded.state,
            nbytes=self._ops.state_nbytes(loaded.state)
            + sum(self._ops.state_nbytes(st) for _, st in alternates),
            kind="prefix" if loaded.kind == "prefix" else "session",
            roster=loaded.roster,
            dirty=False,
            alternates=alternates,
        )
        self._drop(self.store.put(entry))
        self._used_at[key] = time.time()
        self.version += 1
        log.info("disk-load cache_id=%s tokens=%d", _short(key), len(entry.tokens))
        return entry, "disk"

    def _log_divergence(
        self, key: str, cached: Sequence[int], prompt: Sequence[int], plan: SeedPlan
    ) -> None:
        """Name the churn: the decoded text on both sides of the divergence is
        the only thing that says whether the prompt or the boundary is wrong."""
        lo = max(0, plan.lcp - 6)
        if self._decode is not None:
            try:
                left = self._decode(list(cached[lo : plan.lcp + 24]))
                right = self._decode(list(prompt[lo : plan.lcp + 24]))
            except Exception as exc:  # diagnostics never break a turn
                left = right = f"<preview unavailable: {exc}>"
        else:
            left, right = list(cached[lo : plan.lcp + 8]), list(prompt[lo : plan.lcp + 8])
        log.warning(
            "full prefill: cache_id=%s untrimmable entry diverges at token %d of %d; "
            "cached=%r prompt=%r",
            _short(key),
            plan.lcp,
            plan.cached_len,
            left,
            right,
        )

    # --- commands from the Trio side ---------------------------------------

    def flush(self, deadline: float | None = None) -> int:
        """Write every dirty entry to disk; returns how many were written.
        Stops once ``time.monotonic()`` passes ``deadline`` (shutdown)."""
        written = 0
        for entry in list(self.store):
            if entry.dirty and entry.kind != "anonymous" and self.disk is not None:
                if deadline is not None and time.monotonic() > deadline:
                    log.warning("flush stopped at its deadline; dirty entries left unwritten")
                    break
                self._write(entry)
                written += 0 if entry.dirty else 1
        if written:
            log.info("flushed %d dirty entries to disk", written)
        return written

    def evict(self, key: str) -> tuple[bool, bool]:
        """Drop ``key`` from memory and disk: ``(in_memory, on_disk)``."""
        mem = self.store.remove(key) is not None
        self._used_at.pop(key, None)
        on_disk = False
        if self.disk is not None:
            on_disk = self.disk.delete(key)
            self.disk.delete(_companion(key))
        self._seeded_prefixes.discard(key)
        if mem or on_disk:
            self.version += 1
            log.info("deleted cache_id=%s memory=%s disk=%s", _short(key), mem, on_disk)
        return mem, on_disk

    def inspect(self, key: str) -> tuple[int, str] | None:
        """``(tokens, roster)`` of the entry under ``key`` (memory, then disk)."""
        entry = self.store.peek(key)
        if entry is None and self.disk is not None and self.disk.exists(key):
            entry, _ = self._lookup(key)
        return None if entry is None else (len(entry.tokens), entry.roster)

    def pinned(self, key: str) -> bool:
        return self.store.pinned(key)

    def view(self) -> tuple[CacheView, ...]:
        return tuple(
            CacheView(
                cache_id=e.key,
                tokens=len(e.tokens),
                bytes=e.nbytes,
                kind=e.kind,
                last_used=self._used_at.get(e.key, 0.0),
                dirty=e.dirty,
                pinned=self.store.pinned(e.key),
            )
            for e in sorted(self.store, key=lambda e: -e.last_use)
        )

    @property
    def live_sequences(self) -> int:
        return len(self._seqs)
