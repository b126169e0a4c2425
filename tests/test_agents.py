"""The OpenAI Agents SDK (``openai-agents``) against the real server on the
default model, SmolLM2-135M-Instruct, offline: tracing off, its client
pointed at the test server. One agent with one function tool runs through
the Responses API (the SDK's default) and through chat completions
(``OpenAIChatCompletionsModel``); the requests are recorded to show which
endpoint served each run. Also here: a ``previous_response_id`` chain on the
real model, whose every turn the prompt cache serves whole."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
from agents.models.openai_provider import OpenAIProvider

from tests.test_server import Server, start_server, stop_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm2_model: Path) -> Iterator[Server]:
    set_tracing_disabled(True)
    srv = start_server(smollm2_model)
    yield srv
    assert stop_server(srv) == 0


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
    kinds = [type(item) for item in result.new_items]
    assert kinds == [ToolCallItem, ToolCallOutputItem, MessageOutputItem]
    assert calls == ["Paris"]
    assert isinstance(result.final_output, str)
    assert result.final_output


def test_agent_runs_through_responses_by_default(server: Server) -> None:
    rec = Recorded(server.url)
    calls: list[str] = []
    config = RunConfig(
        model_provider=OpenAIProvider(openai_client=rec.client),
        model="default",
        tracing_disabled=True,
    )
    result = _run(
        rec,
        Runner.run(_agent(calls), "What is the weather in Paris?", max_turns=4, run_config=config),
    )
    _check_run(result, calls)
    assert rec.paths == ["/v1/responses", "/v1/responses"]


def test_agent_streams_through_responses(server: Server) -> None:
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
    rec = Recorded(server.url)
    calls: list[str] = []
    agent = _agent(calls).clone(
        model=OpenAIChatCompletionsModel(model="default", openai_client=rec.client)
    )
    result = _run(rec, Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    _check_run(result, calls)
    assert rec.paths == ["/v1/chat/completions", "/v1/chat/completions"]


def test_a_chain_of_three_turns_reuses_the_whole_conversation(server: Server) -> None:
    previous = None
    seen: list[tuple[int, int, int]] = []
    answers: list[str] = []
    for question in ("What is the capital of France?", "And of Italy?", "And of Spain?"):
        r = server.client.responses.create(
            model="default",
            instructions="Answer in one sentence.",
            input=question,
            previous_response_id=previous,
            max_output_tokens=32,
            temperature=0,
        )
        assert r.status == "completed"
        assert r.usage is not None
        seen.append(
            (
                r.usage.input_tokens,
                r.usage.input_tokens_details.cached_tokens,
                r.usage.output_tokens,
            )
        )
        answers.append(r.output_text)
        previous = r.id
    assert "Paris" in answers[0]
    assert "Rome" in answers[1]
    for (inputs, _, outputs), (_, cached, _) in itertools.pairwise(seen):
        # The previous prompt and everything generated after it (its end
        # token included) come from the cache.
        assert cached >= inputs + outputs - 1
    assert seen[0][1] < seen[1][1] < seen[2][1]
