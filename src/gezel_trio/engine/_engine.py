"""The engine: a nursery-scoped task that owns the model and its host loop.

Ownership::

    run_engine (task in the caller's nursery)
      └─ nursery
           └─ host runner          in_thread: one thread for the engine's
                                   life, where all MLX work happens
    Engine (this module)           the facade: prepare, submit, chat, warm,
      ├─ Preparer                  worker-thread rendering and checks
      └─ HostLink                  scheduler, request channels, the exchange

A caller prepares a chat (``prepare_chat``) or builds a ``GenerationRequest``,
submits it with ``submit_chat_nowait`` / ``submit_nowait`` and reads events
from the returned handle inside ``with handle:``. Leaving that block - by any
path, cancellation included - withdraws the request (``RequestHandle``).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import trio

from ..core.backend import Backend, PromptRenderer
from ..core.config import EngineConfig
from ..core.constraint import Constraint
from ..core.errors import EngineFailure, GezelError, ModelLoadError
from ..core.model import ModelInfo
from ..core.prepare import ChatRequest, PreparedChat, check_n, check_request
from ..core.request import GenerationRequest, RenderedPrompt
from ..host.exchange import CacheEvict, CacheFlush, Evicted
from ..host.loop import HostRunner, in_thread
from ..host.prompt_cache import CacheTotals, CacheView
from ..shaping.replies import ReplyLedger, ReplySeal, dump_ledger, load_ledger, load_secret
from ._chat import ChatHandle, open_chat
from ._handle import RequestHandle
from ._link import WAITING_EVERY, EngineState, Expected, Health, HostLink, RequestNote
from ._metrics import EngineMetrics
from ._prepare import Preparer
from ._warm import Warmed, warm

__all__ = ["BackendFactory", "Engine", "open_engine", "run_engine"]

log = logging.getLogger("gezel_trio.engine")

BackendFactory = Callable[[EngineConfig], Backend]
# How long stopping may spend writing the reply ledger to the persist dir.
_LEDGER_SAVE_SECONDS = 5.0


class Engine:
    """The Trio face of a running engine (``open_engine``, ``run_engine``);
    every method runs in the Trio thread. ``*_nowait`` methods never block."""

    def __init__(self, config: EngineConfig, link: HostLink, preparer: Preparer) -> None:
        self.config = config
        self.link = link
        self.metrics = link.metrics
        self._prep = preparer

    @property
    def info(self) -> ModelInfo:
        return self._prep.loaded.info

    @property
    def replies(self) -> ReplyLedger | None:
        """The replies this engine generated recently (``shaping.replies``);
        ``None`` with ``reply_ledger_tokens`` 0."""
        return self._prep.replies

    @property
    def seal(self) -> ReplySeal | None:
        """What signs the blobs clients carry back (``shaping.replies``):
        sealed replies and compacted histories. ``None`` only where a
        ``Preparer`` was built without one."""
        return self._prep.seal

    @property
    def renderer(self) -> PromptRenderer:
        return self._prep.loaded.renderer

    # --- preparation (worker threads; cancelling one discards it) ------------

    async def prepare_chat(self, chat: ChatRequest) -> PreparedChat:
        """Render ``chat`` with the model's template, compile what it
        constrains and check it against the model, once. Raises
        ``EngineFailure``/``EngineClosed``/``QueueFull`` if it would be
        refused now (before any work), ``InvalidRequest`` naming the field.
        Queues nothing."""
        self.link.check_admission()
        preparing = Expected()
        self.link.expect(preparing)  # until prepared, then the prepared chat
        try:
            prepared = await self._prep.prepare(chat)
        finally:
            self.link.unexpect(preparing)
        self.link.expect(prepared)
        return prepared

    async def count_tokens(self, chat: ChatRequest) -> int:
        """How many prompt tokens ``chat`` renders to (images included)."""
        rendered, _ = await self._prep.render(chat)
        return len(rendered.tokens)

    async def render_chat(
        self, messages: Sequence[dict[str, Any]], **options: Any
    ) -> RenderedPrompt:
        """A conversation as prompt tokens (``options``: ``tools``,
        ``template_kwargs``, ``template_override``, ``band_chars``). Raises
        ``InvalidRequest`` when the template rejects it."""
        return await self._prep.render_chat(messages, **options)

    async def compile_constraint(self, **what: Any) -> Constraint | None:
        """The grammar ``response_format``/``tools``/``tool_choice``/
        ``tool_grammar`` ask for (``None``: nothing is constrained)."""
        return await self._prep.compile_constraint(**what)

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> tuple[int, ...]:
        """``text`` as token ids, without a chat template."""
        return await self._prep.tokenize(text, add_special_tokens=add_special_tokens)

    async def detokenize(self, tokens: Sequence[int]) -> str:
        """Token ids as text; ``InvalidRequest`` for an id outside the vocabulary."""
        return await self._prep.detokenize(tokens)

    async def token_texts(self, tokens: Sequence[int]) -> tuple[str, ...]:
        """Each token's own text; ``InvalidRequest`` for an id outside the vocabulary."""
        return await self._prep.token_texts(tokens)

    # --- submission ------------------------------------------------------------

    def submit_nowait(self, request: GenerationRequest, n: int = 1) -> RequestHandle:
        """Check ``request`` against the model and queue ``n`` sequences of
        it (``n > 1``: the prompt computed once, member ``i`` sampling with
        ``seed + i``). Raises ``EngineClosed``, ``EngineFailure``,
        ``QueueFull`` (unless all ``n`` fit) or ``InvalidRequest``. Use the
        handle in a ``with`` block: leaving it withdraws the request."""
        check_n(self.config.scheduling, n)
        check_request(request, self.info, self.config, image_token=self._prep.image_token)
        return self.link.submit(request, n)

    def submit_chat_nowait(self, prepared: PreparedChat) -> ChatHandle:
        """Queue a prepared chat (``prepared.chat.n`` choices) and return its
        handle; raises as ``submit_nowait`` does, without checking again."""
        self.link.unexpect(prepared)
        handle = self.link.submit(prepared.request, prepared.chat.n)
        return open_chat(handle, prepared, self.info, self._prep.replies)

    async def chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> ChatHandle:
        """``prepare_chat`` then ``submit_chat_nowait``: ``options`` are
        ``ChatRequest``'s fields. Use the handle in a ``with`` block."""
        prepared = await self.prepare_chat(ChatRequest(messages, **options))
        return self.submit_chat_nowait(prepared)

    # --- the prompt cache --------------------------------------------------------

    async def warm(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> Warmed:
        """Build the named entry ``cache_id`` from ``messages`` at background
        priority (``options``: ``cache_id``, ``tools``, ``template_kwargs``,
        ``template_override``, ``persist``, ``salt``); see ``engine._warm``.
        Cancellation withdraws it; the cache keeps what it computed."""
        return await warm(self, messages, **options)

    async def evict(self, cache_id: str) -> Evicted:
        """Drop the entry named ``cache_id`` (and its alternates) from memory
        and disk, between two steps. Cancelling the wait leaves it to run."""
        return await self.link.call(CacheEvict(cache_id))

    async def flush(self) -> int:
        """Write dirty cache entries to disk now; how many were written."""
        return await self.link.call(CacheFlush())

    async def settle(self) -> None:
        """Wait until every withdrawn sequence has left the batch, so its
        cancellation save is filed. Bound it with a cancel scope."""
        await self.link.wait_until(lambda _: self.link.settled)

    @property
    def cache_view(self) -> tuple[CacheView, ...]:
        """The prompt cache's entries as of the last engine step."""
        return self.link.cache.entries

    @property
    def cache_totals(self) -> CacheTotals:
        """The prompt cache's totals (bytes, blocks, hits) as of the last step."""
        return self.link.cache.totals

    def cache_ids_in_use(self) -> set[str]:
        """Cache ids named by requests that are queued or running."""
        return self.link.cache_ids_in_use()

    # --- observation and lifecycle -----------------------------------------------

    def health(self) -> Health:
        """The engine's condition for ``/health``."""
        return self.link.health()

    def state(self) -> EngineState:
        return self.link.state()

    async def wait_until(self, predicate: Callable[[EngineState], bool]) -> EngineState:
        """Wait until ``predicate(state)`` holds, re-checking whenever the
        engine's state changes (each step, submit, withdrawal). For tests
        and observability; cancel it with an ordinary scope."""
        return await self.link.wait_until(predicate)

    def watch(
        self, max_buffer: int = 256, waiting_every: float = WAITING_EVERY
    ) -> trio.MemoryReceiveChannel[RequestNote]:
        """A channel of ``RequestNote`` values for every request: prefill
        progress, failures contained on the host thread, cache seeds, waits
        (repeated every ``waiting_every`` seconds while a request waits),
        admissions after a wait and warms, as the engine delivers them. The
        engine never waits for the watcher: when ``max_buffer`` notes are
        unread, new ones are dropped. One watcher at a time; closing the
        channel ends it."""
        return self.link.watch(max_buffer, waiting_every)

    def close_nowait(self, why: str = "the engine shut down") -> None:
        """Stop admitting; fail every queued and running request with
        ``EngineClosed(why)``. The host loop stops at its next exchange."""
        self.link.close_nowait(why)


async def run_engine(
    config: EngineConfig,
    backend_factory: BackendFactory,
    *,
    host: HostRunner = in_thread,
    task_status: trio.TaskStatus[Engine] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run an engine until cancelled; use with ``nursery.start``.

    ``backend_factory(config)`` builds the backend where the host loop runs
    (``host``: on its own thread by default; ``host.loop.inline`` runs it as
    a Trio task, for backends that need no thread). ``task_status.started``
    gets the ``Engine`` only after the model has loaded, so "ready" is real.
    Cancelling this task fails every live request with ``EngineClosed``;
    the host loop finishes its current step, files cancellation saves,
    flushes and closes the backend.

    Raises ``ModelLoadError`` before ready; after it ``EngineFailure`` when
    the engine stops working (its host loop died, or ``max_step_failures``
    model steps failed in a row) - every live request was failed with it.
    Neither comes wrapped in an exception group.
    """
    link = HostLink(config.scheduling, config.memory, EngineMetrics())
    died: list[GezelError] = []

    async def run_host() -> None:
        try:
            await host(link, lambda: backend_factory(config), config)
        except Exception as exc:
            # Every request hears why at once; the caller below, unwrapped
            # (raised here, the nursery would wrap it in a group).
            died.append(_failure(link, exc))
        finally:
            link.close_nowait()
            link.is_loaded.set()  # a load that failed wakes the wait below

    replies: ReplyLedger | None = None
    kept: Path | None = None
    try:
        # run_host closes the link however it ends, cancellation included.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_host)
            await link.is_loaded.wait()
            if link.loaded is not None and not died:
                info = link.loaded.info
                fingerprint = info.fingerprint or info.model_id
                persist = config.cache.persist_dir
                # Without a directory the key is fresh random bytes: no file,
                # so no thread hop (0.2 ms of every engine's start).
                secret = (
                    load_secret(None)
                    if persist is None
                    else await trio.to_thread.run_sync(load_secret, persist)
                )
                seal = ReplySeal(secret, fingerprint)
                if config.shaping.reply_ledger_tokens:
                    replies = ReplyLedger(
                        config.shaping.reply_ledger_tokens, info.think_markers, seal
                    )
                    if config.cache.persist_dir is not None:
                        digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
                        kept = config.cache.persist_dir / f"replies-{digest}.bin"
                        await trio.to_thread.run_sync(load_ledger, replies, kept)
                task_status.started(
                    Engine(config, link, Preparer(link.loaded, config, link.metrics, replies, seal))
                )
    finally:
        if replies is not None and kept is not None:
            # Bounded: a ledger of 1M ids is a few MB.
            with trio.move_on_after(_LEDGER_SAVE_SECONDS, shield=True):
                await trio.to_thread.run_sync(_save_ledger, replies, kept)
    if died:
        raise died[0]
    if link.failure is not None:
        raise link.failure  # too many failed model steps


def _save_ledger(replies: ReplyLedger, path: Path) -> None:
    try:
        dump_ledger(replies, path)
    except OSError as exc:
        log.warning("cannot write the reply ledger to %s: %s", path, exc)


def _failure(link: HostLink, exc: Exception) -> GezelError:
    """What the caller hears when the host loop raised ``exc``."""
    if link.loaded is None:
        if isinstance(exc, GezelError):
            return exc
        load = ModelLoadError(f"could not load the model: {type(exc).__name__}: {exc}")
        load.__cause__ = exc
        return load
    # The host loop died: every request hears why, and so does the caller.
    log.critical("the engine's host thread died", exc_info=exc)
    death = EngineFailure(f"the engine's host thread died: {type(exc).__name__}: {exc}")
    death.__cause__ = exc
    link.die(death)
    return death


async def _supervised(
    config: EngineConfig,
    backend_factory: BackendFactory,
    host: HostRunner,
    failed: list[Exception],
    owner: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[Engine],
) -> None:
    """``run_engine`` for ``open_engine``: a failure before ready comes out
    of ``nursery.start`` as it is; one after it is kept for ``open_engine``
    to raise, and cancels the block."""
    ready = False

    class Status:
        def started(self, value: Engine | None = None) -> None:
            nonlocal ready
            assert value is not None
            ready = True
            task_status.started(value)

    try:
        await run_engine(config, backend_factory, host=host, task_status=Status())
    except Exception as exc:
        if not ready:
            raise
        failed.append(exc)
        owner.cancel()


@asynccontextmanager
async def open_engine(
    config: EngineConfig,
    backend_factory: BackendFactory,
    *,
    host: HostRunner = in_thread,
) -> AsyncIterator[Engine]:
    """``async with open_engine(config, backend_factory) as engine:`` - an
    engine scoped to the block. Leaving the block closes it: queued and
    running requests fail with ``EngineClosed`` and the host loop stops
    after its current step.

    Raises what ``run_engine`` raises (``ModelLoadError`` instead of
    entering the block; ``EngineFailure``, after cancelling the block) and
    whatever the block raises, each as itself: no ``Exception`` comes out
    wrapped in an exception group. ``Cancelled`` and ``KeyboardInterrupt``
    travel as Trio's nurseries carry them."""
    failed: list[Exception] = []
    async with trio.open_nursery() as nursery:
        try:
            engine: Engine = await nursery.start(
                partial(_supervised, config, backend_factory, host, failed, nursery.cancel_scope)
            )
        except Exception as exc:
            failed.append(exc)
        else:
            try:
                yield engine
            except Exception as exc:
                failed.insert(0, exc)  # the block's own error first
            finally:
                engine.close_nowait()
    if failed:
        raise failed[0]
