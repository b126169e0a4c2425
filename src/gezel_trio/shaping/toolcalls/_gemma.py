"""Gemma 4 markup: ``<|tool_call>call:NAME{key:VALUE,...}<tool_call|>``.

Gemma 4's chat template writes the arguments in a JSON-like syntax of its
own: keys bare (``key:``), strings between two ``<|"|>`` tokens with nothing
escaped inside, numbers and ``true`` / ``false`` / ``null`` bare, objects
``{...}`` and arrays ``[...]`` nested the same way, no whitespace. The body
turns that into the arguments' JSON text as it streams: ``{`` and each key
at once, a string's text as it arrives (escaped), a bare value once it ends.
Keys spelled ``<|"|>key<|"|>`` (the template's tool declarations write them
so) are read too, as are Python's ``True`` / ``False`` / ``None``, which a
template without a ``none`` branch renders; any other bare word is a string.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from .._markers import MarkerSeeker
from ..call_syntax import KeyedSyntax, json_scalar, lit, regex_escape, value_kind
from ._body import CLOSED, DONE, WS, Body, Owner, skip_ws
from ._format import BodyReader, ToolFormat
from ._tags import TaggedBody, held_word

__all__ = ["GEMMA4", "STRING_DELIMITER", "GemmaBody", "GemmaSyntax"]

# A string's delimiter (one special token in Gemma 4's vocabulary).
STRING_DELIMITER = '<|"|>'


def _open_body(owner: Owner, fmt: ToolFormat) -> Body:
    return GemmaBody(owner, fmt.end)


def _teaches(chat_template: str) -> bool:
    return "<|tool_call>" in chat_template and "<tool_call|>" in chat_template


_HEAD = "call:"
_NAME = re.compile(r"[A-Za-z0-9_.:\-]*+")
_BARE = re.compile(r"[^,:{}\[\]<\s]*+")
_PYTHON_WORDS = {"True": "true", "False": "false", "None": "null"}

# States after the name; each says what may come next.
_S_HEAD = 0  # "call:"
_S_NAME = 1
_S_KEY_OR_CLOSE = 2  # just after "{"
_S_KEY = 3  # after "," in an object
_S_COLON = 4
_S_VALUE = 5
_S_ITEM_OR_CLOSE = 6  # just after "["
_S_AFTER = 7  # after a value: "," or a closer
_S_STRING = 8  # inside <|"|>...<|"|>
_S_BARE = 9  # a bare key or value, cut by the end of the text


def _bare_json(word: str) -> str:
    """A bare value as JSON: a JSON number or literal as it is, else a string."""
    if word in _PYTHON_WORDS:
        return _PYTHON_WORDS[word]
    try:
        value = json.loads(word)
    except (ValueError, RecursionError):
        value = None
    else:
        if isinstance(value, bool | int | float) or value is None:
            return word
    return json.dumps(word, ensure_ascii=False)


class GemmaBody(TaggedBody):
    """Gemma 4's ``call:NAME{...}``, converted to JSON arguments as it streams.

    The call is complete when the object opened after the name closes; the
    closing marker then follows (read by the splitter's trailer). The
    closing marker written inside an unfinished object ends the call as
    malformed.
    """

    def __init__(self, owner: Owner, end: str) -> None:
        self._owner = owner
        self._end = end
        # Inside the arguments: a string opens, or the call ends early.
        self._tags = (STRING_DELIMITER, end)
        self._state = _S_HEAD
        self._parts: list[str] = []  # the name, or a bare word, so far
        self._stack: list[str] = []  # "{" or "[" per open container
        self._key_string = False  # the string being read is a key
        self._seeker = MarkerSeeker(STRING_DELIMITER)
        self._first = True  # no member yet in the innermost container

    def closable_at_end(self) -> bool:
        return False

    def step(self, text: str, i: int) -> int:
        n = len(text)
        while i < n and not self.status:
            st = self._state
            if st == _S_STRING:
                i = self._string(text, i)
            elif st == _S_HEAD:
                i = self._tag(text, i, (_HEAD,))
            elif st == _S_NAME:
                i = self._name(text, i)
            elif st == _S_BARE:
                i = self._bare(text, i)
            elif self._lit:
                i = self._tag(text, i, self._tags)
            elif text[i] in WS:
                i = skip_ws(text, i)
            else:
                i = self._structure(text, i)
        return i if self.status else n

    # -- before the arguments

    def _name(self, text: str, i: int) -> int:
        name, j = held_word(_NAME, text, i, self._parts)
        if name is None:
            return j
        if text[j] != "{" or not name:
            return self._fail(j)
        self._owner._start(name)
        self._open("{")
        return j + 1

    # -- the arguments

    def _structure(self, text: str, i: int) -> int:
        c = text[i]
        st = self._state
        if c == "<":
            return self._tag(text, i, self._tags)
        if st in (_S_KEY_OR_CLOSE, _S_ITEM_OR_CLOSE, _S_AFTER) and c in "}]":
            return self._close(c, i)
        if st == _S_AFTER:
            if c != ",":
                return self._fail(i)
            self._state = _S_KEY if self._stack[-1] == "{" else _S_VALUE
            return i + 1
        if st == _S_COLON:
            if c != ":":
                return self._fail(i)
            self._owner._args(": ")
            self._state = _S_VALUE
            return i + 1
        if st in (_S_KEY_OR_CLOSE, _S_KEY):
            if c in ",:{}[]":
                return self._fail(i)
            self._key_string = True
            self._state = _S_BARE
            return i
        # A value (or an array item).
        if c in "{[":
            self._member()
            self._open(c)
            return i + 1
        if c in ",:}]":
            return self._fail(i)
        self._member()
        self._key_string = False
        self._state = _S_BARE
        return i

    def _member(self) -> None:
        """The separator before a value in an array (objects add it with the key)."""
        if self._stack[-1] == "[":
            if not self._first:
                self._owner._args(", ")
            self._first = False

    def _open(self, c: str) -> None:
        self._stack.append(c)
        self._owner._args(c)
        self._first = True
        self._state = _S_KEY_OR_CLOSE if c == "{" else _S_ITEM_OR_CLOSE

    def _close(self, c: str, i: int) -> int:
        if (self._stack[-1] == "{") != (c == "}"):
            return self._fail(i)
        self._stack.pop()
        self._owner._args(c)
        self._first = False
        self._state = _S_AFTER
        if not self._stack:
            self.complete = True
            self.status = DONE
        return i + 1

    def _key(self, key: str) -> None:
        sep = "" if self._first else ", "
        self._first = False
        self._owner._args(sep + json.dumps(key, ensure_ascii=False))
        self._state = _S_COLON

    def _bare(self, text: str, i: int) -> int:
        word, j = held_word(_BARE, text, i, self._parts)
        if word is None:
            return j
        if not word:
            return self._fail(j)
        if self._key_string:
            self._key(word)
        else:
            self._owner._args(_bare_json(word))
            self._state = _S_AFTER
        return j

    def _tag_done(self, tag: str, i: int) -> int:
        if tag == _HEAD:
            self._state = _S_NAME
            return i
        if tag == self._end:  # the call ends early
            self.status = CLOSED
            return i
        return self._string_opens(i)

    def _string_opens(self, i: int) -> int:
        st = self._state
        if st in (_S_KEY_OR_CLOSE, _S_KEY):
            self._key_string = True
        elif st in (_S_VALUE, _S_ITEM_OR_CLOSE):
            self._member()
            self._key_string = False
        else:
            return self._fail(i - len(STRING_DELIMITER), back="")
        if not self._key_string:
            self._owner._args('"')
        self._state = _S_STRING
        return i

    def _string(self, text: str, i: int) -> int:
        before, j, found = self._seeker.seek(text, i)
        if self._key_string:
            self._parts.append(before)
        elif before:
            self._owner._args(json.dumps(before, ensure_ascii=False)[1:-1])
        if found:
            if self._key_string:
                key = "".join(self._parts)
                self._parts.clear()
                self._key(key)
            else:
                self._owner._args('"')
                self._state = _S_AFTER
        return j


class GemmaSyntax(KeyedSyntax):
    """Gemma 4: ``<|tool_call>call:NAME{key:VALUE,...}<tool_call|>``, strings
    between ``<|"|>`` tokens, keys bare and sorted (the template's
    ``dictsort``)."""

    closing_texts = (STRING_DELIMITER, "}<tool_call|>", "}", "]")
    extra_tokens = (STRING_DELIMITER,)
    separated = True
    sorted_keys = True

    def shared_rules(self) -> list[str]:
        s = STRING_DELIMITER
        return [
            'gemma_members: (gemma_member ("," gemma_member)*)?',
            'gemma_member: GEMMA_KEY ":" gemma_value',
            'gemma_value: gemma_string | GEMMA_NUMBER | "true" | "false" | "null"'
            ' | "{" gemma_members "}" | "[" (gemma_value ("," gemma_value)*)? "]"',
            f"gemma_string: {s} GEMMA_TEXT? {s}",
            # Text cannot spell the delimiter: the parser would end the string there.
            f"GEMMA_TEXT: /(?s:.+)/ & ~/(?s:.*){regex_escape(s)}(?s:.*)/",
            r"GEMMA_KEY: /[A-Za-z_$][A-Za-z0-9_$]*/",
            r"GEMMA_NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/",
        ]

    def free_args(self) -> str:
        return "gemma_members"

    def entry(self, key: str, schema: Any, options: Any, dump: Callable[[Any], str]) -> str:
        head = lit(f"{key}:")
        kind, values = value_kind(schema)
        if kind == "enum":
            alts = " | ".join(lit(v) for v in values)
            return f"{head} {STRING_DELIMITER} ({alts}) {STRING_DELIMITER}"
        if kind == "string":
            return f"{head} gemma_string"
        if kind == "json" and json_scalar(schema):
            # Gemma 4 writes numbers, booleans and null as JSON does.
            return f"{head} {self.json_value(schema, options, dump)}"
        return f"{head} gemma_value"

    def call(self, name: str, args: str) -> str:
        return f'{lit(f"call:{name}{{")} {args} "}}"'


GEMMA4 = ToolFormat(
    "gemma4",
    "<|tool_call>",
    "<tool_call|>",
    BodyReader(frozenset("c" + WS), _open_body),
    teaches=_teaches,
    grammar=GemmaSyntax,
    # The seed's client's spelling, as tool_grammar.format took it before
    # the family had one name.
    client_names=("gemma",),
)
