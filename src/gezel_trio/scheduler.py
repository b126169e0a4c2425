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
  never share a batch: a class is admitted only into an empty batch or one
  of its own class.
* ``continuous`` admission lets a queued request join a running batch with
  free slots; without it the batch runs as a static wave and admission waits
  for it to drain.
"""

from __future__ import annotations

from collections import deque
from typing import Literal

import attrs

from .errors import QueueFull
from .request import Priority

__all__ = ["Plan", "Scheduler"]

Where = Literal["queued", "running", "unknown"]


@attrs.frozen
class Plan:
    """What the host thread does before its next step."""

    admit: tuple[int, ...] = ()
    remove: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.admit and not self.remove


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
    def idle(self) -> bool:
        """Nothing running, nothing queued, nothing to remove."""
        return not self._running and not self.queued and not self._to_remove

    def position(self, rid: int) -> int | None:
        """0-based place in the admission order, or ``None`` if not queued."""
        for i, q in enumerate(self.queued):
            if q == rid:
                return i
        return None

    # --- events ------------------------------------------------------------

    def check_room(self) -> None:
        """Raise ``QueueFull`` if a new request would be refused."""
        if len(self.queued) >= self.max_queue + self._free_slots():
            raise QueueFull(f"the admission queue is full ({self.max_queue} waiting); retry later")

    def enqueue(self, rid: int, priority: Priority) -> None:
        self.check_room()
        self._queues[priority].append(rid)

    def withdraw(self, rid: int) -> Where:
        """The caller left. A queued request is dropped now; a running one is
        removed at the next ``plan``."""
        for q in self._queues.values():
            if rid in q:
                q.remove(rid)
                return "queued"
        if rid in self._running:
            if rid not in self._to_remove:
                self._to_remove.append(rid)
            return "running"
        return "unknown"

    def finished(self, rid: int) -> None:
        """The backend ended the sequence by itself (stop, length, failure)."""
        self._running.pop(rid, None)
        if rid in self._to_remove:
            self._to_remove.remove(rid)

    def withdraw_all(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shutdown: drop every queued request and mark every running one for
        removal. Returns ``(queued, running)`` ids."""
        queued = self.queued
        for q in self._queues.values():
            q.clear()
        running = self.running
        for rid in running:
            self.withdraw(rid)
        return queued, running

    # --- the decision ------------------------------------------------------

    def plan(self) -> Plan:
        remove = tuple(self._to_remove)
        for rid in remove:
            del self._running[rid]
        self._to_remove.clear()

        admit: list[int] = []
        if self.continuous or not self._running:
            for cls in ("interactive", "background"):
                q = self._queues[cls]
                if not q:
                    continue
                if any(p != cls for p in self._running.values()):
                    break  # the batch belongs to the other class
                while q and self._free_slots() > 0:
                    rid = q.popleft()
                    self._running[rid] = cls
                    admit.append(rid)
                break  # the highest waiting class decides this step
        return Plan(admit=tuple(admit), remove=remove)

    def _free_slots(self) -> int:
        return self.max_running - len(self._running)
