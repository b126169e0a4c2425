"""A quantized KV cache in the batch (``mlx.kv_quant``, ``--kv-bits``) on
the real MLX backend.

The tiny demo models' heads are 16 wide, narrower than MLX's smallest
quantization group (32), so the model here is the dense tiny one with
32-wide heads (built by the demo builder, float32).

- A batch of sequences that join and leave at different steps decodes
  exactly what each decodes alone through mlx-lm's own single-sequence
  ``QuantizedKVCache``, and leaves that cache behind.
- The engine serves with ``kv_bits``: what it stores is quantized and
  smaller per token, a repeated prompt is read from the prompt cache and
  decodes the same text, and a restart reads it back from disk only in
  the same KV format.
- A head size the group does not divide stays unquantized, by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache
from mlx_lm.utils import load

from gezel_trio import (
    EngineConfig,
    GenerationRequest,
    SamplingParams,
    open_engine,
)
from gezel_trio.http.app import HttpSettings, create_app
from gezel_trio.mlx import kv_quant
from gezel_trio.mlx.loading import hold_float32
from gezel_trio.mlx.mlx_lm_surface import HoleyKVCache, cache_index, with_holes
from gezel_trio.mlx.sampling import greedy
from gezel_trio.mlx.speculation.lookup import NgramLookup
from tests.support.generate import text_and_usage
from tests.support.speculation import oracle, run
from tests.support.wide_heads import batch_prompts, wide_heads

TOKENS = 24
HANG = 120


@pytest.fixture(scope="module")
def kv_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return wide_heads("dense", tmp_path_factory.mktemp("kv-dense"))


@pytest.fixture(scope="module")
def kv_hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return wide_heads("hybrid", tmp_path_factory.mktemp("kv-hybrid"))


@pytest.fixture(scope="module")
def model(kv_model: Path) -> Any:
    m, _ = load(str(kv_model))
    hold_float32(m)
    mx.eval(m.parameters())
    return m


def _alone(model: Any, prompt: list[int], bits: int) -> tuple[list[int], list[Any]]:
    """Greedy decoding through mlx-lm's own single-sequence quantized cache."""
    cache = [QuantizedKVCache(32, bits) for _ in model.layers]
    logits = model(mx.array([prompt]), cache=cache)
    out: list[int] = []
    for _ in range(TOKENS):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    return out, cache


def _batched(model: Any, prompts: list[list[int]], bits: int) -> tuple[list[list[int]], list[Any]]:
    """The same prompts through a BatchGenerator over ``QuantizedKV``
    layers: the second joins two steps after the first, the third later;
    they end at different steps."""
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4, stop_tokens=None)
    layers = frozenset(range(len(model.layers)))
    budgets = [TOKENS, TOKENS - 9, TOKENS - 3]
    uids: list[int] = []
    out: dict[int, list[int]] = {}
    finals: dict[int, Any] = {}
    try:
        step = 0
        while len(finals) < len(prompts):
            if step in (0, 2, 5) and len(uids) < len(prompts):
                i = len(uids)
                (uid,) = gen.insert(
                    [prompts[i]],
                    max_tokens=[budgets[i]],
                    caches=[kv_quant.layout(model, bits, 32, layers)],
                    samplers=[greedy],
                )
                uids.append(uid)
                out[uid] = []
            step += 1
            _, responses = gen.next()
            for r in responses:
                out[r.uid].append(r.token)
                if r.finish_reason is not None:
                    finals[r.uid] = r
            for c in gen._generation_batch.prompt_cache:
                assert isinstance(c, kv_quant.BatchQuantizedKVCache)
    finally:
        gen.close()
    return [out[u] for u in uids], [finals[u] for u in uids]


@pytest.mark.parametrize("bits", [8, 4])
def test_the_quantized_batch_decodes_what_each_sequence_decodes_alone(
    model: Any, bits: int
) -> None:
    prompts = batch_prompts()
    got, finals = _batched(model, prompts, bits)
    for prompt, tokens, final in zip(prompts, got, finals, strict=True):
        want, cache = _alone(model, prompt, bits)
        assert tokens == want[: len(tokens)]
        # The finished sequence leaves the quantized cache decoding left.
        for mine, ref in zip(final.prompt_cache, cache, strict=True):
            assert isinstance(mine, kv_quant.QuantizedKV)
            assert mine.bits == bits
            n = mine.offset
            assert n == len(final.all_tokens)
            # The batch's matmuls round differently in the last bits, and a
            # value on a level's edge may quantize one level apart.
            for got_kv, want_kv in ((mine.keys, ref.keys), (mine.values, ref.values)):
                w, s, b = (x[..., :n, :] for x in got_kv)
                rw, rs, rb = (x[..., :n, :] for x in want_kv)
                assert mx.mean((w == rw).astype(mx.float32)).item() > 0.99
                got_f = mx.dequantize(w, s, b, group_size=32, bits=bits)
                want_f = mx.dequantize(rw, rs, rb, group_size=32, bits=bits)
                step = mx.max(mx.abs(rs)).item()
                assert mx.allclose(got_f, want_f, atol=1.01 * step + 1e-6).item()


def test_a_head_size_the_group_does_not_divide_stays_unquantized(dense_model: Path) -> None:
    m, _ = load(str(dense_model))  # 16-wide heads
    plan = kv_quant.plan(m, 8, 32, mx.default_stream(mx.default_device()))
    assert plan.layers == frozenset()
    assert plan.kept == dict.fromkeys(range(len(m.layers)), (16, 16))
    line = plan.describe(32)
    assert line is not None
    assert "head size 16 is not a multiple of the group size 32" in line
    cache = kv_quant.layout(m, 8, 32, plan.layers)
    assert all(type(c) is KVCache for c in cache)


async def _text(engine: Any, prompt: tuple[int, ...]) -> tuple[str, Any]:
    greedy_request = GenerationRequest(
        prompt, TOKENS, SamplingParams(temperature=0.0), ignore_eos=True, speculate=False
    )
    return await text_and_usage(engine, greedy_request)


async def test_the_engine_serves_and_stores_a_quantized_kv_cache(
    kv_model: Path, tmp_path: Path
) -> None:
    messages = [{"role": "user", "content": "kv cache " * 30}]
    per_token: dict[int, int] = {}
    texts: dict[int, str] = {}
    persist = tmp_path / "persist"
    with trio.fail_after(HANG):
        for bits in (0, 8, 4):
            config = EngineConfig.from_flags(
                model=kv_model, kv_bits=bits, kv_group_size=32, persist_dir=persist
            )
            async with open_engine(config) as engine:
                assert engine.info.kv is not None
                per_token[bits] = engine.info.kv.per_token
                prompt = (await engine.render_chat(messages)).tokens
                texts[bits], first = await _text(engine, prompt)
                again, usage = await _text(engine, prompt)
                # Read from the prompt cache, and the same text.
                assert usage.cached_tokens > 0
                assert again == texts[bits]
                assert first.cached_tokens == 0  # nothing on disk in this format yet
            # A restart in the same format reads the prompt back from disk.
            async with open_engine(config) as engine:
                text, usage = await _text(engine, prompt)
                assert usage.cached_tokens > 0
                assert text == texts[bits]
    # 32-wide heads in float32: 256 bytes per layer per token for keys and
    # values; 8 bits pack 64 bytes plus a scale and a bias per 32 values.
    assert per_token[8] < 0.4 * per_token[0]
    assert per_token[4] < 0.7 * per_token[8]


PROTOCOLS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "kv " * 40}]}),
    ("/v1/completions", {"prompt": "kv " * 40}),
    ("/v1/responses", {"input": "kv " * 40}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "kv " * 40}]}),
]


async def test_every_protocol_serves_from_a_quantized_kv_cache(kv_model: Path) -> None:
    """Each protocol's request, twice: answered, and the second reused the
    first's prefix from the quantized prompt cache."""
    config = EngineConfig.from_flags(model=kv_model, kv_bits=8, kv_group_size=32)
    with trio.fail_after(HANG):
        async with open_engine(config) as engine:
            assert engine.info.fingerprint.endswith("+kv8g32")
            async with create_app(engine, HttpSettings()).test_app() as app:
                client = app.test_client()
                for path, body in PROTOCOLS:
                    limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
                    request = {"model": "m", limit: 8, "temperature": 0, **body}
                    before = _cached(engine)
                    for _ in range(2):
                        r = await client.post(path, json=request)
                        assert r.status_code == 200, await r.get_data(as_text=True)
                    # The second read the first's prompt from the cache.
                    assert _cached(engine) > before, path


def _cached(engine: Any) -> float:
    for line in engine.metrics.exposition().decode().splitlines():
        if line.startswith("gezel_prefix_cache_hits_total "):
            return float(line.split()[1])
    raise AssertionError("no gezel_prefix_cache_hits_total in /metrics")


async def test_a_hybrid_model_quantizes_its_attention_and_keeps_its_recurrent_state(
    kv_hybrid: Path,
) -> None:
    """Qwen3.5-style: linear-attention layers keep their state as it is;
    the attention layers' KV is quantized; the prompt cache serves both."""
    messages = [{"role": "user", "content": "hybrid kv " * 30}]
    texts = {}
    per_token: dict[int, int] = {}
    with trio.fail_after(HANG):
        for bits in (0, 8):
            config = EngineConfig.from_flags(model=kv_hybrid, kv_bits=bits, kv_group_size=32)
            async with open_engine(config) as engine:
                prompt = (await engine.render_chat(messages)).tokens
                texts[bits], _ = await _text(engine, prompt)
                again, usage = await _text(engine, prompt)
                assert usage.cached_tokens > 0
                assert again == texts[bits]
                kv = engine.info.kv
                assert kv is not None
                assert kv.fixed > 0  # the recurrent layers' state
                per_token[bits] = kv.per_token
    assert per_token[8] < 0.4 * per_token[0]


def _decode(model: Any, prompts: list[list[int]], *, spec: bool) -> tuple[list[list[int]], Any]:
    layers = frozenset(range(len(model.layers)))
    out, finals, stats, holey = run(
        model,
        prompts,
        spec=spec,
        max_tokens=[TOKENS * 2] * len(prompts),
        caches=[kv_quant.layout(model, 8, 32, layers) for _ in prompts],
    )
    return out, (stats, finals, any(holey))


def test_speculation_runs_on_the_quantized_batch(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy speculation over a quantized cache writes what plain decoding
    over it writes, holes and all, and leaves a dense quantized cache.

    The random weights do not repeat what they read, so the proposer is an
    oracle of plain decoding's text, its last token wrong every other time:
    verifies accept different counts per sequence (holes) and reject some."""
    prompts = batch_prompts()
    plain, _ = _decode(model, prompts, spec=False)

    monkeypatch.setattr(NgramLookup, "propose", oracle(prompts, plain, spoil=True))
    spec, (stats, finals, holey) = _decode(model, prompts, spec=True)
    assert holey
    assert stats.verify_steps > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert spec == plain
    for final in finals:
        for c in final.prompt_cache:
            assert isinstance(c, kv_quant.QuantizedKV)
            assert c.offset == len(final.all_tokens) == c.keys[0].shape[2]


def test_a_layer_gets_holes_and_is_quantized_as_a_new_cache_holding_its_state() -> None:
    # Two rows of 3 slots, the first left-padded by one; each slot's keys
    # are its row and slot, so what a cache holds can be read back.
    layer = BatchKVCache([1, 0])
    keys = mx.broadcast_to(mx.arange(6, dtype=mx.float32).reshape(2, 1, 3, 1), (2, 2, 3, 32))
    layer.update_and_fetch(keys, keys + 100)
    holey = with_holes(layer)
    # A new object; the layer it replaces keeps its class.
    assert holey is not layer
    assert type(layer) is BatchKVCache
    assert holey.keys is layer.keys
    assert cache_index(holey) == 3
    holey.reject([1, 0])  # row 0's last slot is a hole now
    quantized = kv_quant.quantized_batch_layer(holey, 32, 8)
    assert quantized is not holey
    assert type(holey) is HoleyKVCache
    assert isinstance(quantized, kv_quant.BatchQuantizedKVCache)
    assert isinstance(quantized, HoleyKVCache)
    assert quantized.holes is not None
    assert holey.holes is not None
    assert mx.array_equal(quantized.holes, holey.holes).item()
    assert cache_index(quantized) == 3
    assert quantized.offset.tolist() == [1, 3]
    # Row 0 extracts its one valid slot (slot 1; slot 0 is padding, slot 2 a hole).
    one = quantized.extract(0)
    assert isinstance(one, kv_quant.QuantizedKV)
    assert one.offset == 1
    got = mx.dequantize(*one.keys, group_size=32, bits=8)
    assert got.shape == (1, 2, 1, 32)
    assert mx.allclose(got, mx.full(got.shape, 1.0), atol=0.02).item()
