"""The chat-level engine API: messages in, shaped events out (SPEC H1).

This is the one path every caller takes - each HTTP protocol and every Trio
program that embeds the engine. A ``ChatRequest`` names a conversation and
what to do with it; ``Engine.prepare_chat`` renders it with the model's chat
template and compiles its constraints (worker threads, never the MLX thread)
into a ``PreparedChat``; ``Engine.submit_chat_nowait`` queues that and
returns a ``ChatHandle``. ``await engine.chat(messages, ...)`` does both::

    with await engine.chat(messages, tools=tools, max_tokens=256) as chat:
        async for event in chat:
            match event:
                case TextDelta(text=text): ...
                case ToolCallDone(name=name, arguments=arguments): ...
                case ChatFinished(reason=reason, message=message): ...

A handle yields the shaped events (``TextDelta``, ``ReasoningDelta``,
``ToolCallDelta``, ``ToolCallDone``), ``ChatLogprobs`` when asked for, the
engine's liveness notes (``Queued``, ``Progress``, ``Parked``, ``Resumed``),
and exactly one terminal event: ``ChatFinished`` (``stop``, ``length`` or
``tool_calls``, with usage and the whole assistant message) or ``Failed``.

Cancellation is ``submit_nowait``'s: leaving the handle's ``with`` block by
any path withdraws the request, and the prompt cache keeps what it computed.
Cancelling ``prepare_chat`` (or ``chat`` before it returns) submits nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import attrs

from ..core.events import (
    Delta,
    Failed,
    Finished,
    Parked,
    Progress,
    Queued,
    Resumed,
    TokenLogprob,
    Usage,
)
from ..core.request import GenerationRequest, Priority, SamplingParams
from ..shaping.shaper import (
    ReasoningDelta,
    Shaper,
    TextDelta,
    ToolCallDelta,
    ToolCallDone,
)

if TYPE_CHECKING:
    from ._engine import RequestHandle

__all__ = [
    "ChatEvent",
    "ChatFinished",
    "ChatHandle",
    "ChatLogprobs",
    "ChatRequest",
    "PreparedChat",
    "roster_fingerprint",
]

ChatFinishReason = Literal["stop", "length", "tool_calls"]


def roster_fingerprint(tools: Sequence[Mapping[str, Any]] | None) -> str:
    """A short id of the exact tool list a prompt was rendered with."""
    if not tools:
        return "none"
    canon = json.dumps(list(tools), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


@attrs.frozen
class ChatRequest:
    """A conversation and how to continue it.

    ``messages`` and ``tools`` are OpenAI chat shapes (what a chat template
    renders). ``tool_choice`` (``"auto"``, ``"none"``, ``"required"`` or a
    named function), ``response_format`` (``json_object`` / ``json_schema``)
    and ``tool_grammar`` are enforced by grammars. ``max_tokens`` ``None``
    means what the context window leaves, up to the engine's default.
    ``cache_id`` and ``prefix_ids`` name prompt-cache entries; without them
    the request is still cached. ``template_kwargs`` go to the chat template
    (``enable_thinking``); ``max_thinking_tokens`` bounds a think block.
    """

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: str | Mapping[str, Any] | None = None
    response_format: Mapping[str, Any] | None = None
    tool_grammar: Mapping[str, Any] | None = None
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: Priority = "interactive"
    cache_id: str | None = None
    prefix_ids: tuple[str, ...] = ()
    stable_prefix_chars: int | None = None
    template_kwargs: Mapping[str, Any] = attrs.field(factory=dict)
    template_override: str | None = None
    max_thinking_tokens: int | None = None
    top_logprobs: int | None = None

    @property
    def parses_tools(self) -> bool:
        """Whether tool markup in the output becomes calls."""
        return bool(self.tools) and self.tool_choice != "none"


@attrs.frozen
class PreparedChat:
    """A rendered chat with its constraints compiled: ``request`` is what the
    engine will run; nothing is queued yet."""

    chat: ChatRequest
    request: GenerationRequest


@attrs.frozen
class ChatLogprobs:
    """Logprobs of the tokens generated since the last ones."""

    items: tuple[TokenLogprob, ...]


@attrs.frozen
class ChatFinished:
    """The terminal event of a chat that ended normally. ``message`` is the
    whole assistant message (``content``, ``reasoning_content``,
    ``tool_calls``); ``reason`` is ``tool_calls`` when the model called;
    ``stop_sequence`` is the stop string that ended it, if one did."""

    reason: ChatFinishReason
    usage: Usage
    message: dict[str, Any]
    stop_sequence: str | None = None


ChatEvent = (
    TextDelta
    | ReasoningDelta
    | ToolCallDelta
    | ToolCallDone
    | ChatLogprobs
    | Queued
    | Progress
    | Parked
    | Resumed
    | ChatFinished
    | Failed
)


class ChatHandle:
    """A submitted chat: iterate it for events, leave its ``with`` block to
    withdraw it. ``usage`` is the latest usage the engine reported."""

    def __init__(self, handle: RequestHandle, prepared: PreparedChat, shaper: Shaper) -> None:
        self._handle = handle
        self._shaper = shaper
        self._pending: deque[ChatEvent] = deque()
        self._done = False
        self.prepared = prepared
        self.usage: Usage | None = None

    @property
    def rid(self) -> int:
        return self._handle.rid

    @property
    def prompt_tokens(self) -> int:
        return len(self.prepared.request.prompt)

    def __enter__(self) -> ChatHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._handle.__exit__(exc_type, exc, tb)

    def close(self) -> None:
        """Withdraw the request (what leaving the ``with`` block does)."""
        self._handle.__exit__(None, None, None)

    def __aiter__(self) -> ChatHandle:
        return self

    def _json_complete(self) -> bool:
        """A constrained JSON answer that parses is whole: a prefix of an
        object or array never parses."""
        constraint = self.prepared.request.constraint
        if constraint is None or constraint.kind not in (
            "json_object",
            "json_schema",
            "json_or_tool_call",
        ):
            return False
        try:
            value = json.loads("".join(self._shaper.content))
        except ValueError:
            return False
        return isinstance(value, dict | list)

    async def __anext__(self) -> ChatEvent:
        """The next event; cancellation leaves the request queued or running
        until the ``with`` block is left."""
        while not self._pending:
            if self._done:
                raise StopAsyncIteration
            event = await self._handle.__anext__()
            match event:
                case Delta(text=text, usage=usage, logprobs=logprobs):
                    self.usage = usage
                    if logprobs:
                        self._pending.append(ChatLogprobs(logprobs))
                    self._pending.extend(self._shaper.feed(text))
                case Finished(reason=reason, usage=usage, stop_sequence=stop_sequence):
                    self.usage = usage
                    self._pending.extend(self._shaper.finish())
                    called = self._shaper.finish_reason(reason) == "tool_calls"
                    final: ChatFinishReason = "tool_calls" if called else reason
                    if final == "length" and self._json_complete():
                        final = "stop"  # the grammar closed on the budget's last token
                    self._pending.append(
                        ChatFinished(final, usage, self._shaper.message(), stop_sequence)
                    )
                    self._done = True
                case Failed():
                    self._pending.append(event)
                    self._done = True
                case _:
                    self._pending.append(event)
        return self._pending.popleft()
