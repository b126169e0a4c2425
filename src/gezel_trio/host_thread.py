"""The engine's host thread: the only place a backend (and so MLX) is touched.

``run_host`` is the body of the engine's single long
``trio.to_thread.run_sync`` call. It loads the backend, then loops: exchange
the last step's events for new orders with the Trio side (one
``trio.from_thread.run_sync`` per step), apply the orders, step the backend,
turn its tokens into text events. When nothing is running it blocks in
``trio.from_thread.run(link.wait_for_work)``, so an idle engine costs nothing
and needs no polling.

The prompt cache (``PromptCache``) lives here too, beside the states it keeps:
admission seeds each sequence from it, segment ends capture snapshots, and
every ending - finished, stopped by text, withdrawn, failed - goes through it
exactly once, which is what releases its pins.

Cancellation: the thread cannot be interrupted mid-step. The Trio side answers
the next exchange with ``stop`` once the engine task is cancelled or closing;
the thread then applies the final removals (filing cancellation snapshots),
flushes dirty cache entries to disk and returns. An idle wait raises
``trio.Cancelled`` in this thread, which propagates out after the same flush.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import trio

from .backend import (
    Backend,
    Captured,
    ConstraintCompiler,
    Detokenizer,
    ModelInfo,
    PromptRenderer,
    TokenOut,
)
from .config import EngineConfig
from .errors import EngineFailure
from .events import Delta, Event, Failed, Finished, FinishReason, Progress, TokenLogprob, Usage
from .persist import DiskCache
from .prompt_cache import CacheSnapshot, PromptCache
from .request import GenerationRequest, Priority
from .text import TextFilter

__all__ = [
    "CacheEvict",
    "CacheFlush",
    "CacheInspect",
    "EngineLink",
    "HostCommand",
    "Observer",
    "Orders",
    "Point",
    "StepReport",
    "run_host",
    "run_host_inline",
]

log = logging.getLogger("gezel_trio.host")


@attrs.frozen
class CacheEvict:
    cache_id: str


@attrs.frozen
class CacheFlush:
    pass


@attrs.frozen
class CacheInspect:
    cache_id: str


HostCommand = CacheEvict | CacheFlush | CacheInspect


@attrs.frozen
class StepReport:
    """What one step produced, per request id; ``ended`` lists sequences that
    left the backend by themselves (their last event is in ``events``).
    ``cache_view`` is set when the prompt cache changed; ``replies`` answer
    the previous orders' commands."""

    events: tuple[tuple[int, Event], ...] = ()
    ended: tuple[int, ...] = ()
    replies: tuple[tuple[int, Any], ...] = ()
    cache_view: CacheSnapshot | None = None
    memory: int | None = None


@attrs.frozen
class Orders:
    """Before the next step: remove, run commands, admit, then step ``lane``
    (``None``: nothing to step). ``parked``/``resumed`` are for observers."""

    stop: bool = False
    remove: tuple[int, ...] = ()
    admit: tuple[tuple[int, GenerationRequest], ...] = ()
    commands: tuple[tuple[int, HostCommand], ...] = ()
    lane: Priority | None = None
    parked: tuple[int, ...] = ()
    resumed: tuple[int, ...] = ()


class EngineLink(Protocol):
    """The Trio side, as the host thread sees it. ``ready`` and ``exchange``
    are called with ``trio.from_thread.run_sync``; ``wait_for_work`` with
    ``trio.from_thread.run``."""

    def ready(
        self, info: ModelInfo, renderer: PromptRenderer, compiler: ConstraintCompiler | None
    ) -> None: ...
    def exchange(self, report: StepReport) -> Orders: ...
    async def wait_for_work(self) -> None: ...


@attrs.define
class _Sequence:
    prompt_len: int
    cached: int
    detok: Detokenizer
    text: TextFilter
    admitted_at: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    generated: int = 0

    def usage(self) -> Usage:
        first, last = self.first_token_at, self.last_token_at
        prompt_tps = 0.0
        if first is not None and first > self.admitted_at:
            prompt_tps = (self.prompt_len - self.cached) / (first - self.admitted_at)
        gen_tps = 0.0
        if first is not None and last is not None and last > first:
            gen_tps = (self.generated - 1) / (last - first)
        return Usage(
            input_tokens=self.prompt_len,
            output_tokens=self.generated,
            cached_tokens=self.cached,
            prompt_tps=round(prompt_tps, 2),
            generation_tps=round(gen_tps, 2),
        )


def make_prompt_cache(backend: Backend, config: EngineConfig) -> PromptCache:
    disk = None
    if config.persist_dir is not None:
        disk = DiskCache(config.persist_dir, backend.info.fingerprint, backend)
    return PromptCache(
        backend,
        model_trimmable=backend.info.trimmable,
        budget_bytes=int(config.cache_budget_mb * 1024 * 1024),
        disk=disk,
        disk_budget_bytes=int(config.disk_cache_budget_mb * 1024 * 1024),
        decode=getattr(backend, "decode", None),
    )


class _Host:
    """Per-sequence text and cache state around a backend, on the host thread."""

    def __init__(
        self, backend: Backend, cache: PromptCache, memory_limit_bytes: int | None = None
    ) -> None:
        self.backend = backend
        self.memory_limit = memory_limit_bytes
        self.cache = cache
        self.seqs: dict[int, _Sequence] = {}
        self._markers = backend.info.framing_markers
        self._eos = backend.info.eos_ids
        self._reported_version = -1
        self._replies: list[tuple[int, Any]] = []
        self._captures: list[int] = []
        self._refused: list[tuple[int, Event]] = []

    def take_captures(self) -> list[int]:
        out, self._captures = self._captures, []
        return out

    def apply(self, orders: Orders) -> None:
        if orders.remove:
            gone = [rid for rid in orders.remove if self.seqs.pop(rid, None) is not None]
            if gone:
                states = self.backend.remove(gone)
                for rid in gone:
                    self.cache.cancelled(rid, states.get(rid))
        for cid, command in orders.commands:
            self._replies.append((cid, self._run(command)))
        if orders.admit:
            now = time.perf_counter()
            admissions = []
            for rid, request in orders.admit:
                admission, seed = self.cache.admit(rid, request)
                admissions.append(admission)
                self.seqs[rid] = _Sequence(
                    prompt_len=len(request.prompt),
                    cached=seed.reuse,
                    detok=self.backend.detokenizer(),
                    text=TextFilter(request.stop, self._markers),
                    admitted_at=now,
                )
            refused = self.backend.insert(admissions)
            for rid, err in refused.items():
                # Refused at insertion (a grammar this tokenizer cannot
                # serve): the request fails alone, the batch goes on.
                self.seqs.pop(rid, None)
                self.cache.cancelled(rid, None)
                self._refused.append((rid, Failed(err)))

    def _run(self, command: HostCommand) -> Any:
        match command:
            case CacheEvict(cache_id=cache_id):
                return self.cache.evict(cache_id)
            case CacheFlush():
                return self.cache.flush()
            case CacheInspect(cache_id=cache_id):
                return (self.cache.inspect(cache_id), self.cache.pinned(cache_id))

    def report(
        self, events: tuple[tuple[int, Event], ...] = (), ended: tuple[int, ...] = ()
    ) -> StepReport:
        view = None
        if self.cache.version != self._reported_version:
            self._reported_version = self.cache.version
            view = self.cache.view()
        replies, self._replies = tuple(self._replies), []
        memory = self.backend.memory_in_use() if self.memory_limit is not None else None
        if memory is not None and self.memory_limit and memory > 0.85 * self.memory_limit:
            self.backend.reclaim()  # under pressure: give cached buffers back now
        if self._refused:
            events = (*self._refused, *events)
            ended = (*(rid for rid, _ in self._refused), *ended)
            self._refused = []
        return StepReport(events, ended, replies, view, memory)

    def step(self, lane: Priority) -> StepReport:
        try:
            out = self.backend.step(lane)
        except Exception as exc:  # mapped: every sequence in the batch fails
            return self._fail_all(exc)
        events: list[tuple[int, Event]] = []
        for p in out.prefill:
            if p.rid not in self.seqs:
                continue
            events.append((p.rid, Progress(p.done, p.total)))
            if p.segment_end and self.cache.wants_capture(p.rid, p.done):
                cap = self.backend.capture(p.rid)
                if cap is not None:
                    self.cache.captured(p.rid, p.done, cap)
                    self._captures.append(p.rid)
        ended: list[int] = []
        stopped_by_text: list[int] = []
        now = time.perf_counter()
        for tok in out.tokens:
            seq = self.seqs.get(tok.rid)
            if seq is None:
                continue
            reason = self._advance(seq, tok, now, events)
            if reason is None:
                continue
            events.append((tok.rid, Finished(reason, seq.usage())))
            ended.append(tok.rid)
            del self.seqs[tok.rid]
            if tok.finish is None:
                stopped_by_text.append(tok.rid)
            else:
                cap = Captured(tok.state, tok.state_tokens) if tok.state is not None else None
                self.cache.finished(tok.rid, cap)
        if stopped_by_text:
            states = self.backend.remove(stopped_by_text)
            for rid in stopped_by_text:
                self.cache.finished(rid, states.get(rid))
        if ended and not self.seqs:
            self.backend.reclaim()  # a turn ended and nothing runs: give buffers back
        return self.report(tuple(events), tuple(ended))

    def _advance(
        self, seq: _Sequence, tok: TokenOut, now: float, events: list[tuple[int, Event]]
    ) -> FinishReason | None:
        seq.generated += 1
        if seq.first_token_at is None:
            seq.first_token_at = now
        seq.last_token_at = now
        if not (tok.finish == "stop" and tok.token in self._eos):
            seq.detok.add_token(tok.token)
        if tok.finish is not None:
            seq.detok.finalize()
        text = seq.text.feed(seq.detok.last_segment)
        reason: FinishReason | None = "stop" if seq.text.stopped else tok.finish
        if reason is not None:
            text += seq.text.flush()
        logprobs: tuple[TokenLogprob, ...] = ()
        if tok.logprob is not None:
            top = tuple((self.backend.token_text(t), lp) for t, lp in tok.top)
            logprobs = (TokenLogprob(self.backend.token_text(tok.token), tok.logprob, top),)
        events.append((tok.rid, Delta(text, (tok.token,), seq.usage(), logprobs)))
        return reason

    def _fail_all(self, exc: Exception) -> StepReport:
        log.exception("backend step failed; failing %d sequences", len(self.seqs))
        err = EngineFailure(f"the model step failed: {type(exc).__name__}: {exc}")
        rids = tuple(self.seqs)
        self.seqs.clear()
        self.backend.reset()
        for rid in rids:
            self.cache.cancelled(rid, None)
        return self.report(tuple((rid, Failed(err)) for rid in rids), rids)

    def shutdown(self) -> None:
        """Last act on the thread: file what is still running, flush to disk."""
        if self.seqs:
            rids = list(self.seqs)
            self.seqs.clear()
            states = self.backend.remove(rids)
            for rid in rids:
                self.cache.cancelled(rid, states.get(rid))
        self.cache.flush()


@attrs.frozen
class Point:
    """A named moment in the engine's life, for observers (``gezel_trio.testing``):
    ``admitted``, ``prefill`` (chunk ``index`` of a request done), ``decode``
    (token ``index`` emitted), ``snapshot`` (a snapshot captured), ``finished``,
    ``removed`` (a withdrawn request left the batch), ``parked``, ``resumed``,
    ``shutdown`` (the engine began to stop)."""

    kind: str
    rid: int | None = None
    index: int = 0


class Observer(Protocol):
    async def at(self, point: Point) -> None:
        """Called with the world stopped at ``point``; the engine resumes when
        it returns."""
        ...


def _memory_limit(config: EngineConfig) -> int | None:
    limit = config.memory_limit_mb
    return None if limit is None else int(limit * 1024 * 1024)


def run_host(link: EngineLink, make_backend: Callable[[], Backend], config: EngineConfig) -> None:
    """Body of the host thread; returns when the engine orders ``stop``."""
    backend = make_backend()
    host: _Host | None = None
    try:
        host = _Host(backend, make_prompt_cache(backend, config), _memory_limit(config))
        trio.from_thread.run_sync(link.ready, backend.info, backend.renderer, backend.compiler)
        report = host.report()
        while True:
            orders = trio.from_thread.run_sync(link.exchange, report)
            host.apply(orders)
            if orders.stop:
                return
            if host.seqs and orders.lane is not None:
                report = host.step(orders.lane)
            elif orders.commands or host.cache.version != host._reported_version:
                report = host.report()
            else:
                report = host.report()
                trio.from_thread.run(link.wait_for_work)
    finally:
        try:
            if host is not None:
                host.shutdown()
        finally:
            backend.close()


async def run_host_inline(
    link: EngineLink,
    make_backend: Callable[[], Backend],
    config: EngineConfig,
    observer: Observer | None = None,
) -> None:
    """The same loop as ``run_host``, as a Trio task: for backends that need no
    thread (the scripted testing backend), so a test runs the whole engine in
    one Trio run under ``MockClock``. ``observer.at`` is awaited at each named
    point, which stops the world there. Cancellation: the loop stops at its
    next checkpoint; the final removals and the flush run, unshielded and
    synchronous, before ``Cancelled`` propagates."""
    backend = make_backend()
    host: _Host | None = None
    chunks: dict[int, int] = {}
    try:
        host = _Host(backend, make_prompt_cache(backend, config), _memory_limit(config))
        link.ready(backend.info, backend.renderer, backend.compiler)
        report = host.report()
        while True:
            orders = link.exchange(report)
            host.apply(orders)
            points = [Point("removed", rid) for rid in orders.remove]
            points += [Point("admitted", rid) for rid, _ in orders.admit]
            points += [Point("parked", rid) for rid in orders.parked]
            points += [Point("resumed", rid) for rid in orders.resumed]
            idle = False
            if orders.stop:
                points.append(Point("shutdown"))
            elif host.seqs and orders.lane is not None:
                report = host.step(orders.lane)
                points += _points(report, host, chunks)
            else:
                idle = not orders.commands and host.cache.version == host._reported_version
                report = host.report()
            if observer is not None:
                for point in points:
                    await observer.at(point)
            if orders.stop:
                return
            if idle:
                await link.wait_for_work()
            else:
                await trio.lowlevel.checkpoint()
    finally:
        try:
            if host is not None:
                host.shutdown()
        finally:
            backend.close()


def _points(report: StepReport, host: _Host, chunks: dict[int, int]) -> list[Point]:
    out = [Point("snapshot", rid) for rid in host.take_captures()]
    for rid, event in report.events:
        match event:
            case Progress():
                chunks[rid] = chunks.get(rid, 0) + 1
                out.append(Point("prefill", rid, chunks[rid]))
            case Delta(usage=usage):
                out.append(Point("decode", rid, usage.output_tokens))
            case Finished() | Failed():
                chunks.pop(rid, None)
                out.append(Point("finished", rid))
    return out
