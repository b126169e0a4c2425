"""The GIL's switch interval while a prompt prefills (``tuning.gil``,
``--prefill-switch-ms``): short from a prompt's first chunk to its first
token, Python's again once nothing prefills and when the engine stops, and
left alone at 0. Driven over the scripted engine, whose host loop is a Trio
task on this thread, stopped at its breakpoints."""

from __future__ import annotations

import sys

import trio
import trio.testing

from gezel_trio import ChatRequest
from gezel_trio.testing import ScriptedBackend, open_test_engine
from gezel_trio.tuning.gil import PrefillSwitch

PYTHONS = 0.005


def test_the_interval_is_short_only_while_a_prompt_prefills() -> None:
    async def scenario() -> None:
        before = sys.getswitchinterval()
        seen: list[float] = []
        async with open_test_engine(ScriptedBackend(prefill_step=8)) as t:
            first_chunk = t.breakpoints.add("prefill", index=1)
            decoding = t.breakpoints.add("decode", index=2)
            # A 60-character prompt: several chunks of 8.
            request = ChatRequest([{"role": "user", "content": "x" * 60}], max_tokens=4)
            prepared = await t.engine.prepare_chat(request)
            async with trio.open_nursery() as nursery:

                async def run() -> None:
                    with t.engine.submit_chat_nowait(prepared) as chat:
                        async for _ in chat:
                            pass

                nursery.start_soon(run)
                await first_chunk.reached()
                seen.append(sys.getswitchinterval())
                first_chunk.release()
                await decoding.reached()
                seen.append(sys.getswitchinterval())
                decoding.release()
        # Short from the first chunk on; Python's once the answer decodes.
        assert seen == [0.0005, before]
        assert sys.getswitchinterval() == before

    sys.setswitchinterval(PYTHONS)
    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def test_an_engine_stopped_mid_prefill_puts_the_interval_back() -> None:
    async def scenario() -> None:
        async with open_test_engine(ScriptedBackend(prefill_step=8)) as t:
            chunk = t.breakpoints.add("prefill", index=2)
            request = ChatRequest([{"role": "user", "content": "x" * 60}], max_tokens=4)
            prepared = await t.engine.prepare_chat(request)
            chat = t.engine.submit_chat_nowait(prepared)
            await chunk.reached()
            during = sys.getswitchinterval()
            chunk.release()
            chat.close()
        assert during == 0.0005
        assert sys.getswitchinterval() == PYTHONS

    sys.setswitchinterval(PYTHONS)
    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def test_zero_leaves_the_interval_alone() -> None:
    async def scenario() -> None:
        async with open_test_engine(ScriptedBackend(prefill_step=8), prefill_switch_ms=0) as t:
            chunk = t.breakpoints.add("prefill", index=1)
            request = ChatRequest([{"role": "user", "content": "x" * 60}], max_tokens=2)
            prepared = await t.engine.prepare_chat(request)
            with t.engine.submit_chat_nowait(prepared):
                await chunk.reached()
                during = sys.getswitchinterval()
                chunk.release()
        assert during == PYTHONS

    sys.setswitchinterval(PYTHONS)
    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_switch_puts_back_what_was_there() -> None:
    sys.setswitchinterval(0.002)
    try:
        switch = PrefillSwitch(0.0005)
        switch.prefilling(True)
        switch.prefilling(True)  # still prefilling: nothing saved twice
        assert sys.getswitchinterval() == 0.0005
        switch.prefilling(False)
        assert sys.getswitchinterval() == 0.002
        switch.prefilling(False)
        assert sys.getswitchinterval() == 0.002
    finally:
        sys.setswitchinterval(PYTHONS)
