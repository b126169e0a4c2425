"""The gated delta rule in chunks (``tuning.gated_delta``) against mlx-lm's token loop.

- ``chunked`` gives ``gated_delta_ops``'s outputs and final state within
  float rounding: prompts shorter than a chunk, of whole chunks and not;
  more value heads than key heads; half-precision inputs; no state; gates
  that decay to nothing (0 and underflow); weights up to 2 (the negative
  eigenvalues some families allow); a batch with left padding, whose
  padded positions leave the state alone.
- Routed, mlx-lm's ``gated_delta_update`` runs it for a prompt on the
  CPU and runs its own loop for a few tokens, a gate per key dimension, or
  ``sequential``; its own function is back after the block, even one that
  raised.
- Through the hybrid demo model: the same greedy tokens and logits within
  rounding as mlx-lm's loop, and the served backend runs its config's mode
  during its steps and leaves mlx-lm's own function in place after each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import gated_delta as mlx_gated_delta
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from gezel_trio import EngineConfig
from gezel_trio.core.backend import Admission
from gezel_trio.core.request import GenerationRequest, SamplingParams
from gezel_trio.mlx.backend import MlxBackend
from gezel_trio.mlx.loading import hold_float32
from gezel_trio.mlx.mlx_lm_surface import gated_delta_kernel_as
from gezel_trio.tuning import gated_delta

SEQUENTIAL = mlx_gated_delta.gated_delta_ops


@pytest.fixture(autouse=True)
def _mlx_lms_own_after() -> Any:
    """After every test, mlx-lm's layers call its own function again."""
    yield
    assert mlx_gated_delta.gated_delta_ops is SEQUENTIAL


def _inputs(
    T: int,
    *,
    B: int = 1,
    Hk: int = 2,
    Hv: int = 4,
    Dk: int = 32,
    Dv: int = 16,
    seed: int = 0,
    gates: tuple[float, float] = (0.5, 1.0),
    beta_max: float = 1.0,
    dtype: Any = mx.float32,
) -> dict[str, mx.array]:
    mx.random.seed(seed)
    q, k = mlx_gated_delta.normalize_qk(
        mx.random.normal((B, T, Hk, Dk)),
        mx.random.normal((B, T, Hk, Dk)),
        inv_scale=Dk**-0.5,
        eps=1e-6,
    )
    return {
        "q": q.astype(dtype),
        "k": k.astype(dtype),
        "v": mx.random.normal((B, T, Hv, Dv)).astype(dtype),
        "g": mx.random.uniform(*gates, (B, T, Hv)),
        "beta": mx.random.uniform(0.0, beta_max, (B, T, Hv)),
        "state": 0.1 * mx.random.normal((B, Hv, Dv, Dk)),
    }


def _close(got: tuple[mx.array, mx.array], want: tuple[mx.array, mx.array], tol: float) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert a.dtype == b.dtype
        assert not mx.isnan(a).any().item()
        diff = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
        assert diff <= tol, diff


@pytest.mark.parametrize("T", [1, 5, 32, 37, 200])
def test_chunked_is_the_token_loop_within_rounding(T: int) -> None:
    x = _inputs(T)
    _close(gated_delta.chunked(**x), SEQUENTIAL(**x), 2e-6)


def test_one_key_head_per_value_head_and_wider_heads() -> None:
    x = _inputs(70, Hk=8, Hv=8, Dk=64, Dv=64, seed=1)
    _close(gated_delta.chunked(**x), SEQUENTIAL(**x), 2e-6)


def test_half_precision_inputs_give_their_dtype_and_a_float32_state() -> None:
    x = _inputs(50, dtype=mx.bfloat16, seed=2)
    y, state = gated_delta.chunked(**x)
    assert y.dtype == mx.bfloat16
    assert state.dtype == mx.float32
    _close((y, state), SEQUENTIAL(**x), 2e-2)  # bfloat16's own rounding of y


def test_without_a_state_it_starts_from_zeros() -> None:
    x = _inputs(40, seed=3)
    del x["state"]
    _close(gated_delta.chunked(**x), SEQUENTIAL(**x), 2e-6)


def test_gates_that_decay_to_nothing_stay_finite() -> None:
    x = _inputs(64, gates=(0.0, 1e-20), seed=4)
    x["g"] = mx.where(mx.arange(64)[None, :, None] % 3 == 0, 0.0, x["g"])  # exactly 0 too
    _close(gated_delta.chunked(**x), SEQUENTIAL(**x), 2e-6)


def test_weights_up_to_two_as_negative_eigenvalues_allow() -> None:
    x = _inputs(96, beta_max=2.0, seed=5)
    _close(gated_delta.chunked(**x), SEQUENTIAL(**x), 1e-5)


def test_left_padding_leaves_the_state_and_the_real_tokens_outputs_alone() -> None:
    x = _inputs(45, B=3, seed=6)
    mask = mx.arange(45)[None, :] >= mx.array([0, 13, 40])[:, None]
    y, state = gated_delta.chunked(**x, mask=mask)
    want_y, want_state = SEQUENTIAL(**x, mask=mask)
    _close((state,), (want_state,), 2e-6)
    real = mask[..., None, None]
    assert mx.abs(mx.where(real, y - want_y, 0.0)).max().item() <= 2e-6
    # A row that is all padding but its last 5 tokens ends where those 5 alone take it.
    alone = {name: a[2:, 40:] if name != "state" else a[2:] for name, a in x.items()}
    _close((state[2:],), (SEQUENTIAL(**alone)[1],), 2e-6)


def test_a_gate_per_key_dimension_is_refused() -> None:
    x = _inputs(20)
    x["g"] = mx.broadcast_to(x["g"][..., None], (*x["g"].shape, 32))
    with pytest.raises(ValueError, match="gate per head"):
        gated_delta.chunked(**x)


def _update(x: dict[str, mx.array], **kw: Any) -> tuple[mx.array, mx.array]:
    """mlx-lm's entry point, as a model's layer calls it (a, b are the
    pre-activations of the gate and the weight)."""
    B, T, Hv = x["g"].shape
    mx.random.seed(9)
    a, b = mx.random.normal((B, T, Hv)), mx.random.normal((B, T, Hv))
    a_log, dt_bias = mx.random.normal((Hv,)), mx.random.normal((Hv,))
    y, state = mlx_gated_delta.gated_delta_update(
        x["q"], x["k"], x["v"], a, b, a_log, dt_bias, x["state"], use_kernel=False, **kw
    )
    mx.eval(y, state)
    return y, state


def test_routed_mlx_lm_runs_it_for_a_prompt_and_its_own_loop_for_a_few_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    real = gated_delta.chunked

    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(args[0].shape[1])
        return real(*args, **kw)

    monkeypatch.setattr(gated_delta, "chunked", counted)
    prompt = _inputs(gated_delta.MIN_TOKENS + 20)
    few = _inputs(gated_delta.MIN_TOKENS - 1)
    routed = gated_delta.routed("chunked", SEQUENTIAL)
    assert routed is not None
    with gated_delta_kernel_as(routed):
        chunked = _update(prompt)
        assert calls == [gated_delta.MIN_TOKENS + 20]
        _update(few)
        assert calls == [gated_delta.MIN_TOKENS + 20]
    assert gated_delta.routed("sequential", SEQUENTIAL) is None
    loop = _update(prompt)  # mlx-lm's own again
    assert calls == [gated_delta.MIN_TOKENS + 20]
    _close(chunked, loop, 2e-6)
    assert not mx.array_equal(chunked[1], loop[1]).item()  # a different sum, really run
    with pytest.raises(ValueError, match="unknown"):
        gated_delta.routed("fast", SEQUENTIAL)


def test_mlx_lms_own_function_is_back_after_a_block_that_raised() -> None:
    routed = gated_delta.routed("chunked", SEQUENTIAL)
    assert routed is not None
    seen: list[Any] = []

    def step() -> None:
        with gated_delta_kernel_as(routed):
            seen.append(mlx_gated_delta.gated_delta_ops)
            raise RuntimeError("in the step")

    with pytest.raises(RuntimeError, match="in the step"):
        step()
    assert seen == [routed]
    assert mlx_gated_delta.gated_delta_ops is SEQUENTIAL


def _greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], mx.array]:
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    first = logits
    tokens = []
    for _ in range(n):
        token = int(mx.argmax(logits, axis=-1).item())
        tokens.append(token)
        logits = model(mx.array([[token]]), cache=cache)[:, -1]
    return tokens, first


def test_the_hybrid_demo_model_answers_as_with_mlx_lms_loop(hybrid_model: Path) -> None:
    model, _ = load(str(hybrid_model))
    hold_float32(model)
    prompt = [(7 * i + 5) % 2000 + 4 for i in range(150)]
    want, want_logits = _greedy(model, prompt, 24)
    routed = gated_delta.routed("chunked", SEQUENTIAL)
    assert routed is not None
    with gated_delta_kernel_as(routed):
        got, got_logits = _greedy(model, prompt, 24)
    assert got == want
    assert mx.abs(got_logits - want_logits).max().item() <= 1e-4
    assert not mx.array_equal(got_logits, want_logits).item()


@pytest.mark.parametrize("mode", ["sequential", "chunked"])
def test_the_served_backend_runs_its_configs_mode_only_during_its_steps(
    hybrid_model: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = gated_delta.chunked

    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(args[0].shape[1])
        return real(*args, **kw)

    monkeypatch.setattr(gated_delta, "chunked", counted)
    backend = MlxBackend(EngineConfig.from_flags(model=hybrid_model, gated_delta_prefill=mode))
    prompt = tuple((7 * i + 5) % 2000 + 4 for i in range(40))
    request = GenerationRequest(prompt, 4, SamplingParams(temperature=0.0), ignore_eos=True)
    try:
        assert backend.insert([Admission(1, request, (prompt,))]) == {}
        for _ in range(50):
            out = backend.step("interactive")
            assert not out.failed, out.failed
            # Between steps, mlx-lm's layers call mlx-lm's own function.
            assert mlx_gated_delta.gated_delta_ops is SEQUENTIAL
            if any(t.finish is not None for t in out.tokens):
                break
        else:
            raise AssertionError("the request did not finish")
    finally:
        backend.close()
    # The prompt's call through each linear-attention layer ran in chunks.
    assert (calls != []) == (mode == "chunked")
    assert all(n >= gated_delta.MIN_TOKENS for n in calls)
