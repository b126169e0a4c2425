"""Tool-call markup in streamed model output, split out as OpenAI tool-call deltas.

Pure string logic (stdlib and attrs only), used per sequence on the engine's
host thread like :mod:`gezel_trio.text`: the detokenized text of each step
goes into :meth:`ToolCallSplitter.feed`, typed events come out. Argument text
is streamed as it is generated, not handed over as one whole call at the end.

Formats are resolved from the chat template (:func:`detect_format`), never
guessed from what the model writes; an unknown family gets no splitter and its
output stays content.

For every call the events are, in order: one :class:`CallStart` (index, id,
name), sent once the name is known and the markup so far is valid; zero or
more :class:`CallArgs` whose fragments concatenate to the call's arguments
JSON text; one :class:`CallEnd`. :class:`Content` carries the text outside
calls. Any chunking of the same output gives the same events once adjacent
``Content`` values, and adjacent ``CallArgs`` of one call, are merged (ids
come from ``id_factory`` and so differ unless it is deterministic).

Malformed markup never raises. Before its ``CallStart`` a call that turns out
malformed degrades to content: its raw text, opening marker included, is
emitted as ``Content`` and scanning resumes at the offending character. A
``CallStart`` cannot be taken back, so a call that breaks later ends with
``CallEnd(malformed=True)`` (its arguments are then whatever was already
sent) and the text from the offending character on is scanned again as
ordinary output. ``malformed`` is false when the arguments value itself was
complete, so a model that only forgets the object's closing brace still
produces a good call.

Whitespace right after a call is markup layout: it is held back and dropped if
another call or the end of the text follows, and emitted otherwise.

Every step is linear in the text fed: no pattern here can backtrack, nothing
rescans what it has already passed, and held-back text is bounded by the
longest marker.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterable
from typing import Any, Literal, Protocol, TypeAlias

import attrs

__all__ = [
    "HERMES",
    "MISTRAL",
    "QWEN3_CODER",
    "CallArgs",
    "CallEnd",
    "CallStart",
    "Content",
    "ToolCallSplitter",
    "ToolEvent",
    "ToolFormat",
    "collect",
    "detect_format",
    "new_call_id",
]


@attrs.frozen
class ToolFormat:
    """How one chat-template family writes a tool call.

    ``start`` opens a call and ``end`` closes it (empty when the call ends with
    its body). ``body`` names the syntax in between:

    * ``"json"``: one object ``{"name": ..., "arguments": ...}`` (Hermes, Qwen
      2.5/3); ``"parameters"`` is accepted for ``"arguments"``.
    * ``"xml"``: ``<function=NAME>`` then ``<parameter=KEY>VALUE</parameter>``
      blocks, then ``</function>`` (Qwen3-Coder).
    * ``"name_args"``: ``NAME[ARGS]`` then the arguments as one JSON value
      (Mistral tokenizer v11 and later).
    """

    name: str
    start: str
    end: str
    body: Literal["json", "xml", "name_args"]


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "json")
QWEN3_CODER = ToolFormat("qwen3_coder", "<tool_call>", "</tool_call>", "xml")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", "name_args")


def detect_format(chat_template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template teaches its model, or None.

    Checked most specific first: Qwen3-Coder's template also contains
    ``<tool_call>``. GLM's ``<arg_key>`` bodies and Mistral's older JSON-list
    form are not supported, so they give None rather than a wrong guess.
    """
    if not chat_template:
        return None
    t = chat_template
    if "<tool_call>" in t and "<function=" in t and "<parameter=" in t:
        return QWEN3_CODER
    if "<tool_call>" in t and "<arg_key>" not in t:
        return HERMES
    if "[TOOL_CALLS]" in t and "[ARGS]" in t:
        return MISTRAL
    return None


@attrs.frozen
class Content:
    """Text outside any tool call."""

    text: str


@attrs.frozen
class CallStart:
    """A tool call began: its position among this output's calls, its id and name."""

    index: int
    id: str
    name: str


@attrs.frozen
class CallArgs:
    """The next piece of call ``index``'s arguments JSON text."""

    index: int
    fragment: str


@attrs.frozen
class CallEnd:
    """Call ``index`` is complete. ``malformed``: its markup broke after it had
    started, and the arguments sent may not parse."""

    index: int
    malformed: bool = False


ToolEvent: TypeAlias = Content | CallStart | CallArgs | CallEnd


def new_call_id() -> str:
    """A fresh id in OpenAI's shape: ``call_`` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


def collect(events: Iterable[ToolEvent]) -> tuple[str, list[dict[str, Any]]]:
    """The content and the OpenAI ``tool_calls`` list that ``events`` add up to,
    for a non-streaming response. Malformed calls are kept, so a streaming and a
    non-streaming client see the same calls."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    args: dict[int, list[str]] = {}
    for event in events:
        match event:
            case Content(text=text):
                content.append(text)
            case CallStart(index=index, id=call_id, name=name):
                calls[index] = {"id": call_id, "type": "function", "function": {"name": name}}
                args[index] = []
            case CallArgs(index=index, fragment=fragment):
                args[index].append(fragment)
            case CallEnd():
                pass
    for index, call in calls.items():
        call["function"]["arguments"] = "".join(args[index])
    return "".join(content), [calls[k] for k in sorted(calls)]


_WS = " \t\n\r"
_WS_RUN = re.compile(r"[ \t\n\r]+")


def _skip_ws(text: str, i: int) -> int:
    m = _WS_RUN.match(text, i)
    return i if m is None else m.end()


def _held_tail(text: str, i: int, marker: str) -> int:
    """Length of the longest end of ``text[i:]`` that is a proper prefix of ``marker``."""
    n = len(text)
    k = text.find(marker[0], max(i, n - len(marker) + 1))
    while k >= 0:
        if marker.startswith(text[k:]):
            return n - k
        k = text.find(marker[0], k + 1)
    return 0


class _MarkerSeeker:
    """Finds one marker in streamed text, holding back a possible partial match
    at the end of each piece until the next piece decides it.

    Shared with :mod:`gezel_trio.reasoning`.
    """

    __slots__ = ("held", "marker")

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.held = ""

    def seek(self, text: str, i: int) -> tuple[str, int, bool]:
        """Scan ``text`` from ``i``: the text before the marker (or all that is
        safe), where scanning stopped, and whether the marker was found there."""
        marker = self.marker
        held = self.held
        n = len(text)
        before = ""
        if held:
            rest = marker[len(held) :]
            if text.startswith(rest, i):
                self.held = ""
                return "", i + len(rest), True
            if n - i < len(rest) and rest.startswith(text[i:]):
                self.held = held + text[i:]
                return "", n, False
            # The held text is not the marker after all: release it one
            # character at a time until what is left could still begin one.
            pending = held + text[i]
            i += 1
            k = 1
            while not marker.startswith(pending[k:]):
                k += 1
            before, self.held = pending[:k], ""
            if k < len(pending):
                return self._resume(before, pending[k:], text, i)
        k = text.find(marker, i)
        if k >= 0:
            return before + text[i:k], k + len(marker), True
        keep = _held_tail(text, i, marker)
        self.held = text[n - keep :]
        return before + text[i : n - keep], n, False

    def _resume(self, before: str, pending: str, text: str, i: int) -> tuple[str, int, bool]:
        # ``pending`` (short, a proper prefix of the marker) starts the rest.
        self.held = pending
        out, j, found = self.seek(text, i)
        return before + out, j, found

    def take(self) -> str:
        """Release the held-back text (the output has ended)."""
        held, self.held = self.held, ""
        return held


# Body scan outcomes.
_RUNNING = 0  # everything given was consumed
_DONE = 1  # the call's body is complete; the closing marker may follow
_CLOSED = 2  # the closing marker was consumed (possibly before the body was complete)
_FAILED = 3  # the markup is malformed at the returned position


class _Owner(Protocol):
    def _start(self, name: str) -> None: ...
    def _args(self, fragment: str) -> None: ...


class _Body(Protocol):
    status: int
    back: str
    complete: bool

    def step(self, text: str, i: int) -> int: ...
    def closable_at_end(self) -> bool: ...


# --- JSON bodies --------------------------------------------------------------

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
_DIGITS = re.compile(r"[0-9]+")
_HEX = frozenset("0123456789abcdefABCDEF")
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_CLOSER = {"{": "}", "[": "]"}
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
# What ends a run of ordinary string characters.
_STRING_STOP = re.compile(r'["\\\x00-\x1f]')

# Roles of a value at the call object's member level.
_R_SKIP, _R_NAME, _R_ARGS = range(3)
# Progress of the arguments value.
_A_ABSENT, _A_PENDING, _A_DONE = range(3)
_ARGS_KEYS = ("arguments", "parameters")


def _escape_control(c: str) -> str:
    return json.dumps(c)[1:-1]


class _JsonBody:
    """Scans a JSON call body incrementally with a full validating pushdown
    automaton, so it knows exactly where the arguments value ends and that it
    parses.

    In Hermes form (``root_args=False``) the root is the call object and its
    ``"name"`` and ``"arguments"`` members are picked out; an arguments object
    is passed on as raw text while it streams, an arguments string as its
    decoded content (OpenAI sends arguments as a string holding JSON, so a
    model that double-encodes means that inner text). With ``root_args`` the
    whole root value is the arguments and the name is already known.

    Raw control characters inside strings are invalid JSON that models still
    write (a literal newline in code); they are passed on escaped so the
    arguments parse.
    """

    __slots__ = (
        "_args",
        "_args_sent",
        "_cap",
        "_capturing",
        "_end",
        "_end0",
        "_high",
        "_hex",
        "_in_key",
        "_level",
        "_lit",
        "_marker",
        "_named",
        "_num",
        "_out",
        "_owner",
        "_parts",
        "_role",
        "_stack",
        "_state",
        "back",
        "complete",
        "status",
    )

    def __init__(self, owner: _Owner, end: str, *, root_args: bool) -> None:
        self._owner = owner
        self._end = end
        self._end0 = end[:1]
        self.status = _RUNNING
        self.back = ""
        self.complete = False
        self._stack: list[str] = []
        # Depth of the values whose role matters: the call object's members, or the root.
        self._level = 0 if root_args else 1
        self._state = _J_VALUE if root_args else _J_ROOT
        self._role = _R_ARGS if root_args else _R_SKIP
        self._named = root_args
        self._args = _A_ABSENT
        self._args_sent = False  # an arguments string has decoded to something
        self._in_key = False
        self._parts: list[str] = []
        self._out: Callable[[str], None] | None = None  # where decoded string text goes
        self._capturing = False  # raw arguments text is being passed on
        self._cap = 0  # where the raw text not yet passed on starts, in the current piece
        self._high = 0  # a high surrogate from a \u escape, waiting for its pair
        self._hex = ""
        self._lit = ""
        self._num = 0
        self._marker = 0

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
                m = _STRING_STOP.search(text, i)
                j = n if m is None else m.start()
                if j > i:
                    if self._out is not None:
                        self._decoded(text[i:j])
                    i = j
                    continue
                c = text[i]
                i += 1
                if c == '"':
                    if self._string_done(text, i):
                        return i
                elif c == "\\":
                    self._state = _J_ESCAPE
                else:
                    self._control(text, i - 1, c)
                continue
            c = text[i]
            if st <= _J_AFTER:
                if c in _WS:
                    i = _skip_ws(text, i)
                    continue
                if c == self._end0 and self._named:
                    # Never JSON outside a string: this can only be the closing
                    # marker, written before the JSON was closed.
                    self._stop_capture(text, i)
                    self._state = _J_MARKER
                    self._marker = 1
                    i += 1
                    continue
                i += 1
                if st == _J_AFTER:
                    top = self._stack[-1]
                    if c == ",":
                        self._state = _J_KEY if top == "{" else _J_VALUE
                        continue
                    if c == _CLOSER[top]:
                        self._stack.pop()
                        if self._value_done(text, i):
                            return i
                        continue
                    return self._fail(text, i - 1)
                if st == _J_COLON:
                    if c != ":":
                        return self._fail(text, i - 1)
                    self._state = _J_VALUE
                    continue
                if st == _J_KEY or st == _J_KEY_OR_CLOSE:
                    if c == '"':
                        self._open_string(key=True)
                        continue
                    if c == "}" and st == _J_KEY_OR_CLOSE:
                        self._stack.pop()
                        if self._value_done(text, i):
                            return i
                        continue
                    return self._fail(text, i - 1)
                if st == _J_ROOT:
                    if c != "{":
                        return self._fail(text, i - 1)
                    self._stack.append("{")
                    self._state = _J_KEY_OR_CLOSE
                    continue
                if st == _J_ITEM_OR_CLOSE and c == "]":
                    self._stack.pop()
                    if self._value_done(text, i):
                        return i
                    continue
                # A value starts here.
                if len(self._stack) == self._level and not self._member_starts(text, i - 1, c):
                    return self._fail(text, i - 1)
                if c == "{" or c == "[":
                    self._stack.append(c)
                    self._state = _J_KEY_OR_CLOSE if c == "{" else _J_ITEM_OR_CLOSE
                elif c == '"':
                    self._open_string(key=False)
                elif c == "-" or c in _DIGIT:
                    self._state = _J_NUMBER
                    self._num = _N_SIGN if c == "-" else _N_ZERO if c == "0" else _N_INT
                elif c in _LITERALS:
                    self._state = _J_LITERAL
                    self._lit = _LITERALS[c]
                else:
                    return self._fail(text, i - 1)
                continue
            if st == _J_NUMBER:
                num = self._num
                if c in _DIGIT:
                    if num in _N_RUNS:
                        i = _DIGITS.match(text, i).end()  # type: ignore[union-attr]  # c is a digit
                        continue
                    if num == _N_ZERO:  # no leading zeros
                        return self._fail(text, i)
                    if num == _N_SIGN:
                        num = _N_ZERO if c == "0" else _N_INT
                    elif num == _N_DOT:
                        num = _N_FRAC
                    else:  # after the exponent's e or its sign
                        num = _N_EXP
                elif c == "." and (num == _N_ZERO or num == _N_INT):
                    num = _N_DOT
                elif (c == "e" or c == "E") and (num == _N_ZERO or num == _N_INT or num == _N_FRAC):
                    num = _N_E
                elif (c == "+" or c == "-") and num == _N_E:
                    num = _N_ESIGN
                elif num in _N_ACCEPT:
                    # The number ended just before c, which is looked at again.
                    if self._value_done(text, i):
                        return i
                    continue
                else:
                    return self._fail(text, i)
                self._num = num
                i += 1
                continue
            if st == _J_LITERAL:
                if c != self._lit[0]:
                    return self._fail(text, i)
                i += 1
                self._lit = self._lit[1:]
                if not self._lit and self._value_done(text, i):
                    return i
                continue
            if st == _J_ESCAPE:
                if c == "u":
                    self._state = _J_UNICODE
                    self._hex = ""
                elif c in _ESCAPES:
                    self._state = _J_STRING
                    if self._out is not None:
                        self._decoded(_ESCAPES[c])
                else:
                    return self._fail(text, i)
                i += 1
                continue
            if st == _J_UNICODE:
                if c not in _HEX:
                    return self._fail(text, i)
                i += 1
                self._hex += c
                if len(self._hex) == 4:
                    self._state = _J_STRING
                    if self._out is not None:
                        self._code_point(int(self._hex, 16))
                continue
            # _J_MARKER
            end = self._end
            if c != end[self._marker]:
                return self._fail(text, i, back=end[: self._marker])
            i += 1
            self._marker += 1
            if self._marker == len(end):
                if self._args == _A_ABSENT:
                    self._owner._args("{}")
                    self._args = _A_DONE
                self.complete = self._args == _A_DONE
                self.status = _CLOSED
                return i
        if self._capturing and n > self._cap:
            self._owner._args(text[self._cap : n])
        return n

    def _member_starts(self, text: str, i: int, c: str) -> bool:
        """A value of the call object (or the root arguments) starts at ``i``."""
        role = self._role
        if role == _R_NAME:
            return c == '"'
        if role == _R_ARGS:
            self._args = _A_PENDING
            if c != '"':
                self._capturing = True
                self._cap = i
        return True

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
                self._args_sent = False

    def _string_done(self, text: str, i: int) -> bool:
        if self._high:
            self._decoded("")
        self._out = None
        at_level = len(self._stack) == self._level
        if self._in_key:
            self._in_key = False
            self._state = _J_COLON
            if at_level:
                key = "".join(self._parts)
                if key == "name":
                    if self._named:  # a second name cannot be taken back
                        self._fail(text, i)
                        return True
                    self._role = _R_NAME
                elif key in _ARGS_KEYS:
                    if self._args != _A_ABSENT:
                        self._fail(text, i)
                        return True
                    self._role = _R_ARGS
                else:
                    self._role = _R_SKIP
            return False
        if at_level and self._role == _R_NAME:
            name = "".join(self._parts)
            if not name.strip():
                self._fail(text, i)
                return True
            self._named = True
            self._owner._start(name)
        elif at_level and self._role == _R_ARGS and not self._args_sent:
            self._owner._args("{}")  # "arguments": "" means no arguments
        return self._value_done(text, i)

    def _args_text(self, s: str) -> None:
        self._args_sent = True
        self._owner._args(s)

    def _value_done(self, text: str, i: int) -> bool:
        """A value ended just before ``i``; true when the scan must stop."""
        self._state = _J_AFTER
        if len(self._stack) == self._level:
            if self._role == _R_ARGS:
                self._stop_capture(text, i)
                self._args = _A_DONE
            self._role = _R_SKIP
        if self._stack:
            return False
        if not self._named:
            self._fail(text, i)
            return True
        if self._args == _A_ABSENT:
            self._owner._args("{}")  # what OpenAI sends for a call without arguments
            self._args = _A_DONE
        self.status = _DONE
        return True

    def _fail(self, text: str, i: int, back: str = "") -> int:
        self._stop_capture(text, i)
        self.status = _FAILED
        self.back = back
        self.complete = self._named and self._args == _A_DONE
        return i

    def _stop_capture(self, text: str, i: int) -> None:
        if self._capturing:
            self._capturing = False
            if i > self._cap:
                self._owner._args(text[self._cap : i])

    def _control(self, text: str, i: int, c: str) -> None:
        if self._capturing:
            if i > self._cap:
                self._owner._args(text[self._cap : i])
            self._owner._args(_escape_control(c))
            self._cap = i + 1
        elif self._out is not None:
            self._decoded(c)

    def _decoded(self, s: str) -> None:
        out = self._out
        assert out is not None
        if self._high:
            # A lone surrogate cannot be encoded as UTF-8 later; replace it.
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


_NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]*")
_ARGS_MARK = "[ARGS]"


class _NameArgsBody:
    """Mistral's ``NAME[ARGS]{...}``: a bare function name, then the arguments
    as one JSON value; the call ends with that value."""

    __slots__ = ("_json", "_matched", "_owner", "_parts", "back", "complete", "status")

    def __init__(self, owner: _Owner) -> None:
        self._owner = owner
        self.status = _RUNNING
        self.back = ""
        self.complete = False
        self._parts: list[str] = []
        self._matched = 0  # how much of "[ARGS]" has been read
        self._json: _JsonBody | None = None

    def closable_at_end(self) -> bool:
        return False

    def step(self, text: str, i: int) -> int:
        n = len(text)
        while self._json is None:
            if i == n:
                return n
            if not self._matched:
                j = _NAME_CHARS.match(text, i).end()  # type: ignore[union-attr]  # matches ""
                self._parts.append(text[i:j])
                i = j
                if i == n:
                    return n
            if text[i] != _ARGS_MARK[self._matched]:
                self.status = _FAILED
                self.back = _ARGS_MARK[: self._matched]
                return i
            i += 1
            self._matched += 1
            if self._matched == len(_ARGS_MARK):
                name = "".join(self._parts)
                if not name:
                    self.status = _FAILED
                    return i
                self._owner._start(name)
                self._json = _JsonBody(self._owner, "", root_args=True)
        j = self._json.step(text, i)
        self.status = self._json.status
        self.back = self._json.back
        self.complete = self._json.complete
        return j


# --- the XML body (Qwen3-Coder) ---------------------------------------------

_X_OPEN = 0  # before <function=
_X_NAME = 1
_X_BODY = 2  # between parameters
_X_KEY = 3
_X_VALUE = 4
_FUNCTION_TAGS = ("<function=",)
_PARAM_TAG = "<parameter="
_PARAM_END = "</parameter>"
_FUNCTION_END = "</function>"
_WORD_STOP = re.compile(r"[>\n<]")


def _param_json(raw: str) -> str:
    """A parameter's value as JSON text.

    The template writes strings bare and everything else as JSON, so a value
    that parses as a JSON number, bool, null, array or object is taken as one,
    and anything else is a string. Without the tool's schema a string that
    looks like a number (``"007"`` parses; ``"12"`` becomes 12) is taken as
    the number; the schema-free guess is the price of not knowing the tools.
    """
    # The template puts the value on its own lines.
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    try:
        parsed = json.loads(value, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        parsed = value
    if isinstance(parsed, str):
        return json.dumps(value, ensure_ascii=False)
    return value.strip()


def _reject_constant(name: str) -> Any:
    raise ValueError(name)  # NaN and Infinity are not JSON


class _XmlBody:
    """Qwen3-Coder's ``<function=NAME><parameter=KEY>VALUE</parameter>...</function>``.

    The arguments object is built as JSON text: ``{`` and the first member when
    the first parameter closes, ``, "KEY": VALUE`` for each later one, ``}`` at
    ``</function>``. A value is only known to be complete at its closing tag,
    so each parameter is sent whole.
    """

    __slots__ = (
        "_body_tags",
        "_key",
        "_lit",
        "_owner",
        "_params",
        "_parts",
        "_seeker",
        "_state",
        "back",
        "complete",
        "status",
    )

    def __init__(self, owner: _Owner, end: str) -> None:
        self._owner = owner
        self.status = _RUNNING
        self.back = ""
        self.complete = False
        self._state = _X_OPEN
        self._body_tags = (_PARAM_TAG, _FUNCTION_END, end)
        self._lit = ""  # a tag read so far
        self._parts: list[str] = []
        self._key = ""
        self._params = 0
        self._seeker = _MarkerSeeker(_PARAM_END)

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
            if st == _X_NAME or st == _X_KEY:
                m = _WORD_STOP.search(text, i)
                if m is None:
                    self._parts.append(text[i:])
                    return n
                k = m.start()
                self._parts.append(text[i:k])
                if text[k] != ">":
                    return self._fail(k)
                i = k + 1
                word = "".join(self._parts).strip()
                self._parts.clear()
                if not word:
                    return self._fail(i)
                if st == _X_NAME:
                    self._owner._start(word)
                    self._state = _X_BODY
                else:
                    self._key = word
                    self._state = _X_VALUE
                continue
            # _X_OPEN or _X_BODY: tags, with whitespace between them.
            c = text[i]
            if not self._lit and c in _WS:
                i = _skip_ws(text, i)
                continue
            lit = self._lit + c
            tags = _FUNCTION_TAGS if st == _X_OPEN else self._body_tags
            if not any(t.startswith(lit) for t in tags):
                return self._fail(i, back=self._lit)
            i += 1
            if lit not in tags:
                self._lit = lit
                continue
            self._lit = ""
            if lit == "<function=":
                self._state = _X_NAME
            elif lit == _PARAM_TAG:
                self._state = _X_KEY
            else:
                # </function>, or the closing marker with </function> missing.
                self._owner._args("}" if self._params else "{}")
                self.complete = True
                self.status = _DONE if lit == _FUNCTION_END else _CLOSED
                return i
        return n

    def _param_done(self) -> None:
        value = _param_json("".join(self._parts))
        self._parts.clear()
        key = json.dumps(self._key, ensure_ascii=False)
        self._owner._args(("{" if not self._params else ", ") + key + ": " + value)
        self._params += 1

    def _fail(self, i: int, back: str = "") -> int:
        self.status = _FAILED
        self.back = back
        return i


class _Trailer:
    """After a complete body: whitespace, then the closing marker."""

    __slots__ = ("_end", "_held", "_matched", "back", "complete", "status")

    def __init__(self, end: str) -> None:
        self._end = end
        self.status = _RUNNING
        self.back = ""
        self.complete = True
        self._held: list[str] = []
        self._matched = 0

    def closable_at_end(self) -> bool:
        return True

    def step(self, text: str, i: int) -> int:
        n = len(text)
        end = self._end
        while i < n:
            if not self._matched and text[i] in _WS:
                j = _skip_ws(text, i)
                self._held.append(text[i:j])
                i = j
                continue
            if text[i] != end[self._matched]:
                self.status = _FAILED
                self.back = "".join(self._held) + end[: self._matched]
                return i
            i += 1
            self._matched += 1
            if self._matched == len(end):
                self.status = _CLOSED
                return i
        return n


# --- the splitter -------------------------------------------------------------


class ToolCallSplitter:
    """Splits one generation's streamed text into content and tool-call events.

    ``feed`` takes the next piece of text and returns the events it completes;
    ``finish`` ends the text and returns the rest. Neither raises on anything
    the model writes.
    """

    def __init__(self, fmt: ToolFormat, *, id_factory: Callable[[], str] = new_call_id) -> None:
        self._fmt = fmt
        self._new_id = id_factory
        self._opener = _MarkerSeeker(fmt.start)
        self._start0 = fmt.start[0]
        self._events: list[ToolEvent] = []
        self._run: list[str] = []  # text of the Content or CallArgs being built
        self._run_kind: int | None = None  # -1: Content; otherwise a call index
        self._body: _Body | None = None
        self._raw: list[str] | None = None  # a call's markup, until its CallStart
        self._held_args: list[str] = []  # arguments written before the name
        self._started = False
        self._index = -1
        self._count = 0
        self._after_call = False
        self._ws: list[str] = []  # whitespace after a call, not yet known to be content
        self._finished = False

    @property
    def call_count(self) -> int:
        """How many calls have started so far."""
        return self._count

    def feed(self, text: str) -> list[ToolEvent]:
        """Take the next piece of output; return the events it completes."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if (
            self._body is None
            and not self._after_call
            and not self._opener.held
            and self._start0 not in text
        ):
            # Plain content, the common case: no marker can begin in it.
            return [Content(text)] if text else []
        self._scan(text)
        return self._take()

    def finish(self) -> list[ToolEvent]:
        """End the output: close or degrade an open call, release held text."""
        if self._finished:
            return []
        self._finished = True
        body, self._body = self._body, None
        if body is not None and self._raw is not None:
            self._plain("".join(self._raw))
            self._raw = None
        elif body is not None and not isinstance(body, _Trailer):
            # Markup left unclosed belongs to the call, not to the content.
            self._end(malformed=not body.closable_at_end())
        self._plain(self._opener.take())
        if self._ws and not self._after_call:
            self._text(-1, "".join(self._ws))
        self._ws.clear()
        return self._take()

    # -- scanning

    def _scan(self, text: str) -> None:
        i, n = 0, len(text)
        while i < n:
            body = self._body
            if body is None:
                before, i, found = self._opener.seek(text, i)
                self._plain(before)
                if found:
                    self._open()
                continue
            j = body.step(text, i)
            if self._raw is not None:
                self._raw.append(text[i:j])
            i = j
            if body.status != _RUNNING:
                self._settle(body)

    def _open(self) -> None:
        fmt = self._fmt
        body: _Body
        if fmt.body == "json":
            body = _JsonBody(self, fmt.end, root_args=False)
        elif fmt.body == "xml":
            body = _XmlBody(self, fmt.end)
        else:
            body = _NameArgsBody(self)
        self._body = body
        self._raw = [fmt.start]
        self._started = False

    def _settle(self, body: _Body) -> None:
        """The body (or trailer) stopped: end the call, degrade it, or move on."""
        status = body.status
        self._body = None
        if isinstance(body, _Trailer):
            if status == _FAILED:
                self._scan(body.back)
            return
        if status == _DONE:
            self._end(malformed=False)
            if self._fmt.end:
                self._body = _Trailer(self._fmt.end)
            return
        back = body.back if status == _FAILED else ""
        if self._raw is not None:
            raw = "".join(self._raw)
            self._raw = None
            self._held_args.clear()
            self._plain(raw[: len(raw) - len(back)])
        else:
            self._end(malformed=not body.complete)
        if back:
            self._scan(back)

    # -- callbacks from the bodies

    def _start(self, name: str) -> None:
        self._started = True
        self._raw = None
        self._ws.clear()  # layout between calls
        self._index = self._count
        self._count += 1
        self._event(CallStart(self._index, self._new_id(), name))
        if self._held_args:
            self._text(self._index, "".join(self._held_args))
            self._held_args.clear()

    def _args(self, fragment: str) -> None:
        if self._started:
            self._text(self._index, fragment)
        else:
            self._held_args.append(fragment)

    def _end(self, *, malformed: bool) -> None:
        self._event(CallEnd(self._index, malformed))
        self._started = False
        self._after_call = True

    # -- output

    def _plain(self, s: str) -> None:
        """Content that is final, except whitespace straight after a call."""
        if not s:
            return
        if self._after_call:
            if not s.strip(_WS):
                self._ws.append(s)
                return
            self._after_call = False
            if self._ws:
                self._text(-1, "".join(self._ws))
                self._ws.clear()
        self._text(-1, s)

    def _text(self, kind: int, s: str) -> None:
        if kind != self._run_kind:
            self._flush()
            self._run_kind = kind
        self._run.append(s)

    def _event(self, event: ToolEvent) -> None:
        self._flush()
        self._events.append(event)

    def _flush(self) -> None:
        if self._run:
            s = "".join(self._run)
            self._run.clear()
            kind = self._run_kind
            self._events.append(CallArgs(kind, s) if kind is not None and kind >= 0 else Content(s))
        self._run_kind = None

    def _take(self) -> list[ToolEvent]:
        self._flush()
        out, self._events = self._events, []
        return out
