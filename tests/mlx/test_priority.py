"""``--compute-priority batch|idle``: the host thread and the threads no
Python code started run at ``SCHED_BATCH`` or ``SCHED_IDLE``; Python's other
threads keep theirs. ``batch`` also runs them 5 nicer than the process.

Run in a child process: a thread cannot leave ``SCHED_IDLE`` again."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's policy")

CHILD = r"""
import ctypes, os, sys, threading
# This process may have inherited the test runner's policy (a test that
# built a backend on the runner's main thread set it): start from normal,
# before anything starts a thread.
os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
from gezel_trio.tuning.priority import set_compute_priority

# A thread no Python code started (as OpenBLAS's workers are): pthreads via libc.
libc = ctypes.CDLL(None)
started = threading.Event()
def sleeper():
    started.set()
    threading.Event().wait()
trio_like = threading.Thread(target=sleeper, daemon=True)
trio_like.start()
started.wait()
native = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(lambda _: libc.pause())
tid = ctypes.c_ulong()
assert libc.pthread_create(ctypes.byref(tid), None, native, None) == 0

out = {}
def host():
    out["said"] = set_compute_priority(sys.argv[1], 5)
    out["host"] = threading.get_native_id()
h = threading.Thread(target=host)
h.start()
h.join()
policy, nice = {}, {}
for t in os.listdir("/proc/self/task"):
    try:
        p, n = os.sched_getscheduler(int(t)), os.getpriority(os.PRIO_PROCESS, int(t))
    except OSError:
        continue  # the host thread, exiting after its join, went between the two
    policy[int(t)], nice[int(t)] = p, n
main = threading.main_thread().native_id
library = [t for t in policy if t not in (main, trio_like.native_id)]
print(out["said"])
want = os.SCHED_IDLE if sys.argv[1] == "idle" else os.SCHED_BATCH
print(policy[main] == os.SCHED_OTHER, policy[trio_like.native_id] == os.SCHED_OTHER,
      bool(library) and all(policy[t] == want for t in library))
# batch: the library threads 5 nicer than the process; Python's own kept.
base = nice[main]
lower = min(base + 5, 19) if sys.argv[1] == "batch" else base
print(nice[trio_like.native_id] == base, all(nice[t] == lower for t in library))
"""


@pytest.mark.parametrize(("priority", "policy"), [("batch", "SCHED_BATCH"), ("idle", "SCHED_IDLE")])
def test_the_host_and_library_threads_take_the_policy(priority: str, policy: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, priority],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr  # what the child raised, if it did
    said, flags, nice = done.stdout.strip().splitlines()
    assert said.startswith(f"{priority} ({policy} on the host thread and "), said
    assert flags == "True True True", done.stdout
    assert nice == "True True", done.stdout
    assert (", nice " in said) == (priority == "batch"), said


def test_the_compute_nice_is_a_setting() -> None:
    from gezel_trio.core.config import EngineConfig

    assert EngineConfig(model="m").tuning.compute_nice == 5
    for bad in (-1, 20):
        with pytest.raises(ValueError, match="compute_nice"):
            EngineConfig.from_flags(model="m", compute_nice=bad)


def test_normal_changes_nothing() -> None:
    from gezel_trio.tuning.priority import set_compute_priority

    assert set_compute_priority("normal") == "normal"
