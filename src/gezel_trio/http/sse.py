"""Server-sent events: framing, the OpenAI response shapes, and the one
streamed body every protocol's chat goes out through (``ChatStream``)."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

import trio
from quart import Response, current_app

from ..core.errors import GezelError
from ..core.events import (
    CacheMiss,
    Failed,
    Parked,
    Progress,
    Queued,
    Resumed,
    TokenLogprob,
    Usage,
)
from ..engine import (
    ChatChoice,
    ChatEvent,
    ChatFinished,
    ChatHandle,
    ChatLogprobs,
    PreparedChat,
)
from ..shaping.shaper import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallDone
from .strict import dump_json

if TYPE_CHECKING:
    from ..engine import Engine

__all__ = [
    "DONE",
    "ChatStream",
    "Translator",
    "cache_miss_body",
    "chunk",
    "comment",
    "completion",
    "error_body",
    "event_stream",
    "frame",
    "liveness_comment",
    "run_chat",
    "run_choices",
    "stream_chat",
    "usage_body",
]

log = logging.getLogger("gezel_trio.http")

DONE = b"data: [DONE]\n\n"
# At most this many waiting events go out in one write (``ChatStream``).
COALESCE_EVENTS = 256
# Where the app keeps ``--stream-hold-ms`` (seconds) for ``stream_chat``.
STREAM_HOLD_KEY = "GEZEL_STREAM_HOLD_S"
# The events that carry the answer's output: only these are held back.
_OUTPUT = (TextDelta, ReasoningDelta, ToolCallDelta, ToolCallDone, ChatLogprobs)


def frame(obj: dict[str, Any]) -> bytes:
    return b"data: " + dump_json(obj, compact=True).encode() + b"\n\n"


def comment(text: str) -> bytes:
    """An SSE comment line: OpenAI clients ignore it; it keeps a slow stream
    visibly alive."""
    return b": " + text.replace("\n", " ").encode() + b"\n\n"


def liveness_comment(event: ChatEvent) -> bytes | None:
    """The SSE comment that shows a slow stream is alive (prefill progress,
    its place in the queue, parked and resumed), if ``event`` is one."""
    match event:
        case Progress(done=done, total=total):
            return comment(f"prefill {done}/{total}")
        case Queued(position=position):
            return comment(f"queued {position}")
        case Parked():
            return comment("parked")
        case Resumed():
            return comment("resumed")
    return None


def usage_body(u: Usage) -> dict[str, Any]:
    """gezel's usage names (``input_tokens``, ``cached_tokens``, the rates)
    alongside the standard OpenAI ones, so both kinds of client read the
    same object."""
    return {
        "input_tokens": u.input_tokens,
        "output_tokens": u.output_tokens,
        "total_tokens": u.total_tokens,
        "cached_tokens": u.cached_tokens,
        "prompt_tps": u.prompt_tps,
        "generation_tps": u.generation_tps,
        "prompt_tokens": u.input_tokens,
        "completion_tokens": u.output_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        # OpenAI's predicted-output counts, for what speculation proposed.
        "completion_tokens_details": speculation_body(u),
        "cache_miss": cache_miss_body(u.cache_miss),
    }


def speculation_body(u: Usage) -> dict[str, int]:
    """What speculation proposed for a request, in OpenAI's predicted-output
    names (every protocol's usage: chat's and completions'
    ``completion_tokens_details``, Responses' ``output_tokens_details``,
    Messages' gezel ``speculation``): proposed tokens the model accepted
    (each also an output token), and those it did not."""
    return {
        "accepted_prediction_tokens": u.accepted_draft_tokens,
        "rejected_prediction_tokens": u.draft_tokens - u.accepted_draft_tokens,
    }


def cache_miss_body(miss: CacheMiss | None) -> dict[str, Any] | None:
    """gezel's ``usage.cache_miss`` (every protocol): where the prompt left
    the longest cached prefix, ``null`` when it reused all the cache held
    for it (docs/protocols.md, "Cache misses")."""
    if miss is None:
        return None
    return {
        "reason": miss.reason,
        "token": miss.token,
        "reused": miss.reused,
        "message": miss.message,
        "role": miss.role,
        "common": miss.common,
        "cached": miss.cached,
        "prompt": miss.prompt,
    }


def error_body(err: GezelError) -> dict[str, Any]:
    return {
        "error": {
            "message": err.message,
            "type": err.error_type,
            "code": err.code,
            "param": err.param,
        }
    }


def chunk(
    cid: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish_reason: str | None,
    usage: Usage | None,
) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
        "usage": usage_body(usage) if usage is not None else None,
    }


def completion(
    cid: str, model: str, message: dict[str, Any], finish_reason: str, usage: Usage
) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage_body(usage),
    }


class Translator(Protocol):
    """How one protocol writes a chat's events as bytes on the wire."""

    def opening(self) -> list[bytes]:
        """Frames sent once the chat is queued."""
        ...

    def render(self, event: ChatEvent, chat: ChatChoice) -> list[bytes]:
        """Frames for one event; the terminal event's end the stream."""
        ...

    def failure(self, err: GezelError) -> list[bytes]:
        """Frames for an error after the response began (the last frames)."""
        ...


class ChatStream:
    """A streamed response body over one chat, for any protocol.

    An explicit async iterator, not a generator, so its cleanup never depends
    on when a suspended generator is finalized. It submits the prepared chat
    on the first ``__anext__`` and withdraws it when the stream ends, when
    ``__anext__`` is cancelled (quart-trio cancels it about 1 ms after the
    client closes) and in ``aclose`` (Quart calls it when the response ends
    by any path). Errors after the first byte become the protocol's error
    frames; ``Cancelled`` propagates untouched.

    The translator sees each event with its ``ChatChoice`` (its ``index``;
    with ``n > 1`` the choices interleaved); the stream ends after every
    choice finished, or at the first failure. Each read of the body is one
    socket write: the frames of the event it waited for, and of every event
    already waiting behind it (up to ``COALESCE_EVENTS``), so a client that
    fell behind catches up in a few writes, not one per token.

    ``hold_s`` (the server's ``--stream-hold-ms``; 0 here) lets a write wait
    for the output the sequence is about to produce when it produces it
    faster than that: output is held at most ``hold_s`` after it arrived,
    and only while the next token is expected before then (the gap between
    the last two arrivals of output). The stream's first output, and every
    other event (progress, the end, a failure), is never held. On a CPU the
    HTTP side's sends take cores from the compute (``docs/performance.md``).
    """

    def __init__(
        self,
        engine: Engine,
        prepared: PreparedChat,
        translator: Translator,
        *,
        hold_s: float = 0.0,
    ) -> None:
        self._engine = engine
        self._prepared = prepared
        self._translator = translator
        self._hold_s = hold_s
        self._chat: ChatHandle | None = None
        self._pending: deque[bytes] = deque()
        self._started = False
        self._ended = False
        # When output last arrived (awaited), and the gap before it.
        self._output_at: float | None = None
        self._output_gap: float | None = None
        self._held = False  # the pending frames hold output that may wait

    def __aiter__(self) -> ChatStream:
        return self

    async def __anext__(self) -> bytes:
        while not self._pending:
            if self._ended:
                raise StopAsyncIteration
            if not self._started:
                self._start()
                continue
            assert self._chat is not None
            try:
                chat, event = await self._chat.__anext__()
                self._take(chat, event)
                if self._held:
                    await self._hold()
            except StopAsyncIteration:
                self._close()
                continue
            except BaseException:
                self._close()
                raise
        out = b"".join(self._pending)
        self._pending.clear()
        self._held = False
        return out

    def _take(self, chat: ChatChoice, event: ChatEvent) -> None:
        """Render ``event`` and every event already waiting behind it."""
        if isinstance(event, _OUTPUT):
            now = trio.current_time()
            if self._output_at is not None:
                self._output_gap = now - self._output_at
                self._held = self._hold_s > 0
            self._output_at = now
        else:
            self._held = False  # progress, the end, a failure: sent at once
        self._render(chat, event)
        # Behind its sequence (the socket was slow), the stream takes
        # every event already waiting and writes them in one send.
        for _ in range(COALESCE_EVENTS):
            got = self._chat.next_nowait() if self._chat is not None else None
            if got is None:
                break
            if not isinstance(got[1], _OUTPUT):
                self._held = False
            self._render(*got)

    async def _hold(self) -> None:
        """Keep the pending output for the tokens due before ``hold_s`` has
        passed since it arrived. Raises what ``ChatHandle.__anext__`` does;
        the caller closes the chat."""
        assert self._output_at is not None
        assert self._output_gap is not None
        deadline = self._output_at + self._hold_s
        while self._held and self._chat is not None:
            if trio.current_time() + self._output_gap > deadline:
                return  # the next token is not due in time
            with trio.move_on_at(deadline) as waited:
                chat, event = await self._chat.__anext__()
            if waited.cancelled_caught:
                return
            self._take(chat, event)

    def _render(self, chat: ChatChoice, event: ChatEvent) -> None:
        self._pending += self._translator.render(event, chat)
        if isinstance(event, Failed):
            log.warning("stream failed: %s", event.error.message)
            self._close()
        elif isinstance(event, ChatFinished) and self._chat is not None and self._chat.finished:
            self._close()

    async def aclose(self) -> None:
        self._close()
        await trio.lowlevel.checkpoint()

    def _start(self) -> None:
        self._started = True
        try:
            self._chat = self._engine.submit_chat_nowait(self._prepared)
        except GezelError as err:
            self._pending += self._translator.failure(err)
            self._ended = True
            return
        self._pending += self._translator.opening()

    def _close(self) -> None:
        self._ended = True
        if self._chat is not None:
            self._chat.close()
            self._chat = None


async def run_chat(
    engine: Engine, prepared: PreparedChat
) -> tuple[ChatFinished, list[TokenLogprob]]:
    """Run a one-choice chat to its end for a non-streamed response: its
    terminal event and the logprobs it reported; raises its error."""
    return (await run_choices(engine, prepared))[0]


async def run_choices(
    engine: Engine, prepared: PreparedChat
) -> list[tuple[ChatFinished, list[TokenLogprob]]]:
    """Run a chat's ``n`` choices to their end for a non-streamed response:
    each choice's terminal event and logprobs, by index; raises the first
    error. Cancellation (the client left) withdraws every choice."""
    n = prepared.chat.n
    finished: list[ChatFinished | None] = [None] * n
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
    with engine.submit_chat_nowait(prepared) as chat:
        async for choice, event in chat:
            match event:
                case ChatLogprobs(items=items):
                    logprobs[choice.index] += items
                case ChatFinished():
                    finished[choice.index] = event
                case Failed(error=error):
                    raise error
    done = [(f, lp) for f, lp in zip(finished, logprobs, strict=True) if f is not None]
    if not done:
        raise GezelError("the request ended without a result")  # pragma: no cover
    return done


def stream_chat(engine: Engine, prepared: PreparedChat, translator: Translator) -> Response:
    """The streamed response of a chat in the app's protocol ``translator``,
    its output held as the server's ``--stream-hold-ms`` says."""
    hold_s = float(current_app.config.get(STREAM_HOLD_KEY, 0.0))
    return event_stream(ChatStream(engine, prepared, translator, hold_s=hold_s))


def event_stream(body: ChatStream) -> Response:
    resp = Response(
        body,
        mimetype="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    resp.timeout = None
    return resp
