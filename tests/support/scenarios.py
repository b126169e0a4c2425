"""Helpers for scripted-engine scenarios (``tests/engine``): requests on one
fixed prompt, submitting and draining, the end-state check, and running a
scenario many times on fresh mock clocks."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import trio.testing

from gezel_trio import GenerationRequest, SamplingParams
from gezel_trio.core.request import CacheRequest
from gezel_trio.testing import Point, TestEngine

RUNS = int(os.environ.get("GEZEL_SCENARIO_RUNS", "200"))
PROMPT = tuple(ord(c) for c in "system: you are a scripted model\nuser: hello there\nassistant:")


def req(cache_id: str | None = None, max_tokens: int = 6, **kw: Any) -> GenerationRequest:
    return GenerationRequest(
        PROMPT,
        max_tokens,
        SamplingParams(temperature=0.0),
        cache=CacheRequest(cache_id=cache_id),
        **kw,
    )


async def drain(t: TestEngine, request: GenerationRequest) -> list[Any]:
    with t.engine.submit_nowait(request) as handle:
        return [e async for _, e in handle]


def spawn(
    nursery: trio.Nursery, t: TestEngine, request: GenerationRequest, into: list[Any]
) -> None:
    """Submit now, synchronously, and read in a new task. Submitting without a
    checkpoint in between fixes what the engine sees at its next exchange,
    whatever order Trio runs the tasks in - which is what keeps a scenario's
    trace identical from run to run."""
    handle = t.engine.submit_nowait(request)

    async def read() -> None:
        with handle:
            into.extend([e async for _, e in handle])

    nursery.start_soon(read)


async def assert_clean(t: TestEngine) -> None:
    # Pins are released when the host applies a removal, which the engine
    # hears at the following exchange: wait for that view, then check.
    closing = t.engine.state().closing  # a stopped host publishes no more views
    with trio.fail_after(60):
        await t.engine.wait_until(
            lambda s: s.live == 0 and (closing or not any(e.pinned for e in t.engine.cache_view))
        )
    state = t.engine.state()
    assert state.live == 0
    assert state.running == ()
    assert state.queued == ()
    assert t.backend.running == ()
    assert closing or not any(e.pinned for e in t.engine.cache_view), "every pin released"


def run_many(
    scenario: Callable[[], Awaitable[list[Point]]],
    *,
    runs: int | None = None,
    same_trace: bool = True,
) -> list[Point]:
    """Run ``scenario`` on fresh mock clocks (RUNS times); every trace must match."""
    traces = []
    for _ in range(RUNS if runs is None else runs):
        traces.append(trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0)))
    first = traces[0]
    if same_trace:
        assert all(t == first for t in traces), "the scenario is not deterministic"
    return first


def bg(max_tokens: int, cache_id: str | None = None) -> GenerationRequest:
    return GenerationRequest(
        PROMPT,
        max_tokens,
        SamplingParams(temperature=0.0),
        priority="background",
        ignore_eos=True,
        cache=CacheRequest(cache_id=cache_id),
    )
