"""The engine's host thread: the only place a backend (and so MLX) is touched.

``run_host`` is the body of the engine's single long
``trio.to_thread.run_sync`` call. It loads the backend, then loops: exchange
the last step's events for new orders with the Trio side (one
``trio.from_thread.run_sync`` per step), apply the orders, step the backend,
turn its tokens into text events. When nothing is running it blocks in
``trio.from_thread.run(link.wait_for_work)``, so an idle engine costs nothing
and needs no polling.

Cancellation: the thread cannot be interrupted mid-step. The Trio side answers
the next exchange with ``stop`` once the engine task is cancelled or closing,
and an idle wait raises ``trio.Cancelled`` in this thread, which propagates
out after the backend is closed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import attrs
import trio

from .backend import Admission, Backend, Detokenizer, ModelInfo, PromptRenderer, TokenOut
from .errors import EngineFailure
from .events import Delta, Event, Failed, Finished, FinishReason, Progress, Usage
from .text import TextFilter

__all__ = ["EngineLink", "Orders", "StepReport", "run_host"]


@attrs.frozen
class StepReport:
    """What one step produced, per request id; ``ended`` lists sequences that
    left the backend by themselves (their last event is in ``events``)."""

    events: tuple[tuple[int, Event], ...] = ()
    ended: tuple[int, ...] = ()


@attrs.frozen
class Orders:
    stop: bool = False
    remove: tuple[int, ...] = ()
    admit: tuple[Admission, ...] = ()


class EngineLink(Protocol):
    """The Trio side, as the host thread sees it. ``ready`` and ``exchange``
    are called with ``trio.from_thread.run_sync``; ``wait_for_work`` with
    ``trio.from_thread.run``."""

    def ready(self, info: ModelInfo, renderer: PromptRenderer) -> None: ...
    def exchange(self, report: StepReport) -> Orders: ...
    async def wait_for_work(self) -> None: ...


@attrs.define
class _Sequence:
    prompt_len: int
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
            prompt_tps = self.prompt_len / (first - self.admitted_at)
        gen_tps = 0.0
        if first is not None and last is not None and last > first:
            gen_tps = (self.generated - 1) / (last - first)
        return Usage(
            input_tokens=self.prompt_len,
            output_tokens=self.generated,
            cached_tokens=0,
            prompt_tps=round(prompt_tps, 2),
            generation_tps=round(gen_tps, 2),
        )


class _Host:
    """Per-sequence text state around a backend; lives on the host thread."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.seqs: dict[int, _Sequence] = {}
        self._markers = backend.info.framing_markers
        self._eos = backend.info.eos_ids

    def apply(self, orders: Orders) -> None:
        if orders.remove:
            gone = [rid for rid in orders.remove if self.seqs.pop(rid, None) is not None]
            if gone:
                self.backend.remove(gone)
        if orders.admit:
            now = time.perf_counter()
            for adm in orders.admit:
                self.seqs[adm.rid] = _Sequence(
                    prompt_len=len(adm.request.prompt),
                    detok=self.backend.detokenizer(),
                    text=TextFilter(adm.request.stop, self._markers),
                    admitted_at=now,
                )
            self.backend.insert(orders.admit)

    def step(self) -> StepReport:
        try:
            out = self.backend.step()
        except Exception as exc:  # mapped: every sequence in the batch fails
            return self._fail_all(exc)
        events: list[tuple[int, Event]] = [
            (p.rid, Progress(p.done, p.total)) for p in out.prefill if p.rid in self.seqs
        ]
        ended: list[int] = []
        stopped_by_text: list[int] = []
        now = time.perf_counter()
        for tok in out.tokens:
            seq = self.seqs.get(tok.rid)
            if seq is None:
                continue
            reason = self._advance(seq, tok, now, events)
            if reason is not None:
                events.append((tok.rid, Finished(reason, seq.usage())))
                ended.append(tok.rid)
                del self.seqs[tok.rid]
                if tok.finish is None:
                    stopped_by_text.append(tok.rid)
        if stopped_by_text:
            self.backend.remove(stopped_by_text)
        return StepReport(tuple(events), tuple(ended))

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
        events.append((tok.rid, Delta(text, (tok.token,), seq.usage())))
        return reason

    def _fail_all(self, exc: Exception) -> StepReport:
        err = EngineFailure(f"the model step failed: {type(exc).__name__}: {exc}")
        rids = tuple(self.seqs)
        self.seqs.clear()
        self.backend.reset()
        return StepReport(tuple((rid, Failed(err)) for rid in rids), rids)


def run_host(link: EngineLink, make_backend: Callable[[], Backend]) -> None:
    """Body of the host thread; returns when the engine orders ``stop``."""
    backend = make_backend()
    try:
        trio.from_thread.run_sync(link.ready, backend.info, backend.renderer)
        host = _Host(backend)
        report = StepReport()
        while True:
            orders = trio.from_thread.run_sync(link.exchange, report)
            if orders.stop:
                return
            host.apply(orders)
            if host.seqs:
                report = host.step()
            else:
                report = StepReport()
                trio.from_thread.run(link.wait_for_work)
    finally:
        backend.close()
