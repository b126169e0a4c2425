"""A stream that fell behind its sequence writes what waits in one send
(``http.sse.ChatStream``): one socket write per read of the body, not one
per token, while a stream that keeps up still gets each event as it comes.
Driven over the scripted engine, whose host loop is a Trio task, so when
the reader falls behind is exact."""

from __future__ import annotations

import trio
import trio.testing

from gezel_trio import ChatFinished, ChatRequest, TextDelta
from gezel_trio.http.sse import ChatStream
from gezel_trio.testing import ScriptedBackend, open_test_engine
from tests.support.sse_frames import NamedFrames, event_names


def test_a_stream_behind_its_sequence_writes_every_waiting_event_at_once() -> None:
    async def scenario() -> None:
        async with open_test_engine(ScriptedBackend()) as t:
            request = ChatRequest([{"role": "user", "content": "hi"}], max_tokens=6)
            prepared = await t.engine.prepare_chat(request)
            stream = ChatStream(t.engine, prepared, NamedFrames())
            assert event_names(await stream.__anext__()) == ["open"]  # submitted now
            # The reader stops reading; the sequence runs to its end meanwhile.
            await t.engine.wait_until(lambda s: s.running == () and s.queued == ())
            write = event_names(await stream.__anext__())
            # One write: every delta, then the end.
            assert write.count(TextDelta.__name__) == 6
            assert write[-1] == ChatFinished.__name__
            try:
                await stream.__anext__()
            except StopAsyncIteration:
                pass
            else:
                raise AssertionError("the stream went on after its end")

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_stream_that_keeps_up_writes_each_event_as_it_comes() -> None:
    async def scenario() -> None:
        async with open_test_engine(ScriptedBackend()) as t:
            request = ChatRequest([{"role": "user", "content": "hi"}], max_tokens=6)
            prepared = await t.engine.prepare_chat(request)
            writes = [event_names(w) async for w in ChatStream(t.engine, prepared, NamedFrames())]
            # Read as fast as they come, each token is its own write.
            assert sum(w == [TextDelta.__name__] for w in writes) >= 5
            assert writes[-1][-1] == ChatFinished.__name__

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
