"""The per-request failure boundary on the real MLX backend.

mlx-lm calls every sequence's logits processors and sampler inside one
``BatchGenerator.next()`` for the whole batch; a sequence whose own code
raises there must fail alone while its batch-mates decode exactly what they
decode alone. A backend subclass adds a processor that raises on its third
call to the requests a test marks; everything else is the real engine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from unittest import mock

import trio

from gezel_trio import (
    Delta,
    EngineConfig,
    Failed,
    Finished,
    GenerationRequest,
    RequestFailed,
    SamplingParams,
    open_engine,
)
from gezel_trio.core.backend import Backend
from gezel_trio.core.request import GenerationRequest as Request
from gezel_trio.mlx import backend as backend_module
from gezel_trio.mlx.backend import MlxBackend
from gezel_trio.mlx.decoding import Decoding

HANG = 60
MARK = 7  # requests with this min_tokens get the raising processor


class _FaultyDecoding(Decoding):
    def processors(self, r: Request) -> list[Any]:
        procs = super().processors(r)
        if r.min_tokens == MARK:
            calls = [0]

            def explode(_tokens: Any, logits: Any) -> Any:
                calls[0] += 1
                if calls[0] == 3:
                    raise RuntimeError("a processor bug")
                return logits

            procs.append(explode)
        return procs


def _faulty(config: EngineConfig) -> Backend:
    with mock.patch.object(backend_module, "Decoding", _FaultyDecoding):
        return MlxBackend(config)


async def _run(engine: Any, req: GenerationRequest) -> tuple[str, Any]:
    parts: list[str] = []
    with engine.submit_nowait(req) as handle:
        async for _, event in handle:
            if isinstance(event, Delta):
                parts.append(event.text)
            if isinstance(event, Finished | Failed):
                return "".join(parts), event
    raise AssertionError("no terminal event")


async def test_a_raising_logits_processor_fails_its_request_alone(dense_model: Path) -> None:
    with trio.fail_after(HANG):
        config = EngineConfig.from_flags(model=dense_model, max_concurrency=4)
        async with open_engine(config, backend_factory=_faulty) as engine:
            prompt = (
                await engine.render_chat(
                    [{"role": "user", "content": "Tell me a long story."}],
                    template_kwargs={"enable_thinking": False},
                )
            ).tokens

            def greedy(n: int, **kw: Any) -> GenerationRequest:
                return GenerationRequest(
                    prompt, n, SamplingParams(temperature=0.0), ignore_eos=True, **kw
                )

            def sampled(n: int, **kw: Any) -> GenerationRequest:
                params = SamplingParams(temperature=0.8, seed=5)
                return GenerationRequest(prompt, n, params, ignore_eos=True, **kw)

            alone = (await _run(engine, greedy(24)))[0]
            alone_sampled = (await _run(engine, sampled(24)))[0]
            results: dict[str, tuple[str, Any]] = {}

            async def one(name: str, req: GenerationRequest) -> None:
                results[name] = await _run(engine, req)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, "healthy", greedy(24))
                nursery.start_soon(one, "bad", greedy(24, min_tokens=MARK))
                nursery.start_soon(one, "sampled", sampled(24))
            _, bad = results["bad"]
            assert isinstance(bad, Failed)
            assert isinstance(bad.error, RequestFailed)
            assert "processor bug" in bad.error.message
            assert results["healthy"] == (alone, results["healthy"][1])
            assert isinstance(results["healthy"][1], Finished)
            assert results["sampled"][0] == alone_sampled
            state = await engine.wait_until(lambda s: s.live == 0 and not s.running)
            assert state.running == ()
            assert engine.health().status == "ok"


async def test_the_engine_leaves_the_embedders_environment_alone(dense_model: Path) -> None:
    before = dict(os.environ)
    async with open_engine(EngineConfig(model=dense_model)):
        pass
    assert dict(os.environ) == before


async def test_out_of_vocabulary_ids_and_huge_top_k_are_handled_before_the_step(
    dense_model: Path,
) -> None:
    """The rows that killed the process or every batch-mate: an embedder's
    request is checked against the model at submit, and a top_k past the
    vocabulary keeps every token instead of failing the step."""
    import pytest

    from gezel_trio import InvalidRequest

    with trio.fail_after(HANG):
        async with open_engine(EngineConfig(model=dense_model)) as engine:
            prompt = (await engine.render_chat([{"role": "user", "content": "hi"}])).tokens
            vocab = engine.info.vocab_size
            for bias in ((vocab, 5.0), (999_999_999, 5.0), (3, float("nan"))):
                bad = GenerationRequest(prompt, 4, SamplingParams(logit_bias=(bias,)))
                with pytest.raises(InvalidRequest) as info:
                    engine.submit_nowait(bad)
                assert info.value.param == "logit_bias"
            with pytest.raises(InvalidRequest):
                engine.submit_nowait(GenerationRequest((vocab + 3,), 4))
            huge_k = SamplingParams(temperature=1.0, top_k=10**6, seed=2**70 - 1)
            _, fin = await _run(engine, GenerationRequest(prompt, 6, huge_k, ignore_eos=True))
            assert isinstance(fin, Finished)
            assert fin.usage.output_tokens == 6
