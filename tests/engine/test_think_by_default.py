"""``--think-by-default``: a request that names no ``enable_thinking`` renders
with it true (the seed's default); one that names it keeps its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from gezel_trio import Engine, EngineConfig, open_engine

# Thinks only when told to, as the dense demo template and many others do.
TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    "{% if enable_thinking is defined and enable_thinking %}THINK{% else %}PLAIN{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hello"}]


async def _rendered(engine: Engine, **kwargs: object) -> str:
    rendered = await engine.render_chat(
        MESSAGES, template_override=TEMPLATE, template_kwargs=dict(kwargs)
    )
    return await engine.detokenize(list(rendered.tokens))


@pytest.mark.parametrize("on", [False, True])
async def test_a_request_without_enable_thinking_follows_the_setting(
    dense_model: Path, on: bool
) -> None:
    with trio.fail_after(120):
        async with open_engine(
            EngineConfig.from_flags(model=dense_model, think_by_default=on)
        ) as engine:
            assert (await _rendered(engine)).endswith("THINK" if on else "PLAIN")
            # A request that names the switch decides for itself either way.
            assert (await _rendered(engine, enable_thinking=False)).endswith("PLAIN")
            assert (await _rendered(engine, enable_thinking=True)).endswith("THINK")
