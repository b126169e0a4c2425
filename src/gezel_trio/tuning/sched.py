"""The Trio thread's EEVDF slice: it answers before the compute's turn ends.

On a machine whose cores the compute fills (a long prefill takes every core
OpenBLAS is given), the Trio thread that answers ``/health`` waits for a
core each time it wakes. Linux's EEVDF scheduler (6.6+) lets the running
thread finish its protected slice first, unless the woken one asks for a
shorter slice than it has (Linux 6.12+: ``sched_setattr``'s
``sched_runtime`` for a normal thread, 0.1-100 ms, unprivileged; the
default here is 1.4 ms).

The server process (``server.main_serve``) asks for ``EVENT_LOOP_SLICE_NS``
on its Trio thread once the engine runs. Measured on
the dense bench model during a 5,929-token prefill on 2 cores, ``/health``
polled every 20 ms (about 900 samples a run, docs/performance.md): p99
5.2-5.9 ms in 16 runs with the slice, 6.5-7.0 in 11 without. A long slice
for the compute threads instead, a shorter switch interval for the GIL, or
a short slice for the polling client changed nothing measurable.

The Trio thread's share of the cores is what it was (its weight is the
same); it only runs sooner after waking and in shorter turns. Other kernels
and platforms keep the default (``request_slice`` says why).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from typing import Final

__all__ = ["EVENT_LOOP_SLICE_NS", "request_slice", "slice_ns_of"]

EVENT_LOOP_SLICE_NS: Final = 100_000  # the shortest the kernel takes

# sched_setattr's number per architecture (sched_getattr's is the next);
# struct sched_attr
# (include/uapi/linux/sched/types.h).
_SCHED_SETATTR: Final = {"x86_64": 314, "aarch64": 274}


class _SchedAttr(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("sched_policy", ctypes.c_uint32),
        ("sched_flags", ctypes.c_uint64),
        ("sched_nice", ctypes.c_int32),
        ("sched_priority", ctypes.c_uint32),
        ("sched_runtime", ctypes.c_uint64),
        ("sched_deadline", ctypes.c_uint64),
        ("sched_period", ctypes.c_uint64),
        ("sched_util_min", ctypes.c_uint32),
        ("sched_util_max", ctypes.c_uint32),
    ]


def request_slice(slice_ns: int) -> str | None:
    """Ask for a slice of ``slice_ns`` for the calling thread, keeping its
    policy and nice value; ``None`` when asked, else why not."""
    number = _SCHED_SETATTR.get(platform.machine())
    if not sys.platform.startswith("linux") or number is None:
        return f"sched_setattr is not known on {sys.platform}/{platform.machine()}"
    policy = os.sched_getscheduler(0)
    if policy not in (os.SCHED_OTHER, os.SCHED_BATCH):
        return f"policy {policy} has no slice"
    attr = _SchedAttr(size=ctypes.sizeof(_SchedAttr), sched_policy=policy)
    attr.sched_nice = os.getpriority(os.PRIO_PROCESS, 0)
    attr.sched_runtime = slice_ns
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, 0, ctypes.byref(attr), 0) != 0:
        return os.strerror(ctypes.get_errno())
    # Kernels before 6.12 take the call and ignore the slice.
    got = slice_ns_of(0)
    if got != slice_ns:
        return f"this kernel keeps its own slice ({got} ns)"
    return None


def slice_ns_of(tid: int) -> int | None:
    """Thread ``tid``'s slice (0: the calling thread), as the kernel reports
    it: 0 before Linux 6.12; ``None`` where it cannot be read."""
    number = _SCHED_SETATTR.get(platform.machine())
    if not sys.platform.startswith("linux") or number is None:
        return None
    got = _SchedAttr()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number + 1, tid, ctypes.byref(got), ctypes.sizeof(got), 0) != 0:
        return None
    return int(got.sched_runtime)
