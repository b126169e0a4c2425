"""``gezel-trio serve`` with its Trio thread's stalls recorded.

The bench starts ``python bench/_gezel_stalls.py OUT ARGS`` instead of
``python -m gezel_trio serve ARGS`` where it measures how responsive the
Trio thread stays (``bench decode``, ``bench scheduler``'s health section):
the same server, in a Trio run given two watchers.

* A Trio instrument times every task step; each one of ``STEP_MS`` or more
  is kept with its task's name, the Trio thread's CPU time in it, the time
  it waited runnable for a core (the kernel's ``run_delay``, from
  ``/proc/thread-self/schedstat``) and the time Python's garbage collector
  ran in it. What is left of a long step after its CPU and its wait for a
  core, it was asleep: for the GIL (a task step makes no other blocking
  call); one with a collection in it paid for that.
* A heartbeat task sleeps ``BEAT_S`` and records how late it woke: what any
  blocking costs a task that wants to run - a long task step, a long
  ``run_sync_soon`` callback (the host's exchange runs as one), the GIL
  held by another thread.

Every quarter second ``OUT`` (JSON) is rewritten with the heartbeat's
lateness quantiles and the long steps since the last ``mark`` (a file
beside it, ``OUT.mark``, holding the time the window began); the bench
marks before a phase and reads after it (``read_stalls``). Nothing else
changes.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

STEP_MS = 8.0
BEAT_S = 0.005
WRITE_EVERY_S = 0.25
_HEARTBEAT = f"{__name__}._heartbeat"


class _Steps(trio.abc.Instrument):
    def __init__(self) -> None:
        self.started = 0.0
        self.started_cpu = 0.0
        self.gc_ms = 0.0  # the Trio thread's collections, in all
        self.gc_at_start = 0.0
        self._gc_began = 0.0
        self._thread = threading.get_ident()  # trio.run's, where this is made
        self.started_queued = 0
        self._queued_ns = queued_ns_reader()  # this (the Trio) thread's
        # (wall time, ms, task, the thread's CPU ms, the collector's ms, ms waiting for a core)
        self.long: list[tuple[float, float, str, float, float, float]] = []
        gc.callbacks.append(self._collected)

    def _collected(self, phase: str, info: dict[str, Any]) -> None:
        if threading.get_ident() != self._thread:
            return
        if phase == "start":
            self._gc_began = time.perf_counter()
        else:
            self.gc_ms += (time.perf_counter() - self._gc_began) * 1e3

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        # Read first: the read releases the GIL, and waiting to take it back
        # is the watcher's, not the step's.
        self.started_queued = self._queued_ns()
        self.started = time.perf_counter()
        self.started_cpu = time.thread_time()
        self.gc_at_start = self.gc_ms

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        ms = (time.perf_counter() - self.started) * 1e3
        if ms >= STEP_MS and task.name != _HEARTBEAT:  # not the watcher's own steps
            cpu = (time.thread_time() - self.started_cpu) * 1e3
            collected = self.gc_ms - self.gc_at_start
            queued = (self._queued_ns() - self.started_queued) / 1e6
            self.long.append(
                (
                    time.time(),
                    round(ms, 2),
                    task.name,
                    round(cpu, 2),
                    round(collected, 2),
                    round(queued, 2),
                )
            )


def queued_ns_reader() -> Callable[[], int]:
    """A reader of the calling thread's time spent runnable, waiting for a
    core (ns, the second field of ``/proc/thread-self/schedstat``); 0
    where the kernel does not say. Make it on the thread it is to read."""
    try:
        fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    except OSError:
        return lambda: 0

    def read() -> int:
        try:
            return int(os.pread(fd, 64, 0).split()[1])
        except (OSError, ValueError, IndexError):
            return 0

    return read


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _marked(out: Path) -> float:
    try:
        return float(out.with_name(out.name + ".mark").read_text())
    except (OSError, ValueError):
        return 0.0


async def _heartbeat(out: Path, steps: _Steps) -> None:
    late: list[tuple[float, float]] = []  # (wall time, ms late)
    written = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        await trio.sleep(BEAT_S)
        late.append((time.time(), (time.perf_counter() - t0 - BEAT_S) * 1e3))
        now = time.perf_counter()
        if now - written < WRITE_EVERY_S:
            continue
        written = now
        since = _marked(out)  # what came before the mark is forgotten
        late = [b for b in late if b[0] >= since]
        steps.long = [x for x in steps.long if x[0] >= since]
        _write(out, [ms for _, ms in late], steps, since)


def _write(out: Path, late: list[float], steps: _Steps, since: float) -> None:
    data: dict[str, Any] = {
        "beats": len(late),
        "late_p50_ms": _quantile(late, 0.5),
        "late_p99_ms": _quantile(late, 0.99),
        "late_max_ms": max(late) if late else None,
        # [ms, task, CPU ms, collector ms, ms waiting for a core, s after the mark],
        # the longest first
        "long_steps": sorted(
            ((*x[1:], round(x[0] - since, 3) if since else None) for x in steps.long),
            reverse=True,
        )[:20],
        "long_step_count": len(steps.long),
        "written": time.time(),
    }
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(out)


def read_stalls(out: Path, after: float) -> dict[str, Any]:
    """What the server recorded since the last ``mark``, once it has
    written a window that ends after ``after`` (``time.time()``): waits
    for the next write, at most a few of them."""
    deadline = time.monotonic() + 20 * WRITE_EVERY_S
    while True:
        try:
            data: dict[str, Any] = json.loads(out.read_text())
        except (OSError, ValueError):
            data = {}
        if data.get("written", 0.0) > after or time.monotonic() > deadline:
            return data
        time.sleep(WRITE_EVERY_S / 5)


def mark(out: Path) -> None:
    """Start a new window: what the server recorded before now is forgotten."""
    m = out.with_name(out.name + ".mark")
    m.write_text(repr(time.time()))


def main() -> None:
    out = Path(sys.argv[1])
    from gezel_trio import cli

    steps = _Steps()
    run = trio.run

    def watched(fn: Any, *args: Any, **kwargs: Any) -> Any:
        async def both() -> Any:
            got: list[Any] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_heartbeat, out, steps)
                try:
                    got.append(await fn(*args))
                finally:
                    nursery.cancel_scope.cancel()
            return got[0]

        return run(both, instruments=[steps], **kwargs)

    trio.run = watched  # type: ignore[assignment]  # the server's one trio.run
    sys.argv = ["gezel-trio", *sys.argv[2:]]
    sys.exit(cli.main())


if __name__ == "__main__":
    main()
