"""Rank 0's backend: each call that changes what the ranks hold is an
order to every rank first, each call sent to the group timed by a
watchdog (``--group-timeout``)."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx

from ...core.backend import (
    Admission,
    BackendFigures,
    Captured,
    Detokenizer,
    RankStep,
    StepOutput,
)
from ...core.errors import EngineFailure
from ...core.model import ModelInfo
from ...core.request import Priority
from .states import (
    CALLS,
    Held,
    check_shard,
    digest,
    local_of,
    map_args,
    map_result,
    method_of,
    number_of,
    shard_meta,
)
from .wire import GroupLost, Order, Wire, log_times

__all__ = ["GroupBackend"]

log = logging.getLogger("gezel_trio.mlx")


# How long a stopping rank 0 drains before it exits anyway: its host thread
# may be blocked in a collective that never returns.
_GRACE = 5.0


class _Watchdog:
    """Rank 0's deadline on each backend call sent to the group (its
    order's collectives, which wait for the step in flight, and the call's
    own), and its watch on the other ranks' order connections: past
    ``limit`` seconds, or as soon as a rank's connection closes (``gone``:
    the rank exited or was killed), it fails every request through the
    engine (``report``; without one, SIGTERM to this process) and exits 1
    ``_GRACE`` seconds later.

    A rank's death is seen on its own connection, not left to the
    collective in flight: the ring backend may keep polling a socket whose
    peer is gone, and the host thread with it, until ``limit``."""

    def __init__(self, limit: float, gone: Callable[[], int | None]) -> None:
        self._limit = limit
        self._gone = gone
        self._since: float | None = None
        # The engine's way to fail every request (``FailsFromAfar``).
        self.report: Callable[[EngineFailure], None] | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="gezel-group-watchdog", daemon=True
        )
        self._thread.start()

    @contextlib.contextmanager
    def guard(self) -> Any:
        self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        tick = min(1.0, self._limit / 4)
        while not self._closed.wait(tick):
            since = self._since
            gone = self._gone()
            if gone is not None:
                line = (
                    f"gezel-trio: rank {gone} of the group closed its connection "
                    "(it exited or was killed): stopping"
                )
            elif since is not None and time.monotonic() - since > self._limit:
                line = (
                    f"gezel-trio: the group's other ranks have not answered for "
                    f"{self._limit:g} s (a rank stalled): stopping"
                )
            else:
                continue
            if self._closed.is_set():
                return  # rank 0 closed the group itself meanwhile
            log.error("%s", line)
            print(line, file=sys.stderr, flush=True)
            if self.report is not None:
                # Every request fails now, and /health answers 503.
                self.report(GroupLost(line.removeprefix("gezel-trio: ")))
            else:
                os.kill(os.getpid(), signal.SIGTERM)
            # The host thread is blocked in the collective for good: exit
            # once the failed requests have been told.
            if not self._closed.wait(_GRACE):
                os._exit(1)
            return


class GroupBackend:
    """Rank 0's backend, a decorator over ``local`` (rank 0's own backend,
    holding its part of the model: ``Sharding``): each call that changes
    what the ranks hold is an order to every rank first (``mlx.group``),
    the rest is ``local``'s."""

    def __init__(self, local: Any, group: Any, stream: Any, timeout: float) -> None:
        self._local = local
        self._group = group
        self._wire = Wire(group, stream)
        self._watchdog = _Watchdog(timeout, self._wire.closed_peer)
        # States made so far: the next one's number (each rank counts alike).
        self._made = 0
        self._released: list[int] = []
        self._last_step: str | None = None
        # The time spent pickling and sending each order (the latest ones).
        self._sending: collections.deque[float] = collections.deque(maxlen=100_000)
        # Each rank's last step count and when rank 0 heard of it (/health).
        # Without order connections the other ranks cannot say (only rank 0).
        now = time.monotonic()
        reporting = range(self.world_size) if self._wire.connected else range(1)
        self._ranks = {r: RankStep(r, 0, now) for r in reporting}
        mx.random.seed(self._wire.seed())

    def on_failure(self, report: Callable[[EngineFailure], None]) -> None:
        self._watchdog.report = report

    # Read-only: rank 0 alone.
    @property
    def info(self) -> ModelInfo:
        info: ModelInfo = self._local.info
        return info

    @property
    def renderer(self) -> Any:
        return self._local.renderer

    @property
    def compiler(self) -> Any:
        return self._local.compiler

    @property
    def images(self) -> Any:
        return None

    @property
    def world_size(self) -> int:
        return int(self._group.size())

    def token_text(self, token: int) -> str:
        text: str = self._local.token_text(token)
        return text

    def decode(self, tokens: Sequence[int]) -> str:
        text: str = self._local.decode(tokens)
        return text

    def detokenizer(self, keep_leading_space: bool = False) -> Detokenizer:
        detok: Detokenizer = self._local.detokenizer(keep_leading_space)
        return detok

    def state_offsets(self, state: Any) -> list[int | None]:
        offsets: list[int | None] = self._local.states.state_offsets(local_of(state))
        return offsets

    def memory_in_use(self) -> int:
        return int(self._local.memory_in_use())

    @property
    def states(self) -> GroupBackend:
        """Its own state codec: each state is a shard held on every rank."""
        return self

    def figures(self) -> BackendFigures:
        """Rank 0's figures, with each rank's last step."""
        now = time.monotonic()
        for rank, steps in self._wire.acks().items():
            self._ranks[rank] = RankStep(rank, steps, now)
        figures: BackendFigures = self._local.figures()
        return attrs.evolve(figures, ranks=tuple(self._ranks.values()))

    # Cache files: rank 0's shard in the file the disk cache seals, each
    # other rank's in a file of its own beside it (``ShardFiles``).
    def dump_state(self, state: Any, metadata: dict[str, str], path: Path) -> None:
        with self._watchdog.guard():
            self._send(
                "dump_shard", (number_of(state), str(path.parent), metadata["gezel_file"], metadata)
            )
            self._local.states.dump_state(
                local_of(state), {**metadata, **shard_meta(0, self.world_size)}, path
            )

    def load_state(self, payload: bytes, path: Path) -> tuple[Any, dict[str, str]]:
        with self._watchdog.guard():
            self._send("load_shard", (str(path.parent), path.stem))
            # The check of a loaded state's shapes runs the model once (its
            # collectives with it): on every rank, before any file is read.
            self._local.states.ready_state_checks()
            try:
                state, meta = self._local.states.load_state(payload, path)
                check_shard(meta, path.stem, 0, self.world_size)
            except Exception:
                self._wire.count(1)
                raise
            # Every rank says whether its shard loaded: all of them, or none.
            missing = self._wire.count(0)
        if missing:
            raise ValueError(f"{missing} of the group's other ranks hold no usable shard of it")
        return self._hold(state), meta

    def forget_state(self, path: Path) -> None:
        with self._watchdog.guard():
            self._send("forget_shard", (str(path.parent), path.stem))

    # Orders: every rank.
    def _call(self, name: str, *args: Any) -> Any:
        # The order's collectives and the call's own (a split layer's
        # all_sum in the step) wait on the other ranks: both are timed.
        with self._watchdog.guard():
            return self._order(name, *args)

    def _send(self, name: str, args: tuple[Any, ...]) -> None:
        start = time.monotonic()
        # Finalizers append as handles die, on whichever thread collects them.
        n = len(self._released)
        released = tuple(self._released[:n])
        del self._released[:n]
        self._wire.send(Order(name, args, released, self._made, self._last_step, start))
        self._sending.append(time.monotonic() - start)

    def _order(self, name: str, *args: Any) -> Any:
        kinds, result = CALLS[name]
        self._send(name, tuple(map_args(k, a, number_of) for k, a in zip(kinds, args, strict=True)))
        mine = tuple(map_args(k, a, local_of) for k, a in zip(kinds, args, strict=True))
        try:
            out = method_of(self._local, name)(*mine)
        except RuntimeError as exc:
            if "[ring]" not in str(exc) and "distributed" not in str(exc):
                raise
            # A split layer's collective: a rank was lost mid-step.
            self._wire.lost = f"a rank of the group was lost: {exc}"
            raise GroupLost(self._wire.lost) from exc
        if name == "step":
            self._last_step = digest(out)
            self._ranks[0] = RankStep(0, self._ranks[0].steps + 1, time.monotonic())
        return map_result(result, out, self._hold)

    def _hold(self, state: Any) -> Held:
        held = Held(self._made, state)
        self._made += 1
        weakref.finalize(held, self._release, held.number)
        return held

    def _release(self, number: int) -> None:
        self._released.append(number)

    def insert(self, admissions: Sequence[Admission]) -> dict[int, Exception]:
        out: dict[int, Exception] = self._call("insert", list(admissions))
        return out

    def remove(self, rids: Sequence[int]) -> dict[int, Captured]:
        out: dict[int, Captured] = self._call("remove", list(rids))
        return out

    def capture(self, rid: int) -> Captured | None:
        out: Captured | None = self._call("capture", rid)
        return out

    def state_blocks(self, state: Any, ranges: Sequence[tuple[int, int]]) -> list[tuple[Any, int]]:
        out: list[tuple[Any, int]] = self._call("state_blocks", state, list(ranges))
        return out

    def state_rest(self, state: Any) -> tuple[Any, int]:
        out: tuple[Any, int] = self._call("state_rest", state)
        return out

    def join_state(self, blocks: Sequence[Any], length: int, rest: Any) -> Any:
        return self._call("join_state", list(blocks), length, rest)

    def step(self, lane: Priority) -> StepOutput:
        out: StepOutput = self._call("step", lane)
        return out

    def reset(self, lane: Priority) -> None:
        self._call("reset", lane)

    def reclaim(self) -> None:
        self._call("reclaim")

    def close(self) -> None:
        log_times(
            "rank 0 sent %d orders, each %.1f us (median) / %.1f us (p90) to pickle and send",
            self._sending,
        )
        # Watched no more: the other ranks close their connections now.
        self._watchdog.close()
        try:
            if self._wire.lost is None:
                self._wire.send(None)  # the other ranks close and exit
        finally:
            self._wire.close()
            self._local.close()
