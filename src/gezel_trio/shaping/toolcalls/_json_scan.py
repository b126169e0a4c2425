"""A JSON call body read by a string/depth scanner, with :func:`json.loads`
deciding each member value once it is whole.

A candidate to replace :mod:`._json_lexer`, measured against it by
``bench/toolcall_parsing.py`` (which loads this file from the commit that
added it); nothing imports it here.

Used by every format whose calls are JSON: Hermes and the generic format read
a call object (``{"name": ..., "arguments": ...}``), Mistral the arguments
value alone.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ._body import CLOSED, DONE, FAILED, RUNNING, WS, Owner, skip_ws

__all__ = ["JsonBody"]

# Where the scan is in the call object. Only its own members are checked here
# token by token; inside a member value the scanner tracks strings and
# brackets only, and json.loads checks the value once it has ended.
_ROOT = 0  # before the call object
_KEY_OR_CLOSE = 1  # just after "{"
_KEY = 2  # after ","
_COLON = 3
_VALUE = 4  # a member value is expected
_AFTER = 5  # after a member value: "," or "}"
_IN_KEY = 6
_IN_VALUE = 7
_MARKER = 8  # matching the closing marker outside any string

# Roles of a member value.
_R_SKIP, _R_NAME, _R_ARGS = range(3)
# Progress of the arguments value.
_A_ABSENT, _A_PENDING, _A_DONE = range(3)
_ARGS_KEYS = ("arguments", "parameters")

# String content; an escape is taken whole (json.loads checks it).
_IN_STRING = re.compile(r'(?:[^"\\\x00-\x1f]++|\\[\s\S])*+')
# A number or a literal, and whatever junk json.loads will refuse.
_SCALAR = re.compile(r"[-+.0-9A-Za-z]*+")
_SCALAR_START = frozenset("-0123456789tfn")
_NOT_IN_NAMES = re.compile("[\x00-\x1f\x7f]")
_SURROGATE = re.compile("[\ud800-\udfff]")
# The end of a string's raw text that cannot be decoded yet: an escape cut by
# the end of the piece, after a high surrogate that may still get its pair.
_HELD = re.compile(r"(?:\\u[dD][89abAB][0-9a-fA-F]{2})?(?:\\(?:u[0-9a-fA-F]{0,3})?)?\Z")
_OPENERS = re.compile(r"[\[{]++")
_CLOSERS = re.compile(r"[\]}]++")
_TO_OPENERS = str.maketrans("]}", "[{")


def _reject_constant(name: str) -> Any:
    raise ValueError(name)  # NaN and Infinity are not JSON


_DECODER = json.JSONDecoder(strict=False, parse_constant=_reject_constant)


def _loads(text: str) -> tuple[Any, int]:
    """The value of ``text`` and -1, or None and where it stops being JSON."""
    try:
        return _DECODER.decode(text), -1
    except json.JSONDecodeError as e:
        return None, e.pos
    except (ValueError, RecursionError):
        return None, 0


def _held_from(raw: str) -> int:
    """Where the end of a string's raw text that cannot be decoded yet starts."""
    k = max(0, len(raw) - 12)
    while (m := _HELD.search(raw, k)) is not None and m.start() < len(raw):
        t = m.start()
        j = t
        while j > 0 and raw[j - 1] == "\\":
            j -= 1
        if (t - j) % 2 == 0:  # the backslash at t is not itself escaped
            return t
        k = t + 1
    return len(raw)


def _decode(raw: str) -> str | None:
    """A string's raw content (escapes complete) decoded, or None if invalid."""
    value, _ = _loads('"' + raw + '"')
    if not isinstance(value, str):
        return None
    return _SURROGATE.sub("\ufffd", value)  # a pair has decoded to one character


class JsonBody:
    """Finds where each member value of the call object ends with a
    string/bracket scanner, and decides it with :func:`json.loads`.

    In Hermes form (``root_args=False``) the root is the call object and its
    ``"name"`` and ``"arguments"`` members are picked out; an arguments object
    is passed on as raw text while it streams, an arguments string as its
    decoded content (OpenAI sends arguments as a string holding JSON, so a
    model that double-encodes means that inner text; an empty one means
    ``{}``). With ``root_args`` the whole root value is the arguments and the
    name is already known.

    The call object's own syntax (keys, colons, commas) is checked as it
    comes, so a call fails at the character that breaks it. Inside a member
    value only brackets are matched as they come; anything else wrong there
    is found when the value ends, and the call fails there (what was
    streamed of the value stays streamed).

    Raw control characters inside strings are invalid JSON that models still
    write (a literal newline in code); they are passed on escaped so the
    arguments parse. Lone surrogates from ``\\u`` escapes decode to U+FFFD,
    since they could not be encoded as UTF-8 later.
    """

    status = RUNNING
    back = ""
    complete = False
    _state = _ROOT
    _role = _R_SKIP
    _named = False
    _args = _A_ABSENT
    _in_str = False
    _esc = False
    _scalar = False
    _capturing = False  # raw arguments text is being passed on
    _decoding = False  # an arguments string is being passed on decoded
    _args_sent = False
    _bad_string = False  # an arguments string has an invalid escape
    _cap = 0  # where the text not yet passed on or kept starts, in the current piece
    _marker = 0

    def __init__(self, owner: Owner, end: str, *, root_args: bool) -> None:
        self._owner = owner
        self._end = end
        self._end0 = end[:1]
        self._skip = re.compile('[^"{}\\[\\]' + re.escape(end[:1]) + "]*+")
        self._stack: list[str] = []
        self._val: list[str] = []  # the raw text of the key or value being read
        self._raw: list[str] = []  # an arguments string's raw text not yet decoded
        self._root_args = root_args
        if root_args:
            self._named = True
            self._state = _VALUE
            self._role = _R_ARGS

    def closable_at_end(self) -> bool:
        # Cut off after a complete arguments value: only the closing brace or
        # marker is missing, and nothing that matters could still follow.
        return self._named and self._args == _A_DONE

    def step(self, text: str, i: int) -> int:
        n = len(text)
        self._cap = i
        while i < n:
            st = self._state
            if st >= _IN_KEY:
                i = self._in_value(text, i) if st != _MARKER else self._closing_marker(text, i)
            else:
                i = self._member(text, i)
            if self.status:
                return i
        if self._state >= _IN_KEY and self._state != _MARKER:
            self._keep(text, n)
        return n

    # -- the call object's own syntax

    def _member(self, text: str, i: int) -> int:
        c = text[i]
        st = self._state
        if c in WS:
            return skip_ws(text, i)
        if c == self._end0 and self._named:
            # Never JSON outside a string: this can only be the closing
            # marker, written before the JSON was closed.
            self._state = _MARKER
            return i
        if st == _VALUE:
            return self._open_value(text, i, c)
        if st == _ROOT and c == "{":
            self._state = _KEY_OR_CLOSE
        elif st in (_AFTER, _KEY_OR_CLOSE) and c == "}":
            return self._object_done(text, i + 1)
        elif st in (_KEY, _KEY_OR_CLOSE) and c == '"':
            self._state = _IN_KEY
            self._in_str = True
            self._begin(text, i)
        elif st == _COLON and c == ":":
            self._state = _VALUE
        elif st == _AFTER and c == ",":
            self._state = _KEY
        else:
            return self._fail(text, i)
        return i + 1

    def _open_value(self, text: str, i: int, c: str) -> int:
        role = self._role
        if c == '"':
            self._in_str = True
        elif role == _R_NAME:
            return self._fail(text, i)
        elif c in "{[":
            self._stack.append(c)
        elif c in _SCALAR_START:
            self._scalar = True
        else:
            return self._fail(text, i)
        self._state = _IN_VALUE
        self._begin(text, i)
        if role == _R_ARGS:
            self._args = _A_PENDING
            if c == '"':
                self._decoding = True
                self._cap = i + 1
                return i + 1
            self._capturing = True
        return i if self._scalar else i + 1

    def _key_done(self, text: str, i: int, key: str) -> int:
        self._state = _COLON
        if key == "name":
            if self._named:  # a second name: the first cannot be taken back
                return self._fail(text, i)
            self._role = _R_NAME
        elif key in _ARGS_KEYS:
            if self._args != _A_ABSENT:
                return self._fail(text, i)
            self._role = _R_ARGS
        else:
            self._role = _R_SKIP
        return i

    def _object_done(self, text: str, i: int) -> int:
        if not self._named:
            return self._fail(text, i)
        if self._args == _A_ABSENT:
            self._owner._args("{}")  # what OpenAI sends for a call without arguments
            self._args = _A_DONE
        self.status = DONE
        return i

    def _closing_marker(self, text: str, i: int) -> int:
        end = self._end
        rest = end[self._marker :]
        if text.startswith(rest, i):
            i += len(rest)
        elif rest.startswith(text[i : i + len(rest)]):
            # Cut by the end of the text (shorter than rest): wait for more.
            self._marker += len(text) - i
            return len(text)
        else:
            while text[i] == end[self._marker]:
                i += 1
                self._marker += 1
            return self._fail(text, i, back=end[: self._marker])
        # The model closed the call before closing its JSON (a missing "}" is
        # the usual case): the call is good if its arguments are.
        if self._args == _A_ABSENT:
            self._owner._args("{}")
            self._args = _A_DONE
        self.complete = self._args == _A_DONE
        self.status = CLOSED
        return i

    # -- inside a key or a member value: strings and brackets

    def _in_value(self, text: str, i: int) -> int:
        n = len(text)
        stack = self._stack
        while i < n:
            if self._in_str:
                if self._esc:  # the escaped character; json.loads checks it
                    self._esc = False
                    i += 1
                    continue
                m = _IN_STRING.match(text, i)
                assert m is not None
                i = m.end()
                if i == n:
                    break
                c = text[i]
                i += 1
                if c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
                    if not stack:
                        return self._value_done(text, i)
                elif self._capturing:  # a raw control character: passed on escaped
                    self._keep(text, i - 1)
                    self._owner._args(json.dumps(c)[1:-1])
                    self._val.append(c)
                    self._cap = i
            elif self._scalar:
                m = _SCALAR.match(text, i)
                assert m is not None
                i = m.end()
                if i < n:
                    return self._value_done(text, i)
            else:
                m = self._skip.match(text, i)
                assert m is not None
                i = m.end()
                if i == n:
                    break
                c = text[i]
                if c == '"':
                    self._in_str = True
                elif c == "{" or c == "[":
                    m = _OPENERS.match(text, i)
                    assert m is not None
                    stack.extend(m.group())
                    i = m.end()
                    continue
                elif c == "}" or c == "]":
                    i = self._close(text, i)
                    if self.status or not stack:
                        return i if self.status else self._value_done(text, i)
                    continue
                elif self._named:  # the closing marker, inside unfinished JSON
                    self._keep(text, i)
                    self._state = _MARKER
                    return i
                i += 1
        return i

    def _close(self, text: str, i: int) -> int:
        """A run of closing brackets at ``i``: pop what it closes, up to the
        value's end or the first one that does not match."""
        stack = self._stack
        m = _CLOSERS.match(text, i)
        assert m is not None
        k = min(m.end() - i, len(stack))
        want = "".join(stack[len(stack) - k :])[::-1]
        got = text[i : i + k].translate(_TO_OPENERS)
        if got != want:
            k = next(j for j in range(k) if got[j] != want[j])
            del stack[len(stack) - k :]
            return self._fail(text, i + k)
        del stack[len(stack) - k :]
        return i + k

    def _begin(self, text: str, i: int) -> None:
        self._val.clear()
        self._cap = i

    def _keep(self, text: str, i: int) -> None:
        """The key's or value's text up to ``i`` is read: keep it or pass it on."""
        piece = text[self._cap : i]
        self._cap = i
        if self._capturing:
            self._owner._args(piece)
            self._val.append(piece)
        elif self._decoding:
            self._decode_more(piece, final=False)
        else:
            self._val.append(piece)

    def _decode_more(self, piece: str, *, final: bool) -> None:
        """Pass on what can be decoded of an arguments string so far."""
        raw = "".join(self._raw) + piece if self._raw else piece
        held = "" if final else raw[_held_from(raw) :]
        self._raw = [held] if held else []
        if len(raw) > len(held):
            s = _decode(raw[: len(raw) - len(held)])
            if s is None:
                self._bad_string = True
            elif s:
                self._args_sent = True
                self._owner._args(s)

    def _value_done(self, text: str, i: int) -> int:
        """The key or value ended just before ``i``."""
        if self._state == _IN_KEY:
            self._keep(text, i)
            key, bad = _loads("".join(self._val))
            if bad >= 0:
                return self._fail(text, i)
            return self._key_done(text, i, key)
        role = self._role
        self._state = _AFTER
        self._scalar = False
        if self._decoding:
            self._decoding = False
            self._decode_more(text[self._cap : i - 1], final=True)
            if self._bad_string:
                return self._fail(text, i)
            if not self._args_sent:
                self._owner._args("{}")
        else:
            self._keep(text, i)
            value, bad = _loads("".join(self._val))
            self._capturing = False
            if bad >= 0:
                return self._fail(text, i)
            if role == _R_NAME:
                name = _SURROGATE.sub("\ufffd", value)
                if not name.strip() or _NOT_IN_NAMES.search(name) is not None:
                    return self._fail(text, i)
                self._named = True
                self._owner._start(name)
        self._val.clear()
        self._role = _R_SKIP
        if role == _R_ARGS:
            self._args = _A_DONE
            if self._root_args:
                self.status = DONE
        return i

    def _fail(self, text: str, i: int, back: str = "") -> int:
        if self._capturing and self._state == _IN_VALUE:
            self._owner._args(text[self._cap : i])
        self._capturing = False
        self.status = FAILED
        self.back = back
        self.complete = self._named and self._args == _A_DONE
        return i
