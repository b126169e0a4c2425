"""The generic tool format's prompt side: how tools, calls and results are
written into a conversation for a chat template that has no tool syntax
(the call side is in test_toolcalls.py and test_grammar.py; the default
model exercises both in tests/mlx/test_real_model.py)."""

from __future__ import annotations

import json
from typing import Any

from gezel_trio.shaping.prompt import generic_tool_messages

TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}


def test_tools_are_described_after_the_system_prompt() -> None:
    out = generic_tool_messages(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], [TOOL]
    )
    system = out[0]["content"]
    assert system.startswith("Be brief.\n\n")  # a shared system prefix stays a prefix
    assert json.dumps(TOOL) in system
    assert '{"tool_call": {"name": "<tool name>"' in system
    assert out[1] == {"role": "user", "content": "Hi"}


def test_a_system_turn_is_added_when_there_is_none() -> None:
    out = generic_tool_messages([{"role": "user", "content": "Hi"}], [TOOL])
    assert [m["role"] for m in out] == ["system", "user"]
    assert generic_tool_messages([{"role": "user", "content": "Hi"}], None) == [
        {"role": "user", "content": "Hi"}
    ]


def test_calls_and_results_become_text_the_model_can_read() -> None:
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 °C"},
    ]
    out = generic_tool_messages(history, None)
    # Exactly what the tool grammar generates, so the prompt cache can reuse it.
    assert out[1] == {
        "role": "assistant",
        "content": '{"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}}',
    }
    assert out[2] == {
        "role": "user",
        "content": '{"tool_response": {"name": "get_weather", "content": "-3 °C"}}',
    }
