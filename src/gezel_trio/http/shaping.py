"""Turning a generation's text into OpenAI message fields (SPEC T2, T4, W2).

Per request, in the request's own task: the reasoning splitter takes the
think block out of the text (``reasoning_content``, and the newer
``reasoning`` alias), then the tool-call splitter turns the model's tool
markup into ``tool_calls`` deltas - the first delta of a call carries its
index, id, type and name, later ones argument fragments as generated. Both
hold back only what could still be a marker, so any chunking of the same
output gives the same message.
"""

from __future__ import annotations

from typing import Any

from ..backend import ModelInfo
from ..events import TokenLogprob
from ..reasoning import Reasoning, ReasoningSplitter, prompt_opens_thinking_tokens
from ..shaping.toolcalls import (
    GENERIC,
    HERMES,
    MISTRAL,
    QWEN3_CODER,
    CallArgs,
    CallEnd,
    CallStart,
    Content,
    ToolCallSplitter,
    ToolEvent,
    ToolFormat,
)

__all__ = ["Shaper", "logprobs_body"]

_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, QWEN3_CODER, MISTRAL, GENERIC)}


class Shaper:
    """Text in, OpenAI ``delta`` dicts out; ``message()`` for non-streaming."""

    def __init__(self, info: ModelInfo, prompt: tuple[int, ...], *, tools: bool) -> None:
        self._reasoning: ReasoningSplitter | None = None
        if info.think_markers is not None and info.think_ids is not None:
            start, end = info.think_markers
            inside = prompt_opens_thinking_tokens(prompt, info.think_ids)
            self._reasoning = ReasoningSplitter(start, end, starts_inside=inside)
        fmt = _FORMATS.get(info.tool_format or "") if tools else None
        # Unknown template families stream content untouched: markers are
        # resolved from the template, never guessed from output.
        self._tools = ToolCallSplitter(fmt) if fmt is not None else None
        self.calls: list[dict[str, Any]] = []
        self.content: list[str] = []
        self.reasoning: list[str] = []

    @property
    def called_tools(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        return self._shape(self._split(text, final=False))

    def finish(self) -> list[dict[str, Any]]:
        return self._shape(self._split("", final=True))

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.calls else reason

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if not self.calls:
            msg["content"] = msg["content"] or ""
        if self.reasoning:
            msg["reasoning_content"] = msg["reasoning"] = "".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = self.calls
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

    def _shape(self, events: list[Reasoning | ToolEvent]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for event in events:
            match event:
                case Reasoning(text=text) if text:
                    self.reasoning.append(text)
                    deltas.append({"reasoning_content": text, "reasoning": text})
                case Content(text=text) if text:
                    self.content.append(text)
                    deltas.append({"content": text})
                case CallStart(index=index, id=cid, name=name):
                    self.calls.append(
                        {"id": cid, "type": "function", "function": {"name": name, "arguments": ""}}
                    )
                    call = {
                        "index": index,
                        "id": cid,
                        "type": "function",
                        "function": {"name": name, "arguments": ""},
                    }
                    deltas.append({"tool_calls": [call]})
                case CallArgs(index=index, fragment=fragment) if fragment:
                    self.calls[index]["function"]["arguments"] += fragment
                    deltas.append(
                        {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}
                    )
                case CallEnd():
                    pass
        return deltas


def logprobs_body(items: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's ``logprobs.content`` list."""

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**entry(t.token, t.logprob), "top_logprobs": [entry(s, lp) for s, lp in t.top]}
            for t in items
        ]
    }
