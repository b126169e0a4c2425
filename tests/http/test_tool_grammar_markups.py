"""``tool_grammar`` as the seed's client sends it, on the real MLX backend with
demo models that speak each family's tool-call markup (``tests/support/
markup_models.py``): the demo template's Hermes JSON, Qwen3-Coder XML, GLM
and Gemma 4.

The weights are random, so a call that parses and matches its schema here
is the grammar's doing alone, and the parser's: the call is forced
(``tool_choice: "required"``) with the client's ``tool_grammar`` beside it,
and its arguments are typed (enums and integers) so the grammar closes every
value within the budget.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import jsonschema
import pytest
import trio

from tests.support.inprocess import served
from tests.support.markup_models import markup_model

pytestmark = pytest.mark.slow

HANG = 120

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Bergen"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
MESSAGES = [{"role": "user", "content": "What is the weather like in Oslo this week?"}]

# The markup family of each model -> the tool_grammar.format the seed's client sends.
CLIENT_FORMAT = {"hermes": "hermes", "qwen3_coder": "hermes", "glm": "glm", "gemma4": "gemma"}


@pytest.fixture(scope="module", params=list(CLIENT_FORMAT))
def family_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, dense_model: Path
) -> Iterator[tuple[str, Path]]:
    family: str = request.param
    if family == "hermes":
        yield family, dense_model
        return
    base = tmp_path_factory.mktemp("markup")
    yield family, markup_model(dense_model, family, base / f"demo-{family}")


def body(family: str, mode: str, **extra: Any) -> dict[str, Any]:
    return {
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "tool_grammar": {"format": CLIENT_FORMAT[family], "mode": mode},
        "max_tokens": 96,
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False},
        **extra,
    }


def streamed_calls(lines: list[str]) -> tuple[str, list[dict[str, Any]], str | None]:
    """Content, tool calls and finish reason, read from SSE lines the way
    OpenAI's SDK adds up deltas."""
    content, calls, finish = "", {}, None
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                fn = tc.get("function") or {}
                call["name"] += fn.get("name") or ""
                call["arguments"] += fn.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return content, [calls[k] for k in sorted(calls)], finish


@pytest.mark.parametrize(
    ("mode", "choice"),
    [
        ("name-and-params", {"type": "function", "function": {"name": "get_weather"}}),
        ("name-only", "required"),
    ],
)
async def test_a_forced_turn_of_each_markup_yields_a_call_that_validates(
    family_model: tuple[str, Path], mode: str, choice: Any
) -> None:
    family, model = family_model
    with trio.fail_after(HANG):
        async with served(model) as (engine, url), httpx.AsyncClient(base_url=url) as client:
            assert engine.info.tool_format == family
            r = await client.post(
                "/v1/chat/completions", json=body(family, mode, tool_choice=choice), timeout=HANG
            )
            assert r.status_code == 200, r.text
            answer = r.json()["choices"][0]
            assert answer["finish_reason"] == "tool_calls", answer
            (call,) = answer["message"]["tool_calls"]
            name = call["function"]["name"]
            args = json.loads(call["function"]["arguments"])
            jsonschema.validate(args, SCHEMAS[name])

            # Streamed: the same call, assembled from its deltas.
            lines: list[str] = []
            async with client.stream(
                "POST",
                "/v1/chat/completions",
                json=body(family, mode, tool_choice=choice, stream=True),
                timeout=HANG,
            ) as s:
                assert s.status_code == 200
                lines = [line async for line in s.aiter_lines()]
            _content, calls, finish = streamed_calls(lines)
            assert finish == "tool_calls"
            assert calls == [{"name": name, "arguments": call["function"]["arguments"]}]


async def test_calls_in_free_text_name_only_declared_tools(
    family_model: tuple[str, Path],
) -> None:
    """Not forced, the model pushed towards the call opener (token bias on
    its id): every call it opens names a declared tool. (Its free arguments
    rarely close on random weights within the budget: only names are
    checked.)"""
    family, model = family_model
    with trio.fail_after(HANG):
        async with served(model) as (_e, url), httpx.AsyncClient(base_url=url) as client:
            payload = body(family, "name-only", temperature=1.0, max_tokens=48)
            payload.pop("tool_choice")
            names: list[str] = []
            for seed in range(3):
                # Id 6 is the call opener in each of these vocabularies.
                payload.update(seed=seed, logit_bias={"6": 60})
                r = await client.post("/v1/chat/completions", json=payload, timeout=HANG)
                assert r.status_code == 200, r.text
                calls = r.json()["choices"][0]["message"].get("tool_calls") or []
                names += [c["function"]["name"] for c in calls]
            assert names
            assert set(names) <= set(SCHEMAS)


async def test_a_bad_format_or_mode_is_a_400_and_an_unknown_key_is_named(dense_model: Path) -> None:
    with trio.fail_after(HANG):
        async with served(dense_model) as (_e, url), httpx.AsyncClient(base_url=url) as client:
            for grammar in (
                {"format": "llama", "mode": "name-only"},
                {"format": "hermes", "mode": "everything"},
            ):
                payload = {**body("hermes", "name-only"), "tool_grammar": grammar}
                payload.pop("tool_choice")
                r = await client.post("/v1/chat/completions", json=payload)
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["param"].startswith("tool_grammar"), error
            # A field of tool_grammar this server predates is ignored and named.
            grammar = {"format": "hermes", "mode": "name-only", "future_knob": 1}
            payload = {**body("hermes", "name-only"), "tool_grammar": grammar}
            payload.pop("tool_choice")
            r = await client.post("/v1/chat/completions", json=payload)
            assert r.status_code == 200, r.text
            assert r.headers["x-gezel-ignored-fields"] == "tool_grammar.future_knob"


# --- allowed_names: the tools a turn may call, all of them in the prompt ------

TIDE = {
    "type": "object",
    "properties": {"port": {"enum": ["Oslo", "Bergen"]}},
    "required": ["port"],
    "additionalProperties": False,
}
ROSTER = {**SCHEMAS, "get_tide": TIDE}
ROSTER_TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": s}} for n, s in ROSTER.items()
]
ALLOWED = ["get_weather", "get_tide"]


async def test_allowed_names_bound_a_forced_call_of_each_markup(
    family_model: tuple[str, Path],
) -> None:
    """``required`` over three tools, two allowed: over several seeds every
    call names an allowed tool (unbounded, these models pick ``get_time``
    on some of them) (the grammar forces the name on these
    random weights) and its arguments validate."""
    family, model = family_model
    with trio.fail_after(HANG):
        async with served(model) as (_e, url), httpx.AsyncClient(base_url=url) as client:
            names: list[str] = []
            for seed in range(4):
                payload = body(family, "name-and-params", temperature=1.0, seed=seed)
                payload["tools"] = ROSTER_TOOLS
                payload["tool_grammar"]["allowed_names"] = ALLOWED
                r = await client.post("/v1/chat/completions", json=payload, timeout=HANG)
                assert r.status_code == 200, r.text
                (call,) = r.json()["choices"][0]["message"]["tool_calls"]
                name = call["function"]["name"]
                jsonschema.validate(json.loads(call["function"]["arguments"]), ROSTER[name])
                names.append(name)
            assert set(names) <= set(ALLOWED), names


async def test_allowed_names_bound_calls_in_free_text(family_model: tuple[str, Path]) -> None:
    """Not forced, pushed towards the call opener (as above): every call
    opened names an allowed tool."""
    family, model = family_model
    with trio.fail_after(HANG):
        async with served(model) as (_e, url), httpx.AsyncClient(base_url=url) as client:
            payload = body(family, "name-only", temperature=1.0, max_tokens=48)
            payload.pop("tool_choice")
            payload["tools"] = ROSTER_TOOLS
            payload["tool_grammar"]["allowed_names"] = ["get_tide"]
            names: list[str] = []
            for seed in range(3):
                payload.update(seed=seed, logit_bias={"6": 60})
                r = await client.post("/v1/chat/completions", json=payload, timeout=HANG)
                assert r.status_code == 200, r.text
                calls = r.json()["choices"][0]["message"].get("tool_calls") or []
                names += [c["function"]["name"] for c in calls]
            assert names
            assert set(names) == {"get_tide"}


@pytest.mark.parametrize(
    ("allowed", "choice", "param"),
    [
        ([], "required", "tool_grammar.allowed_names"),
        (["get_time", ""], "required", "tool_grammar.allowed_names[1]"),
        (["get_time", "get_moon"], "required", "tool_grammar.allowed_names[1]"),
        (["get_time"], {"type": "function", "function": {"name": "get_weather"}}, "tool_choice"),
        ("get_time", "required", "tool_grammar.allowed_names"),
    ],
)
async def test_bad_allowed_names_are_400_naming_them(
    dense_model: Path, allowed: Any, choice: Any, param: str
) -> None:
    with trio.fail_after(HANG):
        async with served(dense_model) as (_e, url), httpx.AsyncClient(base_url=url) as client:
            payload = body("hermes", "name-only", tool_choice=choice)
            payload["tool_grammar"]["allowed_names"] = allowed
            r = await client.post("/v1/chat/completions", json=payload)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == param, error
