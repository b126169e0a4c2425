"""``tuning.sched.request_slice``: the calling thread asks for its EEVDF slice
and keeps its policy and nice value; the other threads keep theirs.

Each case runs in a thread of its own, so the test runner's threads keep
their scheduling."""

from __future__ import annotations

import os
import platform
import sys
import threading
from typing import Any

import pytest

from gezel_trio.tuning.sched import EVENT_LOOP_SLICE_NS, request_slice, slice_ns_of

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"),
    reason="Linux's sched_setattr",
)


def _slice_ns(tid: int = 0) -> int:
    got = slice_ns_of(tid)
    assert got is not None
    return got


def _in_a_thread(fn: Any) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def _kernel_slices() -> bool:
    return _slice_ns() > 0  # kernels before 6.12 report none


def test_the_thread_gets_its_slice_and_keeps_its_policy_and_nice() -> None:
    if not _kernel_slices():
        pytest.skip("this kernel has no per-thread slices")
    before = _slice_ns()

    def case() -> tuple[str | None, int, int, int]:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + 2)
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        said = request_slice(EVENT_LOOP_SLICE_NS)
        return (
            said,
            _slice_ns(),
            os.sched_getscheduler(0),
            nice - os.getpriority(os.PRIO_PROCESS, 0),
        )

    said, got, policy, nice_change = _in_a_thread(case)
    assert said is None
    assert got == EVENT_LOOP_SLICE_NS
    assert policy == os.SCHED_BATCH
    assert nice_change == 0
    assert _slice_ns() == before  # this thread's is its own


def test_a_slice_the_kernel_does_not_keep_is_said() -> None:
    if not _kernel_slices():
        pytest.skip("this kernel has no per-thread slices")
    said = _in_a_thread(lambda: request_slice(1_000))  # under the kernel's 0.1 ms
    assert said == "this kernel keeps its own slice (100000 ns)"


def test_a_policy_without_slices_is_left_alone() -> None:
    def case() -> str | None:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return request_slice(EVENT_LOOP_SLICE_NS)

    said = _in_a_thread(case)
    assert said == f"policy {os.SCHED_IDLE} has no slice"
