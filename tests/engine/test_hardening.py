"""No request can hurt another, on the scripted backend.

Each scenario is a whole engine in one Trio run under ``MockClock`` (see
``tests/engine/test_scenarios.py``): a request's own failure fails it alone, a
failed model step fails only its lane, and an engine that stops working
says so to every request. Timeouts are crossed with ``MockClock.jump`` at a
breakpoint, never waited for.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import pytest
import trio
import trio.testing

from gezel_trio import (
    Delta,
    EngineFailure,
    Failed,
    Finished,
    GenerationRequest,
    InvalidRequest,
    RequestFailed,
    SlowConsumer,
)
from gezel_trio.testing import Point, ScriptedBackend, TestEngine, open_test_engine
from tests.support.scenarios import assert_clean, bg, drain, req, run_many, spawn


def text_of(events: list[Any]) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


def test_a_request_whose_sampler_raises_fails_alone() -> None:
    """The backend reports the sequence in ``StepOutput.failed`` (as the MLX
    backend's guarded samplers do); its batch-mates finish as if alone."""

    def poisoned(r: GenerationRequest) -> bool:
        return r.max_tokens == 7

    async def scenario() -> list[Point]:
        async with open_test_engine(ScriptedBackend(poison=poisoned)) as t:
            alone = text_of(await drain(t, req("x", max_tokens=12)))
            out: dict[str, list[Any]] = {"x": [], "bad": [], "y": []}
            async with trio.open_nursery() as nursery:
                spawn(nursery, t, req("x", max_tokens=12), out["x"])
                spawn(nursery, t, req("bad", max_tokens=7), out["bad"])
                spawn(nursery, t, req("y", max_tokens=12), out["y"])
            bad = out["bad"][-1]
            assert isinstance(bad, Failed)
            assert isinstance(bad.error, RequestFailed)
            assert "sampler" in bad.error.message
            for name in ("x", "y"):
                assert isinstance(out[name][-1], Finished)
                assert text_of(out[name]) == alone
            await assert_clean(t)
            assert t.engine.health().status == "ok"
            return t.breakpoints.points

    run_many(scenario, runs=20)


def test_a_failed_step_fails_only_its_lane_and_the_parked_wave_resumes() -> None:
    async def scenario() -> list[Point]:
        backend = ScriptedBackend()
        async with open_test_engine(backend) as t:
            alone = text_of(await drain(t, bg(20)))
            token3 = t.breakpoints.add("decode", rid=1, index=3)
            parked = t.breakpoints.add("parked")
            wave: list[Any] = []
            chat: list[Any] = []
            async with trio.open_nursery() as nursery:
                spawn(nursery, t, bg(20), wave)
                await token3.reached()
                spawn(nursery, t, req("chat", max_tokens=5), chat)
                token3.release()
                await parked.reached()
                backend.fail_at = {backend.steps + 1}  # the interactive lane's next step
                parked.release()
            assert isinstance(chat[-1], Failed)
            assert isinstance(chat[-1].error, EngineFailure)
            assert isinstance(wave[-1], Finished)
            assert text_of(wave) == alone, "the parked wave lost nothing"
            health = t.engine.health()
            assert health.status == "degraded"
            assert "model step failed" in health.reasons[0]
            await assert_clean(t)
            return t.breakpoints.points

    run_many(scenario, runs=20)


async def until_the_engine_fails(
    backend: ScriptedBackend, body: Callable[[TestEngine], Awaitable[None]], **kw: Any
) -> tuple[TestEngine, EngineFailure]:
    """Run ``body`` in a test engine, then wait for the engine's own failure
    to end the block (``open_engine`` raises it); returns both."""
    held: list[TestEngine] = []
    with pytest.raises(EngineFailure) as info:
        await _engine_life(backend, body, held, **kw)
    return held[0], info.value


async def _engine_life(
    backend: ScriptedBackend,
    body: Callable[[TestEngine], Awaitable[None]],
    held: list[TestEngine],
    **kw: Any,
) -> None:
    async with open_test_engine(backend, **kw) as t:
        held.append(t)
        await body(t)
        await trio.sleep_forever()


def test_consecutive_step_failures_stop_the_engine() -> None:
    handles: list[Any] = []

    async def body(t: TestEngine) -> None:
        for _ in range(2):
            last = (await drain(t, req(max_tokens=3)))[-1]
            assert isinstance(last, Failed)
            assert t.engine.health().status == "degraded"
        running = t.engine.submit_nowait(req(max_tokens=3))
        handles.append(t.engine.submit_nowait(req(max_tokens=3)))  # queued behind it
        with running:
            async for _, _ in running:
                pass

    async def scenario() -> None:
        backend = ScriptedBackend(fail_at=[1, 2, 3])
        t, failure = await until_the_engine_fails(backend, body, max_concurrency=1)
        assert "3 consecutive model steps failed" in failure.message
        assert t.engine.health().status == "failed"
        events = [e async for _, e in handles[0]]  # what the queued request heard
        assert isinstance(events[-1], Failed)
        assert isinstance(events[-1].error, EngineFailure)
        with pytest.raises(EngineFailure):
            t.engine.submit_nowait(req())

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_dead_host_fails_every_request_with_engine_failure() -> None:
    handles: list[Any] = []

    async def body(t: TestEngine) -> None:
        handles.extend(t.engine.submit_nowait(req(str(i), max_tokens=30)) for i in range(3))

    async def scenario() -> None:
        t, failure = await until_the_engine_fails(ScriptedBackend(crash_at=3), body)
        assert "host thread died" in failure.message
        for handle in handles:
            with handle:
                events = [e async for _, e in handle]
            assert isinstance(events[-1], Failed)
            assert isinstance(events[-1].error, EngineFailure)
        health = t.engine.health()
        assert health.status == "failed"
        assert "host thread died" in health.reasons[0]

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_request_refused_at_insertion_on_an_idle_engine_fails_at_once() -> None:
    """The refusal is news: the idle host delivers it before it sleeps."""

    async def scenario() -> list[Point]:
        async with open_test_engine() as t:
            refused = GenerationRequest(req().prompt, 4, constraint=cast(Any, object()))
            with trio.fail_after(1):  # under MockClock: only a hang gets here
                events = await drain(t, refused)
            assert isinstance(events[-1], Failed)
            assert isinstance(events[-1].error, InvalidRequest)
            await assert_clean(t)
            return t.breakpoints.points

    run_many(scenario, runs=20)


def test_a_request_withdrawn_in_its_last_step_lets_flush_settle() -> None:
    async def scenario() -> list[Point]:
        async with open_test_engine() as t:
            last_token = t.breakpoints.add("decode", rid=0, index=4)
            handle = t.engine.submit_nowait(req("a", max_tokens=4))
            await last_token.reached()
            handle.__exit__(None, None, None)  # the caller leaves as it finishes
            last_token.release()
            with trio.fail_after(1):
                await t.engine.settle()
            await assert_clean(t)
            return t.breakpoints.points

    run_many(scenario, runs=20)


def test_a_parked_wave_takes_turns_after_max_park_seconds() -> None:
    async def scenario() -> list[Point]:
        async with open_test_engine(max_park_seconds=10) as t:
            alone = text_of(await drain(t, bg(12)))
            token3 = t.breakpoints.add("decode", rid=1, index=3)
            parked = t.breakpoints.add("parked")
            wave: list[Any] = []
            chat: list[Any] = []
            async with trio.open_nursery() as nursery:
                spawn(nursery, t, bg(12), wave)
                await token3.reached()
                spawn(nursery, t, req("chat", max_tokens=200, ignore_eos=True), chat)
                token3.release()
                await parked.reached()
                trio.lowlevel.current_clock().jump(11)  # type: ignore[attr-defined]
                parked.release()
            trace = t.breakpoints.points
            wave_rid, chat_rid = 1, 2
            assert trace.index(Point("finished", wave_rid)) < trace.index(
                Point("finished", chat_rid)
            ), "the wave finished while interactive work still ran"
            assert Point("resumed", wave_rid) in trace
            assert text_of(wave) == alone
            assert isinstance(chat[-1], Finished)
            assert chat[-1].usage.output_tokens == 200
            await assert_clean(t)
            return trace

    run_many(scenario, runs=20)


def test_a_reader_that_stops_reading_is_withdrawn_after_stall_timeout() -> None:
    async def scenario() -> list[Point]:
        async with open_test_engine(stall_timeout=30) as t:
            token3 = t.breakpoints.add("decode", rid=0, index=3)
            reading: list[Any] = []
            async with trio.open_nursery() as nursery:
                silent = t.engine.submit_nowait(req("silent", max_tokens=100))
                spawn(nursery, t, req("reader", max_tokens=20), reading)
                await token3.reached()
                trio.lowlevel.current_clock().jump(31)  # type: ignore[attr-defined]
                token3.release()
                await t.engine.wait_until(
                    lambda s: any(r.rid == silent.rids[0] for r in s.recent_removals)
                )
            assert isinstance(reading[-1], Finished), "a reader that reads is never withdrawn"
            with silent:
                events = [e async for _, e in silent]
            assert isinstance(events[-1], Failed)
            assert isinstance(events[-1].error, SlowConsumer)
            assert sum(isinstance(e, Delta) for e in events) < 100
            await assert_clean(t)
            return t.breakpoints.points

    run_many(scenario, runs=20)


@pytest.mark.parametrize(("timeout", "written"), [(0.0, 0), (30.0, 3)])
def test_the_shutdown_flush_stops_at_its_deadline(
    tmp_path: Path, timeout: float, written: int
) -> None:
    async def scenario() -> None:
        async with open_test_engine(persist_dir=tmp_path, shutdown_timeout=timeout) as t:
            for name in ("a", "b", "c"):
                assert isinstance((await drain(t, req(name, max_tokens=2)))[-1], Finished)

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(list(tmp_path.rglob("*.gzc"))) == written
