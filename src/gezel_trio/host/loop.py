"""The engine's host loop: the only place a backend (and so MLX) is touched.

One driver, ``_drive``, holds the loop: exchange the last step's report for
new orders with the Trio side, apply the orders, step the backend, turn its
tokens into text events; with nothing to do, wait for work. It is a
synchronous generator that *yields* what it needs from the Trio side
(``_Exchange``, ``_Idle``, an observer's ``_At``) and does no I/O itself, so
one loop runs two ways:

* ``in_thread`` - the engine's single long ``trio.to_thread.run_sync`` call,
  reaching the Trio side through its Trio token once per step. While it
  decodes it runs one report ahead (``_Pipe``): it hands the step's report
  over and steps on with the orders that answered the report before, so a
  step never waits for the Trio thread to wake, run and hand the GIL back
  (1.4 ms of a 12 ms step, of which 0.16 ms was the exchange itself). It
  waits for the answer to its report when it has nothing left to step in
  the lane, or when the Trio side has news for it (``link.wants_answer``: a
  request, a withdrawal, a command, the close), so new work is admitted at
  the same step as before. An idle engine blocks in
  ``trio.from_thread.run(link.wait_for_work)``, so it costs nothing and
  needs no polling.
* ``inline(observer)`` - the same loop as a Trio task, for backends that need
  no thread (``gezel_trio.testing``), so a whole engine runs in one Trio run
  under ``MockClock``.

The prompt cache (``PromptCache``) lives here too, beside the states it keeps:
admission seeds each sequence from it, segment ends capture snapshots, and
every ending - finished, stopped by text, withdrawn, failed - goes through it
exactly once, which is what releases its pins.

Cancellation: a step is never interrupted. Before each exchange the threaded
loop asks ``trio.from_thread.check_cancelled()``; an idle wait is cancelled
where it waits. Either way ``trio.Cancelled`` unwinds the loop, which files a
cancellation save for every sequence still running, flushes dirty cache
entries to disk within ``shutdown_timeout`` and closes the backend before
``Cancelled`` propagates. The Trio side also ends the loop with
``Orders.stop`` (closing, or the engine failed).
"""

from __future__ import annotations

import ctypes
import logging
import queue
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, Protocol

import attrs
import outcome
import trio

from ..core.backend import Backend, Captured, Detokenizer, FailsFromAfar, TokenOut
from ..core.cache_store import BLOCK_TOKENS
from ..core.config import EngineConfig
from ..core.errors import EngineFailure, GezelError, RequestFailed
from ..core.events import (
    CacheMiss,
    Delta,
    Event,
    Failed,
    Finished,
    FinishReason,
    Progress,
    Started,
    TokenLogprob,
    Usage,
)
from ..core.request import GenerationRequest, Priority
from ..shaping.text import TextFilter
from ..tuning import plain
from ..tuning.gil import PrefillSwitch
from .block_events import BlockEvents, BlockEventsFactory
from .exchange import (
    CommandFailed,
    EngineLink,
    Observer,
    Orders,
    Point,
    StepReport,
)
from .persist import DiskCache
from .prompt_cache import PromptCache

__all__ = ["HostRunner", "in_thread", "inline"]

log = logging.getLogger("gezel_trio.host")


@attrs.define
class _Sequence:
    lane: Priority
    prompt_len: int
    cached: int
    detok: Detokenizer
    text: TextFilter
    admitted_at: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    generated: int = 0
    drafted: int = 0  # tokens proposed by speculation, and accepted
    accepted: int = 0
    miss: CacheMiss | None = None
    pinned: tuple[int, int] = (0, 0)  # prompt tokens written into pins: 5m, 1h

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
            cache_miss=self.miss,
            pinned_5m_tokens=self.pinned[0],
            pinned_1h_tokens=self.pinned[1],
            draft_tokens=self.drafted,
            accepted_draft_tokens=self.accepted,
        )


@attrs.define
class _Group:
    """Sequences of one prompt sharing its prefill (``CacheRequest.prefill_group``):
    ``prefiller`` computes the prompt; the others wait here until its state at
    ``len(prompt) - 1`` is in the prompt cache, then seed from it, so they
    prefill nothing and join the batch at the step the prefiller starts
    decoding."""

    prefiller: int
    waiting: list[tuple[int, GenerationRequest]] = attrs.field(factory=list)


def make_prompt_cache(
    backend: Backend, config: EngineConfig, blocks: BlockEvents | None = None
) -> PromptCache:
    disk = None
    if config.cache.persist_dir is not None:
        disk = DiskCache(config.cache.persist_dir, backend.info.fingerprint, backend.states)
    return PromptCache(
        backend.states,
        model_trimmable=backend.info.trimmable,
        budget_bytes=int(config.cache.budget_mb * 1024 * 1024),
        disk=disk,
        disk_budget_bytes=int(config.cache.disk_budget_mb * 1024 * 1024),
        decode=getattr(backend, "decode", None),
        # With an add-on told of the blocks (host.block_events): it hashes them.
        block_hasher=blocks.hash_block if blocks is not None else None,
    )


class _Host:
    """Per-sequence text and cache state around a backend, on the host thread.

    The failure boundaries live here (docs/architecture.md, "Failure
    boundaries"). Whatever is built or done for one sequence - its cache
    seed, detokenizer and text filter, its sampler and logits processors
    (the backend reports those in ``StepOutput.failed``), snapshot captures
    and its final save - runs inside ``_fail``'s boundary: an exception fails
    that request alone and takes it out of the batch. Only the shared model
    step (``Backend.step``) fails the sequences of its lane. Anything else
    that raises is a bug in the host itself: the thread dies, and the engine
    fails every request with ``EngineFailure``.
    """

    def __init__(
        self,
        backend: Backend,
        cache: PromptCache,
        memory_limit_bytes: int | None = None,
        shutdown_timeout: float | None = None,
        observed: bool = False,
        write_behind: bool = False,
        blocks: BlockEvents | None = None,
        prefill_switch: PrefillSwitch | None = None,
    ) -> None:
        self.backend = backend
        # A shorter GIL switch interval while a prompt prefills (``tuning.gil``).
        self.prefill_switch = prefill_switch or PrefillSwitch(None)
        self.memory_limit = memory_limit_bytes
        self.shutdown_timeout = shutdown_timeout
        self.write_behind_on = write_behind and cache.disk is not None
        # A busy host stages its next write behind no sooner than this
        # (time.perf_counter()): at most a tenth of its time goes to them.
        self._behind_next = 0.0
        self.cache = cache
        # Told the cache's block changes once per step (report).
        self.blocks = blocks
        self.seqs: dict[int, _Sequence] = {}
        self._markers = backend.info.framing_markers
        self._eos = backend.info.eos_ids
        self._reported_version = -1
        self._replies: list[tuple[int, Any]] = []
        # Snapshot captures since the observer last looked; kept only when
        # one looks (``_points``), so an unobserved host never accumulates them.
        self._observed = observed
        self._captures: list[int] = []
        self._events: list[tuple[int, Event]] = []
        self._ended: list[int] = []
        # (rid, reused tokens, seed source) of each admission since the last report.
        self._seeded: list[tuple[int, int, str]] = []
        self._stepped = False
        # A model step ran since the buffer cache was last given back.
        self._untrimmed = False
        self._step_failure: str | None = None
        # Prefill sharing (n > 1): groups by id, and each prefiller's group.
        self._groups: dict[int, _Group] = {}
        self._prefilling: dict[int, int] = {}

    def runs_in(self, lane: Priority) -> bool:
        """A sequence of ``lane`` is in the batch."""
        return any(seq.lane == lane for seq in self.seqs.values())

    def take_captures(self) -> list[int]:
        out, self._captures = self._captures, []
        return out

    # --- the per-request failure boundary ------------------------------------

    def _fail(self, rid: int, where: str, exc: Exception) -> None:
        """``rid`` fails alone: out of the batch, its pins released, a
        ``Failed`` event for its caller, and a log line with the traceback."""
        log.error("request %d failed in %s; the batch goes on", rid, where, exc_info=exc)
        if self.seqs.pop(rid, None) is not None:
            self.backend.remove([rid])  # still in the batch: its state is not saved
        self._left(rid)
        self._quietly(rid, "releasing its cache pins", self.cache.cancelled, rid, None)
        err = (
            exc
            if isinstance(exc, GezelError)
            else RequestFailed(
                f"this request failed on the engine ({where}): {type(exc).__name__}: {exc}"
            )
        )
        if err is not exc:
            # The traceback travels with the event: the Trio side prints it
            # (the stdout protocol's tagged lines), never this thread.
            err.__cause__ = exc
        self._events.append((rid, Failed(err)))
        self._ended.append(rid)

    def _quietly(self, rid: int, where: str, fn: Callable[..., object], *args: Any) -> None:
        """Work for a request that already ended (its caller left): a failure
        is logged with the request id and harms nobody."""
        try:
            fn(*args)
        except Exception:
            log.exception("request %d: %s failed; ignored", rid, where)

    # --- orders -------------------------------------------------------------

    def apply(self, orders: Orders) -> None:
        if orders.remove:
            self._forget_waiting(orders.remove)
            gone = [rid for rid in orders.remove if self.seqs.pop(rid, None) is not None]
            if gone:
                states = self.backend.remove(gone)
                for rid in gone:
                    self._quietly(
                        rid, "its cancellation save", self.cache.cancelled, rid, states.get(rid)
                    )
                for rid in gone:
                    self._left(rid)
        for cid, command in orders.commands:
            try:
                reply = command.run(self.cache)
            except Exception as exc:
                log.exception("host command %s failed", type(command).__name__)
                reply = CommandFailed(f"{type(exc).__name__}: {exc}")
            self._replies.append((cid, reply))
        if orders.admit:
            self._admit(orders.admit)

    # --- prefill sharing (n > 1) ---------------------------------------------

    def _admit(self, admit: Sequence[tuple[int, GenerationRequest]]) -> None:
        """Insert what can start now; a group member whose sibling is still
        computing the shared prompt waits for it (``_Group``)."""
        now: list[tuple[int, GenerationRequest]] = []
        for rid, request in admit:
            gid = request.cache.prefill_group if request.cache is not None else None
            group = self._groups.get(gid) if gid is not None else None
            if group is not None:
                group.waiting.append((rid, request))
                continue
            if gid is not None:
                self._groups[gid] = _Group(rid)
                self._prefilling[rid] = gid
            now.append((rid, request))
        self._insert(now)

    def _prefilled(self, rid: int) -> None:
        """``rid`` computed its group's prompt (to ``len(prompt) - 1``; the
        cache holds it): its waiting siblings start, seeded from there."""
        gid = self._prefilling.pop(rid, None)
        if gid is not None:
            group = self._groups.pop(gid)
            if group.waiting:
                log.info(
                    "request %d: prompt computed once for %d siblings", rid, len(group.waiting)
                )
            self._insert(group.waiting)

    def _left(self, rid: int) -> None:
        """``rid`` left the batch; if it was computing its group's prompt, the
        first waiting sibling takes over (seeded with whatever was saved)."""
        gid = self._prefilling.pop(rid, None)
        if gid is None:
            return
        group = self._groups.pop(gid)
        if group.waiting:
            (nxt, request), *rest = group.waiting
            self._groups[gid] = _Group(nxt, rest)
            self._prefilling[nxt] = gid
            self._insert([(nxt, request)])

    def _forget_waiting(self, rids: Sequence[int]) -> None:
        gone = set(rids)
        for group in self._groups.values():
            group.waiting = [(r, q) for r, q in group.waiting if r not in gone]

    def _insert(self, admit: Sequence[tuple[int, GenerationRequest]]) -> None:
        now = time.perf_counter()
        admissions = []
        ready = []
        seeded = []
        for rid, request in admit:
            try:
                admission, seed = self.cache.admit(rid, request)
                seq = _Sequence(
                    lane=request.priority,
                    prompt_len=len(request.prompt),
                    cached=seed.reuse,
                    detok=self.backend.detokenizer(keep_leading_space=request.continues_text),
                    text=TextFilter(request.stop, self._markers),
                    admitted_at=now,
                    miss=seed.miss,
                    pinned=(seed.pinned_5m, seed.pinned_1h),
                )
            except Exception as exc:
                self._fail(rid, "admission", exc)
                continue
            self.seqs[rid] = seq
            seeded.append((rid, seed.reuse, seed.source))
            admissions.append(admission)
            if rid in self._prefilling and seed.reuse >= len(request.prompt) - 1:
                ready.append(rid)  # the cache already held the shared prompt
        refused = self.backend.insert(admissions) if admissions else {}
        for rid, err in refused.items():
            # Refused at insertion (a sampler or processor that could not be
            # built): the request fails alone, the batch goes on.
            self.seqs.pop(rid, None)
            self._fail(rid, "insertion", err)
        self._seeded += [s for s in seeded if s[0] in self.seqs]
        # The split between cached and computed prompt tokens is known now,
        # before any prefill: streams that report it up front read it here.
        self._events += [
            (rid, Started(self.seqs[rid].usage())) for rid, _, _ in seeded if rid in self.seqs
        ]
        for rid in ready:
            self._prefilled(rid)

    def report(self) -> StepReport:
        if self.blocks is not None:
            self.blocks.publish_nowait(self.cache.store.take_block_log())
        view = None
        if self.cache.version != self._reported_version:
            self._reported_version = self.cache.version
            view = self.cache.delta()
        replies, self._replies = tuple(self._replies), []
        figures = self.backend.figures()
        memory = self.backend.memory_in_use()
        if self.memory_limit and memory > 0.85 * self.memory_limit:
            self.backend.reclaim()  # under pressure: give cached buffers back now
        events, self._events = tuple(self._events), []
        ended, self._ended = tuple(self._ended), []
        seeded, self._seeded = tuple(self._seeded), []
        stepped, self._stepped = self._stepped, False
        failure, self._step_failure = self._step_failure, None
        disk = self.cache.disk
        return StepReport(
            events,
            ended,
            replies,
            view,
            memory,
            stepped=stepped,
            step_failure=failure,
            persistence=disk.problem if disk is not None else None,
            seeded=seeded,
            figures=figures,
        )

    # --- one step -----------------------------------------------------------

    def step(self, lane: Priority) -> StepReport:
        # A sequence without its first token prefills in this step.
        self.prefill_switch.prefilling(
            any(s.first_token_at is None for s in self.seqs.values() if s.lane == lane)
        )
        try:
            out = self.backend.step(lane)
        except Exception as exc:  # the shared step: every sequence in it fails
            self._fail_lane(lane, exc)
            return self.report()
        self._stepped = True
        self._untrimmed = True
        for rid, error in out.failed:
            if rid in self.seqs:
                self._fail(
                    rid,
                    "its own part of the step (sampler, logits processors, image prefill)",
                    error,
                )
        prefilled = []
        for p in out.prefill:
            seq = self.seqs.get(p.rid)
            if seq is None:
                continue
            self._events.append((p.rid, Progress(p.done, p.total)))
            if p.segment_end:
                try:
                    self._capture(p.rid, p.done)
                except Exception as exc:
                    self._fail(p.rid, "a snapshot capture", exc)
                    continue
            if p.rid in self._prefilling and seq.cached + p.done >= seq.prompt_len - 1:
                prefilled.append(p.rid)
        for rid in prefilled:
            self._prefilled(rid)
        stopped_by_text: list[tuple[int, _Sequence, FinishReason]] = []
        now = time.perf_counter()
        for tok in out.tokens:
            seq = self.seqs.get(tok.rid)
            if seq is None:
                continue
            try:
                reason = self._advance(seq, tok, now)
            except Exception as exc:
                self._fail(tok.rid, "turning its tokens into text", exc)
                continue
            if reason is None:
                continue
            del self.seqs[tok.rid]
            if tok.finish is None:
                stopped_by_text.append((tok.rid, seq, reason))
            else:
                cap = Captured(tok.state, tok.state_tokens) if tok.state is not None else None
                self._finish(tok.rid, seq, reason, cap)
        if stopped_by_text:
            states = self.backend.remove([rid for rid, _, _ in stopped_by_text])
            for rid, seq, reason in stopped_by_text:
                self._finish(rid, seq, reason, states.get(rid))
        return self.report()

    def trim_at_idle(self) -> bool:
        """Nothing runs: MLX's buffer cache goes back to the system, once
        per busy spell (never per step: reused buffers are what make a
        busy engine's steps cheap). Called at the exchange after the last
        sequence ended, when the step's own arrays are gone (trimmed in that
        step, what they held came back to the cache as they were freed).
        ``True`` if it trimmed: the figures after it are news."""
        if not self._untrimmed or self.seqs:
            return False
        self._untrimmed = False
        self.backend.reclaim()
        _malloc_trim()
        return True

    def _capture(self, rid: int, done: int) -> None:
        if self.cache.wants_capture(rid, done):
            cap = self.backend.capture(rid)
            if cap is not None:
                self.cache.captured(rid, done, cap)
                if self._observed:
                    self._captures.append(rid)

    def _finish(self, rid: int, seq: _Sequence, reason: FinishReason, cap: Captured | None) -> None:
        self._prefilled(rid)  # (never still computing a shared prompt here; no sibling waits)
        try:
            self.cache.finished(rid, cap)
        except Exception as exc:
            self._fail(rid, "saving its cache entry", exc)
            return
        self._events.append((rid, Finished(reason, seq.usage(), seq.text.matched)))
        self._ended.append(rid)

    def _advance(self, seq: _Sequence, tok: TokenOut, now: float) -> FinishReason | None:
        seq.generated += 1
        seq.drafted += tok.drafted
        seq.accepted += tok.accepted
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
        self._events.append((tok.rid, Delta(text, (tok.token,), seq.usage(), logprobs)))
        return reason

    def _fail_lane(self, lane: Priority, exc: Exception) -> None:
        rids = [rid for rid, seq in self.seqs.items() if seq.lane == lane]
        log.error(
            "the %s lane's model step failed; failing its %d sequences",
            lane,
            len(rids),
            exc_info=exc,
        )
        self._step_failure = f"{type(exc).__name__}: {exc}"
        err = EngineFailure(f"the model step failed: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        for rid in rids:
            del self.seqs[rid]
        self.backend.reset(lane)
        for rid in rids:
            self._quietly(rid, "releasing its cache pins", self.cache.cancelled, rid, None)
            self._events.append((rid, Failed(err)))
            self._ended.append(rid)
        for rid in rids:
            self._left(rid)

    def write_behind(self) -> bool:
        """Between steps: hand one dirty cache entry to the disk's writer
        thread (``PromptCache.write_behind``); ``True`` if one was. An idle
        host writes whatever is dirty; a busy one only entries saved a
        second ago or more (a turn's interim snapshots are replaced by then)
        and stays under a tenth of its time serializing them, so decoding
        keeps its pace."""
        if not self.write_behind_on:
            return False
        start = time.perf_counter()
        if self.seqs and start < self._behind_next:
            return False
        staged = self.cache.write_behind(min_age=BUSY_WRITE_AGE if self.seqs else 0.0)
        if self.seqs:
            # Nothing to write: look again a little later, not every step.
            spent = time.perf_counter() - start
            self._behind_next = start + (10 * spent if staged else BUSY_LOOK_EVERY)
        return staged

    def may_sleep(self) -> bool:
        """Idle, with write-behind on: ``False`` while there is writing to
        do (one entry staged per turn of the loop, so new work is taken
        between them) or in flight (waited for a moment: the stats then say
        the entries are clean), or while a write that landed meanwhile has
        changed the view the Trio side has not seen."""
        if self.write_behind():
            return False
        if self.cache.writes_behind:
            self.cache.collect_behind(BEHIND_POLL)
            return False
        return self.cache.version == self._reported_version

    def shutdown(self) -> None:
        """Last act on the thread: file what is still running, flush to disk
        within ``shutdown_timeout`` seconds (the writes behind in flight
        land first, in the same bound)."""
        if self.seqs:
            rids = list(self.seqs)
            self.seqs.clear()
            states = self.backend.remove(rids)
            for rid in rids:
                self._quietly(
                    rid, "its cancellation save", self.cache.cancelled, rid, states.get(rid)
                )
        timeout = self.shutdown_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self.cache.flush(deadline=deadline)
        finally:
            try:
                self.cache.close_disk(deadline)
            finally:
                if self.blocks is not None:
                    self.blocks.publish_nowait(self.cache.store.take_block_log())
                    self.blocks.close()


# --- the one loop, and the two ways to run it ------------------------------


@attrs.frozen
class _Ready:
    backend: Backend


@attrs.frozen
class _Exchange:
    """Hand ``report`` over; the reply is every answer that has come back
    (``Orders``, oldest first), to apply in order. ``ahead``: the host may
    step on before this report's own answer (a threaded host does, unless
    the Trio side has news); otherwise that answer is among the reply."""

    report: StepReport
    ahead: bool = False


@attrs.frozen
class _Stepped:
    """A model step ran: an inline loop lets other tasks run."""


@attrs.frozen
class _Idle:
    """Nothing to step and nothing to report: wait for work."""


@attrs.frozen
class _At:
    point: Point


_Need = _Ready | _Exchange | _Stepped | _Idle | _At
# Yielded every step: one value each, not one allocation per step.
_STEPPED = _Stepped()
_IDLE = _Idle()


# A busy host writes behind only entries saved this many seconds ago, and
# looks for one at most this often when it found none.
BUSY_WRITE_AGE = 1.0
BUSY_LOOK_EVERY = 0.25
# How long an idle host waits for a write behind in flight before it looks
# for work again: the delay a request arriving meanwhile may see.
BEHIND_POLL = 0.005


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None)
        trim: Callable[[int], int] = libc.malloc_trim  # glibc only
    except (OSError, AttributeError):
        return None
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def _malloc_trim() -> None:
    """Give glibc's free heap pages back to the system (every arena). The
    host thread's arrays are malloc'ed on the CPU; freed, they stayed
    resident in glibc's arenas: RSS rose 434 -> 534 MiB over a 5-minute
    soak with 60-180 MB of live MLX memory. Elsewhere (macOS) nothing to do."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _make_host(
    backend: Backend,
    config: EngineConfig,
    observed: bool,
    blocks: BlockEventsFactory | None = None,
) -> _Host:
    limit = config.memory.limit_mb
    events = blocks(BLOCK_TOKENS) if blocks is not None else None
    try:
        cache = make_prompt_cache(backend, config, events)
    except BaseException:
        if events is not None:
            events.close()
        raise
    return _Host(
        backend,
        cache,
        None if limit is None else int(limit * 1024 * 1024),
        config.cache.shutdown_timeout,
        observed,
        config.cache.write_behind,
        events,
        PrefillSwitch(
            switch_ms / 1000 if (switch_ms := plain(config.tuning).prefill_switch_ms) else None
        ),
    )


def _drive(
    backend: Backend,
    config: EngineConfig,
    observed: bool,
    blocks: BlockEventsFactory | None = None,
) -> Generator[_Need, tuple[Orders, ...] | None, None]:
    """The host loop. It yields what it needs from the Trio side and is sent
    the answer (the ``Orders`` that came back, for an ``_Exchange``; ``None``
    otherwise); it returns when the orders say ``stop``. Closing it (the
    runner was cancelled, or failed) runs the same shutdown: cancellation
    saves, the flush, the backend closed."""
    host: _Host | None = None
    chunks: dict[int, int] = {}
    try:
        host = _make_host(backend, config, observed, blocks)
        yield _Ready(backend)
        report = host.report()
        lane: Priority | None = None
        ahead = False
        while True:
            answers = yield _Exchange(report, ahead)
            assert answers is not None
            for orders in answers:
                host.apply(orders)
                lane = orders.lane
            if any(orders.stop for orders in answers):
                if observed:
                    points = [p for orders in answers for p in _order_points(orders)]
                    for point in [*points, Point("shutdown")]:
                        yield _At(point)
                return
            idle = False
            if host.seqs and lane is not None:
                report = host.step(lane)
                host.write_behind()
                # Step on before this report's answer only while the lane
                # still has work; otherwise the answer says what comes next.
                ahead = host.runs_in(lane)
            else:
                ahead = False
                trimmed = host.trim_at_idle()
                report = host.report()
                # Only an empty report may wait: news (a request refused at
                # insertion, a command's reply, the figures after a trim) is
                # delivered first.
                idle = not report.has_news and not trimmed
                if idle and host.write_behind_on:
                    idle = host.may_sleep()
            if observed:
                points = [p for orders in answers for p in _order_points(orders)]
                for point in [*points, *_points(report, host, chunks)]:
                    yield _At(point)
            yield _IDLE if idle else _STEPPED
    finally:
        try:
            if host is not None:
                host.prefill_switch.prefilling(False)
                host.shutdown()
        finally:
            backend.close()


def _order_points(orders: Orders) -> list[Point]:
    return [
        *(Point("removed", rid) for rid in orders.remove),
        *(Point("admitted", rid) for rid, _ in orders.admit),
        *(Point("parked", rid) for rid in orders.parked),
        *(Point("resumed", rid) for rid in orders.resumed),
    ]


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


class HostRunner(Protocol):
    """How the engine runs its host loop: ``in_thread`` (the default) or
    ``inline(observer)``. Returns when the loop stops; anything that escapes
    it is a bug in the host, which kills the engine."""

    def __call__(
        self, link: EngineLink, make_backend: Callable[[], Backend], config: EngineConfig
    ) -> Awaitable[None]: ...


async def in_thread(
    link: EngineLink,
    make_backend: Callable[[], Backend],
    config: EngineConfig,
    *,
    blocks: BlockEventsFactory | None = None,
) -> None:
    """Run the host loop on one thread for the engine's whole life (MLX
    streams are thread-local). The thread is never abandoned: cancelling this
    ends the loop at its next exchange or idle wait, after the shutdown.
    ``blocks`` makes the add-on told of the prompt cache's blocks, on that
    thread (``host.block_events``; ``addons.host_runner`` attaches it)."""
    pipe = _Pipe(trio.lowlevel.current_trio_token(), link)
    await trio.to_thread.run_sync(
        _in_thread, pipe, make_backend, config, blocks, thread_name="gezel-mlx-host"
    )


class _Pipe:
    """Reports to the Trio side without waiting, and the orders answering
    them back, in order (``_Exchange``). Each report is answered by
    ``link.exchange`` in a ``run_sync_soon`` callback on the Trio thread;
    the host thread collects the answers from a queue. At most one report
    is left unanswered, so the host is never more than one step ahead and
    reports never pile up. An exchange that raised re-raises on the host
    thread when its answer is collected, as ``trio.from_thread`` would."""

    def __init__(self, token: trio.lowlevel.TrioToken, link: EngineLink) -> None:
        self.token = token
        self.link = link
        self._answers: queue.SimpleQueue[outcome.Outcome[Orders]] = queue.SimpleQueue()
        self.in_flight = 0

    def exchange(self, report: StepReport, ahead: bool) -> tuple[Orders, ...]:
        # Read before posting: this report's own answer clears the flag.
        leave = 1 if ahead and not self.link.wants_answer else 0
        self.in_flight += 1
        self.token.run_sync_soon(self._answer, report)
        answers = []
        while self.in_flight > leave:
            got = self._answers.get()
            self.in_flight -= 1
            answers.append(got.unwrap())
        return tuple(answers)

    def _answer(self, report: StepReport) -> None:  # on the Trio thread
        self._answers.put(outcome.capture(self.link.exchange, report))


def _in_thread(
    pipe: _Pipe,
    make_backend: Callable[[], Backend],
    config: EngineConfig,
    blocks: BlockEventsFactory | None,
) -> None:
    link = pipe.link
    backend = make_backend()
    if isinstance(backend, FailsFromAfar):
        backend.on_failure(lambda error: pipe.token.run_sync_soon(link.die, error))
    driver = _drive(backend, config, observed=False, blocks=blocks)
    try:
        need = next(driver)
        while True:
            reply: tuple[Orders, ...] | None = None
            match need:
                case _Ready(backend=b):
                    trio.from_thread.run_sync(link.ready, b.info, b.renderer, b.compiler, b.images)
                case _Exchange(report=report, ahead=ahead):
                    trio.from_thread.check_cancelled()
                    reply = pipe.exchange(report, ahead)
                case _Idle() if not pipe.in_flight:
                    trio.from_thread.run(link.wait_for_work)
            need = driver.send(reply)
    except StopIteration:
        return
    finally:
        driver.close()


def inline(observer: Observer | None = None) -> HostRunner:
    """Run the host loop as a Trio task, for a backend that needs no thread
    (the scripted testing backend). ``observer.at`` is awaited at each named
    point, which stops the world there. Cancellation ends the loop at its
    next checkpoint, after the shutdown (synchronous, unshielded)."""

    async def run(
        link: EngineLink, make_backend: Callable[[], Backend], config: EngineConfig
    ) -> None:
        backend = make_backend()
        driver = _drive(backend, config, observed=observer is not None)
        try:
            need = next(driver)
            while True:
                reply: tuple[Orders, ...] | None = None
                match need:
                    case _Ready(backend=b):
                        link.ready(b.info, b.renderer, b.compiler, b.images)
                    case _Exchange(report=report):
                        reply = (link.exchange(report),)  # always in step
                    case _Stepped():
                        await trio.lowlevel.checkpoint()
                    case _Idle():
                        await link.wait_for_work()
                    case _At(point=point):
                        assert observer is not None
                        await observer.at(point)
                need = driver.send(reply)
        except StopIteration:
            return
        finally:
            driver.close()

    return run
