"""OpenBLAS's thread count per step (``tuning.step_threads``, ``--decode-threads``).

- ``choose`` gives one thread to the batches, in ascending order, whose
  step on one thread was at most ``TOLERANCE`` slower, and stops at the
  first that was not.
- ``StepThreads`` sets one thread for a decode step of few sequences and
  all of them for a larger one or any step that prefills, only when the
  count changes, and all of them again when closed.
- ``measure`` alternates one thread and all on a real model's decode steps
  in pairs whose order turns, keeps the median of each after a warm-up (a
  call much slower or faster than the rest moves nothing), stops at the first batch not
  given one thread, and leaves all of them set; a model whose warm-up step
  on all threads is longer than ``LONG_STEP_S`` is not measured further.
- The backend asks before each step with what the lane's next step runs
  (its decoding sequences, a prompt waiting), and closes it; a speculative
  verify asks for its rows (one sequence and its proposals: all threads).
- In a process of its own (no ``OPENBLAS_NUM_THREADS``), the backend
  measures at load and says what it chose; ``all`` and a count fixed by the
  environment leave every step on all threads.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.utils import load

from gezel_trio import EngineConfig
from gezel_trio.core.backend import Admission
from gezel_trio.core.request import GenerationRequest, SamplingParams
from gezel_trio.mlx import speculation
from gezel_trio.mlx.backend import MlxBackend
from gezel_trio.mlx.loading import hold_float32
from gezel_trio.mlx.sampling import greedy
from gezel_trio.mlx.speculation.lookup import RecentBySalt
from gezel_trio.tuning import blas
from gezel_trio.tuning.step_threads import (
    LONG_STEP_S,
    REPEATS,
    TOLERANCE,
    StepThreads,
    choose,
    measure,
)
from tests.support.speculation import AlwaysPays


def test_one_thread_for_the_batches_up_to_the_first_it_slows_too_much() -> None:
    assert choose([(1, 1.05, 1.0), (2, 1.4, 1.0)]) == 1
    assert choose([(1, 1.4, 1.0)]) == 0
    assert choose([(4, 1.3, 1.0), (1, 0.9, 1.0), (2, 1.1, 1.0)]) == 2  # any order
    assert choose([(1, 1.0 + TOLERANCE, 1.0)]) == 1
    assert choose([(1, 1.01 + TOLERANCE, 1.0)]) == 0
    # A batch past one that was not given one thread is not either.
    assert choose([(1, 1.5, 1.0), (2, 1.0, 1.0)]) == 0
    assert choose([]) == 0


def test_the_count_changes_only_when_the_next_step_wants_another() -> None:
    calls: list[int] = []
    threads = StepThreads(2, 1, calls.append)
    threads.before_step(1, prefilling=False)
    threads.before_step(1, prefilling=False)
    assert calls == [1]
    threads.before_step(1, prefilling=True)  # a prompt's chunk in the same step
    threads.before_step(2, prefilling=False)
    assert calls == [1, 2]
    threads.before_step(0, prefilling=True)  # a prompt alone
    threads.before_step(0, prefilling=False)  # nothing to decode
    assert calls == [1, 2]
    threads.before_step(1, prefilling=False)
    assert threads.now == 1
    threads.close()
    threads.close()
    assert calls == [1, 2, 1, 2]
    assert threads.switches == 3
    assert threads.now == 2


class _Timed:
    """A model whose steps a fake clock times: each call costs what
    ``cost`` says for its batch and the thread count set; the first of each
    8 more (a warm-up), the second a quarter as much and the fourth four
    times (outliers, either way)."""

    def __init__(self, model: Any, cost: dict[tuple[int, int], float], unit: float = 1.0) -> None:
        self.model, self.cost, self.unit = model, cost, unit
        self.threads = 2
        self.now = 0.0
        self.calls: list[tuple[int, int]] = []

    def set(self, n: int) -> None:
        self.threads = n

    def clock(self) -> float:
        return self.now

    def __call__(self, tokens: mx.array, cache: Any = None) -> Any:
        batch = tokens.shape[0]
        if tokens.shape[1] == 1:
            key = (batch, self.threads)
            nth = self.calls.count(key)
            self.calls.append(key)
            outlier = {1: 0.25, 3: 4.0}.get(nth, 1.0)
            step = self.cost[key] * outlier + (8.0 if nth == 0 else 0.0)
            self.now += step * self.unit
        return self.model(tokens, cache=cache)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def test_measure_alternates_keeps_the_median_and_stops_at_the_first_batch_not_chosen(
    dense_model: Path,
) -> None:
    model, _ = load(str(dense_model))
    hold_float32(model)
    cost = {(1, 1): 1.0, (1, 2): 1.0, (2, 1): 1.125, (2, 2): 1.0, (4, 1): 1.5, (4, 2): 1.0}
    cost |= {(8, 1): 1.0, (8, 2): 1.0}
    unit = 2.0**-7  # every step, warm-ups too, shorter than LONG_STEP_S
    timed = _Timed(model, cost, unit)
    measured = measure(timed, 2, timed.set, [4, 1, 8, 2], clock=timed.clock)
    assert measured.too_long_s is None
    timings = measured.timings
    want = [(1, 1.0, 1.0), (2, 1.125, 1.0), (4, 1.5, 1.0)]  # not 8
    assert timings == [(b, one * unit, most * unit) for b, one, most in want]
    assert choose(timings) == 2
    # Alternated in pairs whose order turns, REPEATS + 1 steps on each count
    # per batch, the first of each a warm-up.
    per_batch = 2 * (REPEATS + 1)
    assert [b for b, _ in timed.calls] == [1] * per_batch + [2] * per_batch + [4] * per_batch
    assert [n for _, n in timed.calls] == ([1, 2, 2, 1] * 9)[: 3 * per_batch]
    assert timed.threads == 2


def test_a_model_whose_step_is_long_is_not_measured_past_its_first_two_steps(
    dense_model: Path,
) -> None:
    model, _ = load(str(dense_model))
    hold_float32(model)
    # The warm-up on all threads: (8 + 1) / 64 of a second, past LONG_STEP_S.
    timed = _Timed(model, {(1, 1): 1.0, (1, 2): 1.0}, 2.0**-6)
    measured = measure(timed, 2, timed.set, [1, 2, 4], clock=timed.clock)
    assert LONG_STEP_S < 9 * 2.0**-6
    assert measured.timings == []
    assert measured.too_long_s == pytest.approx(9 * 2.0**-6)
    assert timed.calls == [(1, 1), (1, 2)]
    assert timed.threads == 2


def test_the_backend_asks_before_each_step_with_what_the_lane_runs(dense_model: Path) -> None:
    backend = MlxBackend(EngineConfig.from_flags(model=dense_model, decode_threads="all"))
    assert backend._lanes.kit.threads is None
    calls: list[int] = []
    backend._lanes.kit.threads = StepThreads(2, 1, calls.append)
    prompt = tuple(range(10, 40))

    def admit(rid: int) -> None:
        request = GenerationRequest(prompt, 8, SamplingParams(temperature=0.0), ignore_eos=True)
        assert backend.insert([Admission(rid, request, (prompt,))]) == {}

    try:
        admit(1)
        backend.step("interactive")  # its prompt: all threads (no change)
        assert calls == []
        steps = 1
        while not calls and steps < 5:  # the prompt's last token, then decoding
            backend.step("interactive")
            steps += 1
        assert calls == [1]
        assert steps >= 2
        admit(2)
        backend.step("interactive")  # the second one's prompt beside it
        assert calls == [1, 2]
        for _ in range(3):
            backend.step("interactive")  # two decoding
        assert calls == [1, 2]
    finally:
        backend.close()
    assert calls == [1, 2]  # all threads already


def test_a_verify_asks_for_its_rows_and_the_plain_steps_for_one(dense_model: Path) -> None:
    model, tok = load(str(dense_model))
    hold_float32(model)
    prompt = tok.encode("a fox")
    calls: list[int] = []
    threads = StepThreads(2, 1, calls.append)
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4, stop_tokens=None)
    stats = speculation.SpecStats()
    # The second turn proposes the first one's answer (RecentBySalt).
    speculation.install(gen, 3, speculation.Roster(), stats, RecentBySalt(), threads=threads)
    type(gen._generation_batch).gate = AlwaysPays()
    try:
        for _ in range(2):
            gen.insert([prompt], max_tokens=[24], samplers=[greedy])
            done = False
            while not done:
                threads.before_step(len(gen._generation_batch), prefilling=False)
                _, responses = gen.next()
                done = any(r.finish_reason is not None for r in responses)
    finally:
        gen.close()
    assert stats.num_accepted_tokens > 0  # verified, and accepted
    assert 1 in calls  # a plain step of one sequence
    assert calls.count(2) >= 2  # each verify's rows (at most 4) past 1: all threads


def test_a_count_fixed_by_the_environment_is_kept(
    dense_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert os.environ.get("OPENBLAS_NUM_THREADS") == "1"  # tests/conftest.py
    assert blas.thread_count() is None
    with pytest.raises(RuntimeError, match="not this process's"):
        blas.set_threads(1)
    with caplog.at_level(logging.INFO, logger="gezel_trio.mlx"):
        backend = MlxBackend(EngineConfig(model=dense_model))
    backend.close()
    assert backend._lanes.kit.threads is None
    assert "decode threads: all, for every step (OpenBLAS's thread count" in caplog.text


_CHILD = """
import ctypes, logging, sys
import gezel_trio
from gezel_trio import EngineConfig
from mlx_lm.generate import BatchGenerator

from gezel_trio.mlx import speculation
from gezel_trio.mlx.speculation.lookup import RecentBySalt
from gezel_trio.tuning import blas
from gezel_trio.mlx.sampling import greedy
from gezel_trio.mlx.backend import MlxBackend
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
get = ctypes.CDLL(None).openblas_get_num_threads
print("most", blas.thread_count())
blas.set_threads(1)
print("set 1", get())
blas.set_threads(99)
print("set 99", get())
for mode in sys.argv[2:]:
    print("mode", mode, flush=True)
    backend = MlxBackend(EngineConfig.from_flags(model=sys.argv[1], decode_threads=mode))
    print("after load", get())
    plan = backend._lanes.kit.threads
    print("plan", None if plan is None else plan.one_up_to)
    backend.close()
    print("after close", get())
"""
MODES = ("auto", "all")


@pytest.fixture(scope="module")
def said_per_mode(dense_model: Path) -> dict[str, str]:
    """What one child process said, loading a backend in each mode in turn
    (a process and its imports cost seconds on 2 busy cores): the lines
    before the first load, then each mode's own."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(dense_model), *MODES],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    said = out.stdout + out.stderr
    assert out.returncode == 0, said
    # The lines before the first load, "mode auto" and its lines, "mode all"
    # and its lines (stderr last, with the last mode).
    head, *parts = re.split(r"^mode (\w+)\n", said, flags=re.M)
    modes, texts = parts[0::2], parts[1::2]
    assert modes == list(MODES), said
    return {mode: head + text for mode, text in zip(modes, texts, strict=True)}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: one thread")
@pytest.mark.parametrize("mode", MODES)
def test_in_a_process_of_its_own_it_measures_at_load(
    said_per_mode: dict[str, str], mode: str
) -> None:
    said = said_per_mode[mode]
    most = len(os.sched_getaffinity(0))
    assert f"most {most}" in said
    assert "set 1 1" in said
    assert f"set 99 {most}" in said  # never past the pool
    assert f"after load {most}" in said
    assert f"after close {most}" in said
    if mode == "all":
        assert "decode threads: all, for every step (--decode-threads all)" in said
        assert "plan None" in said
    else:
        # What it chose depends on this machine; that it measured and said so does not.
        line = next(x for x in said.splitlines() if x.startswith("decode threads: 1 for"))
        assert "1: " in line
        assert " ms on 1, " in line
        plan = next(x for x in said.splitlines() if x.startswith("plan "))
        chosen = int(line.split("up to ")[1].split()[0])
        assert plan == ("plan None" if chosen == 0 else f"plan {chosen}")


def test_openblas_says_the_count_it_runs_with() -> None:
    # The test process's count is the environment's (tests/conftest.py).
    assert ctypes.CDLL(None).openblas_get_num_threads() == 1
