"""The scheduling core: admission and removal decisions, nothing else.

Pure synchronous code with no MLX, no Trio and no clock (an import-linter
contract checks this). The engine feeds it what happened - a request arrived,
a caller withdrew, a sequence finished - and once per engine step asks it for
a ``Plan``: which queued requests to admit into the batch and which running
sequences to remove before the next step.

Policy:

* A bounded queue: ``enqueue`` beyond ``max_queue`` raises ``QueueFull``
  at once; that bound is the admission control behind HTTP 429.
* At most ``max_running`` sequences share the batch.
* ``interactive`` work is admitted before ``background`` work, and the two
  never share a batch: each class has its own lane (its own generator).
* Preemption: when interactive work waits while a background wave runs,
  the background lane is parked - it simply stops being stepped, keeping its
  state - and the interactive lane runs; once no interactive work is left the
  background lane resumes from the exact step it stopped at. ``plan`` reports
  which lane to step and which sequences were just parked or resumed.
* When memory is tight (``plan(memory_tight=True)``) nothing is preempted and
  a lane admits only into an empty batch, one request at a time.
* Background arrivals wait while interactive work runs over a parked wave.
* A parked wave is never starved: once it has been parked ``max_park``
  seconds (``plan(now=...)``; the caller owns the clock), the two lanes take
  turns step by step until that wave drains, then parking applies again.
* ``continuous`` admission lets a queued request join a running batch with
  free slots; without it a lane runs static waves and admission waits for it
  to drain.
* KV-aware admission: given ``kv_bytes`` (a sequence's KV bytes for a
  length) and ``kv_room``, a request is admitted only while the KV of every
  running sequence, its own and what the prompt cache holds
  (``plan(kv_held=...)``) fit in the room. A lane's generator pads its
  sequences to the longest, so a lane costs its count times the KV of its
  longest ``prompt + max_tokens``. One that does not fit now waits at the
  head of its queue (those behind it wait too: it is never starved) until
  running sequences end; into an engine with nothing running it is
  admitted whatever the cache holds (it fits alone: the caller refused
  what never can).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Literal

import attrs

from .errors import QueueFull
from .request import Priority

__all__ = ["Plan", "Scheduler"]

Where = Literal["queued", "running", "unknown"]


@attrs.frozen
class Plan:
    """What the host thread does before its next step: remove, admit, then
    step ``lane`` (``None``: nothing to step). ``parked``/``resumed`` list the
    sequences whose lane just stopped or started stepping again."""

    admit: tuple[int, ...] = ()
    remove: tuple[int, ...] = ()
    lane: Priority | None = None
    parked: tuple[int, ...] = ()
    resumed: tuple[int, ...] = ()


@attrs.define
class Scheduler:
    max_running: int
    max_queue: int
    continuous: bool = True
    _queues: dict[Priority, deque[int]] = attrs.field(
        factory=lambda: {"interactive": deque(), "background": deque()}
    )
    _running: dict[int, Priority] = attrs.field(factory=dict)
    _to_remove: list[int] = attrs.field(factory=list)
    _background_parked: bool = False
    max_park: float | None = None
    _parked_since: float | None = None
    # The wave parked longer than ``max_park``: lanes alternate until it drains.
    _starved: bool = False
    _last_lane: Priority | None = None
    # KV-aware admission (see the policy): bytes for a sequence of a length,
    # the room for all of them, and each request's length (prompt + max_tokens).
    kv_bytes: Callable[[int], int] | None = None
    kv_room: int = 0
    _lengths: dict[int, int] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.max_running < 1:
            raise ValueError("max_running must be at least 1")
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")

    # --- views -------------------------------------------------------------

    @property
    def running(self) -> tuple[int, ...]:
        return tuple(self._running)

    @property
    def queued(self) -> tuple[int, ...]:
        return (*self._queues["interactive"], *self._queues["background"])

    @property
    def parked(self) -> tuple[int, ...]:
        if not self._background_parked:
            return ()
        return tuple(r for r, c in self._running.items() if c == "background")

    @property
    def idle(self) -> bool:
        """Nothing running, nothing queued, nothing to remove."""
        return not self._running and not self.queued and not self._to_remove

    # --- events ------------------------------------------------------------

    def check_room(self, count: int = 1) -> None:
        """Raise ``QueueFull`` if ``count`` new requests would be refused."""
        if len(self.queued) + count > self.max_queue + self._free_slots():
            raise QueueFull(f"the admission queue is full ({self.max_queue} waiting); retry later")

    def enqueue(self, rid: int, priority: Priority, length: int = 0) -> None:
        """Queue ``rid``; ``length`` (its prompt plus ``max_tokens``) is what
        KV-aware admission weighs."""
        self.check_room()
        self._queues[priority].append(rid)
        if length:
            self._lengths[rid] = length

    def withdraw(self, rid: int) -> Where:
        """The caller left. A queued request is dropped now; a running one is
        removed at the next ``plan``."""
        for q in self._queues.values():
            if rid in q:
                q.remove(rid)
                self._lengths.pop(rid, None)
                return "queued"
        if rid in self._running:
            if rid not in self._to_remove:
                self._to_remove.append(rid)
            return "running"
        return "unknown"

    def finished(self, rid: int) -> None:
        """The backend ended the sequence by itself (stop, length, failure)."""
        self._running.pop(rid, None)
        self._lengths.pop(rid, None)
        if rid in self._to_remove:
            self._to_remove.remove(rid)

    def withdraw_all(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shutdown: drop every queued request and mark every running one for
        removal. Returns ``(queued, running)`` ids."""
        queued = self.queued
        for q in self._queues.values():
            q.clear()
        for rid in queued:
            self._lengths.pop(rid, None)
        running = self.running
        for rid in running:
            self.withdraw(rid)
        return queued, running

    # --- the decision ------------------------------------------------------

    def plan(
        self, *, memory_tight: bool = False, now: float | None = None, kv_held: int = 0
    ) -> Plan:
        """The next step's decisions. ``now`` (any monotonic clock) bounds how
        long a background wave stays parked; without it, parking is unbounded.
        ``kv_held``: bytes the prompt cache holds, beside running sequences."""
        remove = tuple(self._to_remove)
        for rid in remove:
            del self._running[rid]
            self._lengths.pop(rid, None)
        self._to_remove.clear()
        was_parked = set(self.parked)

        running = {"interactive": 0, "background": 0}
        for cls in self._running.values():
            running[cls] += 1
        wants_interactive = bool(running["interactive"] or self._queues["interactive"])
        admit: list[int] = []
        if self._queues["interactive"]:
            # Interactive work may start over a background wave only by parking
            # it, which needs memory for a second generator.
            blocked = running["background"] > 0 and memory_tight
            if not blocked:
                admit += self._admit("interactive", running["interactive"], memory_tight, kv_held)
        elif not wants_interactive and self._queues["background"]:
            admit += self._admit("background", running["background"], memory_tight, kv_held)

        has_interactive = any(c == "interactive" for c in self._running.values())
        has_background = any(c == "background" for c in self._running.values())
        lane: Priority | None = (
            "interactive" if has_interactive else "background" if has_background else None
        )
        if not has_background:
            self._starved = False
        elif (
            self._background_parked
            and now is not None
            and self.max_park is not None
            and self._parked_since is not None
            and now - self._parked_since >= self.max_park
        ):
            self._starved = True
        if self._starved and has_interactive and self._last_lane == "interactive":
            lane = "background"  # its turn: a parked wave waits at most max_park
        park_now = has_background and lane == "interactive" and not self._starved
        parked: tuple[int, ...] = ()
        resumed: tuple[int, ...] = ()
        if park_now and not self._background_parked:
            parked = tuple(r for r, c in self._running.items() if c == "background")
            self._parked_since = now
        elif not park_now and was_parked:
            resumed = tuple(r for r in self._running if r in was_parked)
        self._background_parked = park_now
        self._last_lane = lane
        return Plan(tuple(admit), remove, lane, parked, resumed)

    def _admit(self, cls: Priority, running: int, memory_tight: bool, kv_held: int) -> list[int]:
        if running and (memory_tight or not self.continuous):
            return []  # a static (or memory-collapsed) wave must drain first
        cap = 1 if memory_tight else self.max_running
        out: list[int] = []
        q = self._queues[cls]
        while q and running + len(out) < cap:
            if self._running and not self._kv_fits(cls, q[0], kv_held):
                break  # it waits for running sequences to end, first in line
            rid = q.popleft()
            self._running[rid] = cls
            out.append(rid)
        return out

    def _kv_fits(self, cls: Priority, rid: int, held: int) -> bool:
        """Whether ``rid`` joining lane ``cls`` keeps all KV within the room."""
        kv = self.kv_bytes
        if kv is None or self.kv_room <= 0:
            return True
        lanes: dict[Priority, list[int]] = {"interactive": [], "background": []}
        for r, c in self._running.items():
            lanes[c].append(self._lengths.get(r, 0))
        lanes[cls].append(self._lengths.get(rid, 0))
        # A lane's generator pads every sequence to its longest.
        use = sum(len(ls) * kv(max(ls)) for ls in lanes.values() if ls)
        return use + held <= self.kv_room

    def _free_slots(self) -> int:
        # Room counts the interactive lane: that is what a new arrival waits for.
        busy = sum(1 for c in self._running.values() if c == "interactive")
        return max(0, self.max_running - busy)
