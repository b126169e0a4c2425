"""Think blocks in streamed model output, split out as ``reasoning_content``.

Pure string logic (stdlib and attrs only), used per sequence in the
request's task (``engine._chat``'s ``Shaper``), like
:mod:`gezel_trio.shaping.text`: the detokenized text of each step
goes into :meth:`ReasoningSplitter.feed`, and :class:`Reasoning` and
:class:`Content` values come out. Markers that could still be forming at the
end of a piece are held back until the next piece decides them, so any
chunking of the same output gives the same text of each kind.

The rules, for one generation:

* The block is the model's first output. With ``starts_inside`` (the rendered
  prompt already opened it, see :func:`prompt_opens_thinking`) the output
  starts inside it; otherwise it opens only if the start marker comes before
  anything but whitespace, and a start marker met later is ordinary content.
  Models write the block first, so this never mistakes an answer that talks
  about ``<think>`` for reasoning.
* The markers themselves are dropped, and so is the layout around them:
  line breaks at the start and end of the reasoning, and at the start of the
  answer that follows (templates write ``<think>\\n...\\n</think>\\n\\n``).
  Reasoning line breaks are therefore held back until more reasoning follows.
* Text after the end marker is content, verbatim, later markers included.
* Without an end marker (the budget or ``max_tokens`` ran out) everything
  after the start is reasoning.

:class:`ThinkPassthrough` applies the same rules but keeps the text as the
model wrote it (``--reasoning-format none``): its ``Reasoning`` values carry
the block verbatim, markers and layout included, so the concatenation of
everything it returns is the output itself. It tells the shaper where the
block ends (tool markup is parsed only after it) without changing a byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import attrs

# One Content class for both splitters, so a pipeline of the two matches one
# type; the marker search is the same held-back search the tool splitter uses.
from ._markers import MarkerSeeker
from .toolcalls import Content

__all__ = [
    "Content",
    "Reasoning",
    "ReasoningEvent",
    "ReasoningSplitter",
    "ThinkPassthrough",
    "prompt_opens_thinking",
    "prompt_opens_thinking_tokens",
]


@attrs.frozen
class Reasoning:
    """Text from inside the think block."""

    text: str


ReasoningEvent: TypeAlias = Reasoning | Content


def prompt_opens_thinking(prompt_text: str, start: str = "<think>", end: str = "</think>") -> bool:
    """Whether the rendered prompt leaves a think block open for the model:
    its last start marker has no end marker after it."""
    k = prompt_text.rfind(start)
    return k >= 0 and prompt_text.find(end, k + len(start)) < 0


_WS = " \t\n\r"
_BREAKS = "\r\n"

# Phases of one generation.
_LEAD = 0  # nothing visible yet: the block may still open
_THINK_LEAD = 1  # inside the block, before its first visible character
_THINK = 2
_ANSWER_LEAD = 3  # after the block, before the answer's first visible character
_ANSWER = 4


def prompt_opens_thinking_tokens(prompt: Sequence[int], think_ids: tuple[int, int]) -> bool:
    """The token-level twin of ``prompt_opens_thinking``: whether the last
    think marker in the prompt is an opening one."""
    start, end = think_ids
    for token in reversed(prompt):
        if token == end:
            return False
        if token == start:
            return True
    return False


class ReasoningSplitter:
    """Splits one generation's streamed text into reasoning and content.

    ``feed`` takes the next piece and returns what it completes; ``finish``
    ends the text and returns the rest. ``inside`` says whether the text is
    in the think block now, which is what a thinking budget counts.
    """

    def __init__(
        self, start: str = "<think>", end: str = "</think>", *, starts_inside: bool
    ) -> None:
        if not start or not end:
            raise ValueError("think markers must not be empty")
        self._start = start
        self._matched = 0  # how much of the start marker the output began with
        self._lead: list[str] = []  # whitespace before a possible start marker
        self._close = MarkerSeeker(end)
        self._breaks: list[str] = []  # line breaks at the end of the reasoning so far
        self._phase = _THINK_LEAD if starts_inside else _LEAD
        self._events: list[ReasoningEvent] = []
        self._finished = False

    @property
    def inside(self) -> bool:
        """True while the output is in the think block."""
        return self._phase in (_THINK_LEAD, _THINK)

    def feed(self, text: str) -> list[ReasoningEvent]:
        """Take the next piece of output; return the text it completes."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if self._phase == _ANSWER:
            return [Content(text)] if text else []
        i, n = 0, len(text)
        while i < n:
            phase = self._phase
            if phase == _LEAD:
                i = self._lead_in(text, i)
            elif phase in (_THINK_LEAD, _ANSWER_LEAD):
                j = len(text) - len(text[i:].lstrip(_BREAKS)) if text[i] in _BREAKS else i
                if j < n:
                    self._phase = _THINK if phase == _THINK_LEAD else _ANSWER
                i = j
            elif phase == _THINK:
                before, i, found = self._close.seek(text, i)
                self._reason(before)
                if found:
                    self._breaks.clear()
                    self._phase = _ANSWER_LEAD
            else:
                self._emit(Content, text[i:])
                i = n
        return self._take()

    def finish(self) -> list[ReasoningEvent]:
        """End the output and release what was held back."""
        if self._finished:
            return []
        self._finished = True
        if self._phase == _LEAD:
            # The output was only whitespace and part of a start marker.
            self._emit(Content, "".join(self._lead) + self._start[: self._matched])
        elif self.inside:
            self._reason(self._close.take())
        self._lead.clear()
        self._breaks.clear()
        return self._take()

    def _lead_in(self, text: str, i: int) -> int:
        """Before anything visible: whitespace, then the start marker or not."""
        n = len(text)
        if not self._matched:
            j = len(text) - len(text[i:].lstrip(_WS)) if text[i] in _WS else i
            if j > i:
                self._lead.append(text[i:j])
            i = j
            if i == n:
                return n
        rest = self._start[self._matched :]
        if text.startswith(rest, i):
            self._lead.clear()  # layout before the block
            self._phase = _THINK_LEAD
            return i + len(rest)
        if n - i < len(rest) and rest.startswith(text[i:]):
            self._matched += n - i
            return n
        # No block: what was held is the start of the answer.
        self._phase = _ANSWER
        self._emit(Content, "".join(self._lead) + self._start[: self._matched])
        self._lead.clear()
        return i

    def _reason(self, s: str) -> None:
        """Reasoning text, holding back line breaks at its end."""
        body = s.rstrip(_BREAKS)
        if body:
            if self._breaks:
                self._emit(Reasoning, "".join(self._breaks))
                self._breaks.clear()
            self._emit(Reasoning, body)
        if len(body) < len(s):
            self._breaks.append(s[len(body) :])

    def _emit(self, kind: type[Reasoning] | type[Content], s: str) -> None:
        if not s:
            return
        events = self._events
        if events and type(events[-1]) is kind:
            # Merged so one piece gives at most one value of each kind in a row.
            events[-1] = kind(events[-1].text + s)
        else:
            events.append(kind(s))

    def _take(self) -> list[ReasoningEvent]:
        out, self._events = self._events, []
        return out


class ThinkPassthrough:
    """Marks the think block in one generation's streamed text without
    editing it: ``Reasoning`` values are the block as written (start marker,
    layout and end marker included), ``Content`` values the rest. Same
    interface as :class:`ReasoningSplitter`, the same rules for where the
    block is; only a possible marker at the end of a piece is held back.
    """

    def __init__(
        self, start: str = "<think>", end: str = "</think>", *, starts_inside: bool
    ) -> None:
        if not start or not end:
            raise ValueError("think markers must not be empty")
        self._start = start
        self._end = end
        self._lead = ""  # whitespace and part of the start marker, not yet decided
        self._close = MarkerSeeker(end)
        self._phase = _THINK if starts_inside else _LEAD
        self._finished = False

    @property
    def inside(self) -> bool:
        """True while the output is in the think block."""
        return self._phase == _THINK

    def feed(self, text: str) -> list[ReasoningEvent]:
        """Take the next piece of output; return the text it completes."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        out: list[ReasoningEvent] = []
        i = 0
        if self._phase == _LEAD and text:
            i = self._lead_in(text, out)
        if self._phase == _THINK and i < len(text):
            before, i, found = self._close.seek(text, i)
            if found:
                before += self._end
                self._phase = _ANSWER
            if before:
                out.append(Reasoning(before))
        if self._phase == _ANSWER and i < len(text):
            out.append(Content(text[i:]))
        return out

    def finish(self) -> list[ReasoningEvent]:
        """End the output and release what was held back."""
        if self._finished:
            return []
        self._finished = True
        held = self._lead if self._phase == _LEAD else self._close.take()
        self._lead = ""
        if not held:
            return []
        return [Content(held) if self._phase == _LEAD else Reasoning(held)]

    def _lead_in(self, text: str, out: list[ReasoningEvent]) -> int:
        """Before anything visible: whitespace, then the start marker or
        not. Returns where the rest of ``text`` begins."""
        held = len(self._lead)
        lead = self._lead + text
        body = lead.lstrip(_WS)
        if body.startswith(self._start):
            self._phase = _THINK
            self._lead = ""
            cut = len(lead) - len(body) + len(self._start)
            out.append(Reasoning(lead[:cut]))
            return cut - held  # what was held is whitespace and less than the marker
        if self._start.startswith(body):
            self._lead = lead  # still undecided
            return len(text)
        # No block: what was held is the start of the answer.
        self._phase = _ANSWER
        self._lead = ""
        out.append(Content(lead))
        return len(text)
