"""KV-aware admission, on the scripted backend.

The scripted model is given a KV footprint (``kv_per_token`` bytes per
token) and a room for it (``kv_room``); a step whose lane holds more KV
than the room raises, as running out of memory would, and fails every
sequence of the lane. Admission must keep that from ever happening: a
request that can never fit is refused before it is queued (a 400 at the
HTTP edge), and one that does not fit beside the running ones waits in the
queue until they end. Each scenario is a whole engine in one Trio run
under ``MockClock``.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from gezel_trio import ChatRequest, Finished, InvalidRequest, Queued
from gezel_trio.testing import ScriptedBackend, open_test_engine
from tests.support.scenarios import PROMPT, assert_clean, req, spawn

# The scenario prompt is 61 tokens; at one byte per token a request's KV
# is its prompt plus max_tokens.
ROOM = 150


def test_a_request_that_can_never_fit_is_refused_and_the_engine_lives() -> None:
    """Three in a row used to fail their lane three times, which ends the
    engine (``max_step_failures``); now each is refused by name, sizes
    given, and the request already running is unaffected."""

    async def scenario() -> None:
        backend = ScriptedBackend(kv_per_token=1, kv_room=ROOM)
        async with open_test_engine(backend, strict_max_tokens=True) as t:
            running: list[Any] = []
            async with trio.open_nursery() as nursery:
                spawn(nursery, t, req(max_tokens=20), running)
                for _ in range(3):
                    with pytest.raises(InvalidRequest) as err:
                        t.engine.submit_nowait(req(max_tokens=ROOM))
                    assert err.value.param == "max_tokens"
                    assert "needs 211 bytes of KV for 211 tokens" in str(err.value)
                    assert "the memory limit leaves 150 bytes for KV" in str(err.value)
            assert isinstance(running[-1], Finished)
            assert running[-1].usage.output_tokens == 20
            assert t.engine.health().status == "ok"
            await assert_clean(t)

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_prompt_that_alone_cannot_fit_names_the_messages() -> None:
    async def scenario() -> None:
        backend = ScriptedBackend(kv_per_token=1, kv_room=ROOM)
        async with open_test_engine(backend) as t:
            with pytest.raises(InvalidRequest) as err:
                await t.engine.prepare_chat(ChatRequest([{"role": "user", "content": "x" * 200}]))
            assert err.value.param == "messages"
            # Unasked (or asked for more, without --strict-max-tokens),
            # max_tokens is cut to what the room leaves, as to the context.
            messages = [{"role": "user", "content": "hi"}]
            for asked in (None, 10**6):
                prepared = await t.engine.prepare_chat(ChatRequest(messages, max_tokens=asked))
                request = prepared.request
                assert len(request.prompt) + request.max_tokens == ROOM

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_request_that_fits_later_waits_then_runs() -> None:
    """Alone each fits; together (a lane pads every sequence to its
    longest: 2 x 101) they do not, so the second waits in the queue while
    the first runs, then runs; neither fails."""

    async def scenario() -> None:
        backend = ScriptedBackend(kv_per_token=1, kv_room=ROOM)
        async with open_test_engine(backend) as t:
            first: list[Any] = []
            second: list[Any] = []
            async with trio.open_nursery() as nursery:
                spawn(nursery, t, req(max_tokens=40), first)
                spawn(nursery, t, req(max_tokens=6), second)
                state = await t.engine.wait_until(lambda s: bool(s.running))
                assert len(state.running) == 1
                assert len(state.queued) == 1
            assert isinstance(first[-1], Finished)
            assert isinstance(second[-1], Finished)
            assert any(isinstance(e, Queued) for e in second)
            assert second[-1].usage.output_tokens == 6
            assert t.engine.health().status == "ok"
            await assert_clean(t)

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def test_requests_that_fit_together_share_the_batch() -> None:
    async def scenario() -> None:
        backend = ScriptedBackend(kv_per_token=1, kv_room=ROOM)
        async with open_test_engine(backend) as t:
            done: list[list[Any]] = [[], []]
            async with trio.open_nursery() as nursery:
                for events in done:
                    spawn(nursery, t, req(max_tokens=6), events)
                state = await t.engine.wait_until(lambda s: bool(s.running))
                assert len(state.running) == 2  # 2 x 67 fits in 150
            assert all(isinstance(events[-1], Finished) for events in done)
            assert len(PROMPT) == 61

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
