"""Tools, structured outputs, thinking and logprobs through the real server
and the official ``openai`` SDK. The demo models have random
weights, so every valid tool call or JSON document here is the grammar's
doing alone."""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.support.process import Server

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Bergen", "Tromso"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MSG: list[Any] = [{"role": "user", "content": "What is the weather like in Oslo this week?"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def server(request: pytest.FixtureRequest) -> Server:
    """The session's server on each demo model (``tests.support.process``)."""
    server: Server = request.getfixturevalue(f"{request.param}_server")
    return server


def test_required_tool_call_streams_arguments_that_validate(server: Server) -> None:
    stream = server.client.chat.completions.create(
        model="demo",
        messages=MSG,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=1.0,
        seed=7,
        stream=True,
        extra_body=NO_THINK,
    )
    calls: dict[int, dict[str, Any]] = {}
    fragments = 0
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        for tc in choice.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": None, "id": None, "args": ""})
            if tc.id:
                assert entry["id"] is None, "the id comes once, on the first delta"
                entry["id"] = tc.id
                assert tc.type == "function"
                assert tc.function is not None
                entry["name"] = tc.function.name
            if tc.function is not None and tc.function.arguments:
                entry["args"] += tc.function.arguments
                fragments += 1
        finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert len(calls) == 1
    call = calls[0]
    assert call["name"] in SCHEMAS
    jsonschema.validate(json.loads(call["args"]), SCHEMAS[call["name"]])
    assert fragments > 1, "arguments stream incrementally, not as one piece"


def test_named_tool_call_non_streaming(server: Server) -> None:
    r = server.client.chat.completions.create(
        model="demo",
        messages=MSG,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=80,
        extra_body=NO_THINK,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    [call] = choice.message.tool_calls
    assert call.type == "function"
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME)


def test_json_schema_response_format_validates(server: Server) -> None:
    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
            "tags": {
                "type": "array",
                "items": {"type": "string", "enum": ["a", "b", "c"]},
                "maxItems": 3,
            },
        },
        "required": ["answer", "confidence", "tags"],
        "additionalProperties": False,
    }
    for seed in (1, 2, 3):
        r = server.client.chat.completions.create(
            model="demo",
            messages=MSG,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "verdict", "schema": schema, "strict": True},
            },
            max_tokens=80,
            temperature=1.0,
            seed=seed,
            # ignore_eos must not outlive the grammar: a complete document stops.
            extra_body={**NO_THINK, "ignore_eos": True},
        )
        assert r.choices[0].finish_reason == "stop"
        content = r.choices[0].message.content
        assert content is not None
        jsonschema.validate(json.loads(content), schema)


class Forecast(pydantic.BaseModel):
    city: Literal["Oslo", "Bergen"]
    rainy: bool
    wind: Literal["calm", "breezy", "stormy"]


def test_sdk_parse_helper_returns_the_model(server: Server) -> None:
    r = server.client.chat.completions.parse(
        model="demo", messages=MSG, response_format=Forecast, max_tokens=60, extra_body=NO_THINK
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Forecast)


def test_json_object_mode(server: Server) -> None:
    r = server.client.chat.completions.create(
        model="demo",
        messages=MSG,
        response_format={"type": "json_object"},
        max_tokens=200,
        temperature=0.7,
        seed=3,
        logit_bias={},
        extra_body=NO_THINK,
    )
    content = r.choices[0].message.content
    assert content is not None
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # an unbounded object may run out of tokens; it is still a prefix of one
        assert content.startswith("{")


def test_reasoning_is_split_from_content(server: Server) -> None:
    r = server.client.chat.completions.create(
        model="demo",
        messages=MSG,
        max_tokens=20,
        # Greedy: a sampled answer may write a second "<think>" of its own,
        # which is content (a tiny demo model did, once in many runs).
        temperature=0.0,
        extra_body={"max_thinking_tokens": 6, "chat_template_kwargs": {"enable_thinking": True}},
    )
    msg = r.choices[0].message.model_dump()
    assert msg["reasoning_content"]
    assert msg["reasoning"] == msg["reasoning_content"]
    assert "<think>" not in (msg["content"] or "")
    assert "</think>" not in msg["reasoning_content"]
    assert msg["content"], "the budget closed the think block, so an answer follows"


def test_streamed_reasoning_matches_non_streamed(server: Server) -> None:
    kw: dict[str, Any] = dict(
        model="demo",
        messages=MSG,
        max_tokens=16,
        temperature=0,
        extra_body={
            "max_thinking_tokens": 5,
            "ignore_eos": True,
            "chat_template_kwargs": {"enable_thinking": True},
        },
    )
    whole = server.client.chat.completions.create(**kw).choices[0].message.model_dump()
    assert whole["reasoning_content"]
    reasoning, content = "", ""
    for chunk in server.client.chat.completions.create(**kw, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
    assert reasoning == whole["reasoning_content"]
    assert content == whole["content"]


def test_thinking_is_off_by_default_on_the_demo_models(server: Server) -> None:
    r = server.client.chat.completions.create(
        model="demo", messages=MSG, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    msg = r.choices[0].message.model_dump()
    assert msg["content"]
    assert not msg.get("reasoning_content")


def test_a_budget_spent_thinking_leaves_content_empty_and_says_length(server: Server) -> None:
    r = server.client.chat.completions.create(
        model="demo",
        messages=MSG,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": True}},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content == ""
    assert choice.message.model_dump()["reasoning_content"]


def test_logprobs(server: Server) -> None:
    r = server.client.chat.completions.create(
        model="demo",
        messages=MSG,
        max_tokens=5,
        logprobs=True,
        top_logprobs=3,
        extra_body={**NO_THINK, "ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert lp is not None
    assert lp.content is not None
    assert len(lp.content) == 5
    for item in lp.content:
        assert item.logprob <= 0
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.logprob - 1e-4


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {
                            "type": "object",
                            "properties": {"a": {"type": "string", "pattern": "(("}},
                        },
                    },
                }
            },
            "response_format",
        ),
        ({"tool_choice": "required"}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_invalid_constraints_are_400_naming_the_field(
    server: Server, extra: dict[str, Any], param: str
) -> None:
    body = json.dumps({"messages": MSG, "max_tokens": 4, **extra}).encode()
    r = server.post(body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_sdk_error_is_bad_request(server: Server) -> None:
    with pytest.raises(openai.BadRequestError):
        server.client.chat.completions.create(
            model="demo", messages=MSG, tool_choice="required", max_tokens=4
        )


def test_name_only_grammar_allows_parallel_calls(server: Server) -> None:
    """With only the names constrained and the model pushed towards
    ``<tool_call>`` (token bias), it emits several calls in one turn; every
    name is a known tool, streamed or not."""
    counts = []
    for seed in range(5):
        r = server.client.chat.completions.create(
            model="demo",
            messages=MSG,
            tools=TOOLS,
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            logit_bias={"6": 60},  # <tool_call> in the demo vocabulary
            extra_body={**NO_THINK, "tool_grammar": {"mode": "name-only"}},
        )
        calls = r.choices[0].message.tool_calls or []
        assert all(c.function.name in SCHEMAS for c in calls)
        assert len({c.id for c in calls}) == len(calls)
        counts.append(len(calls))
    assert max(counts) >= 2, counts
