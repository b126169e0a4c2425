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

``idle`` puts the compute at ``SCHED_IDLE`` on the host thread: the
threads it starts afterwards (MLX's, the cache writer) inherit it, and the
threads the libraries started before it (OpenBLAS's workers, started when
it was loaded) are set too. A thread Python started other than the host
thread (Trio's, its workers that tokenize, the KV-event publisher) keeps its
policy.

Why it is not the default: another process that keeps the cores busy at
the normal policy runs first, always. Beside two busy loops on the 2
cores, one stream of the same model decoded 34-51 tok/s at the normal
policy (98-103 alone) and not one token in 4 minutes at ``SCHED_IDLE``. A
thread cannot return from ``SCHED_IDLE`` without privilege, so the choice
holds for the process's life: ``idle`` is for a machine that serves and
does nothing else (replicas behind a router whose health checks time out).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

__all__ = ["set_compute_priority"]

log = logging.getLogger("gezel_trio.mlx")


def set_compute_priority(priority: str) -> str:
    """Apply ``priority`` (``idle`` or ``normal``) to the calling thread (the
    host thread) and to the threads no Python code started; says what was
    done, for the startup log."""
    if priority == "normal":
        return "normal"
    if not sys.platform.startswith("linux") or not hasattr(os, "SCHED_IDLE"):
        return "normal (SCHED_IDLE is Linux's)"
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
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError as exc:  # gone meanwhile, or a sandbox that refuses it
            if tid == threading.get_native_id():
                return f"normal (SCHED_IDLE refused: {exc})"
            continue
        done += 1
    return f"idle (SCHED_IDLE on the host thread and {done - 1} library threads)"
