"""A queued background request waits at most ``background_queue_timeout``.

Background work is admitted only while no interactive work runs or waits,
so steady interactive traffic could hold a background request, and its
``max_queue`` slot, for ever. Each scenario is a whole engine in one Trio
run under ``MockClock`` on the scripted backend (see
``tests/engine/test_scenarios.py``); the wait is crossed with
``MockClock.jump`` at a breakpoint, never waited for.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from gezel_trio import Delta, Failed, Finished, QueueFull, QueueTimeout
from gezel_trio.testing import Point, open_test_engine
from tests.support.scenarios import assert_clean, bg, drain, req, run_many, spawn


def jump(seconds: float) -> None:
    trio.lowlevel.current_clock().jump(seconds)  # type: ignore[attr-defined]


def test_a_background_request_queued_too_long_fails_and_frees_its_slot() -> None:
    async def scenario() -> list[Point]:
        async with open_test_engine(max_concurrency=1, max_queue=2) as t:
            token3 = t.breakpoints.add("decode", rid=0, index=3)
            chat: list[Any] = []
            waiting: list[Any] = []
            later: list[Any] = []
            async with trio.open_nursery() as nursery:
                spawn(nursery, t, req("chat", max_tokens=40, ignore_eos=True), chat)
                await token3.reached()
                spawn(nursery, t, bg(5), waiting)
                spawn(nursery, t, req("next", max_tokens=3), later)
                with pytest.raises(QueueFull):
                    t.engine.submit_nowait(req("more"))  # both slots held
                jump(599)
                step = t.engine.state().step
                token3.release()
                # Not yet: two steps later the request has waited 599 s only.
                await t.engine.wait_until(lambda s: s.step >= step + 2)
                assert len(t.engine.state().queued) == 2
                jump(2)
                await t.engine.wait_until(lambda s: len(s.queued) == 1)
                # Its slot is free again: a new request is queued, not refused.
                spawn(nursery, t, req("more", max_tokens=2), [])
            assert not any(isinstance(e, Delta) for e in waiting)
            assert isinstance(waiting[-1], Failed)
            assert isinstance(waiting[-1].error, QueueTimeout)
            assert waiting[-1].error.status == 503
            assert "600 s" in waiting[-1].error.message
            # Interactive requests wait as long as the work ahead of them.
            assert isinstance(chat[-1], Finished)
            assert isinstance(later[-1], Finished)
            await assert_clean(t)
            return t.breakpoints.points

    run_many(scenario, runs=5)


def test_a_background_request_admitted_in_time_runs_and_zero_means_never() -> None:
    async def scenario() -> list[Point]:
        async with open_test_engine(max_concurrency=1, background_queue_timeout=None) as t:
            token3 = t.breakpoints.add("decode", rid=0, index=3)
            chat: list[Any] = []
            waiting: list[Any] = []
            async with trio.open_nursery() as nursery:
                spawn(nursery, t, req("chat", max_tokens=20, ignore_eos=True), chat)
                await token3.reached()
                spawn(nursery, t, bg(5), waiting)
                jump(100_000)
                token3.release()
            assert isinstance(waiting[-1], Finished)
            assert isinstance((await drain(t, bg(2)))[-1], Finished)
            await assert_clean(t)
            return t.breakpoints.points

    run_many(scenario, runs=2)
