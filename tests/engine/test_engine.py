"""The engine's Python API on the real MLX backend, in Trio, without HTTP.

Every wait here is for an engine event (``engine.wait_until`` re-checks a
predicate after each engine step); ``trio.fail_after`` only bounds a hang.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from gezel_trio import (
    Delta,
    Engine,
    EngineConfig,
    Finished,
    GenerationRequest,
    InvalidRequest,
    SamplingParams,
    open_engine,
)
from tests.support.engine_api import collect, greedy, prompt_for

HANG = 60  # seconds; a bound on a hang, never a wait


async def test_generates_to_max_tokens_with_usage(any_model: Path) -> None:
    with trio.fail_after(HANG):
        async with open_engine(EngineConfig(model=any_model)) as engine:
            prompt = await prompt_for(engine)
            text, fin = await collect(engine, greedy(prompt, 12, ignore_eos=True))
            assert fin.reason == "length"
            assert fin.usage.output_tokens == 12
            assert fin.usage.input_tokens == len(prompt)
            assert text.strip()
            assert "\ufffd" not in text
            assert engine.state().running == ()


async def test_batched_greedy_matches_solo_greedy(dense_model: Path) -> None:
    """Four sequences decoded together give what each gives alone."""
    with trio.fail_after(HANG):
        async with open_engine(
            EngineConfig.from_flags(model=dense_model, max_concurrency=4)
        ) as engine:
            prompts = [await prompt_for(engine, f"Question number {i}?") for i in range(4)]
            solo = [await collect(engine, greedy(p, 10, ignore_eos=True)) for p in prompts]
            together: list[str] = [""] * 4

            async def one(i: int) -> None:
                together[i] = (await collect(engine, greedy(prompts[i], 10, ignore_eos=True)))[0]

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(one, i)
            assert together == [s[0] for s in solo]


async def test_same_seed_same_text_whatever_shares_the_batch(dense_model: Path) -> None:
    with trio.fail_after(HANG):
        async with open_engine(EngineConfig(model=dense_model)) as engine:
            prompt = await prompt_for(engine)

            def req(seed: int) -> GenerationRequest:
                return GenerationRequest(
                    prompt,
                    max_tokens=16,
                    sampling=SamplingParams(temperature=1.0, seed=seed),
                    ignore_eos=True,
                )

            alone = (await collect(engine, req(42)))[0]
            results: dict[int, str] = {}

            async def one(key: int, seed: int) -> None:
                results[key] = (await collect(engine, req(seed)))[0]

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 0, 42)
                nursery.start_soon(one, 1, 7)
                nursery.start_soon(one, 2, 42)
            assert results[0] == results[2] == alone
            assert results[1] != alone


async def test_more_requests_than_slots_all_complete(any_model: Path) -> None:
    """Requests arriving while a batch runs join it or wait; none is lost."""
    with trio.fail_after(HANG):
        async with open_engine(
            EngineConfig.from_flags(model=any_model, max_concurrency=2)
        ) as engine:
            prompt = await prompt_for(engine)
            lengths = [3, 9, 5, 7, 4, 6]
            done: dict[int, Finished] = {}

            async def one(i: int, task_status: trio.TaskStatus[None]) -> None:
                with engine.submit_nowait(greedy(prompt, lengths[i], ignore_eos=True)) as h:
                    task_status.started()
                    async for _, event in h:
                        if isinstance(event, Finished):
                            done[i] = event

            async with trio.open_nursery() as nursery:
                await nursery.start(one, 0)
                await nursery.start(one, 1)
                await engine.wait_until(lambda s: len(s.running) == 2)
                for i in range(2, len(lengths)):
                    await nursery.start(one, i)
                state = engine.state()
                assert len(state.queued) + len(state.running) >= 3
            assert {i: f.usage.output_tokens for i, f in done.items()} == dict(enumerate(lengths))


async def test_stop_string_ends_the_turn(dense_model: Path) -> None:
    with trio.fail_after(HANG):
        async with open_engine(EngineConfig(model=dense_model)) as engine:
            prompt = await prompt_for(engine)
            full, _ = await collect(engine, greedy(prompt, 24, ignore_eos=True))
            words = full.split()
            assert len(words) >= 4
            stop = words[2]
            cut = full.index(stop)
            text, fin = await collect(engine, greedy(prompt, 24, ignore_eos=True, stop=(stop,)))
            assert fin.reason == "stop"
            assert text == full[:cut]
            assert engine.state().running == ()


async def test_min_tokens_holds_back_eos(dense_model: Path) -> None:
    with trio.fail_after(HANG):
        async with open_engine(EngineConfig(model=dense_model)) as engine:
            prompt = await prompt_for(engine)
            eos = sorted(engine.info.eos_ids)
            # A bias that makes EOS the certain choice, held back by min_tokens.
            forced = SamplingParams(temperature=0.0, logit_bias=tuple((e, 100.0) for e in eos))
            _, fin = await collect(engine, GenerationRequest(prompt, 20, forced))
            assert (fin.reason, fin.usage.output_tokens) == ("stop", 1)
            _, fin = await collect(engine, GenerationRequest(prompt, 20, forced, min_tokens=5))
            assert (fin.reason, fin.usage.output_tokens) == ("stop", 6)


async def test_thinking_budget_is_respected_to_the_token(any_model: Path) -> None:
    with trio.fail_after(HANG):
        async with open_engine(EngineConfig(model=any_model)) as engine:
            think = engine.info.think_ids
            assert think is not None
            rendered = await engine.render_chat(
                [{"role": "user", "content": "Think first."}],
                template_kwargs={"enable_thinking": True},
            )
            assert rendered.tokens[-2:][-1] == think[0] or think[0] in rendered.tokens[-3:]
            for budget in (0, 1, 7):
                req = GenerationRequest(
                    rendered.tokens,
                    budget + 6,
                    SamplingParams(temperature=1.0, seed=budget),
                    ignore_eos=True,
                    max_thinking_tokens=budget,
                )
                tokens: list[int] = []
                with engine.submit_nowait(req) as handle:
                    async for _, event in handle:
                        if isinstance(event, Delta):
                            tokens += event.tokens
                assert tokens.index(think[1]) == budget


async def test_template_fallback_rungs_and_linkage_probe(dense_model: Path) -> None:
    async with open_engine(EngineConfig(model=dense_model)) as engine:
        strict = (
            "{% if reasoning_effort is defined %}{{ raise_exception('no effort') }}{% endif %}"
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        )
        msgs = [{"role": "user", "content": "hi"}]
        plain = await engine.render_chat(msgs, template_override=strict)
        fallback = await engine.render_chat(
            msgs, template_override=strict, template_kwargs={"reasoning_effort": "high"}
        )
        assert fallback.tokens == plain.tokens  # rendered without the rejected kwarg
        with pytest.raises(InvalidRequest) as info:
            await engine.render_chat(msgs, template_override="{{ raise_exception('broken') }}")
        assert info.value.param == "messages"
        # The demo template keeps unlinked tool results, so ids are not passed.
        linked = "{% for m in messages %}{{ m.tool_call_id or '' }}{{ m.content }}\n{% endfor %}"
        tool_round = [
            {"role": "user", "content": "q"},
            {"role": "tool", "tool_call_id": "call_9", "content": "r"},
        ]
        rendered = await engine.render_chat(tool_round, template_override=linked)
        assert "call_9" not in engine_text(engine, rendered.tokens)


def engine_text(engine: Engine, tokens: tuple[int, ...]) -> str:
    renderer: Any = engine.renderer
    return str(renderer._tokenizer.decode(list(tokens)))
