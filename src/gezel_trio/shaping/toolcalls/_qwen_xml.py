"""Qwen3-Coder markup: ``<tool_call>`` + ``<function=NAME>``, then
``<parameter=KEY>VALUE</parameter>`` blocks, then ``</function>`` +
``</tool_call>``."""

from __future__ import annotations

import json
import re
from typing import Any

from .._markers import MarkerSeeker
from ..call_syntax import BareValueSyntax, lit
from ._body import CLOSED, DONE, WS, Body, Owner, skip_ws
from ._format import BodyReader, ToolFormat
from ._tags import TaggedBody

__all__ = ["QWEN3_CODER", "QwenXmlSyntax", "XmlBody", "param_json"]


def _open_body(owner: Owner, fmt: ToolFormat) -> Body:
    return XmlBody(owner, fmt.end)


def _teaches(chat_template: str) -> bool:
    t = chat_template
    return "<tool_call>" in t and "<function=" in t and "<parameter=" in t


_X_OPEN = 0  # before <function=
_X_NAME = 1
_X_BODY = 2  # between parameters
_X_KEY = 3
_X_VALUE = 4
_FUNCTION_TAG = "<function="
_PARAM_TAG = "<parameter="
_PARAM_END = "</parameter>"
_FUNCTION_END = "</function>"
_WORD_STOP = re.compile(r"[>\n<]")


def _reject_constant(name: str) -> Any:
    raise ValueError(name)  # NaN and Infinity are not JSON


def param_json(raw: str, *, own_lines: bool = True, string: bool = False) -> str:
    """A parameter's value as JSON text.

    The template writes strings bare and everything else as JSON, so a value
    that parses as a JSON number, bool, null, array or object is taken as one,
    and anything else is a string. Without the tool's schema, a string that
    looks like a number (a zip code ``12345``) is taken as the number.
    ``own_lines``: the template puts the value on lines of its own (one
    newline before and after it is layout). ``string``: the tool's schema
    declares the parameter a string, so the value is one whatever it looks
    like.
    """
    value = raw
    if own_lines:
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
    if string:
        return json.dumps(value, ensure_ascii=False)
    try:
        parsed = json.loads(value, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        parsed = value
    if isinstance(parsed, str):
        return json.dumps(value, ensure_ascii=False)
    return value.strip()


class XmlBody(TaggedBody):
    """Qwen3-Coder's ``<function=NAME><parameter=KEY>VALUE</parameter>...</function>``.

    The arguments object is built as JSON text: ``{`` and the first member
    when the first parameter closes, ``, "KEY": VALUE`` for each later one,
    ``}`` at ``</function>``. A value is only known to be complete at its
    closing tag, so each parameter is sent whole. The first ``</parameter>``
    ends a value, whatever the value holds.
    """

    _state = _X_OPEN
    _key = ""
    _name = ""
    _params = 0

    def __init__(self, owner: Owner, end: str) -> None:
        self._owner = owner
        self._body_tags = tuple(t for t in (_PARAM_TAG, _FUNCTION_END, end) if t)
        self._parts: list[str] = []
        self._seeker = MarkerSeeker(_PARAM_END)

    def closable_at_end(self) -> bool:
        return False

    def step(self, text: str, i: int) -> int:
        n = len(text)
        while i < n:
            st = self._state
            if st == _X_VALUE:
                before, i, found = self._seeker.seek(text, i)
                if before:
                    self._parts.append(before)
                if found:
                    self._param_done()
                    self._state = _X_BODY
                continue
            if st in (_X_NAME, _X_KEY):
                i = self._word(text, i, st)
            elif not self._lit and text[i] in WS:
                i = skip_ws(text, i)
                continue
            else:
                i = self._tag(text, i, (_FUNCTION_TAG,) if st == _X_OPEN else self._body_tags)
            if self.status:
                return i
        return n

    def _word(self, text: str, i: int, st: int) -> int:
        """The function name or a parameter key, up to ``>``."""
        m = _WORD_STOP.search(text, i)
        if m is None:
            self._parts.append(text[i:])
            return len(text)
        k = m.start()
        self._parts.append(text[i:k])
        if text[k] != ">":
            return self._fail(k)
        word = "".join(self._parts).strip()
        self._parts.clear()
        if not word:
            return self._fail(k + 1)
        if st == _X_NAME:
            self._name = word
            self._owner._start(word)
            self._state = _X_BODY
        else:
            self._key = word
            self._state = _X_VALUE
        return k + 1

    def _tag_done(self, tag: str, i: int) -> int:
        if tag == _FUNCTION_TAG:
            self._state = _X_NAME
        elif tag == _PARAM_TAG:
            self._state = _X_KEY
        else:
            # </function>, or the closing marker with </function> missing.
            self._owner._args("}" if self._params else "{}")
            self.complete = True
            self.status = DONE if tag == _FUNCTION_END else CLOSED
        return i

    def _param_done(self) -> None:
        string = self._owner._is_string(self._name, self._key)
        value = param_json("".join(self._parts), string=string)
        self._parts.clear()
        key = json.dumps(self._key, ensure_ascii=False)
        self._owner._args(("{" if not self._params else ", ") + key + ": " + value)
        self._params += 1


class QwenXmlSyntax(BareValueSyntax):
    """Qwen3-Coder: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n
    </parameter>\\n...</function>\\n</tool_call>``. A free value is any text
    up to the first ``</parameter>`` (a lazy lexeme: the parser ends a value
    there too)."""

    closing_texts = (
        "</parameter>\n",
        "\n</parameter>\n",
        "</function>\n</tool_call>",
        "\n</function>\n</tool_call>",
    )

    def wrapped(self, body: str) -> str:
        return f'{self.opener} "\\n" {body} "\\n" {self.closer}'

    def shared_rules(self) -> list[str]:
        return [
            'xml_param: "<parameter=" XML_KEY ">\\n" xml_text "\\n"',
            'xml_text[lazy]: /(?s:.*)/ "</parameter>"',
            r"XML_KEY: /[A-Za-z_$][A-Za-z0-9_.$\-]*/",
        ]

    def free_args(self) -> str:
        return "xml_param*"

    value_end = '"\\n</parameter>\\n"'
    free_value = 'xml_text "\\n"'

    def entry_head(self, key: str) -> str:
        return lit("<parameter=" + key + ">\n")

    def call(self, name: str, args: str) -> str:
        head = lit("<function=" + name + ">\n")
        return f'{head} {args} "</function>"'


QWEN3_CODER = ToolFormat(
    "qwen3_coder",
    "<tool_call>",
    "</tool_call>",
    BodyReader(frozenset("<" + WS), _open_body),
    teaches=_teaches,
    grammar=QwenXmlSyntax,
    # The seed's client names the whole <tool_call> family "hermes": Qwen
    # 3.5/3.6 and Nemotron templates are this markup inside it.
    client_names=("hermes",),
)
