"""Streaming tool-call splitting: Hermes JSON, Qwen3-Coder XML and Mistral markup.

Every test feeds text the way the engine does, piece by piece, with ids from
a counter so runs compare equal. The property tests cut the same text at
random places and require the same events, merged, as one whole piece. The
cost tests count work instead of timing it (every function call made, see
``work``): text four times as long must cost four times as much, never
sixteen. What that work takes in seconds is measured by ``python -m bench
toolcall_parsing``.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gezel_trio.shaping.toolcalls import (
    GEMMA4,
    GENERIC,
    GLM,
    HERMES,
    MISTRAL,
    QWEN3_CODER,
    CallArgs,
    CallEnd,
    CallStart,
    Content,
    ToolCallSplitter,
    ToolEvent,
    ToolFormat,
    collect,
    detect_format,
    resolve_format,
    string_parameters,
)

MiB = 1 << 20


def counter() -> Callable[[], str]:
    numbers = itertools.count()
    return lambda: f"call-{next(numbers)}"


def splitter(fmt: ToolFormat) -> ToolCallSplitter:
    return ToolCallSplitter(fmt, id_factory=counter())


def run(fmt: ToolFormat, pieces: Iterable[str]) -> list[ToolEvent]:
    s = splitter(fmt)
    events: list[ToolEvent] = []
    for piece in pieces:
        events += s.feed(piece)
    return events + s.finish()


def merged(events: list[ToolEvent]) -> list[ToolEvent]:
    """Adjacent Content, and adjacent CallArgs of one call, as one value."""
    out: list[ToolEvent] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, Content) and isinstance(last, Content):
            out[-1] = Content(last.text + e.text)
        elif isinstance(e, CallArgs) and isinstance(last, CallArgs) and last.index == e.index:
            out[-1] = CallArgs(e.index, last.fragment + e.fragment)
        else:
            out.append(e)
    return out


def whole(fmt: ToolFormat, text: str) -> list[ToolEvent]:
    return merged(run(fmt, [text]))


def call(index: int, name: str, args: str, *, malformed: bool = False) -> list[ToolEvent]:
    return [
        CallStart(index, f"call-{index}", name),
        CallArgs(index, args),
        CallEnd(index, malformed),
    ]


def hermes(name: str, args: Any, *, sep: str = "\n") -> str:
    body = json.dumps({"name": name, "arguments": args})
    return f"<tool_call>{sep}{body}{sep}</tool_call>"


# --- format detection ----------------------------------------------------------

QWEN25_TEMPLATE = (
    "For each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call>'
)
QWEN3_CODER_TEMPLATE = (
    "<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\n"
    "value_1\\n</parameter>\\n</function>\\n</tool_call>"
)
MISTRAL_TEMPLATE = "{{- '[TOOL_CALLS]' + tool.function.name + '[ARGS]' + arguments }}"


def test_the_family_is_read_from_the_template() -> None:
    assert detect_format(QWEN25_TEMPLATE) is HERMES
    assert detect_format(QWEN3_CODER_TEMPLATE) is QWEN3_CODER
    assert detect_format(MISTRAL_TEMPLATE) is MISTRAL


GLM_TEMPLATE = (
    "{{- '<tool_call>' + tc.name -}}{% for k, v in args.items() %}<arg_key>{{ k }}</arg_key>"
    "\n<arg_value>{{ v }}</arg_value>\n{% endfor %}</tool_call>"
)
GEMMA4_TEMPLATE = "{{- '<|tool_call>call:' + function['name'] + '{' -}}...{{- '}<tool_call|>' -}}"


def test_gemma4_and_glm_are_read_from_the_template() -> None:
    assert detect_format(GLM_TEMPLATE) is GLM
    assert detect_format(GEMMA4_TEMPLATE) is GEMMA4
    # GLM's template also has <tool_call>; Qwen3-Coder's has neither <arg_key>
    # nor Gemma's tokens.
    assert detect_format(QWEN3_CODER_TEMPLATE + GLM_TEMPLATE) is GLM


def test_unknown_families_are_not_guessed() -> None:
    assert detect_format(None) is None
    assert detect_format("") is None
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    # Mistral's older JSON-list form.
    assert detect_format("[TOOL_CALLS] [{{ calls | tojson }}]") is None


def test_a_template_without_tool_syntax_gets_the_generic_format() -> None:
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% endfor %}"
    assert resolve_format(chatml) is GENERIC
    assert resolve_format(QWEN25_TEMPLATE + "{% if tools %}{% endif %}") is HERMES
    # Tool syntax of a family we do not parse: no splitter, not the generic one.
    assert resolve_format("{% if tools %}{{ tools | tojson }}{% endif %}") is None
    assert resolve_format(None) is None


# --- the generic format (templates without tool syntax) ---------------------------


def generic(name: str, args: Any) -> str:
    # What the grammar generates: json.dumps separators, no other whitespace.
    return json.dumps({"tool_call": {"name": name, "arguments": args}}, ensure_ascii=False)


def test_generic_call_in_any_chunking() -> None:
    text = generic("get_weather", {"city": "Paris", "unit": {"c": [1, "}}"]}})
    expected = call(0, "get_weather", '{"city": "Paris", "unit": {"c": [1, "}}"]}}')
    assert whole(GENERIC, text) == expected
    # Closing braces that end arguments, call and wrapper may come as one token.
    assert merged(run(GENERIC, list(text))) == expected
    assert merged(run(GENERIC, [text[:-3], text[-3:]])) == expected


def test_generic_calls_among_text() -> None:
    text = f"Sure. {generic('a', {})}\n{generic('b', {'x': 1})} done"
    assert whole(GENERIC, text) == [
        Content("Sure. "),
        *call(0, "a", "{}"),
        *call(1, "b", '{"x": 1}'),
        Content(" done"),
    ]


def test_json_that_is_not_a_generic_call_stays_content() -> None:
    text = '{"answer": 42} and {"tool_call": "not an object"}'
    assert whole(GENERIC, text) == [Content(text)]


# --- Hermes ------------------------------------------------------------------------


def test_single_call() -> None:
    text = hermes("get_weather", {"city": "Paris"})
    assert run(HERMES, [text]) == call(0, "get_weather", '{"city": "Paris"}')


def test_name_is_announced_first_and_arguments_stream_as_generated() -> None:
    s = splitter(HERMES)
    assert s.feed("<tool_call>\n{") == []
    assert s.feed('"name": "f') == []
    assert s.feed('", "argu') == [CallStart(0, "call-0", "f")]
    assert s.feed('ments": {"a": "he') == [CallArgs(0, '{"a": "he')]
    assert s.feed('llo", "b": [1, 2') == [CallArgs(0, 'llo", "b": [1, 2')]
    assert s.feed("]}}") == [CallArgs(0, "]}"), CallEnd(0)]
    assert s.feed("\n</tool_call>") == []
    assert s.finish() == []
    assert s.call_count == 1


def test_several_calls_with_text_around_them() -> None:
    text = (
        "Let me check both.\n\n" + hermes("a", {"x": 1}) + "\n" + hermes("b", {}) + "\nBoth done."
    )
    assert whole(HERMES, text) == [
        Content("Let me check both.\n\n"),
        *call(0, "a", '{"x": 1}'),
        *call(1, "b", "{}"),
        Content("\nBoth done."),
    ]


def test_whitespace_after_the_last_call_is_layout() -> None:
    text = hermes("a", {}) + "\n\n  "
    assert whole(HERMES, text) == call(0, "a", "{}")


def test_text_between_calls_is_content() -> None:
    text = hermes("a", {}) + " and " + hermes("b", {})
    assert whole(HERMES, text) == [*call(0, "a", "{}"), Content(" and "), *call(1, "b", "{}")]


def test_arguments_before_the_name_wait_for_it() -> None:
    s = splitter(HERMES)
    assert s.feed('<tool_call>{"arguments": {"q": "x"}, ') == []
    assert s.feed('"name": "search"}</tool_call>') == [
        CallStart(0, "call-0", "search"),
        CallArgs(0, '{"q": "x"}'),
        CallEnd(0),
    ]


def test_arguments_as_a_json_string_are_decoded() -> None:
    inner = json.dumps({"path": "a\\b", "text": 'say "hi"\n', "e": "é😀"})
    text = hermes("write", inner)
    assert whole(HERMES, text) == call(0, "write", inner)


def test_an_empty_arguments_string_means_no_arguments() -> None:
    assert whole(HERMES, hermes("f", "")) == call(0, "f", "{}")


def test_missing_arguments_mean_no_arguments() -> None:
    assert whole(HERMES, '<tool_call>{"name": "now"}</tool_call>') == call(0, "now", "{}")


def test_parameters_is_accepted_for_arguments() -> None:
    text = '<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>'
    assert whole(HERMES, text) == call(0, "f", '{"a": 1}')


def test_other_members_are_skipped() -> None:
    text = '<tool_call>{"id": 7, "name": "f", "extra": [{"x": "}"}], "arguments": {}}</tool_call>'
    assert whole(HERMES, text) == call(0, "f", "{}")


TRICKY_ARGS = {
    "code": 'if (a) { return "}"; }\n',
    "quote": '"',
    "backslash": "\\",
    "marker": "</tool_call><tool_call>",
    "nested": {"deep": [[{"k": None}], True, False, -1.5e-3, 0]},
    "unicode": "天気 😀 \u2028",
}


@pytest.mark.parametrize("ensure_ascii", [True, False])
@pytest.mark.parametrize("indent", [None, 2])
def test_strings_and_nesting_do_not_end_the_call(ensure_ascii: bool, indent: int | None) -> None:
    args = json.dumps(TRICKY_ARGS, ensure_ascii=ensure_ascii, indent=indent)
    text = f'<tool_call>\n{{"name": "run", "arguments": {args}}}\n</tool_call>after'
    events = whole(HERMES, text)
    assert events == [*call(0, "run", args), Content("after")]
    # And one character at a time.
    assert merged(run(HERMES, text)) == events
    assert json.loads(args) == TRICKY_ARGS


def test_unicode_names_and_escaped_surrogate_pairs() -> None:
    text = '<tool_call>{"name": "天気", "arguments": "{\\"e\\": \\"\\ud83d\\ude00\\"}"}</tool_call>'
    assert whole(HERMES, text) == call(0, "天気", '{"e": "😀"}')
    assert merged(run(HERMES, text)) == call(0, "天気", '{"e": "😀"}')


def test_lone_surrogate_escapes_decode_to_the_replacement_character() -> None:
    text = '<tool_call>{"name": "f\\ud800", "arguments": "\\udc00x"}</tool_call>'
    assert whole(HERMES, text) == call(0, "f\ufffd", "\ufffdx")


def test_raw_control_characters_in_strings_are_escaped() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"code": "a\nb\tc"}}</tool_call>'
    [_, args, _] = whole(HERMES, text)
    assert isinstance(args, CallArgs)
    assert json.loads(args.fragment) == {"code": "a\nb\tc"}


def test_partial_opening_marker_is_held_back_then_released() -> None:
    s = splitter(HERMES)
    assert s.feed("a <tool_ca") == [Content("a ")]
    assert s.feed("lm down") == [Content("<tool_calm down")]
    assert s.feed(" <") == [Content(" ")]
    assert s.finish() == [Content("<")]


def test_a_missing_closing_brace_still_makes_a_good_call() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>next'
    assert whole(HERMES, text) == [*call(0, "f", '{"a": 1}'), Content("next")]


def test_cut_off_after_complete_arguments_is_a_good_call() -> None:
    assert whole(HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1}') == call(
        0, "f", '{"a": 1}'
    )


def test_cut_off_inside_the_arguments_is_malformed() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"a": [1, 2'
    assert whole(HERMES, text) == call(0, "f", '{"a": [1, 2', malformed=True)


def test_closing_marker_inside_unfinished_arguments_ends_the_call_malformed() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>after'
    assert whole(HERMES, text) == [*call(0, "f", '{"a": 1', malformed=True), Content("after")]


def test_breakage_after_the_start_ends_the_call_and_the_rest_is_content() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"a": 1]}</tool_call>'
    assert whole(HERMES, text) == [
        *call(0, "f", '{"a": 1', malformed=True),
        Content("]}</tool_call>"),
    ]


def test_junk_after_complete_arguments_keeps_the_call() -> None:
    text = '<tool_call>{"name": "f", "arguments": {}, oops}</tool_call>'
    assert whole(HERMES, text) == [*call(0, "f", "{}"), Content("oops}</tool_call>")]


def test_broken_arguments_end_the_call_at_the_offending_character() -> None:
    # An unescaped quote, the commonest way a model breaks its JSON: the call
    # stops at the character after it, and everything from there is read as
    # output again - the answer after the call, and the next call.
    text = (
        '<tool_call>{"name": "f", "arguments": {"text": "say "hi""}}</tool_call>\nDone. '
        + hermes("g", {})
    )
    expected = [
        *call(0, "f", '{"text": "say "', malformed=True),
        Content('hi""}}</tool_call>\nDone. '),
        *call(1, "g", "{}"),
    ]
    assert whole(HERMES, text) == expected
    assert merged(run(HERMES, text)) == expected


def test_invalid_json_inside_the_arguments_stops_their_stream() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"a": 1 2, "b": tru}}</tool_call>'
    assert whole(HERMES, text) == [
        *call(0, "f", '{"a": 1 ', malformed=True),
        Content('2, "b": tru}}</tool_call>'),
    ]


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>not json</tool_call>",
        "<tool_call></tool_call>",
        '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',
        '<tool_call>{"arguments": {"a": 1}, "arguments": {}}</tool_call>',
        '<tool_call>{"name" "f", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f\\x", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f\\n", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f\ng", "arguments": {}}</tool_call>',
        "<tool_call>{'name': 'f'}</tool_call>",
        '<tool_call>{"name": "unterminated',
        "<tool_call>",
        "<tool_call>\n",
    ],
)
def test_malformed_markup_before_the_name_is_content(text: str) -> None:
    assert whole(HERMES, text) == [Content(text)]
    assert merged(run(HERMES, text)) == [Content(text)]


def test_a_failed_call_does_not_hide_the_next_one() -> None:
    text = "<tool_call>" + hermes("f", {}, sep="")
    assert whole(HERMES, text) == [Content("<tool_call>"), *call(0, "f", "{}")]


def test_a_second_name_cannot_replace_the_first() -> None:
    text = '<tool_call>{"name": "f", "name": "g", "arguments": {}}</tool_call>'
    assert whole(HERMES, text) == [
        CallStart(0, "call-0", "f"),
        CallEnd(0, malformed=True),
        Content(': "g", "arguments": {}}</tool_call>'),
    ]


def test_a_format_needs_an_opening_marker() -> None:
    with pytest.raises(ValueError, match="start"):
        ToolFormat("broken", "", "", "json")


def test_feed_after_finish_is_an_error_and_finish_is_idempotent() -> None:
    s = splitter(HERMES)
    assert s.finish() == []
    assert s.finish() == []
    with pytest.raises(RuntimeError):
        s.feed("x")


def test_collect_builds_openai_tool_calls() -> None:
    text = "Checking.\n" + hermes("a", {"x": 1}) + hermes("b", "{}")
    assert collect(run(HERMES, text)) == (
        "Checking.\n",
        [
            {
                "id": "call-0",
                "type": "function",
                "function": {"name": "a", "arguments": '{"x": 1}'},
            },
            {"id": "call-1", "type": "function", "function": {"name": "b", "arguments": "{}"}},
        ],
    )


def test_default_ids_look_like_openai_ids() -> None:
    events = ToolCallSplitter(HERMES).feed(hermes("f", {}))
    start = events[0]
    assert isinstance(start, CallStart)
    assert start.id.startswith("call_")
    assert len(start.id) == len("call_") + 24


# --- Qwen3-Coder XML ---------------------------------------------------------------


def xml_call(name: str, params: dict[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_xml_call_with_typed_and_multiline_parameters() -> None:
    text = "I'll run it.\n" + xml_call(
        "run",
        {
            "command": "ls -la\ncd /tmp && echo '<b>'",
            "timeout": "30",
            "flags": '{"verbose": true}',
            "dry": "false",
            "ratio": "1.50",
            "label": "a < b",
        },
    )
    events = whole(QWEN3_CODER, text)
    args = (
        '{"command": "ls -la\\ncd /tmp && echo \'<b>\'", "timeout": 30, '
        '"flags": {"verbose": true}, "dry": false, "ratio": 1.50, "label": "a < b"}'
    )
    assert events == [Content("I'll run it.\n"), *call(0, "run", args)]
    assert json.loads(args)["command"] == "ls -la\ncd /tmp && echo '<b>'"


def test_xml_parameters_stream_one_by_one() -> None:
    s = splitter(QWEN3_CODER)
    assert s.feed("<tool_call>\n<function=get_weather") == []
    assert s.feed(">\n<parameter=city>\nPar") == [CallStart(0, "call-0", "get_weather")]
    assert s.feed("is\n</parameter>\n") == [CallArgs(0, '{"city": "Paris"')]
    assert s.feed("<parameter=days>\n3\n</para") == []
    assert s.feed("meter>\n</function>\n</tool_call>") == [CallArgs(0, ', "days": 3}'), CallEnd(0)]


def test_xml_without_parameters() -> None:
    assert whole(QWEN3_CODER, xml_call("now", {})) == call(0, "now", "{}")


def test_xml_several_calls_and_a_missing_function_end() -> None:
    text = (
        xml_call("a", {"x": "1"})
        + "\n<tool_call>\n<function=b>\n<parameter=y>\nz\n</parameter>\n</tool_call>\nok"
    )
    assert whole(QWEN3_CODER, text) == [
        *call(0, "a", '{"x": 1}'),
        *call(1, "b", '{"y": "z"}'),
        Content("\nok"),
    ]


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n<func>x</func>\n</tool_call>",
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call>\n<function=bad\nname>\n</function>\n</tool_call>",
        "<tool_call>\n<function=f",
        "<tool_call>\nplain words",
    ],
)
def test_xml_malformed_before_the_name_is_content(text: str) -> None:
    assert whole(QWEN3_CODER, text) == [Content(text)]
    assert merged(run(QWEN3_CODER, text)) == [Content(text)]


def test_xml_breakage_after_the_name_is_malformed() -> None:
    text = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<oops>\n</tool_call>"
    assert whole(QWEN3_CODER, text) == [
        *call(0, "f", '{"a": 1', malformed=True),
        Content("<oops>\n</tool_call>"),
    ]


def test_xml_cut_off_is_malformed() -> None:
    text = "<tool_call>\n<function=f>\n<parameter=a>\nunfinished"
    assert whole(QWEN3_CODER, text) == [CallStart(0, "call-0", "f"), CallEnd(0, True)]


# --- Gemma 4 ----------------------------------------------------------------------

Q = '<|"|>'


def test_gemma4_call_becomes_json_arguments() -> None:
    text = (
        f"Let me check.<|tool_call>call:get_weather{{city:{Q}Paris, "
        f'"FR"{Q},days:3,opts:{{units:[{Q}c{Q},1.5,true],x:null}},when:None}}<tool_call|>'
    )
    args = (
        '{"city": "Paris, \\"FR\\"", "days": 3, '
        '"opts": {"units": ["c", 1.5, true], "x": null}, "when": null}'
    )
    assert whole(GEMMA4, text) == [Content("Let me check."), *call(0, "get_weather", args)]
    assert json.loads(args)["city"] == 'Paris, "FR"'


def test_gemma4_strings_stream_as_they_are_generated() -> None:
    s = splitter(GEMMA4)
    assert s.feed("<|tool_call>call:wri") == []
    assert s.feed("te{path:<|") == [CallStart(0, "call-0", "write"), CallArgs(0, '{"path": ')]
    assert s.feed('"|>a\nb') == [CallArgs(0, '"a\\nb')]
    assert s.feed("\n") == [CallArgs(0, "\\n")]
    assert s.feed(f"{Q}}}<tool_call|>") == [CallArgs(0, '"}'), CallEnd(0)]


def test_gemma4_quoted_keys_words_and_empty_calls() -> None:
    text = f"<|tool_call>call:now{{}}<tool_call|><|tool_call>call:f{{{Q}k k{Q}:yes}}<tool_call|>"
    assert whole(GEMMA4, text) == [*call(0, "now", "{}"), *call(1, "f", '{"k k": "yes"}')]


@pytest.mark.parametrize(
    "text",
    [
        "<|tool_call>cal:f{}<tool_call|>",
        "<|tool_call>call:{}<tool_call|>",
        "<|tool_call>call:bad name{}<tool_call|>",
        "<|tool_call>call:f",
        "<|tool_call>plain words",
    ],
)
def test_gemma4_malformed_before_the_name_is_content(text: str) -> None:
    assert whole(GEMMA4, text) == [Content(text)]
    assert merged(run(GEMMA4, text)) == [Content(text)]


def test_gemma4_breakage_and_early_end_are_malformed() -> None:
    assert whole(GEMMA4, "<|tool_call>call:f{a:1<tool_call|>ok") == [
        *call(0, "f", '{"a": 1', malformed=True),
        Content("ok"),
    ]
    assert whole(GEMMA4, "<|tool_call>call:f{a::1}<tool_call|>") == [
        *call(0, "f", '{"a": ', malformed=True),
        Content(":1}<tool_call|>"),
    ]
    assert whole(GEMMA4, f"<|tool_call>call:f{{a:{Q}cut") == [
        *call(0, "f", '{"a": "cut', malformed=True)
    ]


# --- GLM ---------------------------------------------------------------------------


def glm_call(name: str, params: dict[str, str], nl: str = "\n") -> str:
    body = "".join(
        f"<arg_key>{k}</arg_key>{nl}<arg_value>{v}</arg_value>{nl}" for k, v in params.items()
    )
    return f"<tool_call>{name}{nl}{body}</tool_call>"


@pytest.mark.parametrize("nl", ["\n", ""], ids=["glm-4.5", "glm-4.7"])
def test_glm_call_with_typed_values(nl: str) -> None:
    text = "Checking.\n" + glm_call(
        "run", {"command": "ls <b>\n", "timeout": "30", "flags": '{"v": true}'}, nl
    )
    # A value is the text between its tags, newlines included.
    args = '{"command": "ls <b>\\n", "timeout": 30, "flags": {"v": true}}'
    assert whole(GLM, text) == [Content("Checking.\n"), *call(0, "run", args)]


def test_glm_pairs_stream_one_by_one() -> None:
    s = splitter(GLM)
    assert s.feed("<tool_call>get_wea") == []
    assert s.feed("ther\n<arg_key>ci") == [CallStart(0, "call-0", "get_weather")]
    assert s.feed("ty</arg_key>\n<arg_value>Oslo</arg_val") == []
    assert s.feed("ue>\n") == [CallArgs(0, '{"city": "Oslo"')]
    assert s.feed("</tool_call>") == [CallArgs(0, "}"), CallEnd(0)]


def test_glm_without_arguments_and_several_calls() -> None:
    text = "<tool_call>now</tool_call>\n" + glm_call("f", {"a": "x"})
    assert whole(GLM, text) == [*call(0, "now", "{}"), *call(1, "f", '{"a": "x"}')]


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>I think so</tool_call>",
        "<tool_call><arg_key>a</arg_key></tool_call>",
        '<tool_call>{"name": "f"}</tool_call>',
        "<tool_call>f",
    ],
)
def test_glm_malformed_before_the_name_is_content(text: str) -> None:
    assert whole(GLM, text) == [Content(text)]


def test_string_parameters_stay_strings_with_the_tools_schema() -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "zip": {"type": "string"},
                        "flag": {"enum": ["true", "false"]},
                        "n": {"type": "integer"},
                    },
                },
            },
        }
    ]
    known = string_parameters(tools)
    assert known == {"f": frozenset({"zip", "flag"})}
    params = {"zip": "01234", "flag": "true", "n": "5"}
    args = '{"zip": "01234", "flag": "true", "n": 5}'
    for fmt, text in ((QWEN3_CODER, xml_call("f", params)), (GLM, glm_call("f", params))):
        s = ToolCallSplitter(fmt, id_factory=counter(), string_params=known)
        assert merged(s.feed(text) + s.finish()) == call(0, "f", args)
        # Without the schema a value that looks like JSON is taken as JSON.
        assert json.loads(collect(run(fmt, [text]))[1][0]["function"]["arguments"])["flag"] is True


def test_glm_cut_off_between_pairs_is_a_good_call() -> None:
    # A stop string may take the closing marker.
    text = "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n"
    assert whole(GLM, text) == call(0, "f", '{"a": 1}')
    assert whole(GLM, "<tool_call>now\n") == call(0, "now", "{}")
    assert whole(GLM, text + "<arg_key>b</arg_key><arg_value>cut") == [
        *call(0, "f", '{"a": 1', malformed=True)
    ]


def test_glm_breakage_after_the_name_is_malformed() -> None:
    text = "<tool_call>f\n<arg_key>a</arg_key>\n<oops></tool_call>"
    assert whole(GLM, text) == [
        CallStart(0, "call-0", "f"),
        CallEnd(0, True),
        Content("<oops></tool_call>"),
    ]


# --- Mistral -----------------------------------------------------------------------


def test_mistral_calls() -> None:
    text = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}'
    assert whole(MISTRAL, text) == [
        Content("Sure."),
        *call(0, "get_weather", '{"city": "Paris"}'),
        *call(1, "now", "{}"),
    ]


def test_mistral_broken_arguments_do_not_hide_the_next_call() -> None:
    text = '[TOOL_CALLS]f[ARGS]{"a": "b"c"}[TOOL_CALLS]g[ARGS]{}'
    expected = [*call(0, "f", '{"a": "b"', malformed=True), Content('c"}'), *call(1, "g", "{}")]
    assert whole(MISTRAL, text) == expected
    assert merged(run(MISTRAL, text)) == expected


@pytest.mark.parametrize(
    "text", ["[TOOL_CALLS] is a token", "[TOOL_CALLS]f[ARG]{}", "[TOOL_CALLS][ARGS]{}"]
)
def test_mistral_malformed_is_content(text: str) -> None:
    assert whole(MISTRAL, text) == [Content(text)]


# --- properties --------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
json_objects = st.dictionaries(st.text(max_size=6), json_values, max_size=4)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,10}", fullmatch=True)
gaps = st.sampled_from(["", " ", "\n", "\n\n", "\t "])


@st.composite
def hermes_calls(draw: st.DrawFn) -> tuple[str, str, Any]:
    name, args = draw(names), draw(json_objects)
    dumps = draw(
        st.sampled_from(
            [
                lambda v: json.dumps(v),
                lambda v: json.dumps(v, ensure_ascii=False),
                lambda v: json.dumps(v, indent=1),
                lambda v: json.dumps(v, separators=(",", ":")),
            ]
        )
    )
    value = dumps(json.dumps(args)) if draw(st.booleans()) else dumps(args)
    members = [f'"name": {json.dumps(name)}', f'"arguments": {value}']
    if draw(st.booleans()):
        members.reverse()
    g = draw(gaps)
    return f"<tool_call>{g}{{{g}{', '.join(members)}{g}}}{g}</tool_call>", name, args


@st.composite
def xml_calls(draw: st.DrawFn) -> tuple[str, str, Any]:
    name = draw(names)
    params = draw(st.dictionaries(names, st.text(st.characters(exclude_characters="<"))))
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>", name, params


@st.composite
def mistral_calls(draw: st.DrawFn) -> tuple[str, str, Any]:
    name, args = draw(names), draw(json_objects)
    return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(args)}", name, args


def gemma_value(value: Any) -> str:
    """``value`` as Gemma 4's chat template writes it."""
    if isinstance(value, str):
        return f'<|"|>{value}<|"|>'
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{gemma_value(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, list):
        return "[" + ",".join(gemma_value(v) for v in value) + "]"
    return repr(value)


gemma_keys = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True)
gemma_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(exclude_characters="<"), max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(gemma_keys, inner, max_size=3),
    max_leaves=8,
)


@st.composite
def gemma_calls(draw: st.DrawFn) -> tuple[str, str, Any]:
    name = draw(names)
    args = draw(st.dictionaries(gemma_keys, gemma_values, max_size=4))
    return f"<|tool_call>call:{name}{gemma_value(args)}<tool_call|>", name, args


@st.composite
def glm_calls(draw: st.DrawFn) -> tuple[str, str, Any]:
    name = draw(names)
    params = draw(st.dictionaries(names, st.text(st.characters(exclude_characters="<"))))
    return glm_call(name, params, draw(st.sampled_from(["\n", ""]))), name, params


CALLS = {
    HERMES: hermes_calls(),
    QWEN3_CODER: xml_calls(),
    MISTRAL: mistral_calls(),
    GEMMA4: gemma_calls(),
    GLM: glm_calls(),
}
# Junk made of markup: marker pieces, JSON punctuation, escapes, tags.
JUNK_PIECES = [
    "<tool_call>", "</tool_call>", "<tool_ca", "</tool", "<", ">", "{", "}", "[", "]", '"', ":",
    ",", "\\", "\\u", "d83d", "name", '"name": "x"', '"arguments": ', "[TOOL_CALLS]", "[ARGS]",
    "<function=f>", "<parameter=p>", "</parameter>", "</function>", "\n", " ", "a", "1", "é",
    "<|tool_call>", "<tool_call|>", "call:", "call:f{", '<|"|>', "<|", "k:", "<arg_key>",
    "</arg_key>", "<arg_value>", "</arg_value>",
]  # fmt: skip
junk = st.lists(st.sampled_from(JUNK_PIECES), max_size=8).map("".join)


@st.composite
def outputs(draw: st.DrawFn, fmt: ToolFormat) -> str:
    parts = draw(st.lists(st.one_of(junk, CALLS[fmt].map(lambda c: c[0])), max_size=5))
    return "".join(parts)


@st.composite
def chunkings(draw: st.DrawFn, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    return [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]


def well_formed(events: list[ToolEvent]) -> bool:
    """Calls are numbered from 0 in order, each a start, arguments, then an end."""
    open_call, expected = None, 0
    for e in events:
        match e:
            case CallStart(index=index):
                if open_call is not None or index != expected:
                    return False
                open_call, expected = index, expected + 1
            case CallArgs(index=index):
                if index != open_call:
                    return False
            case CallEnd(index=index):
                if index != open_call:
                    return False
                open_call = None
    return open_call is None


@pytest.mark.parametrize("fmt", [HERMES, QWEN3_CODER, MISTRAL, GEMMA4, GLM], ids=lambda f: f.name)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_chunking_gives_the_same_events(fmt: ToolFormat, data: st.DataObject) -> None:
    text = data.draw(outputs(fmt))
    pieces = data.draw(chunkings(text))
    expected = whole(fmt, text)
    assert merged(run(fmt, pieces)) == expected
    assert merged(run(fmt, text)) == expected  # one character at a time
    assert well_formed(expected)


@pytest.mark.parametrize("fmt", [HERMES, QWEN3_CODER, MISTRAL, GEMMA4, GLM], ids=lambda f: f.name)
@settings(max_examples=100, deadline=None)
@given(text=st.text(), data=st.data())
def test_arbitrary_text_never_raises(fmt: ToolFormat, text: str, data: st.DataObject) -> None:
    text = data.draw(st.sampled_from([fmt.start, ""])) + text
    expected = whole(fmt, text)
    assert merged(run(fmt, data.draw(chunkings(text)))) == expected
    assert well_formed(expected)


def xml_value(v: str) -> Any:
    """What a Qwen3-Coder parameter value means without the tool's schema."""
    try:
        parsed = json.loads(v, parse_constant=lambda c: {}["not JSON: " + c])
    except (ValueError, KeyError, RecursionError):
        return v
    return v if isinstance(parsed, str) else parsed


@pytest.mark.parametrize("fmt", [HERMES, QWEN3_CODER, MISTRAL, GEMMA4, GLM], ids=lambda f: f.name)
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_valid_calls_come_out_whole(fmt: ToolFormat, data: st.DataObject) -> None:
    prose = st.text(st.characters(exclude_characters="<[{"), max_size=10)
    drawn = data.draw(st.lists(st.tuples(prose, CALLS[fmt]), max_size=4))
    tail = data.draw(prose)
    text = "".join(p + c[0] for p, c in drawn) + tail
    content, calls = collect(run(fmt, data.draw(chunkings(text))))
    assert [c["function"]["name"] for c in calls] == [name for _, (_, name, _) in drawn]
    for got, (_, (_, _, args)) in zip(calls, drawn, strict=True):
        parsed = json.loads(got["function"]["arguments"])
        if fmt in (QWEN3_CODER, GLM):
            args = {k: xml_value(v) for k, v in args.items()}
        assert parsed == args
    # Prose is content, except whitespace alone right after a call.
    expected, after_call = "", False
    for p in [*(p for p, _ in drawn), tail]:
        if not (after_call and not p.strip(" \t\n\r")):
            expected += p
        after_call = True
    assert content == expected


# --- cost --------------------------------------------------------------------------

ADVERSARIAL = {
    "opening markers": (HERMES, "<tool_call>" * (MiB // 11)),
    "partial markers": (HERMES, "<tool_ca" * (MiB // 8)),
    "nested arrays": (HERMES, '<tool_call>{"name": "f", "arguments": ' + "[" * MiB),
    "nested objects": (HERMES, '<tool_call>{"name": "f", "arguments": ' + '{"a":' * (MiB // 5)),
    "unterminated string": (
        HERMES,
        '<tool_call>{"name": "f", "arguments": {"a": "' + 'x\\"</tool_call>' * (MiB // 15),
    ),
    "escaped string": (
        HERMES,
        '<tool_call>{"name": "f", "arguments": "' + "\\u00e9\\n" * (MiB // 8),
    ),
    "name never comes": (HERMES, '<tool_call>{"arguments": {"a": "' + "y" * MiB),
    "xml opening tags": (QWEN3_CODER, "<tool_call><function=" * (MiB // 21)),
    "xml endless value": (
        QWEN3_CODER,
        "<tool_call><function=f><parameter=a>" + "</param" * (MiB // 7),
    ),
    "mistral junk": (MISTRAL, "[TOOL_CALLS]" * (MiB // 12)),
    "gemma endless string": (GEMMA4, '<|tool_call>call:f{a:<|"|>' + "<|" * (MiB // 2)),
    "gemma nested arrays": (GEMMA4, "<|tool_call>call:f{a:" + "[" * MiB),
    "glm endless value": (
        GLM,
        "<tool_call>f<arg_key>a</arg_key><arg_value>" + "</arg" * (MiB // 5),
    ),
}  # fmt: skip


# Markup that is nothing but tokens: the per-token path, and the failures
# that once made the C scanner count every line before each error.
TOKEN_DENSE = {
    "late failures": (HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1\n]}</tool_call>\n'),
    "unclosed late failures": (HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1]'),
    "raw control characters": (HERMES, '"k\n":"v\t",\n'),
    "xml calls": (QWEN3_CODER, "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n"),
}  # fmt: skip


_ERROR_INIT = json.JSONDecodeError.__init__.__code__


def work(fmt: ToolFormat, text: str, size: int) -> int:
    """What splitting ``text`` fed in pieces of ``size`` costs, counted, not
    timed: every Python and C function call made, plus the characters each
    JSON error message counts (it numbers the lines before the error, which
    once made each failure cost the length of everything before it).

    The C calls are counted once each: each scans a bounded stretch by
    construction (no pattern backtracks, searches start where the last one
    stopped), so a cost that grows with what came before shows up as calls.
    """
    s = splitter(fmt)
    pieces = [text[k : k + size] for k in range(0, len(text), size)]
    count = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        if event == "call" or event == "c_call":
            count += 1
            if event == "call" and frame.f_code is _ERROR_INIT:
                count += frame.f_locals["pos"]

    sys.setprofile(profile)
    try:
        for piece in pieces:
            s.feed(piece)
        s.finish()
    finally:
        sys.setprofile(None)
    return count


def assert_linear(fmt: ToolFormat, text: str, size: int | None) -> None:
    """``text`` costs about four times what its first quarter costs (in
    pieces of ``size``, or each in one piece): a cost that grew with what came
    before would make it sixteen."""
    quarter = text[: len(text) // 4]
    small = work(fmt, quarter, size or len(quarter))
    large = work(fmt, text, size or len(text))
    assert large <= 4.1 * small + 200, (small, large)


@pytest.mark.parametrize("case", ADVERSARIAL)
def test_adversarial_output_in_one_piece_costs_linear_work(case: str) -> None:
    fmt, text = ADVERSARIAL[case]
    assert_linear(fmt, text[: MiB // 4], None)


@pytest.mark.parametrize("case", ADVERSARIAL)
def test_adversarial_output_in_tokens_costs_linear_work(case: str) -> None:
    fmt, text = ADVERSARIAL[case]
    assert_linear(fmt, text[: MiB // 16], 64)


@pytest.mark.parametrize("case", ADVERSARIAL)
def test_adversarial_output_one_character_at_a_time_costs_linear_work(case: str) -> None:
    fmt, text = ADVERSARIAL[case]
    assert_linear(fmt, text[: MiB // 64], 1)


@pytest.mark.parametrize("case", TOKEN_DENSE)
def test_token_dense_markup_costs_the_same_per_byte(case: str) -> None:
    fmt, unit = TOKEN_DENSE[case]
    prefix = '<tool_call>{"name": "f", "arguments": {' if unit.startswith('"k') else ""
    assert_linear(fmt, prefix + unit * (MiB // 16 // len(unit)), None)
