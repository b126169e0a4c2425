"""``tool_grammar`` (format x mode) and forced calls in every markup a grammar
is built for: Hermes JSON, Qwen3-Coder XML, GLM and Gemma 4.

As in ``test_grammar``, llguidance's own matcher runs over a byte-level
tokenizer (one token per byte plus each markup's special tokens), so what a
test feeds is exactly the grammar's language, independent of any model.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest

from gezel_trio.core.errors import InvalidRequest
from gezel_trio.shaping.grammar import (
    TOOL_GRAMMAR_FORMATS,
    Constraint,
    ToolGrammarHint,
    parser_limits,
    tool_grammar_hint,
)
from gezel_trio.shaping.toolcalls import GEMMA4, GLM, HERMES, QWEN3_CODER, ToolFormat, collect
from gezel_trio.shaping.toolcalls import ToolCallSplitter as Splitter
from tests.support.grammar import accepts, build, byte_tokenizer

Q = '<|"|>'
SPECIALS = ["<|im_end|>", "<tool_call>", "</tool_call>", "<|tool_call>", "<tool_call|>", Q]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
LIST = {"type": "function", "function": {"name": "list", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, LIST]


@pytest.fixture(scope="module")
def tok() -> Any:
    return byte_tokenizer(SPECIALS)


# How each markup writes a call (as its chat template renders one).
def hermes(name: str, args: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def xml(name: str, args: dict[str, Any]) -> str:
    body = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
        for k, v in args.items()
    )
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def glm(name: str, args: dict[str, Any]) -> str:
    body = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}"
        "</arg_value>\n"
        for k, v in args.items()
    )
    return f"<tool_call>{name}\n{body}</tool_call>"


def gemma_value(v: Any) -> str:
    if isinstance(v, str):
        return f"{Q}{v}{Q}"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{gemma_value(x)}" for k, x in sorted(v.items())) + "}"
    if isinstance(v, list):
        return "[" + ",".join(gemma_value(x) for x in v) + "]"
    return json.dumps(v)


def gemma(name: str, args: dict[str, Any]) -> str:
    return f"<|tool_call>call:{name}{gemma_value(args)}<tool_call|>"


WRITERS = {"hermes": hermes, "qwen3_coder": xml, "glm": glm, "gemma4": gemma}
PARSERS: dict[str, ToolFormat] = {"hermes": HERMES, "qwen3_coder": QWEN3_CODER, "glm": GLM}
PARSERS["gemma4"] = GEMMA4
FORMATS = list(WRITERS)


def grammar(fmt: str, mode: str | None = None, **kw: Any) -> Constraint:
    hint = None if mode is None else {"mode": mode}
    c = build(tools=TOOLS, tool_grammar=hint, tool_format=fmt, **kw)
    assert c is not None
    return c


def parsed(fmt: str, text: str) -> list[tuple[str, Any]]:
    s = Splitter(PARSERS[fmt])
    _content, calls = collect(s.feed(text) + s.finish())
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


GOOD = {"city": "Oslo", "days": 3}


# --- the field ------------------------------------------------------------------


def test_the_seed_clients_hints_are_read() -> None:
    assert tool_grammar_hint(None) is None
    assert tool_grammar_hint({"format": "hermes", "mode": "name-and-params"}) == (
        ToolGrammarHint("hermes", "name-and-params")
    )
    assert tool_grammar_hint({"format": "gemma", "mode": "name-only"}) == (
        ToolGrammarHint("gemma", "name-only")
    )
    # The seed's default mode, and no format: the template's markup.
    assert tool_grammar_hint({}) == ToolGrammarHint(None, "name-and-params")


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ({"format": "llama"}, "tool_grammar.format must be one of"),
        ({"mode": "names"}, 'tool_grammar.mode must be "name-only" or "name-and-params"'),
        ({"mode": "name-only", "strict": True}, "not strict"),
        ("name-only", "must be an object"),
    ],
)
def test_bad_hints_are_400_naming_tool_grammar(value: Any, fragment: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        build(tools=TOOLS, tool_grammar=value)
    assert exc.value.param == "tool_grammar"
    assert fragment in exc.value.message


def test_each_client_format_names_its_families() -> None:
    # The seed's "hermes" is the <tool_call> family: Qwen 3.5/3.6 templates
    # are Qwen3-Coder XML inside it.
    assert ToolGrammarHint("hermes", "name-only").agrees_with("qwen3_coder")
    assert ToolGrammarHint("hermes", "name-only").agrees_with("hermes")
    assert not ToolGrammarHint("gemma", "name-only").agrees_with("hermes")
    # Each family's own name, and the seed client's "gemma" for Gemma 4.
    assert set(TOOL_GRAMMAR_FORMATS) == {"hermes", "gemma4", "gemma", "glm", "qwen3_coder"}


def test_the_seed_clients_gemma_names_the_family_its_own_name_does() -> None:
    for name in ("gemma4", "gemma"):
        assert tool_grammar_hint({"format": name}) == ToolGrammarHint(name, "name-and-params")
        assert ToolGrammarHint(name, "name-only").agrees_with(GEMMA4.name)
        assert not ToolGrammarHint(name, "name-only").agrees_with("glm")
    assert TOOL_GRAMMAR_FORMATS["gemma"] == TOOL_GRAMMAR_FORMATS["gemma4"] == ("gemma4",)


def test_a_format_that_disagrees_with_the_template_uses_the_templates_markup(tok: Any) -> None:
    c = build(
        tools=TOOLS, tool_grammar={"format": "gemma", "mode": "name-only"}, tool_format="hermes"
    )
    assert c is not None
    assert accepts(tok, c, hermes("list", {}))
    assert not accepts(tok, c, gemma("list", {}))


def test_the_generic_format_refuses_calls_in_free_text() -> None:
    for mode in ("name-only", "name-and-params"):
        with pytest.raises(InvalidRequest) as exc:
            grammar("generic", mode)
        assert exc.value.param == "tool_grammar"


# --- every markup, both modes ---------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", ["name-only", "name-and-params"])
def test_calls_among_free_text_name_declared_tools_and_parse(tok: Any, fmt: str, mode: str) -> None:
    write = WRITERS[fmt]
    c = grammar(fmt, mode, llg_tokenizer=tok)
    assert c.kind == "tool_name"
    assert accepts(tok, c, "")
    assert accepts(tok, c, "No call, just {braces} and </tool_call> text.", special=False)
    text = "Let me look. " + write("get_weather", GOOD) + "\n" + write("list", {"x": [1]}) + " ok"
    assert accepts(tok, c, text)
    assert parsed(fmt, text) == [("get_weather", GOOD), ("list", {"x": [1]})]
    assert not accepts(tok, c, write("rm_rf", {}))
    # A call spelled with ordinary tokens would escape the grammar.
    assert not accepts(tok, c, write("rm_rf", {}), special=False)


@pytest.mark.parametrize("fmt", FORMATS)
def test_name_and_params_holds_arguments_to_the_schema(tok: Any, fmt: str) -> None:
    write = WRITERS[fmt]
    strict = grammar(fmt, "name-and-params")
    loose = grammar(fmt, "name-only")
    for bad in (
        {"days": 3},  # "city" is required
        {"city": "Oslo", "days": 9},  # above the maximum
        {"city": "Oslo", "unit": "k"},  # not in the enum
        {"city": "Oslo", "extra": "x"},  # not declared
    ):
        assert not accepts(tok, strict, write("get_weather", bad)), bad
        if fmt != "gemma4" or "unit" not in bad:
            # name-only: any well-formed arguments
            assert accepts(tok, loose, write("get_weather", bad)), bad
    assert accepts(tok, strict, write("get_weather", {"city": "Oslo", "unit": "f"}))
    # A tool whose schema declares no properties takes any arguments.
    assert accepts(tok, strict, write("list", {"anything": "goes"}))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_forced_call_in_each_markup_is_one_call_and_nothing_else(tok: Any, fmt: str) -> None:
    write = WRITERS[fmt]
    c = build(
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        tool_grammar={"format": "hermes", "mode": "name-only"},
        tool_format=fmt,
        llg_tokenizer=tok,
    )
    assert c is not None
    assert c.kind == "tool_call"
    assert accepts(tok, c, write("get_weather", GOOD))
    assert not accepts(tok, c, "Sure. " + write("get_weather", GOOD))
    assert not accepts(tok, c, write("list", {}))
    assert not accepts(tok, c, write("get_weather", {"days": 2}))


@pytest.mark.parametrize("fmt", ["qwen3_coder", "glm", "gemma4"])
def test_json_answer_or_a_call_in_a_markup(tok: Any, fmt: str) -> None:
    c = build(
        response_format={"type": "json_object"}, tools=TOOLS, tool_format=fmt, llg_tokenizer=tok
    )
    assert c is not None
    assert c.kind == "json_or_tool_call"
    assert accepts(tok, c, '{"a": 1}')
    assert accepts(tok, c, WRITERS[fmt]("get_weather", GOOD))
    assert not accepts(tok, c, "hello")


# --- markup details ---------------------------------------------------------------


def test_markups_steer_to_their_own_endings_and_json_needs_none() -> None:
    assert grammar("hermes", "name-only").closing_texts == ()
    assert "</parameter>\n" in grammar("qwen3_coder", "name-only").closing_texts
    assert "</arg_value>" in grammar("glm", "name-only").closing_texts
    assert Q in grammar("gemma4", "name-only").closing_texts
    assert grammar("gemma4", "name-only").special_tokens == ("<|tool_call>", "<tool_call|>", Q)


def test_qwen3_coder_values_are_free_text_up_to_the_closing_tag(tok: Any) -> None:
    c = grammar("qwen3_coder", "name-and-params")
    multi = {"city": 'Oslo\n<b>x</b> "q" {}', "days": 2}
    assert accepts(tok, c, xml("get_weather", multi))
    assert parsed("qwen3_coder", xml("get_weather", multi)) == [("get_weather", multi)]
    assert not accepts(tok, c, xml("get_weather", {"city": "a</parameter>b"}))


def test_glm_newlines_are_optional_as_in_glm_4_7(tok: Any) -> None:
    c = grammar("glm", "name-and-params")
    text = glm("get_weather", GOOD).replace("\n", "")
    assert accepts(tok, c, text)
    assert parsed("glm", text) == [("get_weather", GOOD)]


def test_gemma4_keys_come_sorted_and_strings_cannot_spell_the_delimiter(tok: Any) -> None:
    c = grammar("gemma4", "name-and-params")
    assert accepts(
        tok, c, f"<|tool_call>call:get_weather{{city:{Q}a, {{b}}{Q},days:2}}<tool_call|>"
    )
    # The template sorts keys (dictsort): days before city is not its order.
    assert not accepts(tok, c, f"<|tool_call>call:get_weather{{days:2,city:{Q}a{Q}}}<tool_call|>")
    ids = tok.tokenize_str(f"<|tool_call>call:get_weather{{city:{Q}a", parse_special=True)
    ids += tok.greedy_tokenize('<|"|>')  # the delimiter's characters as ordinary tokens
    ids += tok.tokenize_str(f"b{Q}}}<tool_call|>", parse_special=True)
    m = llguidance.LLMatcher(tok, c.grammar, limits=parser_limits(), log_level=0)
    assert not (m.consume_tokens(ids) and m.is_accepting())


def test_the_models_thinking_tokens_may_open_and_close_in_free_text() -> None:
    tok = byte_tokenizer([*SPECIALS, "<think>", "</think>"])
    text = "<think>\nplan</think>\n" + glm("list", {})
    plain = grammar("glm", "name-only", llg_tokenizer=tok)
    assert not accepts(tok, plain, text)
    thinking = grammar("glm", "name-only", llg_tokenizer=tok, text_tokens=("<think>", "</think>"))
    assert accepts(tok, thinking, text)
    assert not accepts(tok, thinking, "<think>" + glm("rm", {}))


def test_a_tokenizer_without_the_markups_tokens_is_refused() -> None:
    plain = byte_tokenizer(["<|im_end|>", "<tool_call>", "</tool_call>"])
    with pytest.raises(InvalidRequest) as exc:
        grammar("gemma4", "name-only", llg_tokenizer=plain)
    assert exc.value.param == "tool_grammar"
