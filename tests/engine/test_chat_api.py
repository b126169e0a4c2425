"""The chat-level engine API: messages in, shaped events out.

The scripted engine checks the event contract deterministically under
MockClock; the real MLX engine on the demo models checks the shaping
(forced tool calls, reasoning, logprobs) and that leaving a chat's ``with``
block withdraws it like any request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from gezel_trio import (
    ChatFinished,
    ChatLogprobs,
    EngineConfig,
    Failed,
    InvalidRequest,
    ReasoningDelta,
    SamplingParams,
    TextDelta,
    ToolCallDelta,
    ToolCallDone,
    open_engine,
)
from gezel_trio.testing import ScriptedBackend, open_test_engine

GREEDY = SamplingParams(temperature=0.0)
MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What time is it in Oslo?"},
]
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a city",
            "parameters": {
                "type": "object",
                # An enum keeps the random-weight model's string short; closing a
                # forced call within its budget is mlx/constraints.py's steer.
                "properties": {"city": {"type": "string", "enum": ["Oslo", "Bergen"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]


def test_a_chat_yields_text_then_exactly_one_terminal_event() -> None:
    async def scenario() -> None:
        async with open_test_engine(ScriptedBackend()) as t:
            events = []
            with await t.engine.chat(MESSAGES, max_tokens=7, sampling=GREEDY) as chat:
                assert chat.prompt_tokens == len(chat.prepared.request.prompt)
                events = [e async for _, e in chat]
            text = "".join(e.text for e in events if isinstance(e, TextDelta))
            terminal = [e for e in events if isinstance(e, ChatFinished | Failed)]
            assert terminal == [events[-1]]
            finished = events[-1]
            assert isinstance(finished, ChatFinished)
            assert finished.reason == "length"
            assert finished.usage.output_tokens == 7
            assert finished.message == {"role": "assistant", "content": text}
            assert len(text) == 7
            await t.engine.wait_until(lambda s: s.live == 0)

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def test_leaving_the_block_withdraws_the_chat() -> None:
    async def scenario() -> None:
        async with open_test_engine(ScriptedBackend()) as t:
            with await t.engine.chat(MESSAGES, max_tokens=1000, ignore_eos=True) as chat:
                async for _, event in chat:
                    if isinstance(event, TextDelta):
                        break
            state = await t.engine.wait_until(lambda s: s.running == () and s.live == 0)
            assert state.recent_removals[-1].rid == chat.rids[0]
            # What it computed is cached: the same chat again reuses it.
            with await t.engine.chat(MESSAGES, max_tokens=1) as again:
                events = [e async for _, e in again]
            finished = events[-1]
            assert isinstance(finished, ChatFinished)
            assert finished.usage.cached_tokens == again.prompt_tokens - 1

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_bad_request_fails_before_anything_is_queued() -> None:
    async def scenario() -> None:
        # Strict: by default such a max_tokens is cut to what fits.
        async with open_test_engine(ScriptedBackend(), strict_max_tokens=True) as t:
            with pytest.raises(InvalidRequest) as err:
                await t.engine.chat(MESSAGES, max_tokens=10**9)
            assert err.value.param == "max_tokens"
            assert t.engine.state().live == 0

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.slow
async def test_a_forced_tool_call_arrives_as_deltas_then_one_whole_call(
    dense_model: Path,
) -> None:
    with trio.fail_after(120):
        async with open_engine(EngineConfig(model=dense_model)) as engine:
            chat = await engine.chat(
                MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=120, sampling=GREEDY
            )
            with chat:
                events = [e async for _, e in chat]
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    (done,) = [e for e in events if isinstance(e, ToolCallDone)]
    finished = events[-1]
    assert isinstance(finished, ChatFinished)
    assert finished.reason == "tool_calls"
    assert (deltas[0].id, deltas[0].name, deltas[0].arguments) == (done.id, "get_time", "")
    assert "".join(d.arguments for d in deltas) == done.arguments
    assert json.loads(done.arguments)["city"] in ("Oslo", "Bergen")
    (call,) = finished.message["tool_calls"]
    assert call == {
        "id": done.id,
        "type": "function",
        "function": {"name": "get_time", "arguments": done.arguments},
    }


@pytest.mark.slow
async def test_reasoning_and_logprobs_are_shaped(dense_model: Path) -> None:
    with trio.fail_after(120):
        async with open_engine(EngineConfig(model=dense_model)) as engine:
            chat = await engine.chat(
                MESSAGES,
                max_tokens=12,
                max_thinking_tokens=4,
                template_kwargs={"enable_thinking": True},
                top_logprobs=2,
                sampling=GREEDY,
                ignore_eos=True,
            )
            with chat:
                events = [e async for _, e in chat]
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    logprobs = [lp for e in events if isinstance(e, ChatLogprobs) for lp in e.items]
    finished = events[-1]
    assert isinstance(finished, ChatFinished)
    assert reasoning
    assert finished.message["reasoning_content"] == reasoning
    assert finished.message["content"] == text
    assert len(logprobs) == finished.usage.output_tokens == 12
    assert all(len(lp.top) == 2 for lp in logprobs)
