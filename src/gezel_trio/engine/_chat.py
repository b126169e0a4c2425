"""The chat-level engine API: messages in, shaped events out.

This is the one path every caller takes - each HTTP protocol and every Trio
program that embeds the engine. A ``ChatRequest`` names a conversation and
what to do with it; ``Engine.prepare_chat`` renders it with the model's chat
template, compiles its constraints (worker threads, never the MLX thread)
and checks it, into a ``PreparedChat``; ``Engine.submit_chat_nowait`` queues
that and returns a ``ChatHandle``. ``await engine.chat(messages, ...)`` does
both::

    with await engine.chat(messages, tools=tools, max_tokens=256) as chat:
        async for choice, event in chat:
            match event:
                case TextDelta(text=text): ...
                case ToolCallDone(name=name, arguments=arguments): ...
                case ChatFinished(reason=reason, message=message): ...

A handle has ``n`` choices (``ChatRequest.n``, one prompt computed once);
iterating it yields ``(choice, event)`` pairs, the choices interleaved as
they are generated. A choice yields the shaped events (``TextDelta``,
``ReasoningDelta``, ``ToolCallDelta``, ``ToolCallDone``), ``ChatLogprobs``
when asked for, the engine's liveness notes (``Queued``, ``Progress``,
``Parked``, ``Resumed``), ``Started`` once it is admitted (the prompt's
usage as known then), and exactly one terminal event: ``ChatFinished``
(``stop``, ``length`` or ``tool_calls``, with usage and the whole assistant
message) or ``Failed``.

Cancellation is ``RequestHandle``'s: leaving the handle's ``with`` block by
any path withdraws every choice, and the prompt cache keeps what it
computed. Cancelling ``prepare_chat`` (or ``chat`` before it returns)
submits nothing.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from types import TracebackType
from typing import Any, Literal

import attrs

from ..core.events import (
    Delta,
    Event,
    Failed,
    Finished,
    Parked,
    Progress,
    Queued,
    Resumed,
    Started,
    TokenLogprob,
    Usage,
)
from ..core.model import ModelInfo
from ..core.prepare import PreparedChat
from ..shaping.replies import ReplyLedger
from ..shaping.shaper import (
    ReasoningDelta,
    ShapedEvent,
    Shaper,
    TextDelta,
    ToolCallDelta,
    ToolCallDone,
)
from ._handle import RequestHandle

__all__ = [
    "ChatChoice",
    "ChatEvent",
    "ChatFinished",
    "ChatHandle",
    "ChatLogprobs",
    "combined_usage",
]

ChatFinishReason = Literal["stop", "length", "tool_calls"]


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
    | Started
    | ChatFinished
    | Failed
)


class ChatChoice:
    """One choice of a chat: its ``index``, the latest ``usage`` the engine
    reported for it, and the shaper that turns its text into chat events."""

    def __init__(
        self,
        prepared: PreparedChat,
        shaper: Shaper,
        index: int,
        replies: ReplyLedger | None = None,
    ) -> None:
        self._shaper = shaper
        self._replies = replies
        self._tokens: list[int] = []
        self._pending: deque[ChatEvent] = deque()
        self._done = False
        # Withdraws this choice from the engine: set by ``open_chat``.
        self._end: Callable[[], None] = _nothing
        # The calls a reply may carry, and how many it has carried.
        self._cap = prepared.chat.max_tool_calls
        self._called = 0
        self.prepared = prepared
        self.index = index
        self.usage: Usage | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prepared.request.prompt)

    @property
    def tokens(self) -> tuple[int, ...]:
        """The ids generated so far (kept only while the engine keeps a
        reply ledger: empty otherwise)."""
        return tuple(self._tokens)

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
            value = json.loads("".join(self._shaper.answer))
        except (ValueError, RecursionError):
            return False
        return isinstance(value, dict | list)

    def _capped(self, events: list[ShapedEvent]) -> list[ShapedEvent]:
        """``events`` up to the end of the last tool call allowed; nothing
        of a further call, nor anything after it, is passed on."""
        if self._cap is None:
            return events
        kept: list[ShapedEvent] = []
        for event in events:
            if self._called >= self._cap:
                break
            kept.append(event)
            if isinstance(event, ToolCallDone):
                self._called += 1
        return kept

    def _message(self) -> dict[str, Any]:
        message = self._shaper.message()
        if self._cap is not None and len(message.get("tool_calls") or ()) > self._cap:
            message["tool_calls"] = message["tool_calls"][: self._cap]
        return message

    def _end_at_cap(self) -> None:
        """The reply carries all the calls it may: the choice ends here,
        finished ``tool_calls``, and leaves the batch (what the model would
        write next is never generated). Its reply is not recorded for the
        next turn: the tokens generated may run past the call."""
        self._end()
        assert self.usage is not None  # a Delta came first
        self._pending.append(ChatFinished("tool_calls", self.usage, self._message()))
        self._done = True

    def _take(self, event: Event) -> None:
        """Shape one engine event into chat events (queued in ``_pending``)."""
        if self._done:
            return  # ended at its last allowed tool call; the rest was in flight
        match event:
            case Delta(text=text, tokens=tokens, usage=usage, logprobs=logprobs):
                self.usage = usage
                if self._replies is not None:
                    self._tokens += tokens
                if logprobs:
                    self._pending.append(ChatLogprobs(logprobs))
                self._pending.extend(self._capped(self._shaper.feed(text)))
                if self._cap is not None and self._called >= self._cap:
                    self._end_at_cap()
            case Finished(reason=reason, usage=usage, stop_sequence=stop_sequence):
                self.usage = usage
                self._pending.extend(self._capped(self._shaper.finish()))
                called = self._shaper.finish_reason(reason) == "tool_calls"
                if self._cap is not None:
                    kept = self._shaper.calls[: self._cap]
                    called = bool(kept) and all(c.complete for c in kept)
                final: ChatFinishReason = "tool_calls" if called else reason
                if final == "length" and self._json_complete():
                    final = "stop"  # the grammar closed on the budget's last token
                message = self._message()
                if self._replies is not None and self.prepared.chat.prompt is None:
                    # The next turn's history carries this reply back.
                    self._replies.record(
                        self._shaper.history_message(), self.prepared.request.prompt, self._tokens
                    )
                self._pending.append(ChatFinished(final, usage, message, stop_sequence))
                self._done = True
            case Failed():
                self._pending.append(event)
                self._done = True
            case Started(usage=usage):
                self.usage = usage
                self._pending.append(event)
            case _:
                self._pending.append(event)


def combined_usage(usages: Sequence[Usage]) -> Usage:
    """The usage of ``n`` choices of one prompt: the prompt counted once
    (with what the cache served it - the sibling that computed it has the
    least), the completions summed."""
    first = min(usages, key=lambda u: u.cached_tokens)
    return Usage(
        input_tokens=first.input_tokens,
        output_tokens=sum(u.output_tokens for u in usages),
        cached_tokens=first.cached_tokens,
        prompt_tps=first.prompt_tps,
        generation_tps=round(sum(u.generation_tps for u in usages), 2),
        cache_miss=first.cache_miss,
        pinned_5m_tokens=first.pinned_5m_tokens,
        pinned_1h_tokens=first.pinned_1h_tokens,
        # What speculation proposed, summed over the choices.
        draft_tokens=sum(u.draft_tokens for u in usages),
        accepted_draft_tokens=sum(u.accepted_draft_tokens for u in usages),
    )


class ChatHandle:
    """A submitted chat (``Engine.submit_chat_nowait``): iterate it for
    ``(choice, event)`` pairs until every choice had its terminal event;
    leave its ``with`` block to withdraw every choice still running."""

    def __init__(self, handle: RequestHandle, choices: Sequence[ChatChoice]) -> None:
        self._handle = handle
        self.choices = tuple(choices)

    @property
    def prepared(self) -> PreparedChat:
        return self.choices[0].prepared

    @property
    def rids(self) -> tuple[int, ...]:
        return self._handle.rids

    @property
    def prompt_tokens(self) -> int:
        return self.choices[0].prompt_tokens

    @property
    def usage(self) -> Usage | None:
        """The choices' usage so far, the prompt counted once."""
        usages = [c.usage for c in self.choices if c.usage is not None]
        return combined_usage(usages) if usages else None

    @property
    def finished(self) -> bool:
        """Every choice had its terminal event and nothing is left to read."""
        return all(c._done and not c._pending for c in self.choices)

    def __enter__(self) -> ChatHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._handle.close()

    def close(self) -> None:
        """Withdraw every choice (what leaving the ``with`` block does)."""
        self._handle.close()

    def __aiter__(self) -> ChatHandle:
        return self

    async def __anext__(self) -> tuple[ChatChoice, ChatEvent]:
        """The next choice's event; cancellation leaves the choices queued or
        running until the ``with`` block is left."""
        while True:
            for choice in self.choices:
                if choice._pending:
                    return choice, choice._pending.popleft()
            if all(c._done for c in self.choices):
                raise StopAsyncIteration
            index, event = await self._handle.__anext__()
            self.choices[index]._take(event)

    def next_nowait(self) -> tuple[ChatChoice, ChatEvent] | None:
        """The next choice's event if one is already there, else ``None``
        (also after the last); never blocks. A stream that fell behind its
        sequence takes what waits this way and writes it at once."""
        while True:
            for choice in self.choices:
                if choice._pending:
                    return choice, choice._pending.popleft()
            got = self._handle.next_nowait()
            if got is None:
                return None
            index, event = got
            self.choices[index]._take(event)


def _nothing() -> None:
    pass


def open_chat(
    handle: RequestHandle,
    prepared: PreparedChat,
    info: ModelInfo,
    replies: ReplyLedger | None = None,
) -> ChatHandle:
    """The chat-level handle over ``handle``: one shaper per choice; each
    finished choice's reply goes into ``replies``."""
    chat = prepared.chat
    raw = chat.prompt is not None
    choices = [
        ChatChoice(
            prepared,
            Shaper(
                info,
                prepared.request.prompt,
                tools=chat.parses_tools,
                reasoning=not raw,
                tool_specs=chat.tools,
                reasoning_format=chat.reasoning_format,
            ),
            index=i,
            replies=replies,
        )
        for i in range(handle.n)
    ]
    for choice in choices:
        choice._end = partial(handle.end, choice.index)
    return ChatHandle(handle, choices)
