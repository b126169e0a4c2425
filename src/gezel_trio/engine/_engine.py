"""The engine: a nursery-scoped task that owns the model and its host thread.

Ownership::

    run_engine (task in the caller's nursery)
      └─ trio.to_thread.run_sync(run_host)   one thread for the engine's life;
                                             all MLX work happens there
    Engine (Trio side, this module)
      ├─ Scheduler                           pure admission decisions
      └─ per request: a memory channel       engine writes with send_nowait,
                                             the caller reads and closes it

A caller submits with ``submit_nowait`` and reads events from the returned
``RequestHandle`` inside ``with handle:``. Leaving that block - normally, by
an exception, or because the caller's cancel scope was cancelled - withdraws
the request: a queued request is never admitted, a running one leaves the
batch before the next engine step. Withdrawal is synchronous, so it is safe
in ``finally`` and on the cancellation path.
"""

from __future__ import annotations

import logging
import math
import traceback
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import trio

from ..core.backend import Backend, ConstraintCompiler, ImagePreparer, PromptRenderer
from ..core.config import EngineConfig
from ..core.errors import (
    EngineClosed,
    EngineFailure,
    GezelError,
    InvalidRequest,
    ModelLoadError,
    RequestFailed,
    SlowConsumer,
)
from ..core.events import Delta, Event, Failed, Finished, Parked, Progress, Queued, Resumed
from ..core.model import ModelInfo
from ..core.request import CacheRequest, GenerationRequest, RenderedPrompt
from ..core.scheduler import Scheduler
from ..host.loop import (
    CommandFailed,
    HostCommand,
    Observer,
    Orders,
    StepReport,
    run_host,
    run_host_inline,
)
from ..host.prompt_cache import CacheSnapshot, CacheTotals, CacheView
from ..shaping.shaper import Shaper
from ._chat import ChatGroupHandle, ChatHandle, ChatRequest, PreparedChat, roster_fingerprint
from ._images import ImageLimits, prepare_vision
from ._metrics import EngineMetrics, Snapshot

if TYPE_CHECKING:
    from ..shaping.grammar import Constraint

__all__ = [
    "Engine",
    "EngineState",
    "GroupHandle",
    "Health",
    "RequestHandle",
    "RequestNote",
    "open_engine",
    "run_engine",
]

log = logging.getLogger("gezel_trio.engine")

# Events per request beyond one per generated token: prefill progress and the
# final event. A reader that falls further behind than this is dropped rather
# than allowed to stall the engine (docs/architecture.md, "Backpressure").
_EVENT_SLACK = 256
# How long /health keeps saying "degraded" after a failed model step.
DEGRADED_FOR = 60.0
# Bounds on what a request may ask of the model (W2, O3).
MAX_TOP_LOGPROBS = 20
MAX_REPETITION_CONTEXT = 8192


@attrs.frozen
class Removal:
    """A withdrawn running sequence and the engine steps around its removal."""

    rid: int
    withdrawn_at_step: int
    removed_at_step: int


@attrs.frozen
class Health:
    """What ``/health`` says: ``ok``, ``degraded`` (serving, with
    ``reasons``), ``shutting_down``, or ``failed`` (the engine stopped
    working; ``reasons`` says why)."""

    status: str
    reasons: tuple[str, ...] = ()


@attrs.frozen
class EngineState:
    """A consistent view of the engine between two steps."""

    step: int
    queued: tuple[int, ...]
    running: tuple[int, ...]
    parked: tuple[int, ...]
    live: int
    closing: bool
    recent_removals: tuple[Removal, ...]


@attrs.frozen
class RequestNote:
    """What a watcher of the whole engine (``Engine.watch``) sees of one
    request: its prefill ``Progress`` and a ``Failed`` that the host thread
    contained (the request failed alone; the engine goes on), with the
    request's cache id. For a failure, ``traceback`` holds its lines as
    Python prints them (the original exception is the cause), taken when
    the engine delivered it: the request's reader may raise the same error
    object later, which adds its own frames."""

    rid: int
    cache_id: str | None
    event: Progress | Failed
    traceback: tuple[str, ...] = ()


_NO_RESULT: Any = object()


@attrs.define
class _Call:
    done: trio.Event = attrs.field(factory=trio.Event)
    result: Any = _NO_RESULT


@attrs.define
class _Ticket:
    """Shared by the engine and a handle: why a request ended when its channel
    could not carry the reason (the reader had fallen behind)."""

    error: GezelError | None = None


class _Sink(Protocol):
    """Where the engine writes one request's events: its own channel, or its
    group's shared one (``_Tagged``)."""

    def send_nowait(self, value: Event, /) -> None: ...
    def close(self) -> None: ...
    def statistics(self) -> trio.MemoryChannelStatistics: ...


class _Tagged:
    """One group member's end of the group's shared channel: its events go
    out tagged with its index (a clone of the send side, so the reader's
    channel ends once every member's end is closed)."""

    def __init__(self, send: trio.MemorySendChannel[tuple[int, Event]], index: int) -> None:
        self._send = send
        self._index = index

    def send_nowait(self, value: Event, /) -> None:
        self._send.send_nowait((self._index, value))

    def close(self) -> None:
        self._send.close()

    def statistics(self) -> trio.MemoryChannelStatistics:
        return self._send.statistics()


@attrs.define
class _Live:
    request: GenerationRequest
    send: _Sink
    ticket: _Ticket
    submitted_at: float
    position: int | None = None
    logged_at: float = float("-inf")
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    # Stall detection: events buffered after the last exchange, and when the
    # reader was last seen draining.
    buffered: int = 0
    drained_at: float = 0.0


_LIVENESS_LOG_EVERY = 5.0


def _describe(event: Event) -> str:
    match event:
        case Progress(done=done, total=total):
            return f"prefill {done}/{total}"
        case Queued(position=position):
            return f"queued at position {position}"
        case Parked():
            return "parked for interactive work"
        case Resumed():
            return "resumed"
    return type(event).__name__


class RequestHandle:
    """A submitted request: iterate it for events, leave its ``with`` block to
    withdraw it. Iteration yields ``Progress`` and ``Delta`` values and ends
    after exactly one ``Finished`` or ``Failed``."""

    def __init__(
        self,
        engine: Engine,
        rid: int,
        events: trio.MemoryReceiveChannel[Event],
        ticket: _Ticket,
    ) -> None:
        self._engine = engine
        self._ticket = ticket
        self._done = False
        self.rid = rid
        self.events = events

    def __enter__(self) -> RequestHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.events.close()
        self._engine._withdraw(self.rid)

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> Event:
        """Next event; cancellation leaves the request queued or running
        until the ``with`` block is left."""
        if self._done:
            raise StopAsyncIteration
        try:
            event = await self.events.receive()
        except trio.EndOfChannel:
            self._done = True
            return Failed(self._ticket.error or EngineClosed("the engine stopped"))
        if isinstance(event, Finished | Failed):
            self._done = True
        return event


class GroupHandle:
    """``n`` submitted sequences of one prompt (``Engine.submit_group_nowait``):
    iterate it for ``(index, event)`` pairs - each member's events in order,
    the members interleaved as they are generated - until every member ended
    with its ``Finished`` or ``Failed``. Leaving its ``with`` block withdraws
    every member still queued or running."""

    def __init__(
        self,
        engine: Engine,
        rids: tuple[int, ...],
        events: trio.MemoryReceiveChannel[tuple[int, Event]],
        tickets: tuple[_Ticket, ...],
    ) -> None:
        self._engine = engine
        self._tickets = tickets
        self._done = [False] * len(rids)
        self.rids = rids
        self.events = events

    def __enter__(self) -> GroupHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.events.close()
        for rid in self.rids:
            self._engine._withdraw(rid)

    def __aiter__(self) -> GroupHandle:
        return self

    async def __anext__(self) -> tuple[int, Event]:
        """The next member's event; cancellation leaves every member queued
        or running until the ``with`` block is left."""
        if all(self._done):
            raise StopAsyncIteration
        try:
            index, event = await self.events.receive()
        except trio.EndOfChannel:
            index = self._done.index(False)
            self._done[index] = True
            error = self._tickets[index].error or EngineClosed("the engine stopped")
            return index, Failed(error)
        if isinstance(event, Finished | Failed):
            self._done[index] = True
        return index, event


class Engine:
    """The Trio face of the engine. Create it with ``open_engine`` or
    ``run_engine``; every method runs in the Trio thread."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._info: ModelInfo | None = None
        self._renderer: PromptRenderer | None = None
        self._images: ImagePreparer | None = None
        self._compiler: ConstraintCompiler | None = None
        self._scheduler = Scheduler(
            max_running=config.max_concurrency,
            max_queue=config.max_queue,
            continuous=config.continuous_batching,
            max_park=config.max_park_seconds,
        )
        self._live: dict[int, _Live] = {}
        # Running sequences whose caller left, with the step at which it left.
        self._withdrawn: dict[int, int] = {}
        self._removals: deque[Removal] = deque(maxlen=64)
        self._next_rid = 0
        self._step = 0
        self._closing = False
        self._wake = trio.Event()
        self._changed = trio.Event()
        self._task_status: trio.TaskStatus[Engine] | None = None
        self._commands: list[tuple[int, HostCommand]] = []
        self._calls: dict[int, _Call] = {}
        self._next_call = 0
        self._cache_view = CacheSnapshot()
        self._memory = 0
        self.metrics = EngineMetrics()
        self.metrics.watch(self._snapshot)
        # Consecutive failed model steps, and the last failure (time, reason).
        self._step_failures = 0
        self._last_step_failure: tuple[float, str] | None = None
        self._persistence: str | None = None
        # Why the engine stopped working, once it has (EngineFailure).
        self._failure: EngineFailure | None = None
        # The one watcher of every request's progress and contained failures.
        self._watcher: trio.MemorySendChannel[RequestNote] | None = None

    # --- public API --------------------------------------------------------

    @property
    def info(self) -> ModelInfo:
        assert self._info is not None, "the engine is not ready yet"
        return self._info

    @property
    def renderer(self) -> PromptRenderer:
        assert self._renderer is not None, "the engine is not ready yet"
        return self._renderer

    async def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        template_override: str | None = None,
        band_chars: int | None = None,
    ) -> RenderedPrompt:
        """Render a conversation to prompt tokens on a worker thread (never
        the MLX thread: tokenizers are plain Python). Raises
        ``InvalidRequest`` when the template rejects the conversation. If
        cancelled, the render finishes in its thread and is discarded."""
        renderer = self.renderer
        kwargs = dict(template_kwargs or {})
        return await trio.to_thread.run_sync(
            lambda: renderer.render(
                messages,
                tools=tools,
                template_kwargs=kwargs,
                template_override=template_override,
                band_chars=band_chars,
            )
        )

    async def compile_constraint(
        self,
        *,
        response_format: Any = None,
        tools: Any = None,
        tool_choice: Any = None,
        tool_grammar: Any = None,
    ) -> Constraint | None:
        """Compile what a request asks to constrain (T3) on a worker thread;
        ``None`` when nothing is. Raises ``InvalidRequest`` naming the field
        for an invalid schema, grammar or tool choice - before any stream."""
        wants = (
            (response_format or {}).get("type") in ("json_object", "json_schema")
            or tool_choice not in (None, "auto", "none")
            or bool(tool_grammar)
        )
        if not wants:
            return None
        compiler = self._compiler
        if compiler is None:
            raise InvalidRequest("this model cannot constrain decoding", param="response_format")
        result: Constraint | None = await trio.to_thread.run_sync(
            lambda: compiler.compile(
                response_format=response_format,
                tools=tools,
                tool_choice=tool_choice,
                tool_grammar=tool_grammar,
            )
        )
        return result

    async def prepare_chat(self, chat: ChatRequest) -> PreparedChat:
        """Render ``chat`` with the model's template and compile what it
        constrains (worker threads; never the MLX thread), bounded by the
        context window. Raises ``InvalidRequest`` naming the field, before
        anything is queued. Cancelling it queues nothing."""
        limit = self.config.max_concurrency
        if not 1 <= chat.n <= limit:
            raise InvalidRequest(f"n must be in [1, {limit}] (--max-concurrency)", param="n")
        if chat.prompt is not None:
            rendered = await self._raw_prompt(chat)
        else:
            rendered = await self.render_chat(
                [dict(m) for m in chat.messages],
                tools=[dict(t) for t in chat.tools] if chat.tools else None,
                template_kwargs=dict(chat.template_kwargs),
                template_override=chat.template_override,
                band_chars=chat.stable_prefix_chars,
            )
        vision = None
        if chat.images:
            preparer = self._images
            if preparer is None:
                raise InvalidRequest(
                    f"the model {self.info.model_id} takes no images (it is text-only)",
                    param=chat.images[0].param,
                )
            limits = ImageLimits.of(self.config)
            parts = tuple(chat.images)
            # Decoding and the processor are CPU work: a worker thread, never
            # the Trio thread nor the MLX host thread.
            rendered, vision = await trio.to_thread.run_sync(
                lambda: prepare_vision(rendered, parts, preparer, limits)
            )
        prompt = rendered.tokens
        max_tokens = self.bound_max_tokens(len(prompt), chat.max_tokens)
        constraint = await self.compile_constraint(
            response_format=dict(chat.response_format) if chat.response_format else None,
            tools=[dict(t) for t in chat.tools] if chat.tools else None,
            tool_choice=chat.tool_choice,
            tool_grammar=dict(chat.tool_grammar) if chat.tool_grammar else None,
        )
        thinking = chat.max_thinking_tokens
        if constraint is not None and self.info.think_ids is not None:
            # A forced output must fit after the think block: thinking gets
            # at most what the output does not need (T3).
            room = max(0, max_tokens - max(64, max_tokens // 2))
            thinking = room if thinking is None else min(thinking, room)
        request = GenerationRequest(
            prompt=prompt,
            max_tokens=max_tokens,
            sampling=chat.sampling,
            stop=chat.stop,
            ignore_eos=chat.ignore_eos,
            min_tokens=min(chat.min_tokens, max_tokens),
            priority=chat.priority,
            cache=CacheRequest(
                cache_id=chat.cache_id,
                prefix_ids=chat.prefix_ids,
                band_end=rendered.band_end,
                boundaries=rendered.boundaries,
                roster=roster_fingerprint(chat.tools),
            ),
            constraint=constraint,
            max_thinking_tokens=thinking,
            top_logprobs=chat.top_logprobs,
            vision=vision,
            continues_text=chat.prompt is not None,
        )
        return PreparedChat(chat, request)

    async def _raw_prompt(self, chat: ChatRequest) -> RenderedPrompt:
        """A legacy completion's prompt: text tokenized without a chat
        template, or token ids as given (checked against the vocabulary by
        ``check_request``)."""
        if chat.messages:
            raise InvalidRequest("send messages or a prompt, not both", param="prompt")
        if isinstance(chat.prompt, str):
            return RenderedPrompt(await self.tokenize(chat.prompt))
        assert chat.prompt is not None
        return RenderedPrompt(tuple(chat.prompt))

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> tuple[int, ...]:
        """``text`` as token ids, without a chat template, on a worker thread
        (never the MLX thread). If cancelled, the work finishes in its thread
        and is discarded."""
        renderer = self.renderer
        return await trio.to_thread.run_sync(
            lambda: renderer.encode(text, add_special_tokens=add_special_tokens)
        )

    async def detokenize(self, tokens: Sequence[int]) -> str:
        """Token ids as text, on a worker thread. Raises ``InvalidRequest``
        for an id outside the vocabulary."""
        vocab = self.info.vocab_size
        if vocab and not all(0 <= t < vocab for t in tokens):
            raise InvalidRequest(f"token ids must be in [0, {vocab})", param="tokens")
        renderer = self.renderer
        ids = list(tokens)
        return await trio.to_thread.run_sync(lambda: renderer.decode(ids))

    async def token_texts(self, tokens: Sequence[int]) -> tuple[str, ...]:
        """Each token's own text (for logprobs of a prompt), on a worker
        thread. Raises ``InvalidRequest`` for an id outside the vocabulary."""
        vocab = self.info.vocab_size
        if vocab and not all(0 <= t < vocab for t in tokens):
            raise InvalidRequest(f"token ids must be in [0, {vocab})", param="tokens")
        renderer = self.renderer
        ids = list(tokens)
        return await trio.to_thread.run_sync(lambda: tuple(renderer.decode([t]) for t in ids))

    def submit_chat_nowait(self, prepared: PreparedChat) -> ChatHandle:
        """Queue a prepared chat and return its handle (``submit_nowait``'s
        rules: never blocks; leaving the handle's ``with`` block withdraws
        it). Raises ``EngineClosed`` or ``QueueFull``."""
        handle = self.submit_nowait(prepared.request)
        return ChatHandle(handle, prepared, self._shaper(prepared))

    def submit_chat_group_nowait(self, prepared: PreparedChat) -> ChatGroupHandle:
        """Queue ``prepared.chat.n`` chats continuing the same prompt, which
        is computed once (``submit_group_nowait``'s rules: choice ``i``
        samples with ``seed + i``; leaving the handle's ``with`` block
        withdraws them all). Raises ``EngineClosed``, ``QueueFull`` or
        ``InvalidRequest``."""
        group = self.submit_group_nowait(prepared.request, prepared.chat.n)
        choices = [
            ChatHandle(None, prepared, self._shaper(prepared), index=i)
            for i in range(prepared.chat.n)
        ]
        return ChatGroupHandle(group, choices)

    def _shaper(self, prepared: PreparedChat) -> Shaper:
        chat = prepared.chat
        raw = chat.prompt is not None
        return Shaper(
            self.info, prepared.request.prompt, tools=chat.parses_tools, reasoning=not raw
        )

    async def chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> ChatHandle:
        """``prepare_chat`` then ``submit_chat_nowait``: ``options`` are
        ``ChatRequest``'s fields. Use the handle in a ``with`` block."""
        prepared = await self.prepare_chat(ChatRequest(messages, **options))
        return self.submit_chat_nowait(prepared)

    def watch(self, max_buffer: int = 256) -> trio.MemoryReceiveChannel[RequestNote]:
        """A channel of ``RequestNote`` values for every request: prefill
        progress and failures contained on the host thread, as the engine
        delivers them (Trio thread, between two steps). The engine never
        waits for the watcher: when ``max_buffer`` notes are unread, new ones
        are dropped. One watcher at a time; closing the channel ends it."""
        send, receive = trio.open_memory_channel[RequestNote](max_buffer)
        if self._watcher is not None:
            self._watcher.close()
        self._watcher = send
        return receive

    def check_admission(self) -> None:
        """Raise ``EngineFailure``, ``EngineClosed`` or ``QueueFull`` if a
        request would be refused now."""
        if self._failure is not None:
            raise EngineFailure(self._failure.message)
        if self._closing:
            raise EngineClosed("the server is shutting down")
        self._scheduler.check_room()

    def check_request(self, request: GenerationRequest) -> None:
        """Raise ``InvalidRequest`` (naming the field) unless ``request`` is
        something this model can serve: token ids inside the vocabulary,
        finite sampling numbers in range, ``max_tokens`` inside the context
        window. ``submit_nowait`` runs it; the HTTP layer runs it before a
        stream starts, so a bad request is a 400, never an error frame."""
        if not request.prompt:
            raise InvalidRequest("the prompt is empty", param="messages")
        if request.max_tokens < 1:
            raise InvalidRequest("max_tokens must be >= 1", param="max_tokens")
        self.bound_max_tokens(len(request.prompt), request.max_tokens)
        vocab = self.info.vocab_size
        ids = request.prompt
        if request.vision is not None:
            if not self.info.vision:
                raise InvalidRequest(
                    f"the model {self.info.model_id} takes no images", param="messages"
                )
            # The prompt is the cache key (core.images); the model sees these.
            ids = request.vision.model_tokens
            if len(ids) != len(request.prompt) or (
                request.vision.spans and request.vision.end >= len(ids)
            ):
                raise InvalidRequest("the prompt must go on after its last image", param="messages")
        if vocab and not all(0 <= t < vocab for t in ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if self._images is not None:
            # A placeholder without its pixels (a message that spells the
            # image marker out) would embed a token the model never saw alone.
            placed = sum(s.length for s in request.vision.spans) if request.vision else 0
            if ids.count(self._images.image_token) != placed:
                raise InvalidRequest(
                    "the prompt holds the model's image placeholder token without an image",
                    param="messages",
                )
        p = request.sampling
        for name, value, lo, hi in (
            ("temperature", p.temperature, 0.0, math.inf),
            ("top_p", p.top_p, 0.0, 1.0),
            ("min_p", p.min_p, 0.0, 1.0),
            ("presence_penalty", p.presence_penalty, -math.inf, math.inf),
            ("frequency_penalty", p.frequency_penalty, -math.inf, math.inf),
            ("repetition_penalty", p.repetition_penalty, 0.0, math.inf),
        ):
            if value is not None and not (math.isfinite(value) and lo <= value <= hi):
                raise InvalidRequest(f"{name} must be a finite number in [{lo}, {hi}]", param=name)
        if p.top_k < -1:
            raise InvalidRequest("top_k must be >= -1 (-1 or 0: no top-k)", param="top_k")
        if not 1 <= p.repetition_context_size <= MAX_REPETITION_CONTEXT:
            raise InvalidRequest(
                f"repetition_context_size must be in [1, {MAX_REPETITION_CONTEXT}]",
                param="repetition_context_size",
            )
        for token, bias in p.logit_bias:
            if not (0 <= token < vocab or (not vocab and token >= 0)):
                raise InvalidRequest(
                    f"logit_bias names token {token}, outside the vocabulary [0, {vocab})",
                    param="logit_bias",
                )
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise InvalidRequest(
                    "logit_bias values must be finite numbers in [-100, 100]", param="logit_bias"
                )
        if request.top_logprobs is not None and not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs"
            )
        if request.min_tokens < 0:
            raise InvalidRequest("min_tokens must be >= 0", param="min_tokens")
        if request.max_thinking_tokens is not None and request.max_thinking_tokens < 0:
            raise InvalidRequest("max_thinking_tokens must be >= 0", param="max_thinking_tokens")

    def health(self) -> Health:
        """The engine's condition for ``/health``."""
        if self._failure is not None:
            return Health("failed", (self._failure.message,))
        if self._closing:
            return Health("shutting_down")
        reasons = []
        last = self._last_step_failure
        if last is not None and trio.current_time() - last[0] < DEGRADED_FOR:
            reasons.append(f"a model step failed: {last[1]}")
        if self._persistence is not None:
            reasons.append(f"persistence: {self._persistence}")
        return Health("degraded" if reasons else "ok", tuple(reasons))

    def bound_max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """The ``max_tokens`` a request may have: at most what the context
        window leaves. Raises ``InvalidRequest`` when it cannot fit."""
        window = self.info.context_length
        room = window - prompt_len
        if room < 1:
            raise InvalidRequest(
                f"the prompt has {prompt_len} tokens; the model's context window is {window}",
                param="messages",
            )
        if requested is None:
            return min(room, self.config.default_max_tokens)
        if requested > room:
            raise InvalidRequest(
                f"max_tokens={requested} plus the prompt's {prompt_len} tokens exceeds "
                f"the context window of {window}",
                param="max_tokens",
            )
        return requested

    def submit_nowait(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request and return its handle; never blocks.

        Raises ``EngineClosed`` (shutting down), ``QueueFull`` (the queue is at
        its bound) or ``InvalidRequest``. Use the handle in a ``with`` block:
        leaving it, by any path including cancellation, withdraws the request.
        """
        self.check_admission()
        self.check_request(request)
        send, receive = trio.open_memory_channel[Event](request.max_tokens + _EVENT_SLACK)
        ticket = _Ticket()
        rid = self._enqueue(request, send, ticket)
        return RequestHandle(self, rid, receive, ticket)

    def submit_group_nowait(self, request: GenerationRequest, n: int) -> GroupHandle:
        """Queue ``n`` sequences that continue the same prompt and return
        their handle; never blocks. Member ``i`` samples with ``seed + i``
        (each its own random stream; no seed: each its own random one).

        The prompt is computed once: the first member admitted prefills it,
        the others wait (holding their slots) until its state at
        ``len(prompt) - 1`` is in the prompt cache, then seed from there and
        decode in the same batch (``host.loop``). Raises as
        ``submit_nowait`` does, ``QueueFull`` unless all ``n`` fit, and
        ``InvalidRequest`` unless ``1 <= n <= max_concurrency``."""
        self.check_admission()
        self.check_request(request)
        limit = self.config.max_concurrency
        if not 1 <= n <= limit:
            raise InvalidRequest(f"n must be in [1, {limit}] (--max-concurrency)", param="n")
        self._scheduler.check_room(n)
        cache = request.cache or CacheRequest()
        if n > 1:
            cache = attrs.evolve(cache, prefill_group=self._next_rid)
        send, receive = trio.open_memory_channel[tuple[int, Event]](
            n * (request.max_tokens + _EVENT_SLACK)
        )
        rids, tickets = [], []
        with send:
            for i in range(n):
                seed = request.sampling.seed
                member = attrs.evolve(
                    request,
                    sampling=attrs.evolve(
                        request.sampling, seed=None if seed is None else seed + i
                    ),
                    cache=cache,
                )
                tickets.append(_Ticket())
                rids.append(self._enqueue(member, _Tagged(send.clone(), i), tickets[-1]))
        return GroupHandle(self, tuple(rids), receive, tuple(tickets))

    def _enqueue(self, request: GenerationRequest, sink: _Sink, ticket: _Ticket) -> int:
        rid = self._next_rid
        self._next_rid += 1
        self._scheduler.enqueue(rid, request.priority)
        self._live[rid] = _Live(request, sink, ticket, submitted_at=trio.current_time())
        self._wake.set()
        self._notify()
        return rid

    def state(self) -> EngineState:
        return EngineState(
            step=self._step,
            queued=self._scheduler.queued,
            running=self._scheduler.running,
            parked=self._scheduler.parked,
            live=len(self._live),
            closing=self._closing,
            recent_removals=tuple(self._removals),
        )

    async def wait_until(self, predicate: Callable[[EngineState], bool]) -> EngineState:
        """Wait until ``predicate(state)`` holds, re-checking whenever the
        engine's state changes (each step, submit, withdrawal). Meant for tests
        and observability; cancel it with an ordinary scope."""
        while True:
            state = self.state()
            if predicate(state):
                return state
            await self._changed.wait()

    @property
    def cache_view(self) -> tuple[CacheView, ...]:
        """The prompt cache's entries as of the last engine step."""
        return self._cache_view.entries

    @property
    def cache_totals(self) -> CacheTotals:
        """The prompt cache's totals (bytes, blocks, hits) as of the last step."""
        return self._cache_view.totals

    def cache_ids_in_use(self) -> set[str]:
        """Cache ids named by requests that are queued or running."""
        ids: set[str] = set()
        for live in self._live.values():
            cr = live.request.cache
            if cr is not None:
                ids.update(k for k in (cr.cache_id, *cr.prefix_ids) if k)
        return ids

    async def host_call(self, command: HostCommand) -> Any:
        """Run a cache command on the host thread, between two steps, and
        return its result. Raises ``EngineClosed`` if the engine stops first.
        Cancelling the wait leaves the command to run; its result is dropped."""
        if self._closing:
            raise EngineClosed("the engine is shutting down")
        cid = self._next_call
        self._next_call += 1
        call = _Call()
        self._calls[cid] = call
        self._commands.append((cid, command))
        self._wake.set()
        try:
            await call.done.wait()
        finally:
            self._calls.pop(cid, None)
        if call.result is _NO_RESULT:
            raise EngineClosed("the engine stopped before the command ran")
        if isinstance(call.result, CommandFailed):
            raise RequestFailed(f"the cache command failed: {call.result.error}")
        return call.result

    async def settle(self) -> None:
        """Wait until every withdrawn sequence has left the batch, so its
        cancellation snapshot is filed. Bound it with a cancel scope."""
        await self.wait_until(lambda _: not self._withdrawn)

    def close_nowait(self) -> None:
        """Stop admitting; fail every queued and running request with
        ``EngineClosed``. The host thread stops at its next exchange."""
        if self._closing:
            return
        self._fail_everything(EngineClosed("the engine shut down"))

    def _fail_everything(self, error: GezelError) -> None:
        """Stop admitting; fail every queued and running request with ``error``."""
        self._closing = True
        queued, running = self._scheduler.withdraw_all()
        for rid in running:
            self._withdrawn.setdefault(rid, self._step)
        for rid in (*queued, *running):
            self._end(rid, Failed(error))
        for call in self._calls.values():
            call.done.set()  # result stays _NO_RESULT: the caller gets EngineClosed
        self._wake.set()
        self._notify()

    def _die(self, error: EngineFailure) -> None:
        """The engine stopped working: ``/health`` fails with the reason and
        every request, queued or running, fails with ``error``."""
        if self._failure is None:
            self._failure = error
        self._fail_everything(error)

    # --- the host thread's side (called through trio.from_thread) ----------

    def ready(
        self,
        info: ModelInfo,
        renderer: PromptRenderer,
        compiler: ConstraintCompiler | None,
        images: ImagePreparer | None = None,
    ) -> None:
        self._info = info
        self._renderer = renderer
        self._compiler = compiler
        self._images = images
        assert self._task_status is not None
        self._task_status.started(self)
        self._task_status = None

    def exchange(self, report: StepReport) -> Orders:
        now = trio.current_time()
        if report.cache_view is not None:
            self._cache_view = report.cache_view
        self._persistence = report.persistence
        for cid, result in report.replies:
            call = self._calls.pop(cid, None)
            if call is not None:
                call.result = result
                call.done.set()
        self._check_stalls(now)
        for rid, event in report.events:
            self._observe(rid, event, now)
            self._tell_watcher(rid, event)
            self._deliver(rid, event)
        for rid in report.ended:
            self._scheduler.finished(rid)
            # A request withdrawn in the step it finished in leaves here.
            self._withdrawn.pop(rid, None)
            self._end(rid, None)
        if report.events or report.ended:
            self._step += 1
        if self._failed_step(report, now):
            return Orders(stop=True)
        # Anything submitted after this point wakes an idle host thread.
        self._wake = trio.Event()
        cancelled = trio.current_effective_deadline() == -math.inf
        if cancelled:
            self.close_nowait()
        if report.memory is not None:
            self._memory = report.memory
        plan = self._scheduler.plan(memory_tight=self.memory_tight, now=now)
        for rid in plan.parked:
            self._deliver(rid, Parked())
        for rid in plan.resumed:
            self._deliver(rid, Resumed())
        self._announce_queue()
        for rid in plan.remove:
            left_at = self._withdrawn.pop(rid, self._step)
            self._removals.append(Removal(rid, left_at, self._step))
        admit = tuple((rid, self._live[rid].request) for rid in plan.admit)
        for rid in plan.admit:
            live = self._live[rid]
            live.admitted_at = live.drained_at = now
            self.metrics.queue.observe(now - live.submitted_at)
        self.metrics.preemptions.inc(len(plan.parked))
        for rid, request in admit:
            log.info(
                "admit request %d priority=%s prompt=%d max_tokens=%d running=%d queued=%d",
                rid,
                request.priority,
                len(request.prompt),
                request.max_tokens,
                len(self._scheduler.running),
                len(self._scheduler.queued),
            )
        stop = cancelled or (self._closing and self._scheduler.idle)
        commands, self._commands = tuple(self._commands), []
        for live in self._live.values():
            live.buffered = live.send.statistics().current_buffer_used
        self._notify()
        return Orders(
            stop=stop,
            remove=plan.remove,
            admit=admit,
            commands=commands,
            lane=plan.lane,
            parked=plan.parked,
            resumed=plan.resumed,
        )

    async def wait_for_work(self) -> None:
        await self._wake.wait()

    def _failed_step(self, report: StepReport, now: float) -> bool:
        """Count consecutive failed model steps; at ``max_step_failures`` the
        engine dies (True: the host must stop)."""
        if report.step_failure is None:
            if report.stepped:
                self._step_failures = 0
            return False
        self._step_failures += 1
        self._last_step_failure = (now, report.step_failure)
        self.metrics.step_failures.inc()
        limit = self.config.max_step_failures
        if self._step_failures < limit:
            return False
        self._die(
            EngineFailure(f"{limit} consecutive model steps failed; last: {report.step_failure}")
        )
        return True

    def _check_stalls(self, now: float) -> None:
        """Withdraw running requests whose reader drained nothing for
        ``stall_timeout`` seconds (docs/architecture.md, "Backpressure")."""
        limit = self.config.stall_timeout
        if limit is None:
            return
        for rid in self._scheduler.running:
            live = self._live.get(rid)
            if live is None:
                continue
            used = live.send.statistics().current_buffer_used
            if used == 0 or used < live.buffered:
                live.drained_at = now
            elif now - live.drained_at >= limit:
                log.warning(
                    "request %d: the client drained nothing for %.0f s; withdrawn", rid, limit
                )
                live.ticket.error = SlowConsumer(
                    f"the client read nothing for {limit:g} s; the request was withdrawn"
                )
                self.metrics.requests.labels("failed", SlowConsumer.code).inc()
                self._withdraw(rid)

    def _observe(self, rid: int, event: Event, now: float) -> None:
        """Request timings for the latency histograms."""
        live = self._live.get(rid)
        if live is None:
            return
        m = self.metrics
        match event:
            case Delta(usage=usage):
                if live.first_token_at is None:
                    live.first_token_at = now
                    m.ttft.observe(now - live.submitted_at)
                    prefill = usage.input_tokens - usage.cached_tokens
                    if live.admitted_at is not None and now > live.admitted_at and prefill > 0:
                        m.prefill_rate.observe(prefill / (now - live.admitted_at))
                elif live.last_token_at is not None:
                    m.itl.observe(now - live.last_token_at)
                live.last_token_at = now
            case Finished(reason=reason, usage=usage):
                m.e2e.observe(now - live.submitted_at)
                m.requests.labels(reason, "").inc()
                m.prompt_tokens.inc(usage.input_tokens)
                m.cached_tokens.inc(usage.cached_tokens)
                m.prefilled_tokens.inc(usage.input_tokens - usage.cached_tokens)
                m.generation_tokens.inc(usage.output_tokens)
            case Failed(error=error):
                m.e2e.observe(now - live.submitted_at)
                m.requests.labels("failed", error.code or "").inc()

    def _tell_watcher(self, rid: int, event: Event) -> None:
        if self._watcher is None or not isinstance(event, Progress | Failed):
            return
        live = self._live.get(rid)
        if live is None:
            return
        cache_id = live.request.cache.cache_id if live.request.cache else None
        lines: tuple[str, ...] = ()
        if isinstance(event, Failed):
            text = "".join(traceback.format_exception(event.error))
            lines = tuple(text.rstrip().splitlines())
        try:
            self._watcher.send_nowait(RequestNote(rid, cache_id, event, lines))
        except trio.WouldBlock:
            pass  # the watcher is behind: its notes are advisory
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._watcher = None

    def _snapshot(self) -> Snapshot:
        state = self.state()
        return Snapshot(
            running=len(state.running),
            waiting=len(state.queued),
            parked=len(state.parked),
            steps=state.step,
            cache_entries=self.cache_totals.entries,
            cache_bytes=self.cache_totals.bytes,
            cache_blocks=self.cache_totals.blocks,
            cache_lookups=self.cache_totals.lookups,
            cache_hits=self.cache_totals.hits,
            memory_bytes=self._memory,
        )

    @property
    def memory_tight(self) -> bool:
        """Live MLX memory above 85% of ``memory_limit_mb`` (E4)."""
        limit = self.config.memory_limit_mb
        return limit is not None and self._memory > 0.85 * limit * 1024 * 1024

    def _announce_queue(self) -> None:
        """Tell each waiting request its place when it changes (E6)."""
        for position, rid in enumerate(self._scheduler.queued):
            live = self._live.get(rid)
            if live is not None and live.position != position:
                live.position = position
                self._deliver(rid, Queued(position))

    # --- internals ---------------------------------------------------------

    def _deliver(self, rid: int, event: Event) -> None:
        live = self._live.get(rid)
        if live is None:
            return
        if isinstance(event, Progress | Queued | Parked | Resumed):
            self._log_liveness(rid, live, event)
        try:
            live.send.send_nowait(event)
        except trio.WouldBlock:
            if isinstance(event, Progress | Queued | Parked | Resumed):
                return  # liveness notes are advisory; a busy reader may miss some
            # The reader stopped draining: drop it rather than stall the engine.
            live.ticket.error = SlowConsumer("the client stopped reading; request dropped")
            self._withdraw(rid)
        except trio.BrokenResourceError:
            self._withdraw(rid)  # the reader closed its end: the client left

    def _log_liveness(self, rid: int, live: _Live, event: Event) -> None:
        """The same liveness the stream shows, in the log (E6); prefill
        progress at most every few seconds per request."""
        now = trio.current_time()
        if isinstance(event, Progress):
            if now - live.logged_at < _LIVENESS_LOG_EVERY and event.done < event.total:
                return
            live.logged_at = now
        cache_id = live.request.cache.cache_id if live.request.cache else None
        log.info("request %d cache_id=%s %s", rid, cache_id or "-", _describe(event))

    def _withdraw(self, rid: int) -> None:
        where = self._scheduler.withdraw(rid)
        if where == "running":
            self._withdrawn.setdefault(rid, self._step)
        live = self._live.pop(rid, None)
        if live is not None:
            if live.ticket.error is None:
                self.metrics.requests.labels("withdrawn", "").inc()
            live.send.close()
        self._wake.set()
        self._notify()

    def _end(self, rid: int, final: Event | None) -> None:
        live = self._live.pop(rid, None)
        if live is None:
            return
        if final is not None:
            try:
                live.send.send_nowait(final)
            except trio.WouldBlock:
                if isinstance(final, Failed):
                    live.ticket.error = final.error
            except trio.BrokenResourceError:
                pass  # nobody is listening any more
        live.send.close()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


def _default_backend(config: EngineConfig) -> Backend:
    # Imported here: the MLX backend is only ever built on the host thread.
    from ..mlx.backend import MlxBackend

    return MlxBackend(config)


async def run_engine(  # noqa: ASYNC128 - Engine.ready() calls started() from the host thread
    config: EngineConfig,
    *,
    backend_factory: Callable[[EngineConfig], Backend] | None = None,
    inline: bool = False,
    observer: Observer | None = None,
    task_status: trio.TaskStatus[Engine] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run an engine until cancelled; use with ``nursery.start``.

    ``task_status.started(engine)`` is called only after the backend has loaded
    the model on the host thread, so "ready" is real. ``inline`` runs the host
    loop as a Trio task instead, for backends that need no thread (tests). Cancelling this task
    fails every live request with ``EngineClosed``; the host thread finishes
    its current step, closes the backend and returns.

    Raises ``ModelLoadError`` before ready; after it, ``EngineFailure`` when
    the engine stops working (its host thread died, or ``max_step_failures``
    model steps failed in a row) - every live request was failed with it.
    """
    make = backend_factory or _default_backend
    engine = Engine(config)
    engine._task_status = task_status
    try:
        if inline:
            # A thread-free backend (gezel_trio.testing) runs as a Trio task.
            await run_host_inline(engine, lambda: make(config), config, observer)
        else:
            await trio.to_thread.run_sync(
                run_host, engine, lambda: make(config), config, thread_name="gezel-mlx-host"
            )
    except Exception as exc:
        if engine._info is None:
            if isinstance(exc, GezelError):
                raise
            raise ModelLoadError(f"could not load the model: {type(exc).__name__}: {exc}") from exc
        # The host thread died: every request hears why, and so does the caller.
        log.critical("the engine's host thread died", exc_info=exc)
        death = EngineFailure(f"the engine's host thread died: {type(exc).__name__}: {exc}")
        engine._die(death)
        raise death from exc
    finally:
        engine.close_nowait()
    if engine._failure is not None:
        raise engine._failure  # too many failed model steps


@asynccontextmanager
async def open_engine(
    config: EngineConfig,
    *,
    backend_factory: Callable[[EngineConfig], Backend] | None = None,
    inline: bool = False,
    observer: Observer | None = None,
) -> AsyncIterator[Engine]:
    """``async with open_engine(config) as engine:`` - an engine scoped to the
    block. Leaving the block closes it: queued and running requests fail with
    ``EngineClosed`` and the host thread stops after its current step.
    Exceptions from the block or the engine come out unwrapped."""
    try:
        async with trio.open_nursery() as nursery:
            engine: Engine = await nursery.start(
                lambda task_status: run_engine(
                    config,
                    backend_factory=backend_factory,
                    inline=inline,
                    observer=observer,
                    task_status=task_status,
                )
            )
            try:
                yield engine
            finally:
                engine.close_nowait()
    except BaseExceptionGroup as group:
        raise _sole(group) from None


def _sole(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one exception behind nested single-member groups, or the group."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
