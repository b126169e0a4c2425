"""The in-memory prompt-cache store: entries, LRU order, byte budget, pins.

Pure bookkeeping: an entry's KV state is an opaque object the backend made
(MLX arrays for the MLX backend), priced by the ``nbytes`` the backend
reported. Owned by the engine's host thread, like the states it holds.

Policy (SPEC C4):

* Over ``budget_bytes``, evict least-recently-used entries down to 80% of the
  budget - the slack keeps one new turn from triggering an eviction pass.
* Never evict the only entry: an over-budget single session is a budget that
  is too tight, and evicting it would buy a full re-prefill next turn.
* Never evict the entry just saved: it is the one the next turn wants.
* Never evict an entry a live request holds. Pins are counted, so requests
  sharing an entry do not release each other's pin.
* Evicted entries are returned to the caller, which writes dirty ones to disk
  before they are gone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any, Literal

import attrs

from .cache_plan import common_prefix

__all__ = ["CacheStore", "Entry", "EntryKind"]

EntryKind = Literal["session", "prefix", "anonymous"]


@attrs.define
class Entry:
    """One saved state: its KV ``state`` holds exactly ``tokens``.

    ``alternates`` are older ``(tokens, state)`` pairs of the same session,
    each a proven prefix state (prompt snapshots), for caches that cannot be
    rewound: when the main state is not a prefix of the next prompt, the
    longest alternate that is still serves instead. ``nbytes`` counts them.
    """

    key: str
    tokens: tuple[int, ...]
    state: Any
    nbytes: int
    alternates: tuple[tuple[tuple[int, ...], Any], ...] = ()
    kind: EntryKind = "session"
    roster: str = ""
    dirty: bool = True
    last_use: int = 0


@attrs.define
class CacheStore:
    budget_bytes: int
    _entries: dict[str, Entry] = attrs.field(factory=dict)
    _pins: Counter[str] = attrs.field(factory=Counter)
    _clock: int = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries.values())

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def peek(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def get(self, key: str) -> Entry | None:
        """The entry for ``key``, marked as just used."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.last_use = self._tick()
        return entry

    def put(self, entry: Entry) -> list[Entry]:
        """Insert or replace; returns the entries evicted to stay in budget."""
        entry.last_use = self._tick()
        self._entries[entry.key] = entry
        return self._enforce_budget(keep=entry.key)

    def remove(self, key: str) -> Entry | None:
        return self._entries.pop(key, None)

    # --- pins --------------------------------------------------------------

    def pin(self, key: str) -> None:
        self._pins[key] += 1

    def unpin(self, key: str) -> None:
        """Release one pin; releasing an unpinned key is a no-op, so a double
        release cannot go negative and unpin someone else's hold."""
        if self._pins[key] <= 1:
            del self._pins[key]
        else:
            self._pins[key] -= 1

    def pinned(self, key: str) -> bool:
        return self._pins[key] > 0

    @property
    def pin_count(self) -> int:
        return sum(self._pins.values())

    # --- lookups -----------------------------------------------------------

    def longest_prefix(
        self, prompt: tuple[int, ...], *, whole_entry: bool
    ) -> tuple[Entry, int] | None:
        """The entry sharing the longest token prefix with ``prompt`` (C9).

        With ``whole_entry`` (untrimmable caches) only entries whose every
        token is a prefix of the prompt qualify, since they cannot be cut
        back. Ties go to the most recently used entry.
        """
        best: tuple[Entry, int] | None = None
        for entry in sorted(self._entries.values(), key=lambda e: -e.last_use):
            lcp = common_prefix(entry.tokens, prompt)
            if whole_entry and lcp < len(entry.tokens):
                continue
            if lcp > 0 and (best is None or lcp > best[1]):
                best = (entry, lcp)
        return best

    # --- internals ---------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _enforce_budget(self, keep: str) -> list[Entry]:
        total = self.total_bytes
        if total <= self.budget_bytes or len(self._entries) <= 1:
            return []
        target = int(self.budget_bytes * 0.8)
        evicted: list[Entry] = []
        for entry in sorted(self._entries.values(), key=lambda e: e.last_use):
            if total <= target or len(self._entries) <= 1:
                break
            if self.pinned(entry.key) or entry.key == keep:
                continue
            del self._entries[entry.key]
            total -= entry.nbytes
            evicted.append(entry)
        return evicted
