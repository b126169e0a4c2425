"""Compiling response_format / tool_choice / tool_grammar into llguidance grammars.

No MLX here. To check what a grammar accepts, each test runs llguidance's own
matcher over a byte-level tokenizer built in-process with ``tokenizers`` (one
token per byte plus the Hermes special tokens), so any text can be fed and
the result is exactly the grammar's language, independent of any model.
"""

from __future__ import annotations

import json
import time
from typing import Any

import attrs
import pytest

from gezel_trio.core.errors import InvalidRequest
from gezel_trio.shaping.grammar import (
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    Constraint,
    parser_limits,
)
from tests.support.grammar import SPECIALS, accepts, build, byte_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": 'Weather for a city. Braces } { and "quotes" must not confuse Lark.',
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": r"^[A-Z][a-z]*\}?$"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {"q": {"type": "string"}},
            "required": ["q"],
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def byte_tok() -> Any:
    return byte_tokenizer(SPECIALS)


def must_build(**kw: Any) -> Constraint:
    c = build(**kw)
    assert c is not None
    return c


def call(name: str, args: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


# --- what needs no constraint ---------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"response_format": {"type": "text"}},
        {"tools": [WEATHER], "tool_choice": "auto"},
        {"tools": [WEATHER]},
        {"tools": [WEATHER], "tool_choice": "none"},
        {"tools": [WEATHER], "tool_choice": "none", "tool_grammar": {"mode": "name-only"}},
    ],
)
def test_no_constraint(kw: dict[str, Any]) -> None:
    assert build(**kw) is None


# --- JSON -----------------------------------------------------------------


def test_json_object_is_any_object_in_compact_form(byte_tok: Any) -> None:
    c = must_build(response_format={"type": "json_object"})
    assert c.kind == "json_object"
    assert c.tool_names == ()
    assert c.special_tokens == ()
    assert accepts(byte_tok, c, '{"a": [1, 2], "b": {"c": null}}')
    assert accepts(byte_tok, c, "{}")
    assert not accepts(byte_tok, c, "[1, 2]")
    assert not accepts(byte_tok, c, '"text"')
    # json.dumps separators only: no whitespace for a weak model to loop on.
    assert not accepts(byte_tok, c, '{ "a": 1 }')
    assert not accepts(byte_tok, c, '{"a":1}')


def test_json_schema_is_enforced(byte_tok: Any) -> None:
    c = must_build(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        }
    )
    assert c.kind == "json_schema"
    assert accepts(byte_tok, c, '{"name": "Ada", "age": 36, "color": "red"}')
    assert not accepts(byte_tok, c, '{"name": "Ada", "age": 36}')
    assert not accepts(byte_tok, c, '{"name": "Ada", "age": 36, "color": "blue"}')
    assert not accepts(byte_tok, c, '{"name": "Ada", "age": "36", "color": "red"}')
    assert not accepts(byte_tok, c, '{"name": "Ada", "age": 36, "color": "red", "x": 1}')


def test_non_ascii_schemas(byte_tok: Any) -> None:
    schema = {"enum": ["café", "naïve ☕"], "description": "ünïcode } {"}
    c = must_build(response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    assert accepts(byte_tok, c, '"naïve ☕"')
    assert not accepts(byte_tok, c, '"cafe"')


def test_tool_choice_none_keeps_json_only(byte_tok: Any) -> None:
    c = must_build(response_format={"type": "json_object"}, tools=[WEATHER], tool_choice="none")
    assert c.kind == "json_object"
    assert not accepts(byte_tok, c, call("get_weather", {"city": "Oslo"}))


def test_client_x_guidance_options_are_replaced(byte_tok: Any) -> None:
    schema = {"type": "object", "x-guidance": {"whitespace_flexible": True}}
    c = must_build(response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    assert not accepts(byte_tok, c, '{ "a": 1 }')
    assert accepts(byte_tok, c, '{"a": 1}')


def test_strict_refuses_unsupported_keywords_and_lax_skips_them() -> None:
    schema = {"type": "string", "not": {"const": "x"}}
    with pytest.raises(InvalidRequest) as exc:
        build(
            response_format={
                "type": "json_schema",
                "json_schema": {"schema": schema, "strict": True},
            }
        )
    assert exc.value.param == "response_format"
    assert "not" in exc.value.message
    lax = build(response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    assert lax is not None
    assert lax.kind == "json_schema"


# --- tool calls -----------------------------------------------------------


def test_forced_tool_call_is_one_hermes_call_to_that_tool(byte_tok: Any) -> None:
    c = must_build(
        tools=[WEATHER, SEARCH],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert c.kind == "tool_call"
    assert c.tool_names == ("get_weather",)
    assert c.special_tokens == ("<tool_call>", "</tool_call>")
    assert accepts(byte_tok, c, call("get_weather", {"city": "Oslo"}))
    assert accepts(byte_tok, c, call("get_weather", {"city": "Oslo}", "days": 3}))
    assert not accepts(byte_tok, c, call("search", {"q": "Oslo"}))
    assert not accepts(byte_tok, c, call("get_weather", {"days": 3}))
    assert not accepts(byte_tok, c, call("get_weather", {"city": "oslo"}))
    assert not accepts(byte_tok, c, call("get_weather", {"city": "Oslo", "days": 9}))
    assert not accepts(byte_tok, c, "Sure! " + call("get_weather", {"city": "Oslo"}))
    # The tags must be the special tokens, not the same text in plain bytes.
    assert not accepts(byte_tok, c, call("get_weather", {"city": "Oslo"}), special=False)


def test_required_allows_any_one_tool_once(byte_tok: Any) -> None:
    c = must_build(tools=[WEATHER, SEARCH], tool_choice="required")
    assert c.kind == "tool_call"
    assert c.tool_names == ("get_weather", "search")
    assert accepts(byte_tok, c, call("get_weather", {"city": "Oslo"}))
    assert accepts(byte_tok, c, call("search", {"q": "rain"}))
    # A key the schema does not declare: JSON Schema admits it when the
    # schema is silent on other keys, but no tool takes it.
    assert not accepts(byte_tok, c, call("search", {"q": "rain", "extra": [1]}))
    assert not accepts(byte_tok, c, call("delete_all", {}))
    two = call("search", {"q": "a"}) + call("search", {"q": "b"})
    assert not accepts(byte_tok, c, two)
    assert not accepts(byte_tok, c, "")


def test_tool_without_parameters_takes_an_empty_object(byte_tok: Any) -> None:
    ping = {"type": "function", "function": {"name": "ping"}}
    c = must_build(tools=[ping], tool_choice="required")
    assert accepts(byte_tok, c, call("ping", {}))
    assert not accepts(byte_tok, c, call("ping", {"x": 1}))


def test_name_only_constrains_names_inside_free_text(byte_tok: Any) -> None:
    c = must_build(tools=[WEATHER, SEARCH], tool_grammar={"mode": "name-only"})
    assert c.kind == "tool_name"
    assert c.tool_names == ("get_weather", "search")
    assert accepts(byte_tok, c, "")
    assert accepts(byte_tok, c, "Just text, {braces} and </tool_call> are fine.\n", special=False)
    # Special tokens other than the call's own are not text.
    assert not accepts(byte_tok, c, "a </tool_call> b")
    assert not accepts(byte_tok, c, "a </think> b")
    # Arguments are any object: the schema is not enforced in this mode.
    assert accepts(byte_tok, c, "Let me look. " + call("get_weather", {"days": "x"}))
    both = call("search", {"q": "a"}) + "\nand " + call("get_weather", {}) + " done"
    assert accepts(byte_tok, c, both)
    assert not accepts(byte_tok, c, "Let me look. " + call("rm_rf", {}))
    assert not accepts(byte_tok, c, call("search", ["not", "an", "object"]))
    # A call spelled in plain text would escape the constraint: it is refused.
    assert not accepts(byte_tok, c, call("rm_rf", {}), special=False)
    assert not accepts(byte_tok, c, "a <tool_call> b", special=False)
    assert accepts(byte_tok, c, "a <tool_cal b", special=False)


def test_json_answer_or_tool_call_when_both_are_allowed(byte_tok: Any) -> None:
    c = must_build(
        response_format={"type": "json_schema", "json_schema": {"schema": PERSON}},
        tools=[WEATHER],
    )
    assert c.kind == "json_or_tool_call"
    assert accepts(byte_tok, c, '{"name": "Ada", "age": 36, "color": "green"}')
    assert accepts(byte_tok, c, call("get_weather", {"city": "Oslo"}))
    assert not accepts(byte_tok, c, '{"name": "Ada"}')
    assert not accepts(byte_tok, c, "hello")


def test_tokenizer_check_finds_missing_special_tokens() -> None:
    plain = byte_tokenizer(["<|im_end|>"])
    with pytest.raises(InvalidRequest) as exc:
        build(tools=[WEATHER], tool_choice="required", llg_tokenizer=plain)
    assert exc.value.param == "tool_choice"
    assert "<tool_call>" in exc.value.message
    # JSON needs no special token.
    assert build(response_format={"type": "json_object"}, llg_tokenizer=plain) is not None


# --- invalid requests -----------------------------------------------------


def _fn(name: str, params: Any = None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name}
    if params is not None:
        fn["parameters"] = params
    return {"type": "function", "function": fn}


INVALID: list[tuple[dict[str, Any], str, str]] = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "blob"}}}},
        "response_format",
        "blob",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "string", "pattern": "(["}},
            }
        },
        "response_format",
        "regex",
    ),
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": True}}},
        "response_format",
        "schema",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "number", "maximum": float("nan")}},
            }
        },
        "response_format",
        "JSON",
    ),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "nope",
    ),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "tool_choice"),
    ({"tool_choice": "required"}, "tools", "tools"),
    ({"tools": [], "tool_choice": "required"}, "tools", "tools"),
    (
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        "tools",
        "tools",
    ),
    (
        {
            "response_format": {"type": "json_object"},
            "tools": [WEATHER],
            "tool_choice": "required",
        },
        "response_format",
        "forced",
    ),
    (
        {"tools": [WEATHER, _fn("bad", {"type": "objectx"})], "tool_choice": "required"},
        "tools",
        "tools[1].function.parameters",
    ),
    ({"tools": [_fn("has space")], "tool_choice": "required"}, "tools", "tools[0]"),
    ({"tools": [_fn("a"), _fn("a")], "tool_choice": "required"}, "tools", "repeated"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools", "tools[0]"),
    ({"tools": [_fn("a", [1])], "tool_choice": "required"}, "tools", "parameters"),
    ({"tools": [WEATHER], "tool_grammar": {"mode": "strict"}}, "tool_grammar", "name-only"),
    ({"tool_grammar": {"mode": "name-only"}}, "tool_grammar", "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "tool_format": "mistral"}, "tool_format", ""),
]


@pytest.mark.parametrize(("kw", "param", "fragment"), INVALID)
def test_invalid_requests_name_their_field(kw: dict[str, Any], param: str, fragment: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        build(**kw)
    assert exc.value.param == param
    assert fragment in exc.value.message
    assert exc.value.status == 400


# --- hostile schemas: refused or compiled quickly, never a hang ------------


def _nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "h", "schema": schema}}


HOSTILE: list[tuple[str, dict[str, Any], str | None]] = [
    (
        "redos-patterns",
        {
            "type": "object",
            "properties": {f"p{i}": {"type": "string", "pattern": "(a+)+$"} for i in range(300)},
            "required": [f"p{i}" for i in range(300)],
        },
        None,
    ),
    ("enum-100k", {"enum": [f"value-{i}" for i in range(100_000)]}, "bytes"),
    ("enum-4k", {"enum": [f"value-{i}" for i in range(4_000)]}, None),
    ("nesting-500", _nested(500), "nested"),
    ("nesting-20", _nested(20), None),
    ("exponential-dfa", {"type": "string", "pattern": "^(a|b)*a(a|b){30}$"}, None),
    ("big-repeats", {"type": "string", "pattern": "^[a-z]{2000}[0-9]{2000}$"}, None),
    (
        "anyof-500",
        {
            "anyOf": [
                {"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(500)
            ]
        },
        None,
    ),
]


@pytest.mark.parametrize(
    ("schema", "refusal"), [(s, r) for _, s, r in HOSTILE], ids=[n for n, _, _ in HOSTILE]
)
def test_hostile_schemas_are_refused_or_compile_quickly(
    schema: dict[str, Any], refusal: str | None
) -> None:
    start = time.perf_counter()
    if refusal is None:
        assert build(response_format=_schema_format(schema)) is not None
    else:
        with pytest.raises(InvalidRequest) as exc:
            build(response_format=_schema_format(schema))
        assert exc.value.param == "response_format"
        assert refusal in exc.value.message
    assert time.perf_counter() - start < 2.0


def test_deeply_nested_json_is_refused_without_recursion() -> None:
    deep: Any = {}
    for _ in range(100_000):  # json.dumps would raise RecursionError on this
        deep = {"items": deep}
    with pytest.raises(InvalidRequest) as exc:
        build(response_format=_schema_format({"type": "array", **deep}))
    assert f"at most {MAX_SCHEMA_DEPTH}" in exc.value.message


def test_schema_size_bound_applies_to_tools_too() -> None:
    big = {"type": "object", "description": "x" * MAX_SCHEMA_BYTES}
    with pytest.raises(InvalidRequest) as exc:
        build(tools=[_fn("f", big)], tool_choice="required")
    assert exc.value.param == "tools"
    assert "bytes" in exc.value.message


def test_total_grammar_size_is_bounded() -> None:
    schema = {"type": "object", "description": "d" * (MAX_SCHEMA_BYTES // 2)}
    tools = [_fn(f"f{i}", schema) for i in range(10)]
    with pytest.raises(InvalidRequest) as exc:
        build(tools=tools, tool_choice="required")
    assert exc.value.param == "tools"
    assert "grammar" in exc.value.message


def test_parser_limits_are_the_documented_ones() -> None:
    limits = parser_limits()
    assert limits.step_lexer_fuel == 200_000
    assert limits.step_max_items == 50_000
    assert limits.max_lexer_states == 50_000
    assert limits.initial_lexer_fuel == 1_000_000
    assert limits.verbose_errors is False
    assert parser_limits() is not limits


def test_constraint_is_a_frozen_value_that_hides_its_grammar() -> None:
    c = must_build(response_format={"type": "json_object"})
    assert "grammar" not in repr(c)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        c.kind = "json_schema"  # type: ignore[misc]
    assert c == must_build(response_format={"type": "json_object"})


# --- the generic format (templates without tool syntax) -------------------


def generic_call(name: str, args: Any) -> str:
    return json.dumps({"tool_call": {"name": name, "arguments": args}})


def test_generic_forced_call_is_one_json_object(byte_tok: Any) -> None:
    c = must_build(tools=[WEATHER, SEARCH], tool_choice="required", tool_format="generic")
    assert c.kind == "tool_call"
    assert c.special_tokens == ()
    assert accepts(byte_tok, c, generic_call("get_weather", {"city": "Paris", "days": 2}))
    assert accepts(byte_tok, c, generic_call("search", {"q": "x"}))
    assert not accepts(byte_tok, c, generic_call("get_weather", {"days": 2}))
    assert not accepts(byte_tok, c, call("get_weather", {"city": "Paris"}))
    named = must_build(
        tools=[WEATHER, SEARCH],
        tool_choice={"type": "function", "function": {"name": "search"}},
        tool_format="generic",
    )
    assert not accepts(byte_tok, named, generic_call("get_weather", {"city": "Paris"}))


def test_generic_json_or_call(byte_tok: Any) -> None:
    c = must_build(
        tools=[WEATHER],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        tool_format="generic",
    )
    assert accepts(byte_tok, c, json.dumps({"name": "A", "age": 3, "color": "red"}))
    assert accepts(byte_tok, c, generic_call("get_weather", {"city": "Oslo"}))


def test_generic_name_only_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidRequest) as err:
        build(tools=[WEATHER], tool_grammar={"mode": "name-only"}, tool_format="generic")
    assert err.value.param == "tool_grammar"
