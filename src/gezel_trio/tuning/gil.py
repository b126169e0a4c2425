"""The GIL's switch interval while a prompt prefills (``--prefill-switch-ms``).

Some models' prefill is a Python loop on the CPU: Qwen 3.5's linear-attention
layers ran mlx-lm's ``gated_delta_ops``, one compiled call per token of the
chunk, with the GIL held between them (``--gated-delta-prefill sequential``
still does; ``tuning.gated_delta`` now builds a chunk's graph in a tenth of
the time). A thread that wants the GIL waits a
whole switch interval (Python's 5 ms) each time it asks, and the Trio thread
asks several times to answer one request (after each wait on its sockets).
Measured on the hybrid bench model during a 5,929-token prefill, ``/health``
every 20 ms (docs/performance.md): p99 11.3-11.7 ms with Python's interval,
4.3-5.4 at 0.5 ms, and the prefill took as long.

Only while something prefills: during decoding the host thread's Python is
the critical path, and a shorter interval hands the GIL to the Trio thread
in the middle of it (decode measured up to a few percent slower, within this
machine's noise). The interval is the process's; the one in force when a
prefill began is put back when prefilling ends and when the host stops.
"""

from __future__ import annotations

import sys

__all__ = ["PrefillSwitch"]


class PrefillSwitch:
    """Sets the switch interval to ``interval_s`` while the host's steps
    prefill; ``None`` leaves it alone. Host thread only."""

    def __init__(self, interval_s: float | None) -> None:
        self._short = interval_s
        self._before: float | None = None  # the interval to put back

    @property
    def active(self) -> bool:
        return self._before is not None

    def prefilling(self, now: bool) -> None:
        """Say whether the next step prefills (a sequence in it has no token yet)."""
        if self._short is None or now == self.active:
            return
        if now:
            self._before = sys.getswitchinterval()
            sys.setswitchinterval(self._short)
        else:
            assert self._before is not None
            sys.setswitchinterval(self._before)
            self._before = None
