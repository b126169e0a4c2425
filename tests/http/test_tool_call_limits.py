"""How many tool calls a reply may carry: chat's ``parallel_tool_calls:
false``, Responses' ``max_tool_calls`` (and its ``parallel_tool_calls``),
Messages' ``disable_parallel_tool_use``. The reply ends at the end of its
last allowed call, finished ``tool_calls``; what the model would write after
it is never generated.

A scripted backend speaking Hermes markup writes two calls and then text,
one character a token, so the tokens of the first call are known; each
protocol is driven by its real SDK over a real server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import openai
import pytest
import trio

from gezel_trio.core.model import ModelInfo
from gezel_trio.core.request import GenerationRequest
from gezel_trio.engine import ChatFinished
from gezel_trio.http.app import HttpSettings
from gezel_trio.server import ServerConfig, serve
from gezel_trio.shaping.shaper import ToolCallDone
from gezel_trio.testing import EOS, ScriptedBackend, open_test_engine

if TYPE_CHECKING:
    pass

# The openai SDK's stream leaves its SSE generators to the garbage collector
# after [DONE] (as tests/clients/test_clients.py notes).
pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

HANG = 60
FIRST = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'
SECOND = '\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>'
AFTER = "\nBoth cities looked up." + "x" * 400
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}}
CHAT_TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_time", "parameters": PARAMETERS}}
]
MESSAGES: list[Any] = [{"role": "user", "content": "Time in Oslo and Rome?"}]


class HermesBackend(ScriptedBackend):
    """Writes ``FIRST``, ``SECOND``, ``AFTER`` and stops, in Hermes markup."""

    def __init__(self) -> None:
        def script(_rid: int, _request: GenerationRequest) -> list[int]:
            return [ord(c) for c in FIRST + SECOND + AFTER] + [EOS]

        super().__init__(script=script)
        self._hermes = attrs.evolve(super().info, tool_format="hermes")

    @property
    def info(self) -> ModelInfo:
        return self._hermes


@asynccontextmanager
async def _served() -> AsyncIterator[str]:
    config = ServerConfig(http=HttpSettings(), port=0)
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(serve, config, backend_factory=lambda _: HermesBackend())
        )
        yield binds[0]
        nursery.cancel_scope.cancel()


def _cities(arguments: Sequence[str]) -> list[str]:
    return [a.split('"city": "')[1].split('"')[0] for a in arguments]


async def test_the_engine_ends_a_choice_at_its_last_allowed_call() -> None:
    with trio.fail_after(HANG):
        async with open_test_engine(HermesBackend()) as t:
            events = []
            with await t.engine.chat(
                MESSAGES, tools=CHAT_TOOLS, max_tokens=600, max_tool_calls=1
            ) as chat:
                async for _, event in chat:
                    events.append(event)
            done = [e for e in events if isinstance(e, ToolCallDone)]
            finished = events[-1]
            assert isinstance(finished, ChatFinished)
            assert len(done) == 1
            assert finished.reason == "tool_calls"
            assert _cities(
                [c["function"]["arguments"] for c in finished.message["tool_calls"]]
            ) == ["Oslo"]
            # The reply ends with the call (at its arguments' end, where the
            # markup is known to close): nothing after it was passed on...
            assert finished.usage.output_tokens <= len(FIRST)
            # ... and the sequence left the batch there, not at its end.
            withdrawn = t.engine.metrics.requests.labels("withdrawn", "")._value.get()
            assert withdrawn == 1
            await t.engine.settle()
            assert t.backend.steps < len(FIRST + SECOND + AFTER)


@pytest.mark.parametrize("parallel", [None, False])
async def test_chat_without_parallel_tool_calls_carries_one_call(parallel: bool | None) -> None:
    extra: dict[str, Any] = {} if parallel is None else {"parallel_tool_calls": parallel}
    with trio.fail_after(HANG):
        async with (
            _served() as url,
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none") as client,
        ):
            reply = await client.chat.completions.create(
                model="scripted", messages=MESSAGES, tools=CHAT_TOOLS, max_tokens=600, **extra
            )
            calls = reply.choices[0].message.tool_calls or []
            cities = _cities([c.function.arguments for c in calls])  # type: ignore[union-attr]
            assert reply.choices[0].finish_reason == "tool_calls"
            if parallel is None:
                assert cities == ["Oslo", "Rome"]
                return
            assert cities == ["Oslo"]
            assert reply.usage is not None
            assert reply.usage.completion_tokens <= len(FIRST)
            async with await client.chat.completions.create(
                model="scripted",
                messages=MESSAGES,
                tools=CHAT_TOOLS,
                max_tokens=600,
                stream=True,
                **extra,
            ) as stream:
                indexes, reasons = set(), []
                async for chunk in stream:
                    for choice in chunk.choices:
                        indexes |= {d.index for d in choice.delta.tool_calls or []}
                        reasons.append(choice.finish_reason)
            assert indexes == {0}
            assert [r for r in reasons if r] == ["tool_calls"]


RESPONSES_TOOLS: list[Any] = [{"type": "function", "name": "get_time", "parameters": PARAMETERS}]


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        ({}, ["Oslo", "Rome"]),
        ({"max_tool_calls": 1}, ["Oslo"]),
        ({"max_tool_calls": 2}, ["Oslo", "Rome"]),
        ({"parallel_tool_calls": False}, ["Oslo"]),
    ],
)
async def test_responses_max_tool_calls(limits: dict[str, Any], expected: list[str]) -> None:
    with trio.fail_after(HANG):
        async with (
            _served() as url,
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none") as client,
        ):
            response = await client.responses.create(
                model="scripted",
                input="Time in Oslo and Rome?",
                tools=RESPONSES_TOOLS,
                max_output_tokens=600,
                **limits,
            )
            calls = [item for item in response.output if item.type == "function_call"]
            assert _cities([c.arguments for c in calls]) == expected
            if "max_tool_calls" in limits:
                assert response.max_tool_calls == limits["max_tool_calls"]


@pytest.mark.parametrize("disable", [None, True])
async def test_messages_disable_parallel_tool_use(disable: bool | None) -> None:
    import anthropic

    choice: Any = {"type": "auto"}
    if disable is not None:
        choice["disable_parallel_tool_use"] = disable
    with trio.fail_after(HANG):
        async with (
            _served() as url,
            anthropic.AsyncAnthropic(base_url=url, api_key="none") as client,
        ):
            message = await client.messages.create(
                model="scripted",
                max_tokens=600,
                messages=MESSAGES,
                tools=[{"name": "get_time", "input_schema": PARAMETERS}],
                tool_choice=choice,
            )
            uses = [b for b in message.content if b.type == "tool_use"]
            cities = [b.input["city"] for b in uses]  # type: ignore[index]
            assert message.stop_reason == "tool_use"
            assert cities == (["Oslo"] if disable else ["Oslo", "Rome"])
