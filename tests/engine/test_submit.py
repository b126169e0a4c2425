"""The engine's Python API on the scripted backend: what it refuses at
submit, a queued request that leaves, a withdrawn or cancelled request, and
closing with requests live. None of it depends on the model, so it runs
without MLX (``gezel_trio.testing``); what the model generates is checked
on the real backend in ``test_engine``.

Every wait here is for an engine event (``engine.wait_until`` re-checks a
predicate after each engine step); ``trio.fail_after`` only bounds a hang.
"""

from __future__ import annotations

import pytest
import trio

from gezel_trio import Delta, EngineClosed, Failed, InvalidRequest, QueueFull
from gezel_trio.testing import ScriptedBackend, open_test_engine
from tests.support.engine_api import collect, greedy, prompt_for

HANG = 60  # seconds; a bound on a hang, never a wait


def _backend(trimmable: bool = True) -> ScriptedBackend:
    # The demo models' window, so a request of 10,000 tokens fits.
    return ScriptedBackend(trimmable=trimmable, context_length=32_768)


async def test_bad_requests_are_refused_at_submit() -> None:
    async with open_test_engine(_backend(), max_queue=0, max_concurrency=1) as t:
        engine = t.engine
        window = engine.info.context_length
        with pytest.raises(InvalidRequest):
            engine.submit_nowait(greedy((), 5))
        with pytest.raises(InvalidRequest) as info:
            engine.submit_nowait(greedy((1, 2), window))
        assert info.value.param == "max_tokens"
        with engine.submit_nowait(greedy((5, 6, 7), 3)), pytest.raises(QueueFull):
            engine.submit_nowait(greedy((5, 6, 7), 3))


async def test_queued_request_that_leaves_is_never_admitted() -> None:
    with trio.fail_after(HANG):
        async with open_test_engine(_backend(), max_concurrency=1) as t:
            engine = t.engine
            prompt = await prompt_for(engine)
            with engine.submit_nowait(greedy(prompt, 10_000, ignore_eos=True)) as first:
                async for _, event in first:
                    if isinstance(event, Delta):
                        break
                with engine.submit_nowait(greedy(prompt, 5)) as second:
                    assert engine.state().queued == (second.rids[0],)
                waiting_rid = second.rids[0]
                assert engine.state().queued == ()
            await engine.wait_until(lambda s: s.running == () and s.live == 0)
            assert all(r.rid != waiting_rid for r in engine.state().recent_removals)


@pytest.mark.parametrize("trimmable", [True, False], ids=["dense", "hybrid"])
async def test_withdrawn_sequence_leaves_within_one_step(trimmable: bool) -> None:
    with trio.fail_after(HANG):
        async with open_test_engine(_backend(trimmable=trimmable)) as t:
            engine = t.engine
            prompt = await prompt_for(engine)
            seen = 0
            with engine.submit_nowait(greedy(prompt, 10_000, ignore_eos=True)) as handle:
                async for _, event in handle:
                    if isinstance(event, Delta):
                        seen += 1
                        if seen == 3:
                            break
            rid = handle.rids[0]
            state = await engine.wait_until(lambda s: any(r.rid == rid for r in s.recent_removals))
            removal = next(r for r in state.recent_removals if r.rid == rid)
            assert removal.removed_at_step - removal.withdrawn_at_step <= 1
            assert rid not in state.running
            assert state.live == 0


async def test_cancelled_caller_scope_withdraws_the_request() -> None:
    with trio.fail_after(HANG):
        async with open_test_engine(_backend()) as t:
            engine = t.engine
            prompt = await prompt_for(engine)
            rid = -1
            request = greedy(prompt, 10_000, ignore_eos=True)
            with trio.CancelScope() as scope, engine.submit_nowait(request) as handle:
                rid = handle.rids[0]
                async for _, event in handle:
                    if isinstance(event, Delta):
                        scope.cancel()
            assert scope.cancelled_caught
            await engine.wait_until(lambda s: any(r.rid == rid for r in s.recent_removals))
            # The slot is free again: a new request runs to completion.
            _, fin = await collect(engine, greedy(prompt, 3, ignore_eos=True))
            assert fin.usage.output_tokens == 3


async def test_closing_fails_live_requests_with_engine_closed() -> None:
    with trio.fail_after(HANG):
        events: list[object] = []
        async with open_test_engine(_backend(), max_concurrency=1) as t:
            engine = t.engine
            prompt = await prompt_for(engine)
            running = engine.submit_nowait(greedy(prompt, 10_000, ignore_eos=True))
            queued = engine.submit_nowait(greedy(prompt, 5))
            await engine.wait_until(lambda s: s.running == (running.rids[0],))
            engine.close_nowait()
            with running, queued:
                events = [e async for _, e in running][-1:] + [e async for _, e in queued][-1:]
            with pytest.raises(EngineClosed):
                engine.submit_nowait(greedy(prompt, 5))
        assert [type(e) for e in events] == [Failed, Failed]
        assert all(isinstance(e, Failed) and isinstance(e.error, EngineClosed) for e in events)
