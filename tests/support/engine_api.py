"""Driving the engine's Python API from a test: a rendered chat prompt, a
greedy request, and a request's text and terminal event."""

from __future__ import annotations

from collections.abc import Sequence

from gezel_trio import Delta, Engine, Failed, Finished, GenerationRequest, SamplingParams


async def prompt_for(engine: Engine, text: str = "Tell me a story.") -> tuple[int, ...]:
    rendered = await engine.render_chat(
        [{"role": "user", "content": text}], template_kwargs={"enable_thinking": False}
    )
    return rendered.tokens


async def collect(engine: Engine, req: GenerationRequest) -> tuple[str, Finished]:
    parts: list[str] = []
    with engine.submit_nowait(req) as handle:
        async for _, event in handle:
            match event:
                case Delta(text=text):
                    parts.append(text)
                case Finished() as fin:
                    return "".join(parts), fin
                case Failed(error=error):
                    raise error
    raise AssertionError("no terminal event")


def greedy(prompt: Sequence[int], n: int, **kw: object) -> GenerationRequest:
    return GenerationRequest(
        tuple(prompt),
        max_tokens=n,
        sampling=SamplingParams(temperature=0.0),
        **kw,  # type: ignore[arg-type]
    )
