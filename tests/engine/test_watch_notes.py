"""What a watcher of the whole engine (``Engine.watch``) hears of waits and
cache seeds, on the scripted backend under ``MockClock``: a queued request
is noted at once and then every ``waiting_every`` seconds between two
steps, its admission after the wait once, and each admission's seed with
what it reused. The clock moves only by ``MockClock.jump`` at a breakpoint;
the notes then go through the stdout protocol to the seed's lines."""

from __future__ import annotations

import io
from typing import Any

import trio
import trio.testing

from gezel_trio import Finished
from gezel_trio.core.events import Parked, Queued
from gezel_trio.engine import Admitted, RequestNote, Seeded
from gezel_trio.stdout_protocol import StdoutProtocol
from gezel_trio.testing import open_test_engine
from tests.support.scenarios import bg, drain, req, spawn


def _notes(receive: trio.MemoryReceiveChannel[RequestNote]) -> list[RequestNote]:
    notes = []
    while True:
        try:
            notes.append(receive.receive_nowait())
        except trio.WouldBlock:
            return notes


def _jump(seconds: float) -> None:
    trio.lowlevel.current_clock().jump(seconds)  # type: ignore[attr-defined]


def _lines(notes: list[RequestNote]) -> list[str]:
    out = io.StringIO()
    protocol = StdoutProtocol(stream=out)
    for note in notes:
        protocol.note_nowait(note, 0.0)
    protocol.close()
    return out.getvalue().splitlines()


def test_a_queued_request_is_noted_at_once_then_every_interval_then_admitted() -> None:
    async def scenario() -> None:
        async with open_test_engine(max_concurrency=1) as t:
            notes = t.engine.watch(waiting_every=8.0)
            third = t.breakpoints.add("decode", rid=0, index=3)
            fifth = t.breakpoints.add("decode", rid=0, index=5)
            first: list[Any] = []
            second: list[Any] = []
            async with trio.open_nursery() as nursery:
                spawn(nursery, t, req("a", max_tokens=8, ignore_eos=True), first)
                spawn(nursery, t, req("b", max_tokens=3), second)
                await third.reached()
                _jump(8.0)  # the interval is up: the next step repeats the note
                third.release()
                await fifth.reached()
                _jump(3.0)  # not again
                fifth.release()
            assert isinstance(second[-1], Finished)
            waited = [n for n in _notes(notes) if n.rid == 1 and not isinstance(n.event, Seeded)]
            assert [(n.event, n.behind, n.cache_id) for n in waited] == [
                (Queued(0), ("a",), "b"),
                (Queued(0), ("a",), "b"),
                (Admitted(11.0), (), "b"),
            ]
            assert _lines(waited) == [
                "[batch] waiting cache=b ahead=0 behind=a",
                "[batch] waiting cache=b ahead=0 behind=a",
                "[batch] admitted cache=b waited=11.0s",
            ]

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_parked_background_request_is_noted_for_the_interactive_one() -> None:
    async def scenario() -> None:
        async with open_test_engine() as t:
            notes = t.engine.watch(waiting_every=8.0)
            token3 = t.breakpoints.add("decode", rid=0, index=3)
            parked = t.breakpoints.add("parked")
            wave: list[Any] = []
            chat: list[Any] = []
            async with trio.open_nursery() as nursery:
                spawn(nursery, t, bg(20, cache_id="task"), wave)
                await token3.reached()
                spawn(nursery, t, req("person", max_tokens=5), chat)
                token3.release()
                await parked.reached()
                parked.release()
            paused = [n for n in _notes(notes) if isinstance(n.event, Parked)]
            assert [(n.rid, n.cache_id, n.behind) for n in paused] == [(0, "task", ("person",))]
            assert _lines(paused) == ["[batch] paused cache=task for=person"]

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def test_each_admission_notes_what_its_seed_reused_and_whose_it_was() -> None:
    async def scenario() -> None:
        async with open_test_engine() as t:
            notes = t.engine.watch()
            first = await drain(t, req("s", max_tokens=4))
            again = await drain(t, req("s", max_tokens=4))
            other = await drain(t, req("other", max_tokens=4))
            seeded = [(n.cache_id, n.event) for n in _notes(notes) if isinstance(n.event, Seeded)]
            usage = [run[-1].usage.cached_tokens for run in (first, again, other)]
            assert usage[0] == 0
            assert usage[1] > 0
            assert seeded == [
                ("s", Seeded(0, "fresh")),
                ("s", Seeded(usage[1], "memory:session")),
                ("other", Seeded(usage[2], "memory:shared")),
            ]
            # Only the turn seeded from its own session's entry prints.
            assert _lines([RequestNote(1, cache_id, event) for cache_id, event in seeded]) == [
                f"[cache] hit cache_id=s prior_tokens={usage[1]}"
            ]

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
