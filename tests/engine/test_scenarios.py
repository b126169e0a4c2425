"""Deterministic cancellation scenarios on the scripted backend.

Each scenario is a whole engine in one Trio run under
``MockClock(autojump_threshold=0)``: the host loop is a Trio task, so there
is no thread and no real time. A scenario stops the world at a named point
with ``Breakpoints``, cancels there, and checks the end state: what the cache
holds, that every pin and channel was released, that nothing is left
running. Each scenario runs 200 times and must trace the very same sequence
of engine points every time.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
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
from gezel_trio.core.cache_plan import SNAPSHOT_MARGIN
from gezel_trio.core.request import CacheRequest
from gezel_trio.testing import Point, ScriptedBackend, TestEngine, open_test_engine
from tests.support.scenarios import PROMPT, assert_clean, bg, drain, req, run_many, spawn


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
                        assert t.engine.state().queued == (queued.rids[0],)
                        await trio.sleep_forever()
                first_token.release()
            await assert_clean(t)
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
            await assert_clean(t)
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
            await t.engine.wait_until(lambda _: any(e.cache_id == "s" for e in t.engine.cache_view))
            entries = {e.cache_id: e.tokens for e in t.engine.cache_view}
            assert entries["s"] == len(PROMPT) + 2  # prompt and both tokens fed
            if not trimmable:  # and the checkpoints taken on the way
                assert sorted(entries.values()) == [
                    len(PROMPT) - SNAPSHOT_MARGIN,
                    len(PROMPT) - 1,
                    len(PROMPT) + 2,
                ]
            events = await drain(t, req("s"))
            finished = events[-1]
            assert isinstance(finished, Finished)
            # The retry: everything but the last prompt token, either way.
            assert finished.usage.cached_tokens == len(PROMPT) - 1
            await assert_clean(t)
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
            await assert_clean(t)
            return t.breakpoints.points

    run_many(scenario)


@pytest.fixture
def ram_path(tmp_path: Path) -> Iterator[Path]:
    """A fresh folder in memory where there is one (``/dev/shm``): a flush
    still writes, fsyncs and renames every file, but its fsync waits for no
    disk. On a disk the other worker's tests were writing to, the fsyncs of
    this test's 200 runs took it from 5 s to 40-50 s; here it takes 1 s."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir=shm, prefix="gezel-test-") as d:
        yield Path(d)


def test_shutdown_begun_fails_live_requests_and_flushes(ram_path: Path) -> None:
    async def scenario() -> list[Point]:
        persist = ram_path / "p"
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
            await assert_clean(t)
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
            outs: dict[str, list[Any]] = {"x": [], "y": []}
            async with trio.open_nursery() as nursery:
                for name, into in outs.items():
                    spawn(nursery, t, req(name, max_tokens=20), into)
            results = {name: events[-1] for name, events in outs.items()}
            assert all(isinstance(r, Failed) for r in results.values())
            assert all(isinstance(r.error, EngineFailure) for r in results.values())
            after = (await drain(t, req("z", max_tokens=3)))[-1]
            assert isinstance(after, Finished)
            assert after.usage.output_tokens == 3
            await assert_clean(t)
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


def test_interactive_parks_a_background_wave_which_resumes_exactly() -> None:
    async def scenario() -> list[Point]:
        async with open_test_engine() as t:
            alone = await drain(t, bg(12))
            results: dict[str, list[Any]] = {"bg1": [], "bg2": [], "chat": []}
            token3 = t.breakpoints.add("decode", rid=1, index=3)
            async with trio.open_nursery() as nursery:
                spawn(nursery, t, bg(12), results["bg1"])
                spawn(nursery, t, bg(12), results["bg2"])
                await token3.reached()
                spawn(nursery, t, req(max_tokens=4), results["chat"])
                token3.release()
            kinds = [type(e).__name__ for e in results["bg1"]]
            assert "Parked" in kinds
            assert kinds.index("Resumed") > kinds.index("Parked")
            text = "".join(e.text for e in results["bg1"] if isinstance(e, Delta))
            assert text == "".join(e.text for e in alone if isinstance(e, Delta))
            trace = t.breakpoints.points
            chat_done = trace.index(Point("finished", 3))
            assert trace.index(Point("finished", 1)) > chat_done, "chat ran before the wave ended"
            parked = trace.index(Point("parked", 1))
            resumed = trace.index(Point("resumed", 1))
            # While parked, the wave's sequences did not move.
            assert not any(p.kind == "decode" and p.rid in (1, 2) for p in trace[parked:resumed])
            await assert_clean(t)
            return trace

    run_many(scenario)


def test_cancel_while_parked_leaves_the_parked_wave() -> None:
    async def scenario() -> list[Point]:
        async with open_test_engine(ScriptedBackend(trimmable=False)) as t:
            admitted = t.breakpoints.add("admitted", rid=0)
            parked = t.breakpoints.add("parked", rid=0)
            chat: list[Any] = []
            background_scope = trio.CancelScope()
            handle = t.engine.submit_nowait(bg(40, cache_id="bg"))

            async def background_reader() -> None:
                with background_scope, handle:
                    async for _ in handle:
                        pass

            async with trio.open_nursery() as nursery:
                nursery.start_soon(background_reader)
                await admitted.reached()
                spawn(nursery, t, req(max_tokens=8), chat)
                admitted.release()
                await parked.reached()
                background_scope.cancel()  # the parked request's caller leaves
                parked.release()
            assert isinstance(chat[-1], Finished)
            trace = t.breakpoints.points
            assert trace.index(Point("removed", 0)) < trace.index(Point("finished", 1))
            assert Point("resumed", 0) not in trace
            # What the parked request had prefilled is kept under its id.
            await t.engine.wait_until(lambda _: bool(t.engine.cache_view))
            assert "bg" in [e.cache_id for e in t.engine.cache_view]
            await assert_clean(t)
            return trace

    run_many(scenario)


def test_tight_memory_holds_preemption_back() -> None:
    async def scenario() -> list[Point]:
        backend = ScriptedBackend()
        async with open_test_engine(backend) as t:
            t.engine.config  # noqa: B018
            backend.memory_bytes = 10**12  # far above any ceiling
            admitted = t.breakpoints.add("admitted", rid=0)
            async with trio.open_nursery() as nursery:
                spawn(nursery, t, bg(6), [])
                await admitted.reached()
                spawn(nursery, t, req(max_tokens=2), [])
                admitted.release()
            trace = t.breakpoints.points
            assert backend.reclaims > 0, "buffers are given back under pressure"
            assert not any(p.kind == "parked" for p in trace)
            assert trace.index(Point("finished", 0)) < trace.index(Point("admitted", 1))
            return trace

    # The memory ceiling needs a configured limit; build the engine with one.
    import gezel_trio.testing as testing

    original = testing.open_test_engine

    def with_limit(*a: Any, **kw: Any) -> Any:
        return original(*a, memory_limit_mb=1.0, **kw)

    globals()["open_test_engine"] = with_limit
    try:
        run_many(scenario)
    finally:
        globals()["open_test_engine"] = original


def test_queued_requests_hear_their_position() -> None:
    async def scenario() -> list[Point]:
        async with open_test_engine(max_concurrency=1) as t:
            results: dict[int, list[Any]] = {i: [] for i in range(3)}
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    spawn(nursery, t, req(max_tokens=3), results[i])
            positions = {
                i: [e.position for e in events if type(e).__name__ == "Queued"]
                for i, events in results.items()
            }
            assert sorted(positions.values()) == [[], [0], [1, 0]]
            return t.breakpoints.points

    run_many(scenario)


def test_a_burst_of_200_clients_leaving_at_random_points_leaks_nothing() -> None:
    import random

    async def scenario() -> list[Point]:
        rng = random.Random(1234)
        async with open_test_engine(max_concurrency=4, max_queue=256) as t:
            async with trio.open_nursery() as nursery:
                for i in range(200):
                    leave_after = rng.randrange(0, 30)  # events read before leaving
                    handle = t.engine.submit_nowait(
                        bg(20, cache_id=f"c{i % 7}") if i % 3 else req(f"c{i % 7}", 20)
                    )

                    async def client(h: Any = handle, n: int = leave_after) -> None:
                        with h:
                            seen = 0
                            async for _ in h:
                                seen += 1
                                if seen >= n:
                                    return  # the client disconnects here

                    nursery.start_soon(client)
            await t.engine.wait_until(lambda s: s.running == () and s.live == 0)
            await assert_clean(t)
            assert t.backend.running == ()
            return t.breakpoints.points

    # Readers leave while the engine runs, so which step sees each departure
    # depends on Trio's scheduling: this checks the end state, not the trace.
    run_many(scenario, runs=20, same_trace=False)


# --- the prompt cache without ids: which prefix, which checkpoint, which eviction ---


def chat_request(turns: list[tuple[str, str]], user: str, max_tokens: int = 4) -> GenerationRequest:
    """A conversation as the scripted renderer draws it, with the message
    boundaries it reports, and no cache id: what a plain client sends."""
    messages = [{"role": "system", "content": "you are a scripted model"}]
    for u, a in turns:
        messages += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    messages.append({"role": "user", "content": user})
    rendered = ScriptedBackend().renderer.render(
        messages, tools=None, template_kwargs={}, template_override=None
    )
    return GenerationRequest(
        rendered.tokens,
        max_tokens,
        SamplingParams(temperature=0.0),
        cache=CacheRequest(boundaries=rendered.boundaries),
    )


async def finished(t: TestEngine, request: GenerationRequest) -> Finished:
    events = await drain(t, request)
    assert isinstance(events[-1], Finished), events[-1]
    return events[-1]


@pytest.mark.parametrize("trimmable", [True, False])
def test_interleaved_plain_conversations_each_resume_their_own_turn(trimmable: bool) -> None:
    """Three conversations, no ids, turns interleaved: each turn starts from
    its own conversation's previous turn (the reply is re-rendered from the
    text, so an untrimmable model resumes at the history's end)."""

    async def scenario() -> list[Point]:
        async with open_test_engine(ScriptedBackend(trimmable=trimmable)) as t:
            histories: list[list[tuple[str, str]]] = [[], [], []]
            for turn in range(3):
                for i, history in enumerate(histories):
                    request = chat_request(history, f"question {turn} of {i}")
                    done = await finished(t, request)
                    if turn:
                        previous = chat_request(history[:-1], history[-1][0])
                        assert previous.cache is not None
                        # At least up to the end of the previous turn's history
                        # (its reply is re-rendered from the text).
                        history_end = previous.cache.boundaries[-1]
                        assert done.usage.cached_tokens >= history_end, (turn, i)
                    history.append((f"question {turn} of {i}", "answer"))
            await assert_clean(t)
            return t.breakpoints.points

    run_many(scenario, runs=20)


def test_eviction_spares_the_seed_of_a_running_request() -> None:
    """A tiny budget: while a long turn runs, its seed entry is pinned and
    survives the saves that push the store over budget; released, it is the
    coldest and goes first."""
    budget_mb = 16 * 200 / 2**20  # 200 scripted tokens of 16 bytes

    async def scenario() -> list[Point]:
        backend = ScriptedBackend(trimmable=True, prefill_step=32)
        async with open_test_engine(backend, cache_budget_mb=budget_mb) as t:
            first = chat_request([], "keep this conversation " * 3)
            await finished(t, first)
            seed_tokens = [e.tokens for e in t.engine.cache_view]
            token3 = t.breakpoints.add("decode", rid=1, index=3)
            follow = chat_request([("keep this conversation " * 3, "answer")], "more", 50)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(drain, t, follow)
                await token3.reached()
                token3.release()
                for i in range(3):  # others fill the store past its budget
                    await finished(t, chat_request([], f"unrelated {i} " * 12))
                    pinned = [e.tokens for e in t.engine.cache_view if e.pinned]
                    assert pinned == seed_tokens
                assert t.engine.cache_totals.evictions > 0
            await assert_clean(t)
            return t.breakpoints.points

    # The long turn decodes beside the others, so how their steps interleave
    # depends on Trio's scheduling: this checks the cache's decisions, which
    # do not, not the trace.
    run_many(scenario, runs=20, same_trace=False)
