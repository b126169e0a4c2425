"""``--platform-tuning`` in the backend: ``off`` runs the plain path (no
chunked gated delta rule, no ``nn.Linear`` as ``W @ xᵀ``, no OpenBLAS
threads per step, the calling thread's CPU policy left as it was) and
answers as ``auto`` does; after every step, with either, mlx-lm's
``gated_delta_ops`` and ``nn.Linear.__call__`` are their own again. The
hybrid demo model has both a linear-attention prefill and a compiled step
of two sequences, so each piece has something to do under ``auto``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mlx.nn as nn
import pytest
from mlx_lm.models import gated_delta as mlx_gated_delta

from gezel_trio import EngineConfig
from gezel_trio.core.backend import Admission
from gezel_trio.core.request import GenerationRequest, SamplingParams
from gezel_trio.mlx.backend import MlxBackend
from gezel_trio.tuning import gated_delta, rows_last
from gezel_trio.tuning.rows_last import linears_rows_last

SEQUENTIAL = mlx_gated_delta.gated_delta_ops


def _counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(module, name)

    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(module, name, counted)
    return calls


def _answers(backend: MlxBackend) -> dict[int, list[int]]:
    """Two greedy requests of 40-token prompts, stepped to their end."""
    tokens: dict[int, list[int]] = {1: [], 2: []}
    admissions = []
    for rid in tokens:
        prompt = tuple((7 * i + 5 * rid) % 2000 + 4 for i in range(40))
        request = GenerationRequest(prompt, 6, SamplingParams(temperature=0.0), ignore_eos=True)
        admissions.append(Admission(rid, request, (prompt,)))
    assert backend.insert(admissions) == {}
    finished = 0
    linear = nn.Linear.__call__
    for _ in range(100):
        out = backend.step("interactive")
        assert not out.failed, out.failed
        # Between steps every patch is put back.
        assert mlx_gated_delta.gated_delta_ops is SEQUENTIAL
        assert nn.Linear.__call__ is linear
        for t in out.tokens:
            tokens[t.rid].append(t.token)
            finished += t.finish is not None
        if finished == 2:
            return tokens
    raise AssertionError("the requests did not finish")


@pytest.mark.parametrize("tuning", ["auto", "off"])
def test_the_switch_off_runs_the_plain_path_and_answers_alike(
    hybrid_model: Path, tuning: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunked = _counting(monkeypatch, gated_delta, "chunked")
    weights_first = _counting(monkeypatch, rows_last, "computed_rows_last")
    policy = os.sched_getscheduler(0)
    if tuning == "off":
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    config = EngineConfig.from_flags(model=hybrid_model, max_concurrency=2, platform_tuning=tuning)
    backend = MlxBackend(config)
    try:
        if tuning == "off":
            assert os.sched_getscheduler(0) == os.SCHED_OTHER  # no priority change
        assert backend._lanes.kit.threads is None or tuning == "auto"
        answers = _answers(backend)
    finally:
        backend.close()
        os.sched_setscheduler(0, policy, os.sched_param(0))
    assert all(len(a) == 6 for a in answers.values())
    if tuning == "off":
        assert (chunked, weights_first) == ([], [])
    else:
        assert chunked
        assert weights_first


def test_nn_linears_own_call_is_back_after_a_block_that_raised() -> None:
    linear = nn.Linear.__call__
    seen: list[Any] = []

    def trace() -> None:
        with linears_rows_last(4):
            seen.append(nn.Linear.__call__)
            raise RuntimeError("in the trace")

    with pytest.raises(RuntimeError, match="in the trace"):
        trace()
    assert seen == [rows_last.computed_rows_last]
    assert nn.Linear.__call__ is linear
