"""The CPU scheduling of the threads that compute (``--compute-priority``).

On a machine whose cores the compute fills (a long prefill takes every
core OpenBLAS is given), every other thread that wakes waits for a core:
the Trio thread that answers ``/health``, and the probe that asked. Linux's
EEVDF scheduler lets a woken thread wait out the running thread's slice,
and one probe's answer needs two wake-ups. Measured on the dense bench
model, a 1,947-token prefill on 2 cores, ``/health`` polled every 20 ms
(docs/performance.md): p99 6.4-9.5 ms with the compute at the normal
policy, 5.1-6.8 at ``SCHED_BATCH``, 1.1-5.4 (median 1.4) at
``SCHED_IDLE``, and the prefill took as long (2.70-2.95 s against
2.69-2.86).

``batch`` (the default) and ``idle`` set the policy on the host thread:
the threads it starts afterwards (MLX's, the cache writer) inherit it, and
the threads the libraries started before it (OpenBLAS's workers, started
when it was loaded) are set too. A thread Python started other than the
host thread (Trio's, its workers that tokenize, the KV-event publisher)
keeps its policy.

``SCHED_BATCH`` keeps the compute's weight (that of the normal policy)
and lets the threads that wake run sooner. On the
default model at 1 and 8 streams, the Trio thread's 5 ms heartbeat woke
4.8-5.9 ms late at p99 against 9.8-11.1 at the normal policy. Task steps of
8 ms or more were 0-2 a run against 8-15. Decoding ran at 0.95-1.00 of raw
in both, within the noise (two paired runs). Beside two busy loops on the
2 cores one stream decoded 40-42 tok/s, as at the normal policy (34-51).

``batch`` also runs those threads ``--compute-nice`` (5) nicer than the
process: the Trio thread and the probe that woke it are then
picked over the compute far more often. ``/health`` every 20 ms during a
5,929-token prefill of the dense bench model (docs/performance.md), p99:
5.2-6.1 ms at nice 0 (6 runs, every one over 5), 2.8-5.2 at nice 5
(7 runs, median 4.3), 2.7-4.9 at nice 10 (5), 3.7-3.8 at nice 19 (2); the
prefill took as long (19.3-20.6 s). Where autogroup is on (the kernel's
default, one group per session) or the process is in a cgroup of its own,
nice weighs the compute only against the threads of its own group: the
server's Trio thread, and whatever the app that started it runs beside it;
another session's busy processes get the share they had.

Why ``idle`` is not the default: another process that keeps the cores busy
at the normal policy runs first, always. Beside the same two busy loops,
one stream decoded not one token in 4 minutes at ``SCHED_IDLE``, and a
thread cannot return from ``SCHED_IDLE`` without privilege, so the choice
holds for the process's life. ``idle`` is for a machine that serves and
does nothing else (replicas behind a router whose health checks time out).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

__all__ = ["set_compute_priority"]

# The process's nice before any call here (``_nicer`` counts from it).
_LOADED_AT_NICE = os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0

log = logging.getLogger("gezel_trio.mlx")


def set_compute_priority(priority: str, nice: int = 0) -> str:
    """Apply ``priority`` (``batch``, ``idle`` or ``normal``) to the calling
    thread (the host thread) and to the threads no Python code started, and
    with ``batch`` run them ``nice`` nicer than the process; says what was
    done, for the startup log."""
    if priority == "normal":
        return "normal"
    name = "SCHED_IDLE" if priority == "idle" else "SCHED_BATCH"
    policy: int | None = getattr(os, name, None)
    if not sys.platform.startswith("linux") or policy is None:
        return f"normal ({name} is Linux's)"
    others = {t.native_id for t in threading.enumerate() if t is not threading.current_thread()}
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError as exc:
        return f"normal (threads unlisted: {exc})"
    done = 0
    for tid in tids:
        if tid in others:
            continue
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except OSError as exc:  # gone meanwhile, or a sandbox that refuses it
            if tid == threading.get_native_id():
                return f"normal ({name} refused: {exc})"
            continue
        done += 1
    said = f"{priority} ({name} on the host thread and {done - 1} library threads"
    if priority == "batch" and nice > 0:
        said += _nicer([t for t in tids if t not in others], nice)
    return said + ")"


def _nicer(tids: list[int], by: int) -> str:
    """Run ``tids`` ``by`` nicer than the process was when this module was
    loaded (at most 19: the same on a second call, as when a test process
    builds many backends); says what was done."""
    nice = min(_LOADED_AT_NICE + by, 19)
    done = 0
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:  # gone meanwhile, or a sandbox that refuses it
            continue
        done += 1
    return f", nice {nice} on {done}"
