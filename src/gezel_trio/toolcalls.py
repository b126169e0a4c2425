"""Tool-call markup in streamed model output, split out as OpenAI tool-call deltas.

Pure string logic (stdlib and attrs only), used per sequence on the engine's
host thread like :mod:`gezel_trio.text`: the detokenized text of each step
goes into :meth:`ToolCallSplitter.feed`, typed events come out. Argument text
is streamed as it is generated, not handed over as one whole call at the end.

Formats are resolved from the chat template (:func:`resolve_format`), never
guessed from what the model writes; a template with tool syntax of an unknown
family gets no splitter and its output stays content. A template with no tool
syntax at all gets :data:`GENERIC`, as llama.cpp's generic handler does: the
tools are described in the system turn (``prompt.generic_tool_messages``)
and a call is one JSON object, ``{"tool_call": {"name": ..., "arguments":
...}}``, constrained by a grammar when the request forces one.

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

Cost is linear in the text fed, whatever its chunking: no pattern here can
backtrack, each character is looked at a bounded number of times, and
held-back text is bounded by the longest marker (or, inside a call, kept in
lists joined once). Runs that are whole in a piece (strings, numbers,
whitespace, openers, the text between markers) are taken at C speed; only
tokens of markup go through Python one by one.
"""

from __future__ import annotations

import json
import re
import secrets
from _json import scanstring as _scanstring  # what json.decoder uses; typeshed types it here
from collections.abc import Callable, Iterable
from typing import Any, Literal, Protocol, TypeAlias

import attrs

__all__ = [
    "GENERIC",
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
    "resolve_format",
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
    start: str = attrs.field(validator=attrs.validators.min_len(1))
    end: str
    body: Literal["json", "xml", "name_args"]


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "json")
QWEN3_CODER = ToolFormat("qwen3_coder", "<tool_call>", "</tool_call>", "xml")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", "name_args")
# For templates without tool syntax: '{"tool_call": ' + the Hermes-style call
# object + '}'. The body scanner reads the inner object; the trailer the "}".
GENERIC = ToolFormat("generic", '{"tool_call":', "}", "json")

# A template that mentions the tool definitions teaches its own syntax.
_TEMPLATE_TOOLS = re.compile(r"\btools\b")


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


def resolve_format(chat_template: str | None) -> ToolFormat | None:
    """:func:`detect_format`, or :data:`GENERIC` for a template that has no
    tool syntax at all; None for no template, or an unsupported family."""
    found = detect_format(chat_template)
    if found is None and chat_template and not _TEMPLATE_TOOLS.search(chat_template):
        return GENERIC
    return found


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
    """A call's markup after its opening marker.

    ``step`` consumes ``text`` from ``i`` and returns where it stopped: the end
    of ``text`` while ``status`` stays ``_RUNNING``, otherwise the position
    that decided the outcome. On ``_FAILED`` that position holds the offending
    character (not consumed) and ``back`` the end of the consumed text that
    must be read again as ordinary output. ``complete`` says whether a started
    call can still end well.
    """

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


def _escape_controls(s: str) -> str:
    return _CONTROL_CHAR.sub(lambda m: json.dumps(m.group())[1:-1], s)


class _JsonBody:
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
    status = _RUNNING
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

    def __init__(self, owner: _Owner, end: str, *, root_args: bool) -> None:
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
            if c in _WS:
                i = _skip_ws(text, i)
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
            s = "" if end < 0 else _scanstring(text, i, False)[0]
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
            self._key_done(text, end, _scanstring(text, i, False)[0])
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
                self._decoded(_scanstring(run + '"', 0, False)[0] if "\\" in run else run)
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
        self.status = _CLOSED
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
        self.status = _DONE

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


_NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]*+")
_ARGS_MARK = "[ARGS]"


class _NameArgsBody:
    """Mistral's ``NAME[ARGS]{...}``: a bare function name, then the arguments
    as one JSON value; the call ends with that value."""

    status = _RUNNING
    back = ""
    complete = False
    _matched = 0  # how much of "[ARGS]" has been read
    _json: _JsonBody | None = None

    def __init__(self, owner: _Owner) -> None:
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
_FUNCTION_TAG = "<function="
_PARAM_TAG = "<parameter="
_PARAM_END = "</parameter>"
_FUNCTION_END = "</function>"
_WORD_STOP = re.compile(r"[>\n<]")
_TAG_WINDOW = 32  # more than any tag, closing markers included


def _reject_constant(name: str) -> Any:
    raise ValueError(name)  # NaN and Infinity are not JSON


def _param_json(raw: str) -> str:
    """A parameter's value as JSON text.

    The template writes strings bare and everything else as JSON, so a value
    that parses as a JSON number, bool, null, array or object is taken as one,
    and anything else is a string. Without the tool's schema, a string that
    looks like a number (a zip code ``12345``) is taken as the number.
    """
    # The template puts the value on lines of its own.
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    try:
        parsed = json.loads(value, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        parsed = value
    if isinstance(parsed, str):
        return json.dumps(value, ensure_ascii=False)
    return value.strip()


def _common_prefix(a: str, b: str) -> int:
    k = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        k += 1
    return k


class _XmlBody:
    """Qwen3-Coder's ``<function=NAME><parameter=KEY>VALUE</parameter>...</function>``.

    The arguments object is built as JSON text: ``{`` and the first member
    when the first parameter closes, ``, "KEY": VALUE`` for each later one,
    ``}`` at ``</function>``. A value is only known to be complete at its
    closing tag, so each parameter is sent whole. The first ``</parameter>``
    ends a value, whatever the value holds.
    """

    status = _RUNNING
    back = ""
    complete = False
    _state = _X_OPEN
    _lit = ""  # a tag cut by the end of the text
    _key = ""
    _params = 0

    def __init__(self, owner: _Owner, end: str) -> None:
        self._owner = owner
        self._body_tags = tuple(t for t in (_PARAM_TAG, _FUNCTION_END, end) if t)
        self._parts: list[str] = []
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
            if st in (_X_NAME, _X_KEY):
                i = self._word(text, i, st)
            elif not self._lit and text[i] in _WS:
                i = _skip_ws(text, i)
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
            self._owner._start(word)
            self._state = _X_BODY
        else:
            self._key = word
            self._state = _X_VALUE
        return k + 1

    def _tag(self, text: str, i: int, tags: tuple[str, ...]) -> int:
        lit = self._lit
        cand = lit + text[i : i + _TAG_WINDOW]
        best = 0
        for tag in tags:
            if cand.startswith(tag):
                self._lit = ""
                return self._tag_done(tag, i + len(tag) - len(lit))
            best = max(best, _common_prefix(cand, tag))
        if best == len(cand):  # a tag cut by the end of the text
            self._lit = cand
            return len(text)
        return self._fail(i + best - len(lit), back=cand[:best])

    def _tag_done(self, tag: str, i: int) -> int:
        if tag == _FUNCTION_TAG:
            self._state = _X_NAME
        elif tag == _PARAM_TAG:
            self._state = _X_KEY
        else:
            # </function>, or the closing marker with </function> missing.
            self._owner._args("}" if self._params else "{}")
            self.complete = True
            self.status = _DONE if tag == _FUNCTION_END else _CLOSED
        return i

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

    status = _RUNNING
    back = ""
    complete = True
    _matched = 0

    def __init__(self, end: str) -> None:
        self._end = end
        self._held: list[str] = []

    def closable_at_end(self) -> bool:
        return True

    def step(self, text: str, i: int) -> int:
        n = len(text)
        end = self._end
        while i < n:
            if not self._matched:
                j = _skip_ws(text, i)
                if j > i:
                    self._held.append(text[i:j])
                    i = j
                    continue
                if text.startswith(end, i):
                    self.status = _CLOSED
                    return i + len(end)
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

_JSON_STRUCTURE = frozenset('{}[],:"')

# The characters a call body can begin with (a Mistral name is never empty).
_FIRST_CHARS = {
    "json": frozenset("{" + _WS),
    "xml": frozenset("<" + _WS),
    "name_args": frozenset("_.-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"),
}


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
        self._first = _FIRST_CHARS[fmt.body]
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
                    if i < n and text[i] not in self._first:
                        # Cannot begin a call: decided at once, without a body
                        # (the body would fail on the same character).
                        self._plain(self._fmt.start)
                    else:
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
            # The body watches for a closing marker written before the JSON
            # is complete, unless the marker is JSON itself (GENERIC's "}"):
            # then only the trailer after the complete body reads it.
            early_end = "" if fmt.end[:1] in _JSON_STRUCTURE else fmt.end
            body = _JsonBody(self, early_end, root_args=False)
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
