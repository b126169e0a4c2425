"""A stream's output held for the tokens due soon (``--stream-hold-ms``,
``http.sse.ChatStream``): fewer writes when the model is faster than the
hold, each token as it comes when it is slower, never the first token nor
the end, and a client that leaves mid-hold withdraws its request. The
scripted engine's decode steps are paced on the mock clock by a breakpoint
at each one, so every arrival time is exact."""

from __future__ import annotations

import itertools

import trio
import trio.testing

from gezel_trio import ChatFinished, ChatRequest, TextDelta
from gezel_trio.http.app import HttpSettings, create_app
from gezel_trio.http.sse import STREAM_HOLD_KEY, ChatStream, stream_chat
from gezel_trio.testing import ScriptedBackend, TestEngine, open_test_engine
from tests.support.sse_frames import NamedFrames, event_names

HOLD = 0.025


async def _pace(t: TestEngine, step_s: float) -> None:
    """Make each decode step take ``step_s`` of the mock clock."""
    while True:
        bp = t.breakpoints.add("decode")
        try:
            await bp.reached()
            await trio.sleep(step_s)
        finally:
            bp.release()  # never leaves the engine stopped


async def _writes(
    step_s: float, tokens: int, hold_s: float = HOLD
) -> list[tuple[float, list[str]]]:
    """Each write of a ``tokens``-token stream (its mock time, its events)
    whose steps take ``step_s``."""
    async with open_test_engine(ScriptedBackend()) as t, trio.open_nursery() as nursery:
        nursery.start_soon(_pace, t, step_s)
        request = ChatRequest([{"role": "user", "content": "hi"}], max_tokens=tokens)
        prepared = await t.engine.prepare_chat(request)
        stream = ChatStream(t.engine, prepared, NamedFrames(), hold_s=hold_s)
        writes = [(trio.current_time(), event_names(w)) async for w in stream]
        nursery.cancel_scope.cancel()
    return writes


def _tokens(writes: list[tuple[float, list[str]]]) -> list[int]:
    return [w.count(TextDelta.__name__) for _, w in writes if TextDelta.__name__ in w]


def test_output_faster_than_the_hold_goes_out_in_fewer_writes() -> None:
    async def scenario() -> None:
        writes = await _writes(step_s=0.010, tokens=11)
        # The first token at once; then what 25 ms brings at 10 ms a token
        # (the one that came and the two due within it); the end at once.
        assert _tokens(writes) == [1, 3, 3, 3, 1]
        assert writes[-1][1][-1] == ChatFinished.__name__
        first_output = next(at for at, w in writes if TextDelta.__name__ in w)
        # The last token and the end were sent when they came: 10 steps
        # after the first token, not a hold later.
        assert round(writes[-1][0] - first_output, 6) == 0.100

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def test_output_slower_than_the_hold_goes_out_as_it_comes() -> None:
    async def scenario() -> None:
        writes = await _writes(step_s=0.040, tokens=6)
        assert _tokens(writes) == [1, 1, 1, 1, 1, 1]
        times = [at for at, w in writes if TextDelta.__name__ in w]
        assert [round(b - a, 6) for a, b in itertools.pairwise(times)] == [0.040] * 5

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def test_no_hold_sends_each_token_as_it_comes() -> None:
    async def scenario() -> None:
        writes = await _writes(step_s=0.010, tokens=6, hold_s=0.0)
        assert _tokens(writes) == [1] * 6

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_token_late_for_its_hold_is_sent_when_the_hold_ends() -> None:
    async def scenario() -> None:
        async with open_test_engine(ScriptedBackend()) as t, trio.open_nursery() as nursery:
            request = ChatRequest([{"role": "user", "content": "hi"}], max_tokens=8)
            prepared = await t.engine.prepare_chat(request)
            stream = ChatStream(t.engine, prepared, NamedFrames(), hold_s=HOLD)
            # Tokens at 10, 20 and 30 ms, then one 200 ms later.
            steps: list[float] = [0.010, 0.010, 0.010, 0.200]
            slow = trio.Event()

            async def pace() -> None:
                while True:
                    bp = t.breakpoints.add("decode")
                    try:
                        await bp.reached()
                        step = steps.pop(0) if steps else 0.010
                        if step > HOLD:
                            slow.set()
                        await trio.sleep(step)
                    finally:
                        bp.release()

            nursery.start_soon(pace)
            writes: list[tuple[float, list[str]]] = []
            async for w in stream:
                writes.append((trio.current_time(), event_names(w)))
                if slow.is_set():
                    break
            await stream.aclose()
            nursery.cancel_scope.cancel()
        # The tokens of 20 and 30 ms were held for the one due at 40; it
        # was late, and they went out when the first had waited 25 ms.
        at, events = writes[-1]
        assert (round(at, 6), events) == (0.045, [TextDelta.__name__] * 2)
        assert _tokens(writes) == [1, 2]

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_client_gone_during_a_hold_withdraws_its_request() -> None:
    async def scenario() -> None:
        async with open_test_engine(ScriptedBackend()) as t, trio.open_nursery() as nursery:
            nursery.start_soon(_pace, t, 0.010)
            request = ChatRequest([{"role": "user", "content": "hi"}], max_tokens=1000)
            prepared = await t.engine.prepare_chat(request)
            stream = ChatStream(t.engine, prepared, NamedFrames(), hold_s=HOLD)
            while TextDelta.__name__ not in event_names(await stream.__anext__()):
                pass
            # The next write holds its token; the client leaves meanwhile.
            with trio.move_on_after(0.015) as left:
                await stream.__anext__()
            assert left.cancelled_caught
            # Withdrawn within a step, not after its 1,000 tokens (10 s).
            with trio.fail_after(0.050):
                await t.engine.wait_until(lambda s: s.running == () and s.queued == ())
            nursery.cancel_scope.cancel()

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_server_setting_reaches_the_app() -> None:
    async def scenario() -> None:
        async with open_test_engine(ScriptedBackend()) as t:
            assert create_app(t.engine, HttpSettings()).config[STREAM_HOLD_KEY] == HOLD
            off = create_app(t.engine, HttpSettings(stream_hold_ms=0))
            assert off.config[STREAM_HOLD_KEY] == 0.0

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def test_every_protocols_stream_holds_as_the_server_says() -> None:
    """``stream_chat`` (each protocol's streamed answer) reads the app's
    ``--stream-hold-ms``."""

    async def writes_under(settings: HttpSettings) -> list[int]:
        async with open_test_engine(ScriptedBackend()) as t, trio.open_nursery() as nursery:
            nursery.start_soon(_pace, t, 0.010)
            request = ChatRequest([{"role": "user", "content": "hi"}], max_tokens=11)
            prepared = await t.engine.prepare_chat(request)
            app = create_app(t.engine, settings)
            async with app.app_context():
                response = stream_chat(t.engine, prepared, NamedFrames())
            async with response.response as body:
                writes = [(0.0, event_names(w)) async for w in body]
            nursery.cancel_scope.cancel()
        return _tokens(writes)

    async def scenario() -> None:
        assert await writes_under(HttpSettings()) == [1, 3, 3, 3, 1]
        assert await writes_under(HttpSettings(stream_hold_ms=0)) == [1] * 11

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
