"""Custom (freeform) tools: the grammar rewrite over JSON-escaped text, and
the raw input read back from a call's arguments.

A forced custom call's grammar is checked with llguidance's own matcher over
a byte-level tokenizer (``tests.support.grammar``), so exactly the grammar's
language is tested: the escaped form of every sentence of the tool's grammar
is accepted inside the call's JSON, and nothing else.
"""

from __future__ import annotations

import json
import time
from typing import Any

import llguidance
import pytest

from gezel_trio.core.errors import InvalidRequest
from gezel_trio.shaping.custom_tools import RawInput, as_function, custom_input, input_arguments
from gezel_trio.shaping.grammar import Constraint, build_constraint, parser_limits
from tests.support.codex import APPLY_PATCH_GRAMMAR
from tests.support.grammar import SPECIALS, byte_tokenizer

PATCH = {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_GRAMMAR}
GOOD_PATCHES = [
    "*** Begin Patch\n*** Delete File: a.txt\n*** End Patch\n",
    '*** Begin Patch\n*** Update File: src/"q".py\n@@ def f():\n-    x = "\\t"\n'
    "+    y\t= 1\n \n*** End of File\n*** End Patch",
    "*** Begin Patch\n*** Add File: ünï\\code.md\n+# hi \x01\n+\n*** End Patch\n",
]
BAD_PATCHES = [
    "*** Begin Patch\nnope\n*** End Patch\n",
    "*** Begin Patch\n*** Add File: a\n*** End Patch\n",  # an added file needs lines
    "*** Begin Patch\n*** Delete File: a\n",
]


@pytest.fixture(scope="module")
def tok() -> Any:
    return byte_tokenizer(SPECIALS)


def _forced(tok: Any, fmt: dict[str, Any], fmt_name: str = "hermes") -> Constraint:
    c = build_constraint(
        response_format=None,
        tools=[as_function("t", "a tool", fmt)],
        tool_choice={"type": "function", "function": {"name": "t"}},
        tool_grammar=None,
        tool_format=fmt_name,  # type: ignore[arg-type]
        custom_tools={"t": fmt},
        llg_tokenizer=tok,
    )
    assert c is not None
    return c


def _accepts(tok: Any, c: Constraint, text: str) -> bool:
    m = llguidance.LLMatcher(tok, c.grammar, limits=parser_limits(), log_level=0)
    ids = tok.tokenize_str(text, parse_special=True)
    return bool(m.consume_tokens(ids)) and bool(m.is_accepting())


def _call(raw: str, fmt_name: str = "hermes") -> str:
    args = json.dumps(
        {"name": "t", "arguments": json.loads(input_arguments(raw))}, ensure_ascii=False
    )
    if fmt_name == "generic":
        return '{"tool_call": ' + args + "}"
    return f"<tool_call>\n{args}\n</tool_call>"


@pytest.mark.parametrize("fmt_name", ["hermes", "generic"])
def test_apply_patch_accepts_escaped_patches_and_nothing_else(tok: Any, fmt_name: str) -> None:
    c = _forced(tok, PATCH, fmt_name)
    for patch in GOOD_PATCHES:
        assert _accepts(tok, c, _call(patch, fmt_name)), patch
    for patch in BAD_PATCHES:
        assert not _accepts(tok, c, _call(patch, fmt_name)), patch
    # The raw text (unescaped newlines) is not a JSON string.
    raw = _call(GOOD_PATCHES[0], fmt_name).replace("\\n", "\n")
    assert not _accepts(tok, c, raw)


def test_apply_patch_compiles_in_milliseconds(tok: Any) -> None:
    start = time.perf_counter()
    _forced(tok, PATCH)
    assert time.perf_counter() - start < 1.0  # measured: about 4 ms


def test_a_regex_grammar_holds_for_the_decoded_string(tok: Any) -> None:
    c = _forced(tok, {"type": "grammar", "syntax": "regex", "definition": r'[a-z"\\]+\n\d{2}'})
    assert _accepts(tok, c, _call('ab"\\c\n42'))
    assert not _accepts(tok, c, _call("ab\n4"))
    assert not _accepts(tok, c, _call("AB\n42"))


def test_text_format_is_any_string(tok: Any) -> None:
    c = _forced(tok, {"type": "text"})
    assert _accepts(tok, c, _call('any "text"\n'))


@pytest.mark.parametrize(
    "definition",
    [
        "start: /^a/",  # anchors
        "start: /(?=a)a/",  # lookarounds
        'start: "a"i',  # case-insensitive
        "start: %json {}",
        "start: WS\n%import common.ESCAPED_STRING",
    ],
)
def test_what_the_rewrite_cannot_keep_is_a_400(tok: Any, definition: str) -> None:
    fmt = {"type": "grammar", "syntax": "lark", "definition": definition}
    with pytest.raises(InvalidRequest) as info:
        _forced(tok, fmt)
    assert info.value.param == "tools[0].format"
    assert "tools[0].format.definition" in info.value.message


def test_raw_input_streams_the_decoded_string_in_any_chunking() -> None:
    raw = 'line "one"\n\ttab \\ é \U0001f600 end'
    args = input_arguments(raw) + "}"
    for size in (1, 2, 3, 7, len(args)):
        reader = RawInput()
        pieces = [reader.feed(args[i : i + size]) for i in range(0, len(args), size)]
        assert "".join(pieces) == raw
    assert custom_input(input_arguments(raw)) == raw
    escaped = json.dumps({"input": raw})  # ensure_ascii: \\ud83d\\ude00 pairs split anywhere
    for size in (1, 5):
        reader = RawInput()
        assert (
            "".join(reader.feed(escaped[i : i + size]) for i in range(0, len(escaped), size)) == raw
        )
    assert custom_input('{"cmd": 1}') is None
