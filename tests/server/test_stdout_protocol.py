"""The stdout protocol's decisions, with the clock given: which prefill
notes become markers (the seed's minimum and interval, per request), and
how a contained failure is printed (every line tagged, none bare). The real
server process is tested against the same regular expressions in
``tests/server/test_seed_compat.py``."""

from __future__ import annotations

import contextlib
import io
import os
import threading
from threading import Event
from typing import TextIO

import pytest
import trio

from gezel_trio import stdout_protocol
from gezel_trio.core.errors import EngineFailure, RequestFailed
from gezel_trio.core.events import Failed, Parked, Progress, Queued
from gezel_trio.engine import Admitted, CacheWarmed, RequestNote, Seeded
from gezel_trio.http.tenancy import Tenant, tenant_id
from gezel_trio.stdout_protocol import StdoutProtocol, StdoutSettings, tagged_traceback
from tests.support.seed import CACHE_HIT, CACHE_WARMED, LEAF, PREFILL, QUEUE, TAGGED


def _printed(notes: list[tuple[float, RequestNote]], **settings: float) -> list[str]:
    out = io.StringIO()
    protocol = StdoutProtocol(StdoutSettings(**settings), out)
    for now, note in notes:
        protocol.note_nowait(note, now)
    protocol.close()
    return out.getvalue().splitlines()


def _progress(rid: int, done: int, total: int, cache_id: str | None = "s") -> RequestNote:
    return RequestNote(rid, cache_id, Progress(done, total))


def test_markers_follow_the_seed_minimum_and_interval_per_request() -> None:
    lines = _printed(
        [
            (0.0, _progress(1, 512, 1000)),  # under the 2048-token minimum: never
            (0.0, _progress(2, 512, 4096, "a")),  # first chunk: at once
            (0.1, _progress(3, 256, 3000, None)),  # another request has its own clock
            (1.0, _progress(2, 1024, 4096, "a")),
            (3.9, _progress(2, 1536, 4096, "a")),
            (4.0, _progress(2, 2048, 4096, "a")),  # the interval has passed
            (4.0, _progress(3, 384, 3000, None)),  # its own 4 s are not up yet
            (4.2, _progress(3, 512, 3000, None)),
            (5.0, _progress(2, 3584, 4096, "a")),
            (9.0, _progress(2, 4096, 4096, "a")),  # prefill over: the first token says so
        ]
    )
    assert lines == [
        "Prefill:  12%| | 512/4096 [batched] cache=a",
        "Prefill:   8%| | 256/3000 [batched]",
        "Prefill:  50%| | 2048/4096 [batched] cache=a",
        "Prefill:  17%| | 512/3000 [batched]",
    ]
    assert all(PREFILL.match(line) for line in lines)


def test_cache_lines_are_the_seeds_for_a_turn_seeded_from_its_own_session() -> None:
    lines = _printed(
        [
            (0.0, RequestNote(1, "s", Seeded(0, "fresh"))),  # the seed's miss: not printed
            (0.0, RequestNote(2, "s", Seeded(812, "memory:session"))),
            (0.0, RequestNote(3, "s", Seeded(640, "disk:session"))),
            # Another session's entry or a prefix's: the seed's prefix-hit or
            # miss, which its client does not read.
            (0.0, RequestNote(4, "s", Seeded(96, "memory:shared"))),
            (0.0, RequestNote(5, "s", Seeded(96, "memory:prefix"))),
            (0.0, RequestNote(6, None, Seeded(900, "memory:session"))),  # nobody to tell
            (0.0, RequestNote(7, "w", CacheWarmed(1536, 0, True))),
            (0.0, RequestNote(8, None, CacheWarmed(1536, 0, True))),
        ]
    )
    assert lines == [
        "[cache] hit cache_id=s prior_tokens=812",
        "[cache] disk-hit cache_id=s prior_tokens=640",
        "[cache] warmed cache_id=w tokens=1536 (prior=0, persist=True)",
    ]
    # What the seed's client flashes ("Cache hit · reusing N tokens"); a
    # disk hit is the seed's own word, which the client does not flash.
    assert [m[1] for line in lines if (m := CACHE_HIT.search(line))] == ["812"]
    assert [m[1] for line in lines if (m := CACHE_WARMED.search(line))] == ["1536"]
    assert not [line for line in lines if LEAF.match(line)]


def test_a_request_that_waits_prints_the_seeds_queue_lines() -> None:
    lines = _printed(
        [
            (0.0, RequestNote(1, "b", Queued(1), behind=("a", "c"))),
            (0.0, RequestNote(2, None, Queued(2), behind=("a",))),  # no id: nobody to route to
            (8.0, RequestNote(1, "b", Queued(0), behind=("a",))),
            (9.0, RequestNote(3, "bg", Parked(), behind=("chat",))),
            (9.5, RequestNote(4, "x", Parked())),
            (11.25, RequestNote(1, "b", Admitted(11.25))),
            (12.0, RequestNote(5, "fast", Admitted(0.0))),  # never printed as waiting: silent
        ]
    )
    assert lines == [
        "[batch] waiting cache=b ahead=1 behind=a,c",
        "[batch] waiting cache=b ahead=0 behind=a",
        "[batch] paused cache=bg for=chat",
        "[batch] paused cache=x for=-",
        "[batch] admitted cache=b waited=11.2s",
    ]
    parsed = [QUEUE.search(line) for line in lines]
    assert [(m[1], m[2]) for m in parsed if m] == [
        ("waiting", "b"),
        ("waiting", "b"),
        ("paused", "bg"),
        ("paused", "x"),
        ("admitted", "b"),
    ]
    assert not [line for line in lines if LEAF.match(line)]


def test_the_minimum_and_the_interval_are_settings() -> None:
    notes = [(t / 10, _progress(1, 10 * (t + 1), 100)) for t in range(5)]
    assert len(_printed(notes, prefill_min_tokens=100, prefill_interval=0.2)) == 3
    assert _printed(notes) == []
    with pytest.raises(ValueError, match="prefill_interval"):
        StdoutSettings(prefill_interval=float("inf"))


def _raised() -> RequestFailed:
    try:
        try:
            raise KeyError("logits")
        except KeyError as exc:
            raise RequestFailed("this request failed on the engine: KeyError") from exc
    except RequestFailed as err:
        return err


def test_a_contained_failure_is_tagged_on_every_line() -> None:
    err = _raised()
    lines = _printed([(0.0, RequestNote(7, "s", Failed(err)))])
    assert lines[0] == (
        "[batch] request 7 failed alone; the engine goes on: "
        "this request failed on the engine: KeyError"
    )
    assert lines[1] == "[batch] | Traceback (most recent call last):"
    assert "[batch] | KeyError: 'logits'" in lines
    leaf = "gezel_trio.core.errors.RequestFailed: this request failed on the engine: KeyError"
    assert lines[-1] == f"[batch] | {leaf}"
    assert all(TAGGED.match(line) for line in lines[1:])
    assert [line for line in lines if LEAF.match(line)] == []
    # What a bare traceback would have shown the supervisor's classifier:
    assert LEAF.match(lines[-1].removeprefix("[batch] | "))


def test_a_failed_step_prints_once_for_its_whole_batch() -> None:
    err = EngineFailure("the model step failed: RuntimeError: boom")
    notes = [(0.0, RequestNote(rid, None, Failed(err))) for rid in (1, 2, 3)]
    lines = _printed(notes)
    assert lines[0].startswith("[batch] a model step failed; its batch failed")
    assert sum(1 for line in lines if not line.startswith("[batch] | ")) == 1


def test_a_line_never_breaks_in_two() -> None:
    out = io.StringIO()
    protocol = StdoutProtocol(stream=out)
    protocol.say_nowait("Loading model from: /a\nb")
    protocol.contained_nowait("http", ["one", "two"], "GET /x answered 500")
    protocol.close()
    protocol.say_nowait("after close, written at once")
    assert out.getvalue().splitlines() == [
        "Loading model from: /a\\nb",
        "[http] GET /x answered 500",
        "[http] | one",
        "[http] | two",
        "after close, written at once",
    ]
    assert tagged_traceback("x", ["a"]) == ["[x] | a"]


# --- a real pipe: what the writer does when the supervisor stops reading ---
#
# These run the writer's worker thread against an os.pipe that the test
# fills, so stdout takes nothing until the test reads. Nothing sleeps: the
# test waits on events the writer's thread sets, and the bounds the module
# keeps for a supervisor that stopped reading are shortened where a test
# needs one to pass.


def _full_pipe() -> tuple[int, TextIO]:
    """A pipe filled to the brim: the read end, and the write end as a text stream."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(w, b"." * 4096)
    os.set_blocking(w, True)
    return r, open(w, "w", encoding="utf-8")


def _read_all(r: int) -> bytes:
    """What the pipe holds now, without waiting."""
    os.set_blocking(r, False)
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(r, 65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _watch_the_writer_thread(monkeypatch: pytest.MonkeyPatch) -> tuple[Event, Event]:
    """Events set when the writer's worker thread starts a batch and when it returns."""
    started, returned = Event(), Event()
    write = StdoutProtocol._write_until_cancelled

    def watched(self: StdoutProtocol, lines: list[str]) -> None:
        started.set()
        try:
            write(self, lines)
        finally:
            returned.set()

    monkeypatch.setattr(StdoutProtocol, "_write_until_cancelled", watched)
    return started, returned


async def test_a_cancelled_writer_leaves_no_thread_writing_to_a_pipe_nobody_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(stdout_protocol, "_CLOSE_GRACE", 0.01)
    started, returned = _watch_the_writer_thread(monkeypatch)
    r, stream = _full_pipe()
    with stream:
        protocol = StdoutProtocol(stream=stream)
        async with trio.open_nursery() as nursery:
            await nursery.start(protocol.run)
            protocol.say_nowait("a line the pipe cannot take")
            await trio.to_thread.run_sync(started.wait)
            nursery.cancel_scope.cancel()
        # The thread was not abandoned: it had returned before run did, so
        # nothing writes behind close's back or after the server ended.
        assert returned.is_set()
        # close waited its grace and dropped the line; a later one (the
        # death traceback) does not wait again.
        assert protocol.dropped == 1
        protocol.death(EngineFailure("the engine died"))
        assert protocol.dropped > 1
        assert set(_read_all(r)) == {ord(".")}
    os.close(r)


async def test_a_slow_reader_gets_every_line_whole_and_in_order_across_a_cancel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Long enough that the reader, started when the writer thread returns,
    # drains the pipe within it; close waits no longer than the pipe needs.
    monkeypatch.setattr(stdout_protocol, "_CLOSE_GRACE", 60.0)
    started, returned = _watch_the_writer_thread(monkeypatch)
    r, stream = _full_pipe()
    lines = [f"line {i:04d} " + "x" * 90 for i in range(300)]  # ~30 KB, several pieces
    received: list[bytes] = []

    def read_after_the_writer_stopped() -> None:
        returned.wait()
        os.set_blocking(r, True)
        while chunk := os.read(r, 65536):
            received.append(chunk)

    reader = threading.Thread(target=read_after_the_writer_stopped)
    reader.start()
    with stream:
        protocol = StdoutProtocol(stream=stream)
        async with trio.open_nursery() as nursery:
            await nursery.start(protocol.run)
            for line in lines[:200]:
                protocol.say_nowait(line)
            await trio.to_thread.run_sync(started.wait)
            # Make room for a few pieces of the batch, then cancel while the
            # writer waits for the next: it stops between two pieces.
            os.read(r, 8192)
            nursery.cancel_scope.cancel()
            for line in lines[200:]:
                protocol.say_nowait(line)
    reader.join(timeout=60)
    out = b"".join(received).lstrip(b".").decode().splitlines()
    assert out == lines
    assert protocol.dropped == 0
    os.close(r)


def test_a_pipe_whose_reader_left_drops_lines_quietly() -> None:
    r, w = os.pipe()
    os.close(r)
    with open(w, "w", encoding="utf-8") as stream:
        protocol = StdoutProtocol(stream=stream)
        protocol.say_nowait("nobody reads this")
        protocol.close()
        protocol.say_nowait("nor this")
        protocol.death(EngineFailure("the engine died"))


def test_cache_ids_are_printed_as_their_tenant_sent_them() -> None:
    # Inside the server a tenant's names are namespaced (http.tenancy).
    alice = Tenant(tenant_id("alice-key"))
    own = alice.name("b")
    assert own is not None
    assert own != "b"
    lines = _printed(
        [
            (0.0, RequestNote(1, own, Queued(1), behind=(alice.name("a") or "a", "c"))),
            (0.0, RequestNote(2, own, Seeded(812, "memory:session"))),
            (0.0, _progress(3, 100, 4000, cache_id=own)),
        ]
    )
    assert lines[0] == "[batch] waiting cache=b ahead=1 behind=a,c"
    assert "cache_id=b " in lines[1]
    assert lines[2].endswith("cache=b")
    assert "alice" not in "".join(lines)
    assert alice.id not in "".join(lines)
