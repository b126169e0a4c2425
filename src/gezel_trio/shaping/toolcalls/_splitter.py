"""The splitter: finds opening markers in streamed text and drives one body per call."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._markers import MarkerSeeker
from ._body import CLOSED, DONE, FAILED, RUNNING, WS, Body, skip_ws
from ._events import CallArgs, CallEnd, CallStart, Content, ToolEvent, new_call_id
from ._format import ToolFormat

__all__ = ["ToolCallSplitter", "string_parameters"]


def string_parameters(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, frozenset[str]]:
    """Each function tool's parameters whose schema says string (``type``
    string, or an ``enum`` / ``const`` of strings)."""
    out: dict[str, frozenset[str]] = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        params = fn.get("parameters") if isinstance(fn, Mapping) else None
        props = params.get("properties") if isinstance(params, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(props, Mapping):
            continue
        out[str(fn.get("name"))] = frozenset(k for k, v in props.items() if _is_string(v))
    return out


def _is_string(schema: Any) -> bool:
    if not isinstance(schema, Mapping):
        return False
    enum = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(enum, list) and enum:
        return all(isinstance(v, str) for v in enum)
    return schema.get("type") == "string"


class _Trailer:
    """After a complete body: whitespace, then the closing marker."""

    status = RUNNING
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
                j = skip_ws(text, i)
                if j > i:
                    self._held.append(text[i:j])
                    i = j
                    continue
                if text.startswith(end, i):
                    self.status = CLOSED
                    return i + len(end)
            if text[i] != end[self._matched]:
                self.status = FAILED
                self.back = "".join(self._held) + end[: self._matched]
                return i
            i += 1
            self._matched += 1
            if self._matched == len(end):
                self.status = CLOSED
                return i
        return n


class ToolCallSplitter:
    """Splits one generation's streamed text into content and tool-call events.

    ``feed`` takes the next piece of text and returns the events it completes;
    ``finish`` ends the text and returns the rest. Neither raises on anything
    the model writes.
    """

    def __init__(
        self,
        fmt: ToolFormat,
        *,
        id_factory: Callable[[], str] = new_call_id,
        string_params: Mapping[str, frozenset[str]] | None = None,
    ) -> None:
        """``string_params``: each tool's parameters declared strings
        (``string_parameters``), for the markups that write values bare."""
        self._fmt = fmt
        self._string_params = string_params or {}
        self._new_id = id_factory
        self._opener = MarkerSeeker(fmt.start)
        self._start0 = fmt.start[0]
        self._first = fmt.body.first_chars
        self._open_body = fmt.body.open
        self._events: list[ToolEvent] = []
        self._run: list[str] = []  # text of the Content or CallArgs being built
        self._run_kind: int | None = None  # -1: Content; otherwise a call index
        self._body: Body | None = None
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
            if body.status != RUNNING:
                self._settle(body)

    def _open(self) -> None:
        fmt = self._fmt
        body = self._open_body(self, fmt)
        self._body = body
        self._raw = [fmt.start]
        self._started = False

    def _settle(self, body: Body) -> None:
        """The body (or trailer) stopped: end the call, degrade it, or move on."""
        status = body.status
        self._body = None
        if isinstance(body, _Trailer):
            if status == FAILED:
                self._scan(body.back)
            return
        if status == DONE:
            self._end(malformed=False)
            if self._fmt.end:
                self._body = _Trailer(self._fmt.end)
            return
        back = body.back if status == FAILED else ""
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

    def _is_string(self, name: str, key: str) -> bool:
        return key in self._string_params.get(name, ())

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
            if not s.strip(WS):
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
