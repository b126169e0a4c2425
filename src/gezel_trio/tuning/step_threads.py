"""OpenBLAS's thread count per step (``--decode-threads``): one thread for a
decode step of few sequences where one costs the step little.

A decode step of one sequence is a chain of matrix-vector products. On a
small model OpenBLAS gains little from its second thread there, and a
parallel call is as slow as its slower thread: when another thread takes
a core from one of them, the whole call waits. Beside the compute run the
host thread's Python for the next step, the Trio thread and the client.
Through HTTP on 2 cores, one stream of the dense bench model decoded at
117-137 tokens/s on one thread against 101 on two (raw mlx-lm's
``BatchGenerator``, with no HTTP but its own Python between calls, 127
against 90), though a step called alone took 7.2-9.3 ms on one and 7.0-8.6
on two (2-8% slower). From two sequences on, two threads ran a step 30-50% faster
on their own and 8-11% faster through HTTP (4 and 8 streams); on SmolLM2,
whose head is a 113 MB matrix, two threads ran even one sequence's step
40% faster.

So it is measured for each model when it loads: ``measure`` times decode
steps of 1, 2, 4... sequences on one thread and on all, alternated, the
median of ``REPEATS`` each, and stops at the first batch where one thread
is more than ``TOLERANCE`` slower: the core it leaves free serves the rest
of the process. A model whose step takes longer than ``LONG_STEP_S`` is
not measured past its first two steps: it keeps all threads. Batches up
to the last one chosen run on one thread; every other step, and every
step that prefills a prompt or an image (matrix products, where both
threads pay), runs on all of them. A speculative verify counts its rows:
one sequence verifying 3 proposals is 4 rows.

The count is OpenBLAS's, the process's: ``StepThreads`` sets it on the host
thread before each step (``tuning.blas.set_threads``), only when it changes,
and sets all of them back when the backend closes. It does nothing where
the process may not change it: ``OPENBLAS_NUM_THREADS`` set (that count is
kept for every step), no OpenBLAS preloaded, or one thread in all.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs
import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

__all__ = ["LONG_STEP_S", "REPEATS", "TOLERANCE", "Measured", "StepThreads", "choose", "measure"]

# One thread is chosen for a batch while its step, measured alone, is at
# most this much slower than on all threads (the dense bench model's one
# sequence: 2-9% slower alone, 17-35% faster through HTTP; two sequences:
# 30-40% slower alone).
TOLERANCE: Final = 0.15
# Timed steps per thread count and batch, after a warm-up of each (the
# median counts). The calls alternate in pairs whose order turns (1, all,
# all, 1, 1, ...), so a slow spell of the machine falls on both counts. The
# fastest of 3 chose wrong in 4 of 40 loads of the dense bench model here:
# all threads for one sequence (a 25-40% slower stream for the server's
# life) or one thread for two.
REPEATS: Final = 5
# A model whose decode step takes longer than this on all threads is not
# measured further (a large model's calls are long enough for every thread
# to pay: SmolLM2's 46-52 ms step was 41% slower on one), so loading it
# costs two steps, not dozens.
LONG_STEP_S: Final = 0.1


class StepThreads:
    """Sets OpenBLAS's thread count before each step: one for a decode step
    of at most ``one_up_to`` rows, ``most`` otherwise. Host thread only."""

    def __init__(self, most: int, one_up_to: int, setter: Callable[[int], None]) -> None:
        self.most = most
        self.one_up_to = one_up_to
        self._set = setter
        self._now = most
        self.switches = 0  # how many times the count changed

    @property
    def now(self) -> int:
        return self._now

    def before_step(self, rows: int, prefilling: bool) -> None:
        """Say what the next step runs: ``rows`` positions decoded (one per
        sequence; a speculative verify's proposals too), and whether it also
        prefills a prompt."""
        want = 1 if 0 < rows <= self.one_up_to and not prefilling else self.most
        if want != self._now:
            self._set(want)
            self._now = want
            self.switches += 1

    def close(self) -> None:
        """All threads again, for whatever runs after the backend."""
        if self._now != self.most:
            self._set(self.most)
            self._now = self.most


def choose(timings: Sequence[tuple[int, float, float]]) -> int:
    """The largest batch, in ascending order, up to which one thread was at
    most ``TOLERANCE`` slower than all of them (0: none). ``timings``:
    (batch, seconds on one thread, seconds on all)."""
    one_up_to = 0
    for batch, one, most in sorted(timings):
        if one > most * (1 + TOLERANCE):
            break
        one_up_to = batch
    return one_up_to


@attrs.frozen
class Measured:
    """What ``measure`` found: (batch, seconds on one thread, on all) per
    batch it timed, and the warm-up step that stopped it when one took
    longer than ``LONG_STEP_S`` (``None``: none did)."""

    timings: list[tuple[int, float, float]]
    too_long_s: float | None = None


def measure(
    model: Any,
    most: int,
    setter: Callable[[int], None],
    batches: Sequence[int],
    clock: Callable[[], float] = time.perf_counter,
) -> Measured:
    """Time decode steps of ``model`` (what ``BatchGenerator`` calls) for
    each batch in ``batches`` on one thread and on ``most``, alternated,
    ``REPEATS`` each after a warm-up, and keep the median of each; stops
    after the first batch ``choose`` does not give one thread, and at once
    when a warm-up step on all threads takes longer than ``LONG_STEP_S``.
    Call it on the host thread, in the model's stream; it leaves ``most``
    set."""
    base = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, 16), dtype=mx.int32), cache=base))
    timings: list[tuple[int, float, float]] = []
    try:
        for batch in sorted(batches):
            cache = [c.merge([c] * batch) for c in base]
            tokens = mx.zeros((batch, 1), dtype=mx.uint32)
            took_s: dict[int, list[float]] = {1: [], most: []}
            for i in range(2 * REPEATS + 2):
                n = 1 if i % 4 in (0, 3) else most  # 1, all, all, 1, 1, all...
                setter(n)
                t0 = clock()
                logits = model(tokens, cache=cache)
                state = [c.keys if type(c) is not ArraysCache else c.cache for c in cache]
                mx.eval(logits, state)
                took = clock() - t0
                if i >= 2:  # the first of each is a warm-up
                    took_s[n].append(took)
                elif n == most and took > LONG_STEP_S:
                    return Measured(timings, took)
            timings.append((batch, statistics.median(took_s[1]), statistics.median(took_s[most])))
            if choose(timings) < batch:
                break
    finally:
        setter(most)
    return Measured(timings)
