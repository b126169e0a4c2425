"""Mistral markup (tokenizer v11 and later): ``[TOOL_CALLS]NAME[ARGS]`` then the
arguments as one JSON value; nothing closes a call but the end of its value."""

from __future__ import annotations

import re

from ._body import FAILED, RUNNING, Body, Owner
from ._format import BodyReader, ToolFormat
from ._json_lexer import JsonBody

__all__ = ["MISTRAL", "NameArgsBody"]


def _open_body(owner: Owner, fmt: ToolFormat) -> Body:
    return NameArgsBody(owner)


def _teaches(chat_template: str) -> bool:
    # Mistral's older JSON-list form is not supported: no "[ARGS]", no family.
    return "[TOOL_CALLS]" in chat_template and "[ARGS]" in chat_template


_NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]*+")
_ARGS_MARK = "[ARGS]"


class NameArgsBody:
    """Mistral's ``NAME[ARGS]{...}``: a bare function name, then the arguments
    as one JSON value; the call ends with that value."""

    status = RUNNING
    back = ""
    complete = False
    _matched = 0  # how much of "[ARGS]" has been read
    _json: JsonBody | None = None

    def __init__(self, owner: Owner) -> None:
        self._owner = owner
        self._parts: list[str] = []

    def closable_at_end(self) -> bool:
        return False

    def step(self, text: str, i: int) -> int:
        n = len(text)
        while self._json is None:
            if not self._matched:
                m = _NAME_CHARS.match(text, i)
                assert m is not None
                self._parts.append(m.group())
                i = m.end()
            if i == n:
                return n
            if text[i] != _ARGS_MARK[self._matched]:
                self.status = FAILED
                self.back = _ARGS_MARK[: self._matched]
                return i
            i += 1
            self._matched += 1
            if self._matched == len(_ARGS_MARK):
                name = "".join(self._parts)
                if not name:
                    self.status = FAILED
                    return i
                self._owner._start(name)
                self._json = JsonBody(self._owner, "", root_args=True)
        j = self._json.step(text, i)
        self.status = self._json.status
        self.back = self._json.back
        self.complete = self._json.complete
        return j


# A Mistral name is never empty. No grammar is built for this markup.
MISTRAL = ToolFormat(
    "mistral",
    "[TOOL_CALLS]",
    "",
    BodyReader(
        frozenset("_.-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"), _open_body
    ),
    teaches=_teaches,
)
