"""Preemption on the real MLX engine, both demo models: a parked
background wave resumes byte-identically, and interactive work does not wait
for it. Gated on engine events; no sleeps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from gezel_trio import (
    Delta,
    Engine,
    EngineConfig,
    Finished,
    GenerationRequest,
    SamplingParams,
    open_engine,
)
from gezel_trio.core.events import Parked, Resumed

HANG = 120


async def prompt(engine: Engine, text: str) -> tuple[int, ...]:
    rendered = await engine.render_chat(
        [{"role": "user", "content": text}], template_kwargs={"enable_thinking": False}
    )
    return rendered.tokens


def request(tokens: tuple[int, ...], n: int, priority: str) -> GenerationRequest:
    return GenerationRequest(
        tokens,
        n,
        SamplingParams(temperature=0.0),
        ignore_eos=True,
        priority=priority,  # type: ignore[arg-type]
    )


async def read(engine: Engine, req: GenerationRequest, into: list[Any]) -> None:
    with engine.submit_nowait(req) as handle:
        async for _, event in handle:
            into.append(event)


def text(events: list[Any]) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


async def test_parked_background_wave_resumes_byte_identically(any_model: Path) -> None:
    with trio.fail_after(HANG):
        async with open_engine(
            EngineConfig.from_flags(model=any_model, max_concurrency=4)
        ) as engine:
            prompts = [await prompt(engine, f"Background job number {i}.") for i in range(4)]
            alone = []
            for p in prompts:
                events: list[Any] = []
                await read(engine, request(p, 24, "background"), events)
                alone.append(text(events))

            waves: list[list[Any]] = [[] for _ in prompts]
            chat: list[Any] = []
            async with trio.open_nursery() as nursery:
                for p, into in zip(prompts, waves, strict=True):
                    nursery.start_soon(read, engine, request(p, 24, "background"), into)
                # Once the wave decodes, a person asks something.
                await engine.wait_until(
                    lambda _: all(any(isinstance(e, Delta) for e in w) for w in waves)
                )
                chat_prompt = await prompt(engine, "Quick question!")
                nursery.start_soon(read, engine, request(chat_prompt, 6, "interactive"), chat)
            assert isinstance(chat[-1], Finished)
            for events, expected in zip(waves, alone, strict=True):
                kinds = [type(e) for e in events]
                assert Parked in kinds
                assert Resumed in kinds
                assert isinstance(events[-1], Finished)
                assert text(events) == expected
            assert engine.state().parked == ()


async def test_interactive_request_starts_before_the_background_wave_ends(
    dense_model: Path,
) -> None:
    with trio.fail_after(HANG):
        async with open_engine(
            EngineConfig.from_flags(model=dense_model, max_concurrency=4)
        ) as engine:
            p = await prompt(engine, "Summarize everything you know.")
            order: list[str] = []

            async def tagged(name: str, req: GenerationRequest) -> None:
                events: list[Any] = []
                await read(engine, req, events)
                order.append(name)

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(tagged, f"bg{i}", request(p, 200, "background"))
                await engine.wait_until(lambda s: len(s.running) == 4)
                nursery.start_soon(tagged, "chat", request(p, 5, "interactive"))
            assert order[0] == "chat"
