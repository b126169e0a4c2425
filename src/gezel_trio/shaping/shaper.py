"""A sequence's text, shaped: the answer, the reasoning and the tool calls.

Per request, in the task that reads it: the reasoning splitter takes the
think block out of the text, then the tool-call splitter turns the model's
tool markup into calls - a call's first delta carries its index, id and name,
later ones argument fragments as they are generated, and a ``ToolCallDone``
carries the whole call once its markup closed. Both hold back only what could
still be a marker, so any chunking of the same output gives the same events.
Every protocol (chat completions, Responses, Messages) and every embedder
gets these same events (``Engine.chat``); none shapes text itself.

The reasoning format says what becomes of the think block: ``auto`` splits
it out as ``ReasoningDelta`` (``reasoning_content`` on the wire); ``none``
(llama.cpp's ``--reasoning-format none``, the seed's behaviour) leaves it in
the answer text exactly as the model wrote it, markers included, so a client
that splits ``<think>`` itself sees what the seed sent. Either way tool
markup is parsed only after the block.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeAlias

import attrs

from ..core.model import ModelInfo
from .reasoning import (
    Reasoning,
    ReasoningSplitter,
    ThinkPassthrough,
    prompt_opens_thinking_tokens,
)
from .toolcalls import (
    CallArgs,
    CallEnd,
    CallStart,
    Content,
    ToolCallSplitter,
    ToolEvent,
    family,
    string_parameters,
)

__all__ = [
    "REASONING_FORMATS",
    "ReasoningDelta",
    "ReasoningFormat",
    "ShapedEvent",
    "Shaper",
    "TextDelta",
    "ToolCallDelta",
    "ToolCallDone",
]


# ``auto``: the think block split out as reasoning; ``none``: left in the
# answer text as written.
ReasoningFormat: TypeAlias = Literal["auto", "none"]
REASONING_FORMATS: tuple[ReasoningFormat, ...] = ("auto", "none")


@attrs.frozen
class TextDelta:
    """Answer text."""

    text: str


@attrs.frozen
class ReasoningDelta:
    """Text of the think block."""

    text: str


@attrs.frozen
class ToolCallDelta:
    """Part of tool call ``index``: the first one has ``id`` and ``name`` and
    no arguments; later ones add ``arguments`` text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@attrs.frozen
class ToolCallDone:
    """Tool call ``index`` ended: ``arguments`` is its whole text. ``complete``
    is false when its markup broke off or its arguments are not a JSON object
    (a generation cut by ``max_tokens``): such a call is never reported with
    ``finish_reason: tool_calls``."""

    index: int
    id: str
    name: str
    arguments: str
    complete: bool = True


ShapedEvent = TextDelta | ReasoningDelta | ToolCallDelta | ToolCallDone


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):  # too deep for Python is not an object to use
        return False


class Shaper:
    """Text in, shaped events out; ``message()`` is the assistant message so far."""

    def __init__(
        self,
        info: ModelInfo,
        prompt: tuple[int, ...],
        *,
        tools: bool,
        reasoning: bool = True,
        tool_specs: Sequence[Mapping[str, Any]] | None = None,
        reasoning_format: ReasoningFormat = "auto",
    ) -> None:
        """``tools``: turn tool markup into calls; ``reasoning``: find the
        think block (off for a raw prompt, whose output is plain text);
        ``tool_specs``: the request's tools, whose schemas tell a string
        parameter in markups that write values bare; ``reasoning_format``:
        split the block out (``auto``) or leave it in the text as written
        (``none``)."""
        self._reasoning: ReasoningSplitter | ThinkPassthrough | None = None
        # ``none``: the block's text is answer text, as written.
        self._verbatim = reasoning_format == "none"
        if reasoning and info.think_markers is not None and info.think_ids is not None:
            start, end = info.think_markers
            inside = prompt_opens_thinking_tokens(prompt, info.think_ids)
            kind = ThinkPassthrough if self._verbatim else ReasoningSplitter
            self._reasoning = kind(start, end, starts_inside=inside)
        fmt = family(info.tool_format) if tools else None
        # Unknown template families stream content untouched: markers are
        # resolved from the template, never guessed from output.
        self._tools = (
            ToolCallSplitter(fmt, string_params=string_parameters(tool_specs))
            if fmt is not None
            else None
        )
        self.calls: list[ToolCallDone] = []
        self._open: dict[int, list[Any]] = {}  # index -> [id, name, argument parts]
        self.content: list[str] = []
        self.reasoning: list[str] = []
        # The answer without the think block (``content`` too, but with the
        # ``none`` format, which sends the two as one).
        self.answer: list[str] = []

    def feed(self, text: str) -> list[ShapedEvent]:
        if not text:
            return []
        return self._shape(self._split(text, final=False))

    def finish(self) -> list[ShapedEvent]:
        """The text held back at the end, and any call left open, closed."""
        return self._shape(self._split("", final=True))

    def finish_reason(self, reason: str) -> str:
        """``tool_calls`` when the model called and every call is whole;
        otherwise the engine's reason (``length`` for a call cut short)."""
        return "tool_calls" if self.calls and all(c.complete for c in self.calls) else reason

    def message(self) -> dict[str, Any]:
        """The OpenAI-shaped assistant message: ``content``,
        ``reasoning_content`` (and ``reasoning``), ``tool_calls``. With the
        ``none`` format the think block stays in ``content``, as written."""
        return self._message(self.content, [] if self._verbatim else self.reasoning)

    def history_message(self) -> dict[str, Any]:
        """The message as a client sends it back in its history (what the
        reply ledger keys on): ``message()``, except that with the ``none``
        format the think block is taken off, as the client that splits it
        itself does, and so are the line breaks that began the answer (as
        ``auto`` drops them)."""
        if not self._verbatim:
            return self.message()
        msg = self._message(self.answer, [])
        if msg["content"]:
            msg["content"] = msg["content"].lstrip("\r\n") or None
        if msg["content"] is None and not self.calls:
            msg["content"] = ""
        return msg

    def _message(self, content: list[str], reasoning: list[str]) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
        if not self.calls:
            msg["content"] = msg["content"] or ""
        if reasoning:
            msg["reasoning_content"] = msg["reasoning"] = "".join(reasoning)
        if self.calls:
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in self.calls
            ]
        return msg

    def _split(self, text: str, *, final: bool) -> list[Reasoning | ToolEvent]:
        if self._reasoning is None:
            pieces: list[Reasoning | Content] = [Content(text)] if text else []
        else:
            pieces = list(self._reasoning.feed(text)) if text else []
            if final:
                pieces += self._reasoning.finish()
        out: list[Reasoning | ToolEvent] = []
        for piece in pieces:
            if isinstance(piece, Reasoning) or self._tools is None:
                out.append(piece)
            else:
                out += self._tools.feed(piece.text)
        if final and self._tools is not None:
            out += self._tools.finish()
        return out

    def _shape(self, events: list[Reasoning | ToolEvent]) -> list[ShapedEvent]:
        out: list[ShapedEvent] = []
        for event in events:
            match event:
                case Reasoning(text=text) if text and self._verbatim:
                    self.reasoning.append(text)
                    self.content.append(text)
                    out.append(TextDelta(text))
                case Reasoning(text=text) if text:
                    self.reasoning.append(text)
                    out.append(ReasoningDelta(text))
                case Content(text=text) if text:
                    self.content.append(text)
                    self.answer.append(text)
                    out.append(TextDelta(text))
                case CallStart(index=index, id=cid, name=name):
                    self._open[index] = [cid, name, []]
                    out.append(ToolCallDelta(index, cid, name))
                case CallArgs(index=index, fragment=fragment) if fragment:
                    self._open[index][2].append(fragment)
                    out.append(ToolCallDelta(index, arguments=fragment))
                case CallEnd(index=index, malformed=malformed):
                    cid, name, parts = self._open.pop(index)
                    arguments = "".join(parts)
                    whole = not malformed and _is_object(arguments)
                    done = ToolCallDone(index, cid, name, arguments, whole)
                    self.calls.append(done)
                    out.append(done)
        return out
