"""Deterministic cancellation scenarios on the scripted backend (SPEC H2).

Each scenario is a whole engine in one Trio run under
``MockClock(autojump_threshold=0)``: the host loop is a Trio task, so there
is no thread and no real time. A scenario stops the world at a named point
with ``Breakpoints``, cancels there, and checks the end state: what the cache
holds, that every pin and channel was released, that nothing is left
running. Each scenario runs 200 times and must trace the very same sequence
of engine points every time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from gezel_trio import (
    Delta,
    EngineClosed,
    EngineFailure,
    Failed,
    Finished,
    GenerationRequest,
    SamplingParams,
)
from gezel_trio.cache_plan import SNAPSHOT_MARGIN
from gezel_trio.request import CacheRequest
from gezel_trio.testing import Point, ScriptedBackend, TestEngine, open_test_engine

RUNS = int(__import__("os").environ.get("GEZEL_SCENARIO_RUNS", "200"))
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
        return [e async for e in handle]


def assert_clean(t: TestEngine) -> None:
    state = t.engine.state()
    assert state.live == 0
    assert state.running == ()
    assert state.queued == ()
    assert t.backend.running == ()
    assert not any(e.pinned for e in t.engine.cache_view), "every pin released"


def run_many(scenario: Callable[[], Awaitable[list[Point]]]) -> list[Point]:
    """Run ``scenario`` RUNS times on fresh mock clocks; every trace must match."""
    traces = []
    for _ in range(RUNS):
        traces.append(trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0)))
    first = traces[0]
    assert all(t == first for t in traces), "the scenario is not deterministic"
    return first


def test_cancel_while_queued_is_never_admitted() -> None:
    async def scenario() -> list[Point]:
        async with open_test_engine(max_concurrency=1) as t:
            first_token = t.breakpoints.add("decode", rid=0, index=1)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(drain, t, req("a", max_tokens=4))
                await first_token.reached()
                with trio.CancelScope() as scope:
                    scope.cancel()  # the caller of the queued request gives up
                    with t.engine.submit_nowait(req("b")) as queued:
                        assert t.engine.state().queued == (queued.rid,)
                        await trio.sleep_forever()
                first_token.release()
            assert_clean(t)
            assert [e.cache_id for e in t.engine.cache_view] == ["a"]
            assert all(p.rid != 1 for p in t.breakpoints.points)
            return t.breakpoints.points

    trace = run_many(scenario)
    assert Point("finished", 0) in trace


@pytest.mark.parametrize("trimmable", [True, False])
def test_cancel_at_prefill_chunk_k_saves_that_edge(trimmable: bool) -> None:
    backend_step = 8

    async def scenario() -> list[Point]:
        backend = ScriptedBackend(trimmable=trimmable, prefill_step=backend_step)
        async with open_test_engine(backend) as t:
            chunk3 = t.breakpoints.add("prefill", rid=0, index=3)
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(drain, t, req("s"))
                    await chunk3.reached()
                    scope.cancel()
                    chunk3.release()
            await t.engine.wait_until(lambda _: bool(t.engine.cache_view))
            [entry] = t.engine.cache_view
            assert entry.tokens == 3 * backend_step
            events = await drain(t, req("s"))
            finished = events[-1]
            assert isinstance(finished, Finished)
            assert finished.usage.cached_tokens == 3 * backend_step
            assert_clean(t)
            return t.breakpoints.points

    run_many(scenario)


@pytest.mark.parametrize("trimmable", [True, False])
def test_cancel_at_decode_token_k_keeps_what_was_paid_for(trimmable: bool) -> None:
    async def scenario() -> list[Point]:
        async with open_test_engine(ScriptedBackend(trimmable=trimmable)) as t:
            token2 = t.breakpoints.add("decode", rid=0, index=2)
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(drain, t, req("s", max_tokens=50))
                    await token2.reached()
                    scope.cancel()
                    token2.release()
            await t.engine.wait_until(lambda _: bool(t.engine.cache_view))
            [entry] = t.engine.cache_view
            if trimmable:
                assert entry.tokens == len(PROMPT) + 2  # prompt and both tokens fed
            else:
                assert entry.tokens == len(PROMPT) - SNAPSHOT_MARGIN  # the snapshot
            events = await drain(t, req("s"))
            finished = events[-1]
            assert isinstance(finished, Finished)
            expected = len(PROMPT) - 1 if trimmable else len(PROMPT) - SNAPSHOT_MARGIN
            assert finished.usage.cached_tokens == expected
            assert_clean(t)
            return t.breakpoints.points

    run_many(scenario)


def test_cancel_while_the_snapshot_is_being_taken() -> None:
    async def scenario() -> list[Point]:
        async with open_test_engine(ScriptedBackend(trimmable=False)) as t:
            snap = t.breakpoints.add("snapshot", rid=0)
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(drain, t, req("s", max_tokens=50))
                    await snap.reached()
                    scope.cancel()
                    snap.release()
            await t.engine.wait_until(lambda _: bool(t.engine.cache_view))
            assert [e.tokens for e in t.engine.cache_view] == [len(PROMPT) - SNAPSHOT_MARGIN]
            assert_clean(t)
            return t.breakpoints.points

    run_many(scenario)


def test_shutdown_begun_fails_live_requests_and_flushes(tmp_path: Path) -> None:
    async def scenario() -> list[Point]:
        persist = tmp_path / "p"
        outcome: list[Any] = []
        async with open_test_engine(persist_dir=persist) as t:
            await drain(t, req("done-before"))
            token1 = t.breakpoints.add("decode", index=1)

            async def victim() -> None:
                outcome.extend(await drain(t, req("live", max_tokens=50)))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(victim)
                await token1.reached()
                t.engine.close_nowait()  # shutdown begins with a request mid-decode
                token1.release()
            await t.engine.wait_until(lambda s: s.running == ())
            assert_clean(t)
            points = t.breakpoints.points
        last = outcome[-1]
        assert isinstance(last, Failed)
        assert isinstance(last.error, EngineClosed)
        assert sorted(p.name for p in persist.rglob("*.gzc")).__len__() == 2
        assert points[-1] == Point("shutdown")
        for p in persist.rglob("*.gzc"):
            p.unlink()
        return points

    run_many(scenario)


def test_injected_step_failure_fails_the_batch_and_the_engine_goes_on() -> None:
    async def scenario() -> list[Point]:
        async with open_test_engine(ScriptedBackend(fail_at=[5])) as t:
            results: dict[str, Any] = {}

            async def one(name: str) -> None:
                results[name] = (await drain(t, req(name, max_tokens=20)))[-1]

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, "x")
                nursery.start_soon(one, "y")
            assert all(isinstance(r, Failed) for r in results.values())
            assert all(isinstance(r.error, EngineFailure) for r in results.values())
            after = (await drain(t, req("z", max_tokens=3)))[-1]
            assert isinstance(after, Finished)
            assert after.usage.output_tokens == 3
            assert_clean(t)
            return t.breakpoints.points

    run_many(scenario)


def test_generated_text_is_the_script() -> None:
    async def scenario() -> list[Point]:
        async with open_test_engine() as t:
            events = await drain(t, req(max_tokens=5))
            text = "".join(e.text for e in events if isinstance(e, Delta))
            assert text == "syste"
            return t.breakpoints.points

    trace = run_many(scenario)
    assert [p.kind for p in trace].count("decode") == 5
