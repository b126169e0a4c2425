"""The edges of the sampling parameters on the real MLX backend.

``top_p: 0`` used to sample from the whole distribution (mlx-lm reads 0 as
"off") and a ``top_p`` that rounds to 0 in float32 drew noise;
``temperature: 1e-40`` overflowed ``1/temperature`` to infinity and drew
noise too. Each now samples the most likely token, so each must decode
exactly the greedy text; a sampled control shows the comparison could fail.
Penalties that make the distribution NaN are refused at submit for an
embedder as for HTTP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio

from gezel_trio import (
    Delta,
    EngineConfig,
    Failed,
    Finished,
    GenerationRequest,
    InvalidRequest,
    SamplingParams,
    open_engine,
)
from gezel_trio.mlx.sampling import make_sampler

HANG = 60
TOKENS = 16


async def _text(engine: Any, prompt: tuple[int, ...], params: SamplingParams) -> str:
    parts: list[str] = []
    with engine.submit_nowait(GenerationRequest(prompt, TOKENS, params, ignore_eos=True)) as h:
        async for _, event in h:
            if isinstance(event, Delta):
                parts.append(event.text)
            if isinstance(event, Failed):
                raise AssertionError(event.error)
            if isinstance(event, Finished):
                assert event.usage.output_tokens == TOKENS
                return "".join(parts)
    raise AssertionError("no terminal event")


async def test_top_p_zero_and_tiny_temperatures_decode_the_greedy_text(dense_model: Path) -> None:
    with trio.fail_after(HANG):
        async with open_engine(EngineConfig(model=dense_model)) as engine:
            prompt = (await engine.render_chat([{"role": "user", "content": "hi"}])).tokens
            greedy = await _text(engine, prompt, SamplingParams(temperature=0.0))
            # The control: the same seed at temperature 1 samples something else.
            assert await _text(engine, prompt, SamplingParams(temperature=1.0, seed=1)) != greedy
            for params in (
                SamplingParams(temperature=1.0, top_p=0.0, seed=1),
                SamplingParams(temperature=1.0, top_p=1e-300, seed=1),
                SamplingParams(temperature=1e-40, seed=1),
                SamplingParams(temperature=1e-6, seed=1),
            ):
                assert await _text(engine, prompt, params) == greedy, params


def test_a_low_temperature_does_not_overflow_float16_logprobs() -> None:
    """A float16 model's logprobs: the best token (index 500) holds 0.16% of
    the mass, logprob -6.4; over 1e-5 that is -640000, past float16's
    -65504, and every token was -inf together: the draw was noise (token 105)."""
    logits = mx.zeros((1, 1000)).at[0, 500].add(0.5)
    logprobs = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(mx.float16)
    for seed in range(4):
        sample = make_sampler(SamplingParams(temperature=1e-5, seed=seed), 1000)
        assert sample(logprobs).item() == 500


async def test_an_embedders_penalty_that_gives_nan_is_refused_at_submit(
    dense_model: Path,
) -> None:
    with trio.fail_after(HANG):
        async with open_engine(EngineConfig(model=dense_model)) as engine:
            prompt = (await engine.render_chat([{"role": "user", "content": "hi"}])).tokens
            for params, param in (
                (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
                (SamplingParams(repetition_penalty=1e-300), "repetition_penalty"),
                (SamplingParams(presence_penalty=-1e39), "presence_penalty"),
                (SamplingParams(frequency_penalty=-3.0), "frequency_penalty"),
            ):
                with pytest.raises(InvalidRequest) as info:
                    engine.submit_nowait(GenerationRequest(prompt, 4, params))
                assert info.value.param == param
