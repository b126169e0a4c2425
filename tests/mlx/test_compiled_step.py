"""The compiled decode step (``mlx.compiled_step``) against the model's own.

- For llama, qwen2 and qwen3 (small models built with random weights), a
  batch of left-padded sequences decodes to the same greedy tokens through
  the compiled step as through the model, its logits within float rounding
  (the attention sums over the padded buffer in another order), across the
  buffer's growth from 256 to 512 slots; one trace per window, shared by
  the layers.
- Through mlx-lm's ``BatchGenerator``, with sequences joining and leaving
  mid-decode, greedy tokens are the model's, and most steps ran compiled.
- Calls it cannot take (a prefill, a quantized cache, a model that asks for
  a sliding window) go to the model, and leave the same results.
- A hybrid model's linear-attention state (Qwen 3.5's ``ArraysCache``)
  goes through the compiled step with the attention layers' KV.
- A step of two sequences or more traces each ``nn.Linear`` as ``W @ xᵀ``,
  the same values to the bit; one sequence's as ``nn.Linear``. A verify's
  few tokens a sequence compute the layers' linears so, not the head.
- The model keeps its layers and weights through compiled steps, and
  through a layer that fails while traced; a model whose loop runs a layer
  twice in a step is the model's.
- Kernels MLX cannot load (a corrupt library in its directory) turn the
  step off at load, in a process of its own with its own ``TMPDIR``.
- The served model's backend (dense and hybrid demo models) compiles its
  step, and the answer is the one with ``--compiled-step off``.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import base, llama, qwen2, qwen3
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.utils import load

from gezel_trio import EngineConfig
from gezel_trio.core.backend import Admission
from gezel_trio.core.request import GenerationRequest, SamplingParams
from gezel_trio.mlx import compiled_step
from gezel_trio.mlx.backend import MlxBackend
from gezel_trio.mlx.compiled_step import CompiledDecode, compiled_blocker, window
from gezel_trio.mlx.kv_quant import BatchQuantizedKVCache
from gezel_trio.mlx.loading import hold_float32
from gezel_trio.mlx.mlx_lm_surface import with_holes
from gezel_trio.tuning import rows_last

VOCAB = 97


def _model(family: ModuleType, seed: int = 0, hidden: int = 64, **more: Any) -> Any:
    mx.random.seed(seed)
    extra: dict[str, Any] = {"rope_theta": 10000.0, **more}
    if family is qwen3:
        extra |= {"head_dim": 32, "max_position_embeddings": 4096, "tie_word_embeddings": True}
    args = family.ModelArgs(
        model_type=family.__name__.rsplit(".", 1)[-1],
        hidden_size=hidden,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        **extra,
    )
    model = family.Model(args)
    mx.eval(model.parameters())
    return model


def _prompt(n: int, salt: int) -> list[int]:
    return [(7 * i + 3 * salt) % VOCAB for i in range(n)]


def _prefilled(
    model: Any, decode: CompiledDecode, lens: list[int]
) -> tuple[list[Any], list[Any], mx.array, mx.array]:
    """Left-padded prompts of ``lens`` tokens prefilled through the model and
    through ``decode``: each one's caches and last logits."""
    pads = [max(lens) - n for n in lens]
    rows = enumerate(zip(pads, lens, strict=True))
    prompt = mx.array([[0] * p + _prompt(n, j) for j, (p, n) in rows])
    plain = [BatchKVCache(pads) for _ in model.layers]
    compiled = [BatchKVCache(pads) for _ in model.layers]
    want = model(prompt, cache=plain)[:, -1]
    got = decode(prompt, cache=compiled)[:, -1]
    return plain, compiled, want, got


@pytest.mark.parametrize("family", [llama, qwen2, qwen3], ids=lambda m: m.__name__.rsplit(".")[-1])
def test_a_padded_batch_decodes_to_the_same_logits_across_the_buffers_growth(
    family: ModuleType,
) -> None:
    model = _model(family, hidden=128)  # heads of 32
    assert compiled_blocker(model) is None
    decode = CompiledDecode(model)
    plain, compiled, want, got = _prefilled(model, decode, [250, 240, 3])
    assert decode.steps == 0  # a prefill is the model's
    assert mx.array_equal(want, got).item()
    for _ in range(30):
        token = mx.argmax(want, -1)
        assert mx.array_equal(token, mx.argmax(got, -1)).item()
        want = model(token[:, None], cache=plain)[:, -1]
        got = decode(token[:, None], cache=compiled)[:, -1]
        assert mx.allclose(want, got, rtol=0, atol=1e-4).item()
    # 250 + 30 tokens: the buffer grew once (that step was the model's).
    assert compiled[0]._idx == plain[0]._idx == 280
    assert compiled[0].keys.shape == plain[0].keys.shape == (3, 2, 512, 32)
    assert decode.steps == 29
    # Windows of 64 slots: 256 up to the growth, then 320 (of 512).
    assert decode.shapes == {(3, 256), (3, 320)}
    # Both layers ran one function, traced once for each window.
    assert decode.layer_traces == 2
    assert mx.array_equal(compiled[1].offset, plain[1].offset).item()


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_a_linear_of_a_few_rows_computed_weights_first_is_the_same_to_the_bit(bias: bool) -> None:
    # The demo models' and SmolLM2's shapes, and a small one.
    for inputs, outputs in ((64, 128), (512, 1024), (1024, 512), (576, 192), (1536, 576)):
        layer = nn.Linear(inputs, outputs, bias=bias)
        if bias:
            layer.bias = mx.random.normal((outputs,))
        for rows in (1, 2, 3, 4, 8, 16):
            # A decode step's rows, and a verify's tokens of one sequence.
            for shape in ((rows, 1, inputs), (1, rows, inputs)):
                x = mx.random.normal(shape)
                got = rows_last.computed_rows_last(layer, x)
                assert mx.array_equal(got, layer(x)).item(), (inputs, outputs, shape)


def test_steps_of_two_sequences_or_more_trace_their_linears_weights_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows: list[int] = []
    real = rows_last.computed_rows_last

    def counted(self: nn.Linear, x: mx.array) -> mx.array:
        rows.append(x.shape[0])
        return real(self, x)

    monkeypatch.setattr(rows_last, "computed_rows_last", counted)
    linear = nn.Linear.__call__
    model = _model(qwen2, seed=4)  # its attention's projections have a bias
    decode = CompiledDecode(model)
    plain, compiled, want, got = _prefilled(model, decode, [12, 7, 9])
    for _ in range(3):
        token = mx.argmax(want, -1)
        want = model(token[:, None], cache=plain)[:, -1]
        got = decode(token[:, None], cache=compiled)[:, -1]
        assert mx.array_equal(token, mx.argmax(got, -1)).item()
        assert mx.allclose(want, got, rtol=0, atol=1e-4).item()
    assert decode.steps == 3
    # One trace of 3 rows: the layers' 7 linears each, the second layer's
    # the same function's.
    assert rows == [3] * 7
    assert nn.Linear.__call__ is linear  # only while a trace runs
    # One sequence: its prompt of 10 tokens is a call of few rows (the
    # layers' 14 linears W @ xT, a test below), its one-row steps as nn.Linear.
    _beside(CompiledDecode(model), model, _prompt(10, 5))
    assert rows == [3] * 7 + [1] * 14


def test_a_verify_of_a_few_tokens_computes_its_layers_linears_weights_first_not_its_head(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[int, tuple[int, ...]]] = []
    real = rows_last.computed_rows_last

    def counted(self: nn.Linear, x: mx.array) -> mx.array:
        seen.append((id(self), x.shape[:-1]))
        return real(self, x)

    monkeypatch.setattr(rows_last, "computed_rows_last", counted)
    linear = nn.Linear.__call__
    model = _model(llama, seed=6, tie_word_embeddings=False)  # a head of its own
    assert isinstance(model.lm_head, nn.Linear)
    decode = CompiledDecode(model)
    # A prefill of 2 x 12 rows is past VERIFY_ROWS: the model's own.
    plain, compiled, want, got = _prefilled(model, decode, [12, 9])
    assert (seen, decode.few_row_calls) == ([], 0)
    assert mx.array_equal(want, got).item()
    # A verify's 4 tokens a sequence (8 rows): the same logits to the bit.
    tokens = mx.array([_prompt(4, 1), _prompt(4, 2)])
    want = model(tokens, cache=plain)
    got = decode(tokens, cache=compiled)
    assert mx.array_equal(want, got).item()
    assert decode.few_row_calls == 1
    # The 2 layers' 7 linears each went W @ xT, the head did not.
    assert len(seen) == 14
    assert all(shape == (2, 4) for _, shape in seen)
    assert id(model.lm_head) not in {i for i, _ in seen}
    assert nn.Linear.__call__ is linear  # only while the graph is built
    assert mx.array_equal(compiled[0].keys, plain[0].keys).item()


def _generate(model: Any, joins: dict[int, list[list[int]]], steps: int) -> dict[int, list[int]]:
    """Greedy tokens per uid; ``joins[i]``: prompts inserted before step i."""
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    out: dict[int, list[int]] = {}
    for i in range(steps):
        for prompt in joins.get(i, []):
            (uid,) = gen.insert([prompt], max_tokens=[12 + 5 * len(out)])
            out[uid] = []
        _, responses = gen.next()
        for r in responses:
            out[r.uid].append(int(r.token))
    gen.close()
    return out


def test_through_batch_generator_sequences_join_and_leave_with_the_models_tokens() -> None:
    model = _model(llama, seed=1, hidden=128)
    joins = {0: [_prompt(40, 1), _prompt(9, 2)], 3: [_prompt(70, 3)], 9: [_prompt(20, 4)]}
    want = _generate(model, joins, 60)
    decode = CompiledDecode(model)
    got = _generate(decode, joins, 60)
    assert got == want
    assert [len(t) for t in got.values()] == [12, 17, 22, 27]
    # Most of the 78 tokens came from compiled steps: not the first of each
    # wave of admissions (the model's prefill), nor a step right after a join.
    assert decode.steps >= 30, decode.steps
    assert {b for b, _ in decode.shapes} <= {1, 2, 3, 4}


def test_speculations_holes_are_masked_and_cleared_as_the_models_step_does() -> None:
    model = _model(llama, seed=5, hidden=128)
    decode = CompiledDecode(model)
    plain, compiled, want, _ = _prefilled(model, decode, [30, 12, 21])
    # A verify of 3 tokens each (the model's step on both), of which 2, 0
    # and 1 were rejected: holes in two sequences.
    proposal = mx.array([[5, 6, 7], [8, 9, 10], [11, 12, 13]])
    model(proposal, cache=plain)
    decode(proposal, cache=compiled)
    for caches in (plain, compiled):
        for j, c in enumerate(caches):
            holey = caches[j] = with_holes(c)
            holey.reject([2, 0, 1])
            # One slot back: the next token is written over a hole (of the
            # first and third sequences), which it must clear.
            holey.trim(1)
    assert plain[0].holes is not None
    assert plain[0].holes[:, plain[0]._idx].tolist() == [True, False, True]
    token = mx.array([20, 21, 22])
    for _ in range(6):
        want = model(token[:, None], cache=plain)[:, -1]
        got = decode(token[:, None], cache=compiled)[:, -1]
        assert mx.allclose(want, got, rtol=0, atol=1e-4).item()
        token = mx.argmax(want, -1)
        assert mx.array_equal(token, mx.argmax(got, -1)).item()
    assert decode.steps == 6
    for a, b in zip(plain, compiled, strict=True):
        assert mx.array_equal(a.holes, b.holes).item()
        assert mx.array_equal(a.offset, b.offset).item()
        assert a._idx == b._idx


def test_past_its_bound_the_traces_are_dropped_and_made_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(compiled_step, "MAX_TRACES", 2)
    model = _model(llama, seed=4, hidden=128)
    joins = {0: [_prompt(100, 1)], 2: [_prompt(30, 2)], 4: [_prompt(60, 3)]}
    want = _generate(model, joins, 40)
    decode = CompiledDecode(model)
    assert _generate(decode, joins, 40) == want
    assert decode.retraced >= 1
    assert len(decode.traces) <= 2


def test_a_hybrid_models_linear_attention_state_goes_through_the_compiled_step(
    hybrid_model: Path,
) -> None:
    model, _ = load(str(hybrid_model))
    hold_float32(model)
    assert compiled_blocker(model) is None
    joins = {0: [_prompt(40, 1), _prompt(9, 2)], 3: [_prompt(70, 3)], 9: [_prompt(20, 4)]}
    want = _generate(model, joins, 60)
    decode = CompiledDecode(model)
    assert _generate(decode, joins, 60) == want
    assert decode.steps >= 30, decode.steps
    # Two kinds of layer (the attention's, and the linear attention's with
    # its padding or without): traces per batch size, not per layer.
    assert decode.layer_traces <= 3 * len({b for b, _ in decode.shapes}) + len(decode.shapes)
    # Linear attention (two state arrays, with or without left padding as
    # joins left it) in three layers of four.
    assert decode.layouts
    for layout in decode.layouts:
        assert layout[3] == "kv"
        assert {entry for i, entry in enumerate(layout) if i != 3} <= {(2, True), (2, False)}


class _Wrapped:
    """llama's model behind a wrapper, as a family that uses its caches
    otherwise would be."""

    def __init__(self, model: Any) -> None:
        self.model, self.layers = model, model.layers


class _FailingBlock(nn.Module):
    """A llama block that fails while its step is traced, as a layer
    asking something of its cache that the traced step does not hold."""

    def __init__(self, block: Any) -> None:
        super().__init__()
        self.block = block
        self.use_sliding = False  # what llama's loop reads of a layer

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if not hasattr(cache, "_idx"):
            raise ValueError("no _idx in this layer's cache")
        out: mx.array = self.block(x, mask, cache=cache)
        return out


def test_the_model_keeps_its_layers_and_weights_through_steps_and_failures() -> None:
    model = _model(llama, seed=7)  # heads of 16: the same logits to the bit
    layers = list(model.layers)
    weights = tree_flatten(model.parameters())
    decode = CompiledDecode(model)
    _beside(decode, model, _prompt(10, 8))
    assert decode.steps == 4
    # The second layer fails while traced: the first's step has run.
    model.model.layers[1] = _FailingBlock(layers[1])
    changed = list(model.layers)
    decode = CompiledDecode(model)
    _beside(decode, model, _prompt(12, 9))
    assert decode.off == "ValueError: no _idx in this layer's cache"
    assert decode.steps == 0
    assert all(a is b for a, b in zip(model.layers, changed, strict=True))
    model.model.layers[1] = layers[1]
    assert all(a is b for a, b in zip(model.layers, layers, strict=True))
    after = tree_flatten(model.parameters())
    assert [k for k, _ in after] == [k for k, _ in weights]
    assert all(a is b for (_, a), (_, b) in zip(after, weights, strict=True))


def _beside(
    decode: CompiledDecode,
    model: Any,
    prompt: list[int],
    cache: Callable[[], Any] = lambda: BatchKVCache([0]),
) -> None:
    """Greedy steps through ``decode`` and through ``model``, each on fresh
    caches made by ``cache``, each the same logits as the other's."""
    caches = [cache() for _ in model.layers]
    mirror = [cache() for _ in model.layers]
    got = decode(mx.array([prompt]), cache=caches)
    want = model(mx.array([prompt]), cache=mirror)
    for _ in range(4):
        got = decode(mx.argmax(got[:, -1], -1)[:, None], cache=caches)
        want = model(mx.argmax(want[:, -1], -1)[:, None], cache=mirror)
        assert mx.array_equal(got, want).item()


def test_a_quantized_cache_is_the_models_step() -> None:
    model = _model(llama, seed=2, hidden=128)  # heads of 32, one quantization group
    decode = CompiledDecode(model)
    _beside(
        decode, model, _prompt(20, 5), lambda: BatchQuantizedKVCache([0], group_size=32, bits=8)
    )
    assert decode.steps == 0


class _WindowedLlama(_Wrapped):
    """llama's model, asking its first cache for a sliding window's mask
    as a windowed family does: what the traced step does not hold."""

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        base.create_attention_mask(mx.zeros((1, inputs.shape[1])), cache[0], window_size=64)
        out: mx.array = self.model(inputs, cache=cache)
        return out


def test_a_model_that_asks_for_a_window_turns_it_off_and_is_answered_by_the_model() -> None:
    inner = _model(llama, seed=3)
    decode = CompiledDecode(_WindowedLlama(inner))
    assert compiled_blocker(_WindowedLlama(inner)) is not None  # not a family it knows
    decode.warm()
    assert decode.off is not None
    assert "window" in decode.off
    _beside(decode, inner, _prompt(10, 6))
    assert decode.steps == 0


def test_the_window_grows_by_64_slots_then_by_a_quarter_of_its_width() -> None:
    assert [window(n) for n in (1, 64, 65, 500, 512, 513, 1000, 1025, 3000)] == [
        64,
        64,
        128,
        512,
        512,
        640,
        1024,
        1280,
        3072,
    ]
    for n in range(1, 5000):
        assert n <= window(n) <= max(n + 63, n * 5 // 4)


def test_without_a_compiler_for_the_fused_kernels_it_is_not_compiled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _model(llama)
    assert compiled_blocker(model) is None
    monkeypatch.setattr("shutil.which", lambda _name: None)
    assert compiled_blocker(model) == "no g++ on PATH for MLX's fused CPU kernels"


_WARM = """
import sys
import gezel_trio
import mlx.core as mx
from mlx_lm.models import llama
from gezel_trio.mlx.compiled_step import CompiledDecode

args = llama.ModelArgs(
    model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97,
)
model = llama.Model(args)
mx.eval(model.parameters())
decode = CompiledDecode(model)
decode.warm()
print(decode.off)
"""


def _seed_kernels(dest: Path) -> None:
    """Copy the kernels this machine's processes compiled (the tests above
    trace this model's shape) into ``dest``, under the lock a warm-up holds
    while it writes them: compiling them afresh is g++ work of 1-3 minutes
    on 2 busy cores, and a kernel missing here is compiled as before."""
    shared = Path(tempfile.gettempdir()) / "mlx"
    if not shared.is_dir():
        return
    with open(shared / "gezel-trio-warm.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        shutil.copytree(shared, dest / "mlx", ignore=shutil.ignore_patterns("*.lock"))


def test_kernels_mlx_cannot_load_turn_it_off_at_load(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    _seed_kernels(tmp_path)

    def warm() -> str:
        out = subprocess.run(
            [sys.executable, "-c", _WARM], env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip().splitlines()[-1]

    assert warm() == "None"  # loaded from, or compiled into, this TMPDIR's mlx/<version>/cpu
    libraries = list((tmp_path / "mlx").glob("*/cpu/lib*.so"))
    assert libraries
    assert (tmp_path / "mlx" / "gezel-trio-warm.lock").is_file()
    for lib in libraries:
        lib.write_bytes(b"not a shared library")
    off = warm()
    assert "Could not load C++ shared library" in off, off


class _PickyLlama(_Wrapped):
    """llama's model, reading an attribute of its cache that the traced
    step's caches do not have: a family that uses its cache otherwise."""

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        if not hasattr(cache[0], "_idx"):
            raise ValueError("no _idx")
        out: mx.array = self.model(inputs, cache=cache)
        return out


def test_a_step_that_fails_to_trace_is_the_models_and_turns_it_off() -> None:
    inner = _model(llama, seed=6)
    decode = CompiledDecode(_PickyLlama(inner))
    _beside(decode, inner, _prompt(10, 7))
    assert decode.off == "ValueError: no _idx"
    assert decode.steps == 0


def _answer(config: EngineConfig) -> tuple[list[int], Any]:
    backend = MlxBackend(config)
    prompt = tuple(_prompt(30, 7))
    request = GenerationRequest(prompt, 24, SamplingParams(temperature=0.0), ignore_eos=True)
    try:
        assert backend.insert([Admission(1, request, (prompt,))]) == {}
        tokens: list[int] = []
        for _ in range(200):
            out = backend.step("interactive")
            assert not out.failed, out.failed
            tokens += [t.token for t in out.tokens]
            if any(t.finish is not None for t in out.tokens):
                break
        return tokens, backend._lanes.kit.decode_model
    finally:
        backend.close()


def test_the_served_backend_compiles_its_step_and_answers_as_without_it(
    any_model: Path,
) -> None:
    on, decode = _answer(EngineConfig.from_flags(model=any_model, speculation="off"))
    off, plain = _answer(
        EngineConfig.from_flags(model=any_model, speculation="off", compiled_step="off")
    )
    assert isinstance(decode, CompiledDecode)
    assert decode.off is None
    assert not isinstance(plain, CompiledDecode)
    assert on == off
    assert len(on) == 24
    # warm() traced batches of 1 and 2 (window 64); the request's steps ran compiled.
    assert {(1, 64), (2, 64)} <= decode.shapes
    assert decode.steps >= 20


class _TwiceLlama(_Wrapped):
    """llama's model run twice over the same caches in one call: each
    compiled layer step would be called twice, its first state lost."""

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        self.model(inputs, cache=cache)
        out: mx.array = self.model(inputs, cache=cache)
        return out


def test_a_model_that_runs_a_layer_twice_in_a_step_is_answered_by_the_model() -> None:
    inner = _model(llama, seed=8)
    decode = CompiledDecode(_TwiceLlama(inner))
    _beside(decode, _TwiceLlama(inner), _prompt(10, 9))
    assert decode.off == "the model's loop did not run each layer's step once"
    assert decode.steps == 0
