"""``--quantized-kv-start`` on the real MLX backend: the KV cache stays
unquantized until a sequence holds the start's tokens, then it is
quantized, as mlx-lm does for one sequence; in a batch the switch is the
lane's (``kv_quant.KvStart``).

- One sequence's logprobs are mlx-lm's ``generate_step`` with the same
  ``kv_bits``, start and prefill chunks, to the bit: unquantized before
  the switch, quantized after (and measurably unlike both a cache
  quantized from the first token and an unquantized one).
- A lane switches whole: a short sequence beside a long one is quantized
  with it, a quantized seed quantizes the lane it joins, and a lane that
  empties starts unquantized again.
- Speculation goes on over a lane that switches mid-decode: its holes
  are kept through the switch, and a finished sequence leaves a dense
  quantized cache.
- A conversation whose first turn was stored unquantized and whose second
  crossed the start is read back from the prompt cache (blocks of both
  formats joined) and from disk after a restart, in a fingerprint that
  names the start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import load

from gezel_trio import (
    Delta,
    EngineConfig,
    Failed,
    Finished,
    GenerationRequest,
    SamplingParams,
    open_engine,
)
from gezel_trio.core.backend import Admission
from gezel_trio.mlx.backend import MlxBackend
from gezel_trio.mlx.kv_quant import BatchQuantizedKVCache, KvStart, QuantizedKV, layout
from gezel_trio.mlx.loading import hold_float32
from gezel_trio.mlx.mlx_lm_surface import HoleyKVCache
from gezel_trio.mlx.speculation.lookup import NgramLookup
from tests.support.generate import text_and_usage
from tests.support.speculation import oracle, run
from tests.support.wide_heads import batch_prompts, wide_heads

HANG = 120
TOKENS = 40
PROMPT = [5 + (7 * i) % 900 for i in range(60)]
CHUNK = 16


@pytest.fixture(scope="module")
def kv_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return wide_heads("dense", tmp_path_factory.mktemp("kv-start"))


def _mlx_lm(path: Path, bits: int, start: int) -> list[float]:
    """Each greedy token's logprob through mlx-lm's single-sequence
    ``generate_step``, converting its cache as mlx-lm does."""
    model, _ = load(str(path))
    hold_float32(model)
    quant = {"kv_bits": bits, "kv_group_size": 32, "quantized_kv_start": start} if bits else {}
    out = []
    for token, logprobs in generate_step(
        mx.array(PROMPT),
        model,
        max_tokens=TOKENS,
        sampler=lambda lp: mx.argmax(lp, axis=-1),
        prefill_step_size=CHUNK,
        **quant,  # type: ignore[arg-type]
    ):
        out.append(float(logprobs[int(token)].item()))
    return out


async def _ours(path: Path, bits: int, start: int) -> list[float]:
    config = EngineConfig.from_flags(
        model=path,
        kv_bits=bits,
        kv_group_size=32,
        quantized_kv_start=start,
        prefill_step_size=CHUNK,
        speculation="off",
        # To the bit against mlx-lm's own step: the compiled one's
        # attention sums in another order (mlx.compiled_step).
        compiled_step="off",
    )
    request = GenerationRequest(
        tuple(PROMPT),
        TOKENS,
        SamplingParams(temperature=0.0),
        ignore_eos=True,
        top_logprobs=0,
    )
    out: list[float] = []
    async with open_engine(config) as engine:
        with engine.submit_nowait(request) as h:
            async for _, event in h:
                if isinstance(event, Delta):
                    out += [t.logprob for t in event.logprobs]
                if isinstance(event, Failed):
                    raise AssertionError(event.error)
                if isinstance(event, Finished):
                    break
    return out


async def test_one_sequence_switches_where_mlx_lm_switches(kv_model: Path) -> None:
    start = len(PROMPT) + 10
    with trio.fail_after(HANG):
        ours = await _ours(kv_model, 4, start)
        from_first = await _ours(kv_model, 4, 0)
    want = _mlx_lm(kv_model, 4, start)
    plain = _mlx_lm(kv_model, 0, 0)
    assert len(ours) == TOKENS
    assert ours == want
    # Before the switch the cache was unquantized ...
    assert ours[:10] == plain[:10]
    # ... and after it quantized: 4 bits move the logprobs by about 1e-2.
    assert max(abs(a - b) for a, b in zip(ours[12:], plain[12:], strict=True)) > 1e-3
    assert max(abs(a - b) for a, b in zip(ours, from_first, strict=True)) > 1e-3


def _admission(rid: int, prompt: list[int], max_tokens: int, seed: Any = None) -> Admission:
    request = GenerationRequest(
        tuple(prompt), max_tokens, SamplingParams(temperature=0.0), ignore_eos=True
    )
    return Admission(rid, request, (tuple(prompt),), seed_state=seed)


def _quantized(state: list[Any]) -> bool:
    kinds = {type(c) for c in state}
    assert len(kinds) == 1, kinds  # every layer in one format
    (kind,) = kinds
    assert kind in (KVCache, QuantizedKV)
    return kind is QuantizedKV


def _until(backend: MlxBackend, done: Any, limit: int = 200) -> None:
    for _ in range(limit):
        if done():
            return
        out = backend.step("interactive")
        assert not out.failed, out.failed
    raise AssertionError("not reached")


def test_a_lane_switches_whole_and_starts_unquantized_once_empty(kv_model: Path) -> None:
    backend = MlxBackend(
        EngineConfig.from_flags(model=kv_model, kv_bits=8, kv_group_size=32, quantized_kv_start=50)
    )
    try:
        lane = backend._lanes.lanes
        # A short sequence alone: unquantized.
        assert backend.insert([_admission(1, [7, 8, 9, 10], 200)]) == {}
        _until(backend, lambda: backend.capture(1) is not None)
        for _ in range(5):
            backend.step("interactive")
        captured = backend.capture(1)
        assert captured is not None
        assert not _quantized(captured.state)
        assert not lane["interactive"].quantized
        # A long one joins; once it holds 50 tokens the lane is quantized,
        # the short one with it.
        assert backend.insert([_admission(2, PROMPT[:45], 200)]) == {}
        _until(backend, lambda: lane["interactive"].quantized)
        short, long = backend.capture(1), backend.capture(2)
        assert short is not None
        assert long is not None
        assert len(short.tokens) < 50 <= len(long.tokens)
        assert _quantized(short.state)
        assert _quantized(long.state)
        # Decoding goes on over the quantized lane.
        for _ in range(3):
            assert not backend.step("interactive").failed
        backend.remove([1, 2])
        # Empty, the lane starts unquantized again; a quantized seed (the
        # long sequence's state) quantizes the lane it joins.
        assert backend.insert([_admission(3, [11, 12], 200)]) == {}
        _until(backend, lambda: backend.capture(3) is not None)
        third = backend.capture(3)
        assert third is not None
        assert not _quantized(third.state)
        seed = backend.states.join_state(
            [b for b, _ in backend.states.state_blocks(long.state, [(0, len(long.tokens))])],
            len(long.tokens),
            None,
        )
        assert _quantized(seed)
        rest = [5, 6]
        admission = Admission(
            4,
            GenerationRequest(
                (*long.tokens, *rest), 200, SamplingParams(temperature=0.0), ignore_eos=True
            ),
            (tuple(rest),),
            seed_state=seed,
            seed_tokens=tuple(long.tokens),
        )
        assert backend.insert([admission]) == {}
        assert lane["interactive"].quantized
        _until(backend, lambda: backend.capture(4) is not None)
        third, fourth = backend.capture(3), backend.capture(4)
        assert third is not None
        assert fourth is not None
        assert _quantized(third.state)
        assert _quantized(fourth.state)
        for _ in range(3):
            assert not backend.step("interactive").failed
    finally:
        backend.close()


async def test_a_conversation_crosses_the_start_through_the_prompt_cache_and_disk(
    kv_model: Path, tmp_path: Path
) -> None:
    """Turn 1 stays under the start and stores its first 64-token block
    unquantized; turn 2 crosses it and stores its later blocks quantized:
    asking turn 2 again joins blocks of both formats."""
    persist = tmp_path / "persist"
    config = EngineConfig.from_flags(
        model=kv_model,
        kv_bits=8,
        kv_group_size=32,
        quantized_kv_start=100,
        persist_dir=persist,
    )

    def greedy(prompt: tuple[int, ...], n: int) -> GenerationRequest:
        return GenerationRequest(
            prompt, n, SamplingParams(temperature=0.0), ignore_eos=True, speculate=False
        )

    tokens = [5 + (7 * i) % 900 for i in range(150)]
    first, second = tuple(tokens[:70]), tuple(tokens)
    with trio.fail_after(HANG):
        async with open_engine(config) as engine:
            assert engine.info.fingerprint.endswith("+kv8g32s100")
            _, usage = await text_and_usage(engine, greedy(first, 8))
            assert usage.output_tokens == 8
            text2, usage = await text_and_usage(engine, greedy(second, 16))
            assert usage.cached_tokens >= 64
            again, usage = await text_and_usage(engine, greedy(second, 16))
            assert usage.cached_tokens > 128
            assert again == text2
        # A restart reads both formats' blocks back from disk.
        async with open_engine(config) as engine:
            text, usage = await text_and_usage(engine, greedy(second, 16))
            assert usage.cached_tokens > 128
            assert text == text2


def test_speculation_goes_on_over_a_lane_that_switches(
    kv_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The random weights do not repeat what they read, so the proposer is
    an oracle of plain decoding's text, its last token spoiled every other
    time: sequences accept different counts (holes) before the switch."""
    model, _ = load(str(kv_model))
    hold_float32(model)
    layers = frozenset(range(len(model.layers)))
    prompts = batch_prompts()
    start = KvStart(len(prompts[0]) + 12, 8, 32, layers)
    switched: list[bool] = []
    holes_kept: list[bool] = []

    def lane(gen: Any) -> None:
        if not switched and start.due(gen):
            start.quantize_generator(gen)
            switched.append(True)
            cache = gen._generation_batch.prompt_cache
            holes_kept.append(
                isinstance(cache[0], HoleyKVCache)
                and isinstance(cache[0], BatchQuantizedKVCache)
                and cache[0].holes is not None
                and bool(mx.any(cache[0].holes).item())
            )

    def decode(spec: bool) -> tuple[list[list[int]], Any]:
        switched.clear()
        holes_kept.clear()
        out, finals, stats, _ = run(
            model,
            prompts,
            spec=spec,
            max_tokens=[TOKENS] * len(prompts),
            caches=[layout(model, 0, 32, layers) for _ in prompts],
            after_step=lane,
        )
        assert switched
        return out, (finals, stats)

    plain, _ = decode(False)

    monkeypatch.setattr(NgramLookup, "propose", oracle(prompts, plain, spoil=True))
    spec, (finals, stats) = decode(True)
    assert holes_kept == [True]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert spec == plain
    for final in finals:
        for c in final.prompt_cache:
            assert isinstance(c, QuantizedKV)
            assert c.offset == len(final.all_tokens) == c.keys[0].shape[2]
