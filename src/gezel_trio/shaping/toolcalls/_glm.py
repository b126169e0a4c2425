"""GLM markup (GLM-4.5 to 4.7): ``<tool_call>NAME`` then
``<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>`` pairs, then
``</tool_call>``; GLM-4.5/4.6 templates put a newline after the name and
after each tag pair, GLM-4.7's none. Values are written as Qwen3-Coder's
are: strings bare, anything else as JSON."""

from __future__ import annotations

import json
import re

from .._markers import MarkerSeeker
from ..call_syntax import BareValueSyntax, lit
from ._body import CLOSED, WS, Body, Owner, skip_ws
from ._format import BodyReader, ToolFormat
from ._qwen_xml import param_json
from ._tags import TaggedBody, held_word

__all__ = ["GLM", "GlmBody", "GlmSyntax"]


def _open_body(owner: Owner, fmt: ToolFormat) -> Body:
    return GlmBody(owner, fmt.end)


def _teaches(chat_template: str) -> bool:
    return "<tool_call>" in chat_template and "<arg_key>" in chat_template


_KEY_OPEN = "<arg_key>"
_KEY_CLOSE = "</arg_key>"
_VALUE_OPEN = "<arg_value>"
_VALUE_CLOSE = "</arg_value>"
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.:\-]*+")

_G_NAME = 0
_G_BODY = 1  # before <arg_key> or the closing marker
_G_KEY = 2
_G_BETWEEN = 3  # before <arg_value>
_G_VALUE = 4


class GlmBody(TaggedBody):
    """GLM's ``NAME<arg_key>K</arg_key><arg_value>V</arg_value>...``.

    The arguments object is built as Qwen3-Coder's is (``XmlBody``): each
    pair is sent whole once its value closes, ``}`` at the closing marker,
    which is the only end a GLM call has.
    """

    def __init__(self, owner: Owner, end: str) -> None:
        self._owner = owner
        self._end = end
        self._state = _G_NAME
        self._parts: list[str] = []
        self._key = ""
        self._function = ""
        self._pairs = 0
        self._seekers = {_G_KEY: MarkerSeeker(_KEY_CLOSE), _G_VALUE: MarkerSeeker(_VALUE_CLOSE)}

    def closable_at_end(self) -> bool:
        # Cut off between pairs: only the closing marker is missing (a stop
        # string may have taken it), so the call is whole.
        if self._state != _G_BODY:
            return False
        self._owner._args("}" if self._pairs else "{}")
        return True

    def step(self, text: str, i: int) -> int:
        n = len(text)
        while i < n and not self.status:
            st = self._state
            if st in self._seekers:
                before, i, found = self._seekers[st].seek(text, i)
                self._parts.append(before)
                if found:
                    self._closed_tag(st, i)
            elif st == _G_NAME:
                i = self._name(text, i)
            elif not self._lit and text[i] in WS:
                i = skip_ws(text, i)
            else:
                tags = (_KEY_OPEN, self._end) if st == _G_BODY else (_VALUE_OPEN,)
                i = self._tag(text, i, tags)
        return i if self.status else n

    def _name(self, text: str, i: int) -> int:
        """The bare function name, up to the newline or the first tag."""
        if not self._parts and text[i] in WS:
            return skip_ws(text, i)
        name, k = held_word(_NAME_CHARS, text, i, self._parts)
        if name is None:
            return k
        if not name or text[k] not in "\n<":
            return self._fail(k)
        self._function = name
        self._owner._start(name)
        self._state = _G_BODY
        return k

    def _closed_tag(self, st: int, i: int) -> None:
        text = "".join(self._parts)
        self._parts.clear()
        if st == _G_KEY:
            key = text.strip()
            if not key or "<" in key or "\n" in key:
                self._fail(i)
                return
            self._key = key
            self._state = _G_BETWEEN
            return
        sep = "{" if not self._pairs else ", "
        self._owner._args(
            sep
            + json.dumps(self._key, ensure_ascii=False)
            + ": "
            + param_json(
                text, own_lines=False, string=self._owner._is_string(self._function, self._key)
            )
        )
        self._pairs += 1
        self._state = _G_BODY

    def _tag_done(self, tag: str, i: int) -> int:
        if tag == _KEY_OPEN:
            self._state = _G_KEY
        elif tag == _VALUE_OPEN:
            self._state = _G_VALUE
        else:  # the closing marker
            self._owner._args("}" if self._pairs else "{}")
            self.complete = True
            self.status = CLOSED
        return i


class GlmSyntax(BareValueSyntax):
    """GLM: ``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE
    </arg_value>\\n...</tool_call>``; the newlines are optional (GLM-4.7's
    template writes none)."""

    closing_texts = ("</arg_value>", "</tool_call>", "\n</tool_call>")

    def shared_rules(self) -> list[str]:
        return [
            'glm_pair: "<arg_key>" GLM_KEY "</arg_key>" "\\n"? "<arg_value>" glm_text "\\n"?',
            'glm_text[lazy]: /(?s:.*)/ "</arg_value>"',
            r"GLM_KEY: /[A-Za-z_$][A-Za-z0-9_.$\-]*/",
        ]

    def free_args(self) -> str:
        return "glm_pair*"

    value_end = '"</arg_value>" "\\n"?'
    free_value = 'glm_text "\\n"?'

    def entry_head(self, key: str) -> str:
        return f'{lit(f"<arg_key>{key}</arg_key>")} "\\n"? "<arg_value>"'

    def call(self, name: str, args: str) -> str:
        return f'{lit(name)} "\\n"? {args}'


GLM = ToolFormat(
    "glm",
    "<tool_call>",
    "</tool_call>",
    # A GLM call opens with the bare function name.
    BodyReader(
        frozenset("_.:-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" + WS),
        _open_body,
    ),
    teaches=_teaches,
    grammar=GlmSyntax,
)
