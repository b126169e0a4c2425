"""Forced output always completes, driven as a standard client does.

A forced tool call or a ``json_schema`` answer is one of two things: whole,
parseable and valid with ``finish_reason`` ``tool_calls`` / ``stop``, or
``length`` - never ``tool_calls`` over arguments that do not parse. Near its
budget the engine steers the grammar to the shortest valid ending, so on the
random-weight demo models (the hardest case: they never close a string on
their own) a reasonable budget always parses, sampling included; with
thinking on, the think block leaves room for the call.

The real hypercorn app over the real MLX engine, in this Trio run; the
official ``openai`` SDK in a worker thread.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import trio

from tests.support.inprocess import served

pytestmark = pytest.mark.slow

# Free strings, a free integer, open to more properties: nothing stops a
# random-weight model from writing forever but the budget steering.
LOOKUP = {
    "type": "object",
    "properties": {
        "query": {"type": "string"},
        "limit": {"type": "integer"},
        "filters": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["query", "limit"],
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}}
]
USER = [{"role": "user", "content": "Find the ledger entries for the harbour."}]


@pytest.fixture(params=["dense", "hybrid"])
def model(request: pytest.FixtureRequest, dense_model: Path, hybrid_model: Path) -> Path:
    return dense_model if request.param == "dense" else hybrid_model


@asynccontextmanager
async def client(model: Path) -> AsyncIterator[openai.OpenAI]:
    async with served(model) as (_engine, url):
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            yield sdk
        finally:
            sdk.close()


async def create(sdk: openai.OpenAI, **kw: Any) -> Any:
    return await trio.to_thread.run_sync(
        lambda: sdk.chat.completions.create(model="demo", messages=USER, **kw)
    )


async def test_a_forced_call_with_200_tokens_always_parses(model: Path) -> None:
    with trio.fail_after(300):
        async with client(model) as sdk:
            for seed in range(4):
                r = await create(
                    sdk,
                    tools=TOOLS,
                    tool_choice="required",
                    max_tokens=200,
                    temperature=1.0,
                    seed=seed,
                )
                choice = r.choices[0]
                assert choice.finish_reason == "tool_calls", (seed, choice)
                (call,) = choice.message.tool_calls
                jsonschema.validate(json.loads(call.function.arguments), LOOKUP)


async def test_a_forced_call_after_thinking_still_parses(model: Path) -> None:
    with trio.fail_after(300):
        async with client(model) as sdk:
            r = await create(
                sdk,
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "lookup"}},
                max_tokens=200,
                extra_body={"chat_template_kwargs": {"enable_thinking": True}},
            )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content  # it did think, within its budget
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), LOOKUP)


async def test_a_json_schema_answer_on_a_small_budget_parses(model: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"title": {"type": "string"}, "tags": {"type": "array"}},
        "required": ["title", "tags"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "note", "schema": schema}}
    with trio.fail_after(300):
        async with client(model) as sdk:
            for seed in range(3):
                r = await create(
                    sdk, response_format=fmt, max_tokens=40, temperature=1.0, seed=seed
                )
                assert r.choices[0].finish_reason == "stop"
                jsonschema.validate(json.loads(r.choices[0].message.content), schema)


async def test_a_budget_too_small_to_close_says_length(dense_model: Path) -> None:
    with trio.fail_after(300):
        async with client(dense_model) as sdk:
            r = await create(sdk, tools=TOOLS, tool_choice="required", max_tokens=4)
            streamed = await trio.to_thread.run_sync(
                lambda: list(
                    sdk.chat.completions.create(
                        model="demo",
                        messages=USER,
                        tools=TOOLS,
                        tool_choice="required",
                        max_tokens=4,
                        stream=True,
                    )
                )
            )
    assert r.choices[0].finish_reason == "length"
    reasons = [c.choices[0].finish_reason for c in streamed if c.choices]
    assert reasons[-1] == "length"
    assert "tool_calls" not in reasons
