"""A JSON call body, lexed as it streams: where each value ends, and that it parses.

Used by every format whose calls are JSON: Hermes and the generic format read
a call object (``{"name": ..., "arguments": ...}``), Mistral the arguments
value alone.

Why hand-written: ``python -m bench toolcall_parsing`` measured it against what
could replace it, on model outputs streamed in chunks of 1-8 characters
(ns per byte, best of 7, on the shared 2-core dev machine; the library
columns time the re-parse alone, to which the splitter's own 120-370 ns per
byte would be added)::

                        lexer  scanner  jiter re-parse  partial-json-parser
    small call (103 B)   1066     1108        132              3332
    8 KiB code string     599      566       1788            479040
    32 KiB code string    609      967       7260          (minutes)
    2000 numbers          949      666      19181          (minutes)

* jiter and partial-json-parser cannot resume a parse, say where a value
  ends in longer text, or give back a member's raw text, so streaming with
  them means parsing the call so far again after every chunk: cheaper than
  the lexer for a small call, but O(n) per chunk, 12x the lexer at 32 KiB
  and growing with the call. Their partial modes also accept broken JSON:
  of 2296 calls made invalid by one changed character, jiter accepted 726
  and partial-json-parser (which guesses completions) 134.
* A string/depth scanner that checks the call object's own syntax and runs
  ``json.loads`` on each member value once it ends (the candidate in this
  package's history, ``_json_scan.py``) costs about the same (0.4x to 3.5x
  the lexer: faster on numbers and indentation, slower on double-encoded
  arguments) and passed all 109 tests then written, but it only learns that
  a value is broken at its end: an unescaped quote in an argument string
  makes it read the rest of the output (the answer, the next call) as
  that string. With one character broken in 5000 calls, each followed by
  prose and a second call, it lost the second call 162 times, the lexer 39.
  The lexer stops at the offending character, as the splitter's contract
  says (``test_broken_arguments_end_the_call_at_the_offending_character``).

At about a microsecond per byte, a stream generating 400 bytes a second
spends well under 0.1% of a core here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from ._body import CLOSED, DONE, FAILED, RUNNING, WS, Owner, skip_ws

__all__ = ["JsonBody"]

# Scanner states. The structural ones come first, so one comparison finds them.
_J_ROOT = 0  # before the call object
_J_VALUE = 1  # a value is expected
_J_KEY_OR_CLOSE = 2  # just after "{"
_J_KEY = 3  # after "," in an object
_J_ITEM_OR_CLOSE = 4  # just after "["
_J_COLON = 5
_J_AFTER = 6  # after a value: "," or a closer
_J_STRING = 7
_J_ESCAPE = 8
_J_UNICODE = 9
_J_NUMBER = 10
_J_LITERAL = 11
_J_MARKER = 12  # matching the closing marker outside any string

# Number states (RFC 8259 grammar).
_N_SIGN, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_E, _N_ESIGN, _N_EXP = range(8)
_N_ACCEPT = frozenset((_N_ZERO, _N_INT, _N_FRAC, _N_EXP))
_N_RUNS = frozenset((_N_INT, _N_FRAC, _N_EXP))
_DIGIT = frozenset("0123456789")
_NUMBER_CHARS = frozenset("0123456789.eE+-")
_HEX = frozenset("0123456789abcdefABCDEF")
_WORDS = {"t": "true", "f": "false", "n": "null"}
_CLOSER = {"{": "}", "[": "]"}
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}

# Fast paths. Every pattern is possessive or a single class, so none can
# backtrack; each either matches what the state machine would accept, char by
# char, or the scan falls back to the state machine.
_DIGITS = re.compile(r"[0-9]+")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*+)(?:\.[0-9]++)?+(?:[eE][-+]?+[0-9]++)?+")
_COLON = re.compile(r"[ \t\n\r]*+:")
_OPEN_BRACKETS = re.compile(r"\[(?:[ \t\n\r]*+\[)*+")
_OBJECT_OPENS = re.compile(r'(?:\{[ \t\n\r]*+"[^"\\\x00-\x1f{]*+"[ \t\n\r]*+:[ \t\n\r]*+)++')
# String content with complete, valid escapes: all of them where nothing is
# decoded, and all but surrogates (which pair up across pieces) where it is.
# Raw control characters are taken too; they are escaped on the way out.
_STRING_RUN = re.compile(r'(?:[^"\\]++|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*+')
_DECODE_RUN = re.compile(r'(?:[^"\\]++|\\["\\/bfnrt]|\\u(?![dD][89a-fA-F])[0-9a-fA-F]{4})*+')
_CONTROL_CHAR = re.compile("[\x00-\x1f]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_NOT_IN_NAMES = re.compile("[\x00-\x1f\x7f]")
# Decodes one string at an offset (raw_decode), with the C scanner; raw
# control characters are allowed, as the automaton allows them.
_DECODER = json.JSONDecoder(strict=False)

# Roles of a value at the call object's member level.
_R_SKIP, _R_NAME, _R_ARGS = range(3)
# Progress of the arguments value.
_A_ABSENT, _A_PENDING, _A_DONE = range(3)
_ARGS_KEYS = ("arguments", "parameters")


def _string_end(text: str, i: int) -> int:
    """Where the string whose content starts at ``i`` ends (after its quote),
    or -1 unless it is complete and valid JSON here.

    Deciding first keeps the C scanner from ever failing: its error message
    counts the lines before the error, which would make each failure cost
    the length of everything before it. Raw control characters are allowed
    (and decoded with ``strict=False``), as the automaton allows them.
    """
    m = _STRING_RUN.match(text, i)
    assert m is not None
    end = m.end()
    return end + 1 if end < len(text) and text[end] == '"' else -1


def _decode_string(text: str, i: int) -> str:
    """The string whose opening quote is at ``i``, known to be complete and valid."""
    s: str = _DECODER.raw_decode(text, i)[0]
    return s


def _escape_controls(s: str) -> str:
    return _CONTROL_CHAR.sub(lambda m: json.dumps(m.group())[1:-1], s)


class JsonBody:
    """Scans a JSON call body incrementally with a validating pushdown
    automaton, so it knows exactly where the arguments value ends and that it
    parses.

    In Hermes form (``root_args=False``) the root is the call object and its
    ``"name"`` and ``"arguments"`` members are picked out; an arguments object
    is passed on as raw text while it streams, an arguments string as its
    decoded content (OpenAI sends arguments as a string holding JSON, so a
    model that double-encodes means that inner text; an empty one means
    ``{}``). With ``root_args`` the whole root value is the arguments and the
    name is already known.

    Raw control characters inside strings are invalid JSON that models still
    write (a literal newline in code); they are passed on escaped so the
    arguments parse. Lone surrogates from ``\\u`` escapes decode to U+FFFD,
    since they could not be encoded as UTF-8 later.

    Runs that are already whole in the text (strings, numbers, whitespace,
    runs of openers) are taken by possessive patterns and decoded by the C
    scanner of :mod:`json`; the automaton, one character at a time, only sees
    what those cannot decide (a token cut by the end of the text, invalid
    JSON, raw control characters) and decides it as the patterns would.
    """

    # Scalars start at these class-level values: a body is made per call, and
    # a failed call is usually decided within a character or two.
    status = RUNNING
    back = ""
    complete = False
    _state = _J_ROOT
    _level = 1  # depth of the values whose role matters: members, or the root
    _role = _R_SKIP
    _named = False
    _args = _A_ABSENT
    _args_sent = False  # an arguments string has decoded to something
    _in_key = False
    _out: Callable[[str], None] | None = None  # where decoded string text goes
    _capturing = False  # raw arguments text is being passed on
    _cap = 0  # where the raw text not yet passed on starts, in the current piece
    _high = 0  # a high surrogate from a \u escape, waiting for its pair
    _hex = ""
    _lit = ""
    _num = 0
    _marker = 0

    def __init__(self, owner: Owner, end: str, *, root_args: bool) -> None:
        self._owner = owner
        self._end = end
        self._end0 = end[:1]
        self._stack: list[str] = []
        self._parts: list[str] = []
        if root_args:
            self._level = 0
            self._state = _J_VALUE
            self._role = _R_ARGS
            self._named = True

    def closable_at_end(self) -> bool:
        # Cut off after a complete arguments value: only the closing brace or
        # marker is missing, and nothing that matters could still follow.
        return self._named and self._args == _A_DONE

    def step(self, text: str, i: int) -> int:
        n = len(text)
        self._cap = i
        while i < n:
            st = self._state
            if st == _J_STRING:
                i = self._string(text, i)
            elif st <= _J_AFTER:
                i = self._structural(text, i)
            elif st == _J_NUMBER:
                i = self._number(text, i)
            elif st == _J_ESCAPE:
                i = self._escape(text, i)
            elif st == _J_UNICODE:
                i = self._unicode(text, i)
            elif st == _J_LITERAL:
                i = self._literal(text, i)
            else:
                i = self._closing_marker(text, i)
            if self.status:
                return i
        if self._capturing and n > self._cap:
            self._owner._args(text[self._cap : n])
        return n

    # -- states

    def _structural(self, text: str, i: int) -> int:
        """Tokens between values, and the values that start there, until the
        scan leaves the structural states."""
        n = len(text)
        stack = self._stack
        while i < n:
            st = self._state
            if st > _J_AFTER or self.status:
                return i
            c = text[i]
            if c in WS:
                i = skip_ws(text, i)
            elif c == self._end0 and self._named:
                # Never JSON outside a string: this can only be the closing
                # marker, written before the JSON was closed.
                self._stop_capture(text, i)
                self._state = _J_MARKER
            elif st == _J_AFTER:
                top = stack[-1]
                if c == ",":
                    self._state = _J_KEY if top == "{" else _J_VALUE
                elif c == _CLOSER[top]:
                    stack.pop()
                    self._value_done(text, i + 1)
                else:
                    return self._fail(text, i)
                i += 1
            elif st in (_J_KEY, _J_KEY_OR_CLOSE):
                if c == '"':
                    i = self._key(text, i + 1)
                elif c == "}" and st == _J_KEY_OR_CLOSE:
                    stack.pop()
                    self._value_done(text, i + 1)
                    i += 1
                else:
                    return self._fail(text, i)
            elif st == _J_COLON:
                if c != ":":
                    return self._fail(text, i)
                self._state = _J_VALUE
                i += 1
            elif st == _J_ROOT:
                if c != "{":
                    return self._fail(text, i)
                stack.append("{")
                self._state = _J_KEY_OR_CLOSE
                i += 1
            elif st == _J_ITEM_OR_CLOSE and c == "]":
                stack.pop()
                self._value_done(text, i + 1)
                i += 1
            else:
                i = self._value(text, i, c)
        return i

    def _value(self, text: str, i: int, c: str) -> int:
        """A value starts at ``i`` with ``c``."""
        at_level = len(self._stack) == self._level
        role = self._role if at_level else _R_SKIP
        if role == _R_NAME and c != '"':
            return self._fail(text, i)
        if role == _R_ARGS:
            self._args = _A_PENDING
            if c != '"':
                self._capturing = True
                self._cap = i
        if c == '"':
            return self._value_string(text, i + 1, role)
        if c == "{":
            m = _OBJECT_OPENS.match(text, i)
            if m is None:
                self._stack.append("{")
                self._state = _J_KEY_OR_CLOSE
                return i + 1
            # Objects opened, each down to its first value: '{"k": {"k": ...'
            self._stack.extend(m.group().count("{") * "{")
            self._state = _J_VALUE
            return m.end()
        if c == "[":
            m = _OPEN_BRACKETS.match(text, i)
            assert m is not None
            self._stack.extend(m.group().count("[") * "[")
            self._state = _J_ITEM_OR_CLOSE
            return m.end()
        if c == "-" or c in _DIGIT:
            m = _NUMBER.match(text, i)
            if m is not None and m.end() < len(text) and text[m.end()] not in _NUMBER_CHARS:
                self._value_done(text, m.end())
                return m.end()
            self._state = _J_NUMBER
            self._num = _N_SIGN if c == "-" else _N_ZERO if c == "0" else _N_INT
            return i + 1
        word = _WORDS.get(c)
        if word is None:
            return self._fail(text, i)
        if text.startswith(word, i):
            self._value_done(text, i + len(word))
            return i + len(word)
        self._state = _J_LITERAL
        self._lit = word[1:]
        return i + 1

    def _value_string(self, text: str, i: int, role: int) -> int:
        """A string value starts at ``i``, just after its quote."""
        end = _string_end(text, i)
        if end >= 0 and self._capturing:
            self._escape_run(text, i, end - 1)
        if end < 0 or role != _R_SKIP:
            s = "" if end < 0 else _decode_string(text, i - 1)
            if end < 0 or _SURROGATE.search(s) is not None:
                self._open_string(key=False)
                return i
            if role == _R_NAME:
                self._name_done(text, end, s)
                if self.status:
                    return end
            else:
                self._owner._args(s or "{}")
        self._value_done(text, end)
        return end

    def _key(self, text: str, i: int) -> int:
        """A key starts at ``i``, just after its quote."""
        end = _string_end(text, i)
        if end < 0:
            self._open_string(key=True)
            return i
        self._state = _J_COLON
        if self._capturing:
            self._escape_run(text, i, end - 1)
        if len(self._stack) == self._level:
            self._key_done(text, end, _decode_string(text, i - 1))
            if self.status:
                return end
        m = _COLON.match(text, end)
        if m is None:
            return end
        self._state = _J_VALUE
        return m.end()

    def _string(self, text: str, i: int) -> int:
        if self._out is None:
            m = _STRING_RUN.match(text, i)
            assert m is not None
            j = m.end()
            if self._capturing:
                self._escape_run(text, i, j)
        else:
            m = _DECODE_RUN.match(text, i)
            assert m is not None
            j = m.end()
            if j > i:
                run = text[i:j]
                self._decoded(_decode_string('"' + run + '"', 0) if "\\" in run else run)
        if j == len(text):
            return j
        # The run stops at the closing quote or at an escape it cannot take whole.
        if text[j] == '"':
            self._string_done(text, j + 1)
        else:
            self._state = _J_ESCAPE
        return j + 1

    def _escape(self, text: str, i: int) -> int:
        c = text[i]
        if c == "u":
            self._state = _J_UNICODE
            self._hex = ""
        elif c in _ESCAPES:
            self._state = _J_STRING
            if self._out is not None:
                self._decoded(_ESCAPES[c])
        else:
            return self._fail(text, i)
        return i + 1

    def _unicode(self, text: str, i: int) -> int:
        c = text[i]
        if c not in _HEX:
            return self._fail(text, i)
        self._hex += c
        if len(self._hex) == 4:
            self._state = _J_STRING
            if self._out is not None:
                self._code_point(int(self._hex, 16))
        return i + 1

    def _number(self, text: str, i: int) -> int:
        c = text[i]
        num = self._num
        if c in _DIGIT:
            if num in _N_RUNS:
                m = _DIGITS.match(text, i)
                assert m is not None
                return m.end()
            if num == _N_ZERO:  # no leading zeros
                return self._fail(text, i)
            if num == _N_SIGN:
                num = _N_ZERO if c == "0" else _N_INT
            elif num == _N_DOT:
                num = _N_FRAC
            else:  # after the exponent's e or its sign
                num = _N_EXP
        elif c == "." and num in (_N_ZERO, _N_INT):
            num = _N_DOT
        elif c in "eE" and num in (_N_ZERO, _N_INT, _N_FRAC):
            num = _N_E
        elif c in "+-" and num == _N_E:
            num = _N_ESIGN
        elif num in _N_ACCEPT:
            # The number ended just before c, which is read again.
            self._value_done(text, i)
            return i
        else:
            return self._fail(text, i)
        self._num = num
        return i + 1

    def _literal(self, text: str, i: int) -> int:
        if text[i] != self._lit[0]:
            return self._fail(text, i)
        self._lit = self._lit[1:]
        if not self._lit:
            self._value_done(text, i + 1)
        return i + 1

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

    # -- transitions

    def _open_string(self, *, key: bool) -> None:
        self._state = _J_STRING
        self._in_key = key
        self._out = None
        if len(self._stack) == self._level:
            if key or self._role == _R_NAME:
                self._parts.clear()
                self._out = self._parts.append
            elif self._role == _R_ARGS:
                self._out = self._args_text

    def _string_done(self, text: str, i: int) -> None:
        """A string read by the automaton ended just before ``i``."""
        if self._high:
            self._decoded("")
        self._out = None
        at_level = len(self._stack) == self._level
        if self._in_key:
            self._in_key = False
            self._state = _J_COLON
            if at_level:
                self._key_done(text, i, "".join(self._parts))
            return
        if at_level and self._role == _R_NAME:
            self._name_done(text, i, "".join(self._parts))
            if self.status:
                return
        elif at_level and self._role == _R_ARGS and not self._args_sent:
            self._owner._args("{}")
        self._value_done(text, i)

    def _key_done(self, text: str, i: int, key: str) -> None:
        if key == "name":
            if self._named:  # a second name: the first cannot be taken back
                self._fail(text, i)
            self._role = _R_NAME
        elif key in _ARGS_KEYS:
            if self._args != _A_ABSENT:
                self._fail(text, i)
            self._role = _R_ARGS
        else:
            self._role = _R_SKIP

    def _name_done(self, text: str, i: int, name: str) -> None:
        if not name.strip() or _NOT_IN_NAMES.search(name) is not None:
            self._fail(text, i)
            return
        self._named = True
        self._owner._start(name)

    def _value_done(self, text: str, i: int) -> None:
        """A value ended just before ``i``."""
        self._state = _J_AFTER
        if len(self._stack) == self._level:
            if self._role == _R_ARGS:
                self._stop_capture(text, i)
                self._args = _A_DONE
            self._role = _R_SKIP
        if self._stack:
            return
        if not self._named:
            self._fail(text, i)
            return
        if self._args == _A_ABSENT:
            self._owner._args("{}")  # what OpenAI sends for a call without arguments
            self._args = _A_DONE
        self.status = DONE

    def _fail(self, text: str, i: int, back: str = "") -> int:
        self._stop_capture(text, i)
        self.status = FAILED
        self.back = back
        self.complete = self._named and self._args == _A_DONE
        return i

    def _stop_capture(self, text: str, i: int) -> None:
        if self._capturing:
            self._capturing = False
            if i > self._cap:
                self._owner._args(text[self._cap : i])

    # -- string text

    def _args_text(self, s: str) -> None:
        self._args_sent = True
        self._owner._args(s)

    def _escape_run(self, text: str, i: int, j: int) -> None:
        """Captured string content ``text[i:j]``: raw control characters
        (invalid JSON that models still write) go out escaped."""
        if _CONTROL_CHAR.search(text, i, j) is None:
            return
        if i > self._cap:
            self._owner._args(text[self._cap : i])
        self._owner._args(_escape_controls(text[i:j]))
        self._cap = j

    def _decoded(self, s: str) -> None:
        out = self._out
        assert out is not None
        if self._high:
            out("\ufffd")
            self._high = 0
        if s:
            out(s)

    def _code_point(self, cp: int) -> None:
        if 0xDC00 <= cp <= 0xDFFF:
            if self._high:
                out = self._out
                assert out is not None
                out(chr(0x10000 + ((self._high - 0xD800) << 10) + (cp - 0xDC00)))
                self._high = 0
            else:
                self._decoded("\ufffd")
        elif 0xD800 <= cp <= 0xDBFF:
            self._decoded("")
            self._high = cp
        else:
            self._decoded(chr(cp))
