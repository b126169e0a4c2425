"""The lines a supervisor reads on stdout: the seed sidecar's protocol.

The supervisor that spawns a sidecar (the TypeScript side of
``@bendyline/gezel-inference``) reads its stdout line by line, and its
watchdog and UI act on what it reads:

* the start-up lines (``Started server process [pid]`` ... ``Application
  startup complete.``) tell it how far loading got;
* ``Prefill: NN%| | done/total [batched] cache=<id>`` keeps its
  pre-first-byte watchdog from killing a long cold prefill (the seed's
  figure: a 37k-token prompt on a 27B model), and the ``cache=`` tag routes
  the bar to the one session that owns it (an untagged line goes to every
  session: another row would draw this request's bar);
* ``[batch] waiting cache=<id> ahead=<n> behind=<ids>`` (queued behind
  others), ``[batch] paused cache=<id> for=<ids>`` (a background request
  parked for interactive work) and ``[batch] admitted cache=<id>
  waited=<s>s`` are the same liveness for a request that waits: printed at
  once and then every 8 s while it waits, each re-arms that session's
  watchdog (the seed's client once killed a queued turn for its silence);
* ``[cache] hit cache_id=<id> prior_tokens=<n>`` (a turn seeded from its
  session's entry in memory; ``disk-hit`` from disk) and ``[cache] warmed
  cache_id=<id> tokens=<n> ...`` flash "Cache hit" / "Cache warmed" in the
  supervisor's UI;
* a bare ``SomeError: message`` line - the last line of a Python
  traceback - is read as "the engine is dead" and the process is torn down.
  So a failure that is contained (one request failed, the engine serves
  everyone else) is printed with every line tagged ``[tag] | ...``, and only
  a real engine death prints an untagged traceback.

Who prints: one ``StdoutProtocol`` per server, owned by ``server.serve``.
Its ``run`` task is the only writer of stdout; it writes queued lines from a
worker thread, so a supervisor that reads slowly never blocks the event
loop, and the host thread never prints. Its ``watch`` task turns the
engine's ``RequestNote`` feed (prefill progress, contained failures,
cache seeds, waits, admissions and warms, as the Trio side delivers them
between two steps) into lines. Every supervisor gets these lines, whatever
the profile: they are the one stdout protocol, liveness of the same kind as
the markers, a line per cached turn or per 8 s of a wait, and none looks
like a leaf line. Everything else
still goes to ``logging`` (stderr), as before; ``LogFormatter`` indents a
log record's traceback there, so stderr never shows a bare leaf line either.

A supervisor that stops reading (alive, its pipe full) must not hold the
process's exit: see ``_Out`` for how a write waits, and how long.
"""

from __future__ import annotations

import logging
import math
import os
import select
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any, TextIO

import attrs
import trio

from .core.errors import EngineFailure
from .core.events import Failed, Parked, Progress, Queued
from .core.settings import setting
from .engine import WAITING_EVERY, Admitted, CacheWarmed, RequestNote, Seeded
from .http.tenancy import public_name

__all__ = [
    "PREFILL_INTERVAL",
    "PREFILL_MIN_TOKENS",
    "LogFormatter",
    "StdoutProtocol",
    "StdoutSettings",
    "admitted_line",
    "cache_hit_line",
    "paused_line",
    "prefill_marker",
    "tagged_traceback",
    "waiting_line",
    "warmed_line",
]

# The seed's figures. Below 2048 tokens to prefill the first token comes
# soon enough that a marker is noise; more than one marker per request every
# 4 s is spam in the supervisor's log.
PREFILL_MIN_TOKENS = 2048
PREFILL_INTERVAL = 4.0
# Lines waiting for the writer. Start-up lines are few; beyond this, markers
# and failure lines are dropped (the logs on stderr still have them) rather
# than letting a supervisor that stopped reading hold memory.
_QUEUE = 1024
# A request whose prefill stopped without ending (withdrawn mid-prefill) is
# forgotten once it has been silent this long.
_FORGET_AFTER = 600.0
# While stdout takes nothing, the writer thread asks this often whether its
# task was cancelled: a thread learns of that only by asking
# (``trio.from_thread.check_cancelled``), so this bounds how long a
# cancelled writer can outlive its cancellation.
_CANCEL_CHECK = 0.25
# How long a line written once the writer is gone (the last queued lines,
# the death traceback) waits for a stdout that takes nothing before it and
# every later line are dropped: a supervisor that stopped reading does not
# hold the process's exit longer than this.
_CLOSE_GRACE = 1.0


def _interval(_: object, attr: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{attr.name} must be a finite number >= 0")


@attrs.frozen
class StdoutSettings:
    """How often ``StdoutProtocol`` prints a request's liveness lines
    (``stdout_protocol``).

    ``prefill_min_tokens``: a request prints markers only when it has at
    least this many prompt tokens to prefill (cached ones do not count).
    ``prefill_interval``: seconds between two markers of one request.
    ``waiting_interval``: seconds between two ``waiting``/``paused`` lines
    of a request that waits (``Engine.watch``'s ``waiting_every``)."""

    prefill_min_tokens: int = setting(
        PREFILL_MIN_TOKENS,
        flag="--prefill-marker-min-tokens",
        help="print stdout 'Prefill:' markers for requests with at least this many tokens "
        "to prefill",
        validator=attrs.validators.ge(0),
    )
    prefill_interval: float = setting(
        PREFILL_INTERVAL,
        flag="--prefill-marker-interval",
        help="seconds between two stdout 'Prefill:' markers of one request",
        validator=_interval,
    )
    waiting_interval: float = setting(
        WAITING_EVERY,
        flag="--waiting-marker-interval",
        help="seconds between two stdout '[batch] waiting' (or 'paused') lines of a request "
        "that waits",
        validator=_interval,
    )


def prefill_marker(done: int, total: int, cache_id: str | None) -> str:
    """The seed's marker; the percentage stops at 99 (the first token, not a
    marker, says prefill is over)."""
    pct = min(99, 100 * done // total) if total > 0 else 0
    tag = f" cache={cache_id}" if cache_id else ""
    return f"Prefill: {pct:3d}%| | {done}/{total} [batched]{tag}"


def _ids(ids: Iterable[str]) -> str:
    return ",".join(ids) or "-"


def waiting_line(cache_id: str, ahead: int, behind: Iterable[str]) -> str:
    """The seed's line for a request queued behind others (``behind``: the
    cache ids of those stepping)."""
    return f"[batch] waiting cache={cache_id} ahead={ahead} behind={_ids(behind)}"


def paused_line(cache_id: str, for_ids: Iterable[str]) -> str:
    """The seed's line for a background request parked for interactive work."""
    return f"[batch] paused cache={cache_id} for={_ids(for_ids)}"


def admitted_line(cache_id: str, waited: float) -> str:
    """The seed's line for a request admitted after it waited."""
    return f"[batch] admitted cache={cache_id} waited={max(0.0, waited):.1f}s"


def cache_hit_line(cache_id: str, reused: int, source: str) -> str | None:
    """The seed's line for a turn seeded from its own session's entry:
    ``hit`` from memory, ``disk-hit`` loaded from disk; ``None`` for any
    other seed (a prefix's or another session's entry, or none: the seed
    printed ``prefix-hit``/``miss`` there, which its client does not read;
    the stderr log has every seed decision)."""
    where, _, whose = source.partition(":")
    if whose != "session" or reused <= 0:
        return None
    word = "hit" if where == "memory" else f"{where}-hit"
    return f"[cache] {word} cache_id={cache_id} prior_tokens={reused}"


def warmed_line(cache_id: str, warmed: CacheWarmed) -> str:
    """The seed's line for a finished ``/v1/cache/warm``."""
    return (
        f"[cache] warmed cache_id={cache_id} tokens={warmed.tokens} "
        f"(prior={warmed.prior}, persist={warmed.persisted})"
    )


def tagged_traceback(
    tag: str, exc: BaseException | Iterable[str], headline: str | None = None
) -> list[str]:
    """``exc``'s traceback (its causes included; or traceback lines already
    formatted), every line ``[tag] | ...``, after an optional ``[tag]
    headline`` line. No line is bare."""
    if isinstance(exc, BaseException):
        exc = "".join(traceback.format_exception(exc)).rstrip().splitlines()
    lines = [f"[{tag}] {headline}"] if headline else []
    lines += [f"[{tag}] | {line}" for line in exc]
    return lines


def _one_line(text: str) -> str:
    # A newline inside a cache id or a message would start a bare line.
    return text.replace("\r", "\\r").replace("\n", "\\n")


class LogFormatter(logging.Formatter):
    """Log lines for stderr, which a supervisor may read along with stdout
    (the seed's own warning was against ``traceback.print_exc()``, which
    writes to stderr): a record's traceback and stack are indented with
    ``  | `` so that no line of them is a bare leaf line."""

    def formatException(self, ei: Any) -> str:
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indented(super().formatStack(stack_info))


def _indented(text: str) -> str:
    return "\n".join(f"  | {line}" for line in text.splitlines())


class _Out:
    """One stream's lines, written so that a wait for a full pipe can end.

    A stream with a file descriptor (the real stdout: a pipe, a socket, a
    file) is written with ``os.write`` in pieces of at most ``PIPE_BUF``
    bytes, each once ``select`` says the descriptor can take it, so the
    writer waits in ``select`` - where a cancellation or a deadline can end
    the wait - and never inside a write that has begun. Bytes not yet
    written stay pending, in order, and go first with the next write, so a
    wait that ended loses nothing and reorders nothing. A stream without a
    descriptor (a test's ``StringIO``) never blocks and is written directly.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._pending = bytearray()
        # The last byte written ended a line (a dropped rest must not leave
        # the next line glued to half of one).
        self._at_line_start = True
        # A wait with a deadline gave up: from then on nothing waits.
        self._stalled = False
        self._gone = False  # nobody reads any more (or the stream was closed)
        self._encoding = getattr(stream, "encoding", None) or "utf-8"
        self._errors = getattr(stream, "errors", None) or "strict"
        self._fd: int | None
        try:
            self._fd = stream.fileno()
            stream.flush()  # what went through the stream before goes first
        except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is both
            self._fd = None

    def write(
        self,
        text: str,
        *,
        deadline: float | None = None,
        check: Callable[[], None] | None = None,
    ) -> int:
        """Write ``text`` after what is pending, waiting for the stream
        until ``deadline`` (``time.monotonic``; ``None``: as long as it
        takes), and calling ``check`` (which may raise, leaving the rest
        pending) every ``_CANCEL_CHECK`` seconds of waiting. Returns how
        many lines a deadline dropped."""
        if self._gone:
            return 0
        if self._fd is None:
            if not text:
                return 0
            try:
                self.stream.write(text)
                self.stream.flush()
            except (BrokenPipeError, ValueError):
                pass  # nobody reads stdout any more (or it was closed): nothing to tell
            return 0
        try:
            self._pending += text.encode(self._encoding, self._errors)
        except ValueError:
            return text.count("\n")  # as the text stream would have: these lines are lost
        if self._stalled:
            deadline = time.monotonic()  # what the pipe takes at once, no more
        while self._pending:
            wait = _CANCEL_CHECK
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
            if not self._writable(max(0.0, wait)):
                if deadline is not None and time.monotonic() >= deadline:
                    return self._give_up()
                if check is not None:
                    check()
                continue
            try:
                n = os.write(self._fd, self._pending[: select.PIPE_BUF])
            except BlockingIOError:
                continue  # a non-blocking descriptor that filled up: wait again
            except OSError:
                self._gone = True  # a broken pipe: nobody reads stdout any more
                self._pending.clear()
                return 0
            self._at_line_start = self._pending[n - 1 : n] == b"\n"
            del self._pending[:n]
        return 0

    def _writable(self, timeout: float) -> bool:
        assert self._fd is not None
        try:
            _, ready, _ = select.select([], [self._fd], [], timeout)
        except (OSError, ValueError):
            return True  # the write will tell (a closed descriptor fails there)
        return bool(ready)

    def _give_up(self) -> int:
        dropped = self._pending.count(b"\n")
        self._pending[:] = b"" if self._at_line_start else b"\n"
        self._stalled = True
        return dropped


class StdoutProtocol:
    """The only writer of the process's stdout while the server runs.

    ``say_nowait`` and ``contained_nowait`` queue lines from the Trio thread
    and never block; ``run`` (a task, ``nursery.start``) writes them;
    ``watch`` (a task) turns the engine's notes into markers and tagged
    failures. Cancelling ``run`` writes what is still queued, then returns.
    """

    def __init__(
        self, settings: StdoutSettings | None = None, stream: TextIO | None = None
    ) -> None:
        self.settings = settings or StdoutSettings()
        self._stream = stream
        self._send, self._receive = trio.open_memory_channel[str](_QUEUE)
        self._out: _Out | None = None
        # Lines dropped: beyond the queue, or left for a stdout nobody read.
        self.dropped = 0
        # Per request: when its last marker was printed (trio clock).
        self._last_marker: dict[int, float] = {}
        # Requests that printed a waiting or paused line, and when the last
        # one was printed (their admission after the wait is printed too).
        self._waited: dict[int, float] = {}
        self._last_failure: BaseException | None = None

    # --- queueing (Trio thread, never blocks) --------------------------------

    def say_nowait(self, line: str) -> None:
        try:
            self._send.send_nowait(_one_line(line))
        except trio.WouldBlock:
            self.dropped += 1
        except trio.ClosedResourceError:
            self._write([_one_line(line)])  # the writer is gone: the server is ending

    def startup_nowait(self, model: object) -> None:
        """The first lines, before the model loads."""
        self.say_nowait(f"Started server process [{os.getpid()}]")
        self.say_nowait("Waiting for application startup.")
        self.say_nowait(f"Loading model from: {model}")

    def contained_nowait(
        self, tag: str, exc: BaseException | Iterable[str], headline: str | None = None
    ) -> None:
        """A failure that harmed one request or one HTTP exchange and that the
        server survived: tagged line by line."""
        for line in tagged_traceback(tag, exc, headline):
            self.say_nowait(line)

    # --- tasks ----------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write queued lines until cancelled; then write what is left
        (``close``).

        Cancellation ends a write only between two pieces of it, never in
        one: the worker thread is not abandoned (a write has effects the
        supervisor sees, and an abandoned one would still be writing while
        ``close`` writes the rest). The thread sees the cancellation within
        ``_CANCEL_CHECK`` seconds even when stdout takes nothing, and what
        it had not written goes first in ``close``, which waits at most
        ``_CLOSE_GRACE`` seconds for a supervisor that stopped reading."""
        task_status.started()
        try:
            async for line in self._receive:
                batch = [line, *self._queued_nowait()]
                # A pipe the supervisor reads slowly blocks this worker
                # thread, never the event loop.
                await trio.to_thread.run_sync(self._write_until_cancelled, batch)
        finally:
            self.close()

    def close(self) -> None:
        """Write what is still queued, synchronously (the server is ending:
        a few short lines, waiting at most ``_CLOSE_GRACE`` seconds for
        stdout); from now on a line is written as it comes."""
        self._send.close()
        self._write(self._queued_nowait())

    def _queued_nowait(self) -> list[str]:
        lines: list[str] = []
        while True:
            try:
                lines.append(self._receive.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                return lines

    async def watch(self, notes: trio.MemoryReceiveChannel[RequestNote]) -> None:
        """Turn the engine's notes into prefill markers and tagged failures,
        until the channel closes or the task is cancelled."""
        with notes:
            async for note in notes:
                self.note_nowait(note, trio.current_time())

    def note_nowait(self, note: RequestNote, now: float) -> None:
        if note.cache_id or note.behind:
            # Cache ids as their clients sent them, not in their tenant's
            # namespace (``http.tenancy``).
            note = attrs.evolve(
                note,
                cache_id=public_name(note.cache_id) if note.cache_id else note.cache_id,
                behind=tuple(map(public_name, note.behind)),
            )
        cache_id = note.cache_id
        match note.event:
            case Progress(done=done, total=total):
                self._progress(note, done, total, now)
            # The lines below are the seed's, each about one request that a
            # supervisor routes by its cache id: a request without one has
            # nobody to tell.
            case Seeded(reused=reused, source=source) if cache_id:
                line = cache_hit_line(cache_id, reused, source)
                if line is not None:
                    self.say_nowait(line)
            case CacheWarmed() as warmed if cache_id:
                self.say_nowait(warmed_line(cache_id, warmed))
            case Queued(position=position) if cache_id:
                self._waiting(note.rid, now)
                self.say_nowait(waiting_line(cache_id, position, note.behind))
            case Parked() if cache_id:
                self._waiting(note.rid, now)
                self.say_nowait(paused_line(cache_id, note.behind))
            case Admitted(waited=waited) if cache_id:
                if self._waited.pop(note.rid, None) is not None:
                    self.say_nowait(admitted_line(cache_id, waited))
            case Failed(error=error):
                self._last_marker.pop(note.rid, None)
                # A failed model step fails its whole lane with one error.
                if error is self._last_failure:
                    return
                self._last_failure = error
                what = (
                    "a model step failed; its batch failed"
                    if isinstance(error, EngineFailure)
                    else f"request {note.rid} failed alone"
                )
                self.contained_nowait(
                    "batch",
                    note.traceback or error,
                    f"{what}; the engine goes on: {error.message}",
                )

    def _waiting(self, rid: int, now: float) -> None:
        self._waited[rid] = now
        if len(self._waited) > 64:
            # A request withdrawn while it waited is never admitted.
            for old, at in list(self._waited.items()):
                if now - at > _FORGET_AFTER:
                    del self._waited[old]

    def _progress(self, note: RequestNote, done: int, total: int, now: float) -> None:
        if done >= total:
            # The last chunk: the first token is next and says more than 100%.
            self._last_marker.pop(note.rid, None)
            return
        if total < self.settings.prefill_min_tokens:
            return
        last = self._last_marker.get(note.rid)
        if last is not None and now - last < self.settings.prefill_interval:
            return
        self._last_marker[note.rid] = now
        if len(self._last_marker) > 64:
            for rid, at in list(self._last_marker.items()):
                if now - at > _FORGET_AFTER:
                    del self._last_marker[rid]
        self.say_nowait(prefill_marker(done, total, note.cache_id))

    # --- the end ----------------------------------------------------------------

    def death(self, exc: BaseException) -> None:
        """The engine is dead: its traceback, untagged, so the supervisor's
        classifier sees the leaf line. Called once the server has stopped."""
        self._write("".join(traceback.format_exception(exc)).rstrip().splitlines())

    def _write_until_cancelled(self, lines: list[str]) -> None:
        """On the writer's worker thread: as long as stdout needs, unless
        the task is cancelled (``trio.Cancelled`` leaves the rest pending)."""
        text = "".join(f"{line}\n" for line in lines)
        self._current().write(text, check=trio.from_thread.check_cancelled)

    def _write(self, lines: Iterable[str]) -> None:
        """On the Trio thread, once the writer is gone: at most
        ``_CLOSE_GRACE`` seconds."""
        text = "".join(f"{line}\n" for line in lines)
        self.dropped += self._current().write(text, deadline=time.monotonic() + _CLOSE_GRACE)

    def _current(self) -> _Out:
        # sys.stdout as it is now (a test may have swapped it).
        stream = self._stream or sys.stdout
        if self._out is None or self._out.stream is not stream:
            self._out = _Out(stream)
        return self._out
