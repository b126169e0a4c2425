"""The OpenAI Agents SDK (``openai-agents``) against the real server on the
default model, SmolLM2-135M-Instruct, offline: tracing off, its client
pointed at the test server. One agent with one function tool runs through
the Responses API (the SDK's default) and through chat completions
(``OpenAIChatCompletionsModel``); the requests are recorded to show which
endpoint served each run. Also here, with the ``openai`` SDK: a streamed
response continued by ``previous_response_id``, whose second turn the prompt
cache serves whole."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import httpx2 as httpx
import openai
import pytest

from tests.support.process import Server

if TYPE_CHECKING:
    from agents import Agent

# The SDK is imported by the tests that drive it, not when the suite is
# collected (a second of every worker's start).

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm2_server: Server) -> Server:
    """The session's server on the default model (``tests.support.process``)."""
    from agents import set_tracing_disabled

    set_tracing_disabled(True)
    return smollm2_server


class Recorded:
    """An ``AsyncOpenAI`` client on the test server that records the paths
    it requested."""

    def __init__(self, url: str) -> None:
        self.paths: list[str] = []

        async def record(request: httpx.Request) -> None:
            self.paths.append(request.url.path)

        self.client = openai.AsyncOpenAI(
            base_url=f"{url}/v1",
            api_key="unused",
            max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(event_hooks={"request": [record]}),
        )


def _run(rec: Recorded, work: Any) -> Any:
    """Run ``work`` (a coroutine) in a fresh asyncio loop, then close the client."""

    async def main() -> Any:
        try:
            return await work
        finally:
            await rec.client.close()

    return asyncio.run(main())


def _agent(calls: list[str]) -> Agent[Any]:
    from agents import Agent, ModelSettings, function_tool

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 degrees in {city}."

    # The first turn must call the tool (a 135M model would not reliably
    # choose to); the SDK resets tool_choice after the call, so the second
    # turn answers in text.
    return Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        tools=[get_weather],
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=64),
    )


def _check_run(result: Any, calls: list[str]) -> None:
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    kinds = [type(item) for item in result.new_items]
    assert kinds == [ToolCallItem, ToolCallOutputItem, MessageOutputItem]
    assert calls == ["Paris"]
    assert isinstance(result.final_output, str)
    assert result.final_output


def test_agent_runs_through_responses_by_default(server: Server) -> None:
    # Streamed, so the SDK consumes our event sequence as it arrives; its
    # final result is built from the response.completed events.
    from agents import RunConfig, Runner
    from agents.models.openai_provider import OpenAIProvider

    rec = Recorded(server.url)
    calls: list[str] = []
    config = RunConfig(
        model_provider=OpenAIProvider(openai_client=rec.client),
        model="default",
        tracing_disabled=True,
    )

    async def run() -> Any:
        result = Runner.run_streamed(
            _agent(calls), "What is the weather in Paris?", max_turns=4, run_config=config
        )
        deltas = []
        async for event in result.stream_events():
            if event.type == "raw_response_event" and event.data.type.endswith("output_text.delta"):
                deltas.append(event.data.delta)
        return result, "".join(deltas)

    result, text = _run(rec, run())
    _check_run(result, calls)
    assert text == result.final_output
    assert rec.paths == ["/v1/responses", "/v1/responses"]


def test_agent_runs_through_chat_completions(server: Server) -> None:
    from agents import OpenAIChatCompletionsModel, Runner

    rec = Recorded(server.url)
    calls: list[str] = []
    agent = _agent(calls).clone(
        model=OpenAIChatCompletionsModel(model="default", openai_client=rec.client)
    )
    result = _run(rec, Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    _check_run(result, calls)
    assert rec.paths == ["/v1/chat/completions", "/v1/chat/completions"]


def test_a_streamed_then_chained_conversation_is_served_from_the_cache(server: Server) -> None:
    with server.client.responses.stream(
        model="default",
        instructions="Answer in one sentence.",
        input="What is the capital of France?",
        max_output_tokens=16,
        temperature=0,
    ) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        first = stream.get_final_response()
    assert first.status == "completed"
    assert first.output_text == text
    assert "Paris" in text
    second = server.client.responses.create(
        model="default",
        instructions="Answer in one sentence.",
        input="And of Italy?",
        previous_response_id=first.id,
        max_output_tokens=16,
        temperature=0,
    )
    assert "Rome" in second.output_text
    assert first.usage is not None
    assert second.usage is not None
    # The first prompt and everything generated after it (its end token
    # included) come from the cache.
    reused = first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens_details.cached_tokens >= reused
    print(
        f"chain: turn 2 input {second.usage.input_tokens}, "
        f"cached {second.usage.input_tokens_details.cached_tokens}"
    )
