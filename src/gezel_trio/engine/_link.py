"""The Trio half of the host exchange: every request's channel, the
scheduler, and the once-per-step conversation with the host loop.

The host loop (``host.loop``) calls ``exchange`` once per step with what the
step produced; the link delivers each event to its request's channel (never
blocking: ``send_nowait``), watches for readers that stopped draining,
observes latencies for the metrics, answers cache commands with their typed
results, asks the pure ``Scheduler`` what to do next and returns the orders.
When nothing runs, the host loop waits in ``wait_for_work`` until something
is submitted, withdrawn or commanded.

Everything here runs in the Trio thread, between two host steps, and never
awaits except ``wait_for_work``, ``call`` and ``wait_until``.
"""

from __future__ import annotations

import logging
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import attrs
import trio

from ..core.backend import ConstraintCompiler, ImagePreparer, PromptRenderer
from ..core.config import MemorySettings, SchedulingSettings
from ..core.errors import (
    EngineClosed,
    EngineFailure,
    GezelError,
    QueueTimeout,
    RequestFailed,
    SlowConsumer,
)
from ..core.events import Delta, Event, Failed, Finished, Parked, Progress, Queued, Resumed
from ..core.figures import BackendFigures, RankStep
from ..core.model import ModelInfo
from ..core.request import CacheRequest, GenerationRequest
from ..core.scheduler import Scheduler
from ..host.exchange import CommandFailed, HostCommand, Orders, StepReport
from ..host.prompt_cache import CacheBook
from ._handle import RequestHandle, Ticket
from ._metrics import EngineMetrics, Snapshot, resident_bytes

__all__ = [
    "WAITING_EVERY",
    "Admitted",
    "CacheWarmed",
    "EngineState",
    "Health",
    "HostLink",
    "Loaded",
    "Note",
    "Removal",
    "RequestNote",
    "Seeded",
]

log = logging.getLogger("gezel_trio.engine")

R = TypeVar("R")

# Events per request beyond one per generated token: prefill progress and the
# final event. A reader that falls further behind than this is dropped rather
# than allowed to stall the engine (docs/architecture.md, "Backpressure").
_EVENT_SLACK = 256
# How long an idle engine waits for prepared requests to be submitted before
# its first step (``wait_for_work``): a burst's requests open their streams
# within a few milliseconds of each other; one step is 10-100 ms here.
_GATHER_S = 0.02
# How long /health keeps saying "degraded" after a failed model step.
DEGRADED_FOR = 60.0
_LIVENESS_LOG_EVERY = 5.0
# The seed's cadence for the notes of a request that waits (queued or
# parked): the supervisor's watchdogs it feeds are minutes long, and a
# ten-request fanout must not flood its log.
WAITING_EVERY = 8.0
# Live MLX memory above this share of ``memory_limit_mb`` is "tight": no
# preemption, one request per wave.
_TIGHT = 0.85


@attrs.frozen
class Removal:
    """A withdrawn running sequence and the engine steps around its removal."""

    rid: int
    withdrawn_at_step: int
    removed_at_step: int


class Expected:
    """A request being prepared: an idle engine's first step waits for it a
    little (``HostLink.wait_for_work``)."""

    __slots__ = ("__weakref__",)


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
    # Under mlx.launch, each rank's last step (``RankStep``).
    ranks: tuple[RankStep, ...] = ()


@attrs.frozen
class Seeded:
    """Admitted: its prompt reused ``reused`` cached tokens, seeded from
    ``source`` (where the seed was found and whose it was:
    ``memory:session``, ``disk:session``, ``memory:prefix``,
    ``memory:shared``, ...; ``fresh`` when nothing was reused)."""

    reused: int
    source: str


@attrs.frozen
class Admitted:
    """A request that had waited in the queue was admitted, ``waited``
    seconds after it was submitted."""

    waited: float


@attrs.frozen
class CacheWarmed:
    """``/v1/cache/warm`` (``Engine.warm``) built its entry: ``tokens``
    tokens, where ``prior`` were held before; ``persisted``: on disk at once."""

    tokens: int
    prior: int
    persisted: bool


Note = Progress | Failed | Queued | Parked | Seeded | Admitted | CacheWarmed


@attrs.frozen
class RequestNote:
    """What a watcher of the whole engine (``Engine.watch``) sees of one
    request, with the request's cache id: its prefill ``Progress``; a
    ``Failed`` that the host thread contained (the request failed alone;
    the engine goes on); what its cache seed reused (``Seeded``); while it
    waits, ``Queued`` and ``Parked`` at once and then every ``waiting_every``
    seconds, between two engine steps (a wedged engine goes quiet), with
    ``behind`` naming the cache ids of the requests it waits on (those
    stepping); its admission after a wait (``Admitted``); a finished warm
    (``CacheWarmed``). For a failure, ``traceback`` holds its lines as Python
    prints them (the original exception is the cause), taken when the
    engine delivered it: the request's reader may raise the same error
    object later, which adds its own frames."""

    rid: int
    cache_id: str | None
    event: Note
    traceback: tuple[str, ...] = ()
    behind: tuple[str, ...] = ()


@attrs.frozen
class Loaded:
    """What the host loop hands over once the model is loaded."""

    info: ModelInfo
    renderer: PromptRenderer
    compiler: ConstraintCompiler | None
    images: ImagePreparer | None


_NO_RESULT: Any = object()


@attrs.define
class _Call:
    done: trio.Event = attrs.field(factory=trio.Event)
    result: Any = _NO_RESULT


@attrs.define
class _Live:
    """One member of a submitted request, while it is queued or running."""

    request: GenerationRequest
    send: trio.MemorySendChannel[tuple[int, Event]]
    index: int
    ticket: Ticket
    submitted_at: float
    position: int | None = None
    logged_at: float = float("-inf")
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    # When the watcher was last told this request waits (queued or parked).
    waiting_noted_at: float = float("-inf")
    # Stall detection: events buffered after the last exchange, and when the
    # reader was last seen draining.
    buffered: int = 0
    drained_at: float = 0.0

    def send_nowait(self, event: Event) -> None:
        self.send.send_nowait((self.index, event))


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


def _cache_ids(lives: Iterable[_Live | None]) -> list[str]:
    """The cache ids of these requests (those that have one), in order."""
    ids = []
    for live in lives:
        cr = live.request.cache if live is not None else None
        if cr is not None and cr.cache_id:
            ids.append(cr.cache_id)
    return ids


def _is_note(event: Event) -> bool:
    """Liveness notes: advisory, dropped rather than queued for a busy reader."""
    return isinstance(event, Progress | Queued | Parked | Resumed)


class HostLink:
    """The engine's requests and its half of the host exchange (Trio thread)."""

    def __init__(
        self, scheduling: SchedulingSettings, memory: MemorySettings, metrics: EngineMetrics
    ) -> None:
        self.scheduling = scheduling
        self.memory = memory
        self.metrics = metrics
        self.loaded: Loaded | None = None
        self.is_loaded = trio.Event()
        self._scheduler = Scheduler(
            max_running=scheduling.max_concurrency,
            max_queue=scheduling.max_queue,
            continuous=scheduling.continuous_batching,
            max_park=scheduling.max_park_seconds,
        )
        self._live: dict[int, _Live] = {}
        # Running sequences whose caller left, with the step at which it left.
        self._withdrawn: dict[int, int] = {}
        self._removals: deque[Removal] = deque(maxlen=64)
        self._next_rid = 0
        self._step = 0
        self._closing = False
        self._wake = trio.Event()
        # Prepared chats not submitted yet, and an event set at each submit
        # (``wait_for_work``).
        # (By identity: a prepared chat hashes by value, and holds lists.)
        self._expected: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
        self._submitted = trio.Event()
        self._changed = trio.Event()
        self._commands: list[tuple[int, HostCommand[Any]]] = []
        self._calls: dict[int, _Call] = {}
        self._next_call = 0
        self.cache = CacheBook()
        self._memory = 0
        self._figures = BackendFigures()
        # Consecutive failed model steps, and the last failure (time, reason).
        self._step_failures = 0
        self._last_step_failure: tuple[float, str] | None = None
        self._persistence: str | None = None
        # Why the engine stopped working, once it has.
        self.failure: EngineFailure | None = None
        # The one watcher of every request's progress and contained failures.
        self._watcher: trio.MemorySendChannel[RequestNote] | None = None
        self._waiting_every = WAITING_EVERY
        metrics.watch(self._snapshot)
        metrics.sizes("engine", self._bookkeeping)

    # --- submission ----------------------------------------------------------

    def check_admission(self, n: int = 1) -> None:
        """Raise ``EngineFailure``, ``EngineClosed`` or ``QueueFull`` if ``n``
        sequences would be refused now."""
        if self.failure is not None:
            raise EngineFailure(self.failure.message)
        if self._closing:
            raise EngineClosed("the server is shutting down")
        self._scheduler.check_room(n)

    def submit(self, request: GenerationRequest, n: int) -> RequestHandle:
        """Queue ``n`` members continuing ``request``'s prompt (checked by the
        caller). Member ``i`` samples with ``seed + i``; with ``n > 1`` they
        share one prefill (``CacheRequest.prefill_group``)."""
        self.check_admission(n)
        cache = request.cache or CacheRequest()
        if n > 1:
            cache = attrs.evolve(cache, prefill_group=self._next_rid)
        send, receive = trio.open_memory_channel[tuple[int, Event]](
            n * (request.max_tokens + _EVENT_SLACK)
        )
        now = trio.current_time()
        rids, tickets = [], []
        with send:
            for i in range(n):
                member = request
                if n > 1:
                    seed = request.sampling.seed
                    sampling = attrs.evolve(
                        request.sampling, seed=None if seed is None else seed + i
                    )
                    member = attrs.evolve(request, sampling=sampling, cache=cache)
                rid = self._next_rid
                self._next_rid += 1
                tickets.append(Ticket())
                self._scheduler.enqueue(
                    rid, member.priority, len(member.prompt) + member.max_tokens
                )
                self._live[rid] = _Live(member, send.clone(), i, tickets[-1], submitted_at=now)
                rids.append(rid)
        self._wake.set()
        self._submitted.set()
        self._submitted = trio.Event()
        self._notify()
        return RequestHandle(self.withdraw, tuple(rids), receive, tuple(tickets))

    def withdraw(self, rid: int) -> None:
        """The reader left: a queued member is never admitted, a running one
        leaves the batch at the next step. Never blocks."""
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

    async def call(self, command: HostCommand[R]) -> R:
        """Run a cache command on the host thread, between two steps, and
        return its result. Raises ``EngineClosed`` if the engine stops first,
        ``RequestFailed`` if the command raised. Cancelling the wait leaves
        the command to run; its result is dropped."""
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
        result: R = call.result
        return result

    def watch(
        self, max_buffer: int, waiting_every: float = WAITING_EVERY
    ) -> trio.MemoryReceiveChannel[RequestNote]:
        send, receive = trio.open_memory_channel[RequestNote](max_buffer)
        if self._watcher is not None:
            self._watcher.close()
        self._watcher = send
        self._waiting_every = waiting_every
        return receive

    def note_nowait(self, rid: int, cache_id: str | None, event: Note) -> None:
        """Tell the watcher, if there is one, of ``event`` (never blocks)."""
        self._send_note(RequestNote(rid, cache_id, event))

    # --- observation -----------------------------------------------------------

    def state(self) -> EngineState:
        return EngineState(
            step=self._step,
            queued=self._scheduler.queued,
            running=self._scheduler.running,
            parked=self._scheduler.parked,
            live=len(self._live),
            closing=self._closing,
            recent_removals=tuple(self._removals),
            ranks=self._figures.ranks,
        )

    async def wait_until(self, predicate: Callable[[EngineState], bool]) -> EngineState:
        while True:
            state = self.state()
            if predicate(state):
                return state
            await self._changed.wait()

    @property
    def settled(self) -> bool:
        """Every withdrawn sequence has left the batch."""
        return not self._withdrawn

    def health(self) -> Health:
        if self.failure is not None:
            return Health("failed", (self.failure.message,))
        if self._closing:
            return Health("shutting_down")
        reasons = []
        last = self._last_step_failure
        if last is not None and trio.current_time() - last[0] < DEGRADED_FOR:
            reasons.append(f"a model step failed: {last[1]}")
        if self._persistence is not None:
            reasons.append(f"persistence: {self._persistence}")
        return Health("degraded" if reasons else "ok", tuple(reasons))

    def cache_ids_in_use(self) -> set[str]:
        ids: set[str] = set()
        for live in self._live.values():
            cr = live.request.cache
            if cr is not None:
                ids.update(k for k in (cr.cache_id, *cr.prefix_ids) if k)
        return ids

    @property
    def memory_tight(self) -> bool:
        limit = self.memory.limit_mb
        return limit is not None and self._memory > _TIGHT * limit * 1024 * 1024

    def _bookkeeping(self) -> dict[str, int]:
        renderer = self.loaded.renderer if self.loaded is not None else None
        sizes = getattr(renderer, "bookkeeping", None)
        out = dict(sizes()) if sizes is not None else {}
        out["seeded_prefix_ids"] = self.cache.totals.seeded_prefixes
        return out

    def _snapshot(self) -> Snapshot:
        totals = self.cache.totals
        return Snapshot(
            running=len(self._scheduler.running),
            waiting=len(self._scheduler.queued),
            parked=len(self._scheduler.parked),
            steps=self._step,
            cache_entries=totals.entries,
            cache_bytes=totals.bytes,
            cache_blocks=totals.blocks,
            cache_lookups=totals.lookups,
            cache_hits=totals.hits,
            memory_bytes=self._memory,
            rss_bytes=resident_bytes(),
            backend=self._figures,
        )

    # --- ending --------------------------------------------------------------

    def close_nowait(self, why: str = "the engine shut down") -> None:
        """Stop admitting; fail every queued and running request with
        ``EngineClosed(why)``. The host loop stops at its next exchange."""
        if self._closing:
            return
        self._fail_everything(EngineClosed(why))

    def die(self, error: EngineFailure) -> None:
        """The engine stopped working: ``/health`` fails with the reason and
        every request, queued or running, fails with ``error``."""
        if self.failure is None:
            self.failure = error
        self._fail_everything(error)

    def _fail_everything(self, error: GezelError) -> None:
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

    # --- the host loop's side ------------------------------------------------

    def ready(
        self,
        info: ModelInfo,
        renderer: PromptRenderer,
        compiler: ConstraintCompiler | None,
        images: ImagePreparer | None = None,
    ) -> None:
        """The model is loaded; the engine task reports ready."""
        self.loaded = Loaded(info, renderer, compiler, images)
        if info.kv is not None and info.kv_room > 0:
            # KV-aware admission: what each sequence's KV takes, and the room.
            self._scheduler.kv_bytes = info.kv.bytes_for
            self._scheduler.kv_room = info.kv_room
        self.is_loaded.set()

    async def wait_for_work(self) -> None:
        await self._wake.wait()
        # An idle engine's first step admits what is queued when it starts.
        # Requests being prepared, or prepared and not yet submitted (a burst
        # released together: a stream submits once its response starts),
        # would join a step later, their first tokens a whole step behind
        # the first one's: wait for them, briefly.
        with trio.move_on_after(_GATHER_S):
            while self._expected:
                await self._submitted.wait()

    def expect(self, prepared: object) -> None:
        """``prepared`` (an ``Expected`` or a prepared chat) will be
        submitted soon; it is forgotten when submitted or dropped."""
        self._expected[id(prepared)] = prepared

    def unexpect(self, prepared: object) -> None:
        self._expected.pop(id(prepared), None)

    @property
    def wants_answer(self) -> bool:
        """Read by the host thread between two steps (``EngineLink``): work
        arrived since the last orders were made. A plain flag read; a stale
        ``False`` costs that work one step."""
        return self._wake.is_set()

    def exchange(self, report: StepReport) -> Orders:
        """Take one step's report; return the orders for the next."""
        now = trio.current_time()
        self._take(report, now)
        if self._failed_step(report, now):
            return Orders(stop=True)
        # Anything submitted after this point wakes an idle host loop.
        self._wake = trio.Event()
        if report.memory is not None:
            self._memory = report.memory
        if report.figures is not None:
            self._figures = report.figures
        plan = self._scheduler.plan(
            memory_tight=self.memory_tight, now=now, kv_held=self.cache.totals.bytes
        )
        for rid in plan.parked:
            self._deliver(rid, Parked())
        for rid in plan.resumed:
            self._deliver(rid, Resumed())
            self._rearm(rid)
        self._announce_queue()
        self._note_waiting(now)
        for rid in plan.remove:
            left_at = self._withdrawn.pop(rid, self._step)
            self._removals.append(Removal(rid, left_at, self._step))
        admit = tuple((rid, self._live[rid].request) for rid in plan.admit)
        for rid, request in admit:
            live = self._live[rid]
            live.admitted_at = live.drained_at = now
            self.metrics.queue.observe(now - live.submitted_at)
            if live.position is not None and live.index == 0:
                self._note(rid, Admitted(now - live.submitted_at))
            self._rearm(rid)
            log.info(
                "admit request %d priority=%s prompt=%d max_tokens=%d running=%d queued=%d",
                rid,
                request.priority,
                len(request.prompt),
                request.max_tokens,
                len(self._scheduler.running),
                len(self._scheduler.queued),
            )
        if plan.parked:
            self.metrics.preemptions.inc(len(plan.parked))
        commands, self._commands = tuple(self._commands), []
        for live in self._live.values():
            live.buffered = live.send.statistics().current_buffer_used
        self._notify()
        return Orders(
            stop=self._closing and self._scheduler.idle,
            remove=plan.remove,
            admit=admit,
            commands=commands,
            lane=plan.lane,
            parked=plan.parked,
            resumed=plan.resumed,
        )

    def _take(self, report: StepReport, now: float) -> None:
        """Deliver what the last step produced."""
        if report.cache_view is not None:
            self.cache.apply(report.cache_view)
        self._persistence = report.persistence
        for cid, result in report.replies:
            call = self._calls.pop(cid, None)
            if call is not None:
                call.result = result
                call.done.set()
        self._check_stalls(now)
        self._expire_queued(now)
        for rid, reused, source in report.seeded:
            live = self._live.get(rid)
            if live is not None and live.index == 0:  # once per request, not per member
                self._note(rid, Seeded(reused, source))
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
        limit = self.scheduling.max_step_failures
        if self._step_failures < limit:
            return False
        self.die(
            EngineFailure(f"{limit} consecutive model steps failed; last: {report.step_failure}")
        )
        return True

    def _check_stalls(self, now: float) -> None:
        """Withdraw running requests whose reader drained nothing for
        ``stall_timeout`` seconds (docs/architecture.md, "Backpressure")."""
        limit = self.scheduling.stall_timeout
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
                self.withdraw(rid)

    def _expire_queued(self, now: float) -> None:
        """Fail the background requests queued for longer than
        ``background_queue_timeout`` (``SchedulingSettings``), freeing their slots."""
        limit = self.scheduling.background_queue_timeout
        if limit is None:
            return
        for rid in self._scheduler.queued:
            live = self._live.get(rid)
            if live is None or live.request.priority != "background":
                continue
            if now - live.submitted_at < limit:
                continue
            self._scheduler.withdraw(rid)
            log.warning("request %d: queued %.0f s behind interactive work; dropped", rid, limit)
            error = QueueTimeout(
                f"the request waited {limit:g} s in the queue behind interactive work "
                "without starting; retry later"
            )
            self.metrics.requests.labels("failed", error.code or "").inc()
            self._end(rid, Failed(error))

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
                miss = usage.cache_miss
                m.cache_misses.labels(miss.reason if miss is not None else "full").inc()
            case Failed(error=error):
                m.e2e.observe(now - live.submitted_at)
                m.requests.labels("failed", error.code or "").inc()

    def _tell_watcher(self, rid: int, event: Event) -> None:
        if self._watcher is None or not isinstance(event, Progress | Failed):
            return
        lines: tuple[str, ...] = ()
        if isinstance(event, Failed):
            text = "".join(traceback.format_exception(event.error))
            lines = tuple(text.rstrip().splitlines())
        self._note(rid, event, lines)

    def _note(
        self, rid: int, event: Note, lines: tuple[str, ...] = (), behind: tuple[str, ...] = ()
    ) -> None:
        live = self._live.get(rid)
        if self._watcher is None or live is None:
            return
        cache_id = live.request.cache.cache_id if live.request.cache else None
        self._send_note(RequestNote(rid, cache_id, event, lines, behind))

    def _send_note(self, note: RequestNote) -> None:
        if self._watcher is None:
            return
        try:
            self._watcher.send_nowait(note)
        except trio.WouldBlock:
            pass  # the watcher is behind: its notes are advisory
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._watcher = None

    def _rearm(self, rid: int) -> None:
        """A request that waits again is noted at once."""
        live = self._live.get(rid)
        if live is not None:
            live.waiting_noted_at = float("-inf")

    def _note_waiting(self, now: float) -> None:
        """Tell the watcher of each queued or parked request at once, then
        every ``waiting_every`` seconds while it waits: between two steps,
        so that a note says the engine is alive and busy with others."""
        # Every step comes here: nothing waiting (the common case) costs
        # nothing, and who is ahead is worked out only when a note is due.
        if self._watcher is None or not (self._scheduler.queued or self._scheduler.parked):
            return
        parked = set(self._scheduler.parked)
        waiting: list[tuple[int, Queued | Parked]] = [
            (rid, Queued(i)) for i, rid in enumerate(self._scheduler.queued)
        ]
        waiting += [(rid, Parked()) for rid in parked]
        behind: tuple[str, ...] | None = None
        for rid, event in waiting:
            live = self._live.get(rid)
            if live is None or live.index != 0:  # once per request, not per member
                continue
            if now - live.waiting_noted_at < self._waiting_every:
                continue
            live.waiting_noted_at = now
            if behind is None:
                stepping = [r for r in self._scheduler.running if r not in parked]
                behind = tuple(dict.fromkeys(_cache_ids(self._live.get(r) for r in stepping)))
            self._note(rid, event, behind=behind)

    def _announce_queue(self) -> None:
        """Tell each waiting request its place when it changes."""
        for position, rid in enumerate(self._scheduler.queued):
            live = self._live.get(rid)
            if live is not None and live.position != position:
                live.position = position
                self._deliver(rid, Queued(position))

    def _deliver(self, rid: int, event: Event) -> None:
        live = self._live.get(rid)
        if live is None:
            return
        if _is_note(event):
            self._log_liveness(rid, live, event)
        try:
            live.send_nowait(event)
        except trio.WouldBlock:
            if _is_note(event):
                return  # a busy reader may miss some liveness notes
            # The reader stopped draining: drop it rather than stall the engine.
            live.ticket.error = SlowConsumer("the client stopped reading; request dropped")
            self.withdraw(rid)
        except trio.BrokenResourceError:
            self.withdraw(rid)  # the reader closed its end: the client left

    def _log_liveness(self, rid: int, live: _Live, event: Event) -> None:
        """The same liveness the stream shows, in the log; prefill progress
        at most every few seconds per request."""
        now = trio.current_time()
        if isinstance(event, Progress):
            if now - live.logged_at < _LIVENESS_LOG_EVERY and event.done < event.total:
                return
            live.logged_at = now
        cache_id = live.request.cache.cache_id if live.request.cache else None
        log.info("request %d cache_id=%s %s", rid, cache_id or "-", _describe(event))

    def _end(self, rid: int, final: Event | None) -> None:
        live = self._live.pop(rid, None)
        if live is None:
            return
        if final is not None:
            try:
                live.send_nowait(final)
            except trio.WouldBlock:
                if isinstance(final, Failed):
                    live.ticket.error = final.error
            except trio.BrokenResourceError:
                pass  # nobody is listening any more
        live.send.close()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
