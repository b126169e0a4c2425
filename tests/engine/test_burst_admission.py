"""An idle engine's first step waits, briefly, for requests still being
prepared (``HostLink.wait_for_work``): a burst released together starts
decoding at one step, not its first request one step ahead of the rest.

Scripted backend under MockClock: when each request is admitted is exact."""

from __future__ import annotations

import trio
import trio.testing

from gezel_trio import GenerationRequest
from gezel_trio.engine._link import _GATHER_S, Expected
from gezel_trio.testing import ScriptedBackend, open_test_engine

FIRST = tuple(ord(c) for c in "user: the first of a burst\nassistant:")
SECOND = tuple(ord(c) for c in "user: the second, a moment behind\nassistant:")


def run(scenario: object) -> None:
    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))  # type: ignore[arg-type]


def test_the_first_step_waits_for_a_request_being_prepared() -> None:
    async def scenario() -> None:
        async with open_test_engine(ScriptedBackend()) as t:
            engine, link = t.engine, t.engine.link
            preparing = Expected()  # the second request, in its preparation
            link.expect(preparing)
            with engine.submit_nowait(GenerationRequest(FIRST, max_tokens=3)) as first:
                await trio.sleep(_GATHER_S / 4)
                assert engine.state().running == ()  # held for the one being prepared
                link.unexpect(preparing)
                with engine.submit_nowait(GenerationRequest(SECOND, max_tokens=3)) as second:
                    state = await engine.wait_until(lambda s: bool(s.running))
                    assert len(state.running) == 2  # admitted together
                    assert [e async for e in first]
                    assert [e async for e in second]

    run(scenario)


def test_the_wait_is_bounded_and_a_dropped_preparation_ends_it() -> None:
    async def scenario() -> None:
        async with open_test_engine(ScriptedBackend()) as t:
            engine, link = t.engine, t.engine.link
            link.expect(Expected())  # dropped at once: a preparation that failed
            start = trio.current_time()
            with engine.submit_nowait(GenerationRequest(FIRST, max_tokens=2)) as one:
                await engine.wait_until(lambda s: bool(s.running))
                assert trio.current_time() == start  # nothing to wait for
                assert [e async for e in one]
            stuck = Expected()  # prepared and never submitted
            link.expect(stuck)
            start = trio.current_time()
            with engine.submit_nowait(GenerationRequest(SECOND, max_tokens=2)) as two:
                await engine.wait_until(lambda s: bool(s.running))
                assert trio.current_time() - start == _GATHER_S
                assert [e async for e in two]
            del stuck

    run(scenario)
