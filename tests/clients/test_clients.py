"""Real client SDKs against the real server on the default model
(SmolLM2-135M-Instruct), each driven the way its users drive it: the
SDK's own defaults, no gezel fields. One server for the module.

SmolLM2's chat template has no tool syntax, so tools travel in the generic
JSON format; where a client asks for a tool call or a structured answer it
either forces it itself (``tool_choice`` named or required, ``json_schema``)
or is told to, so what is checked is the server, not the 135M model's
judgement.

Nothing here may reach the internet: a guard refuses every connection that
is not to this machine, and the clients that would fetch something at run
time (LiteLLM's model-cost map, telemetry) are told not to before import.
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import json
import os
import re
import socket
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import openai
import pytest
from pydantic import BaseModel

from tests.support.process import Server

# Before the clients are imported: LiteLLM reads its bundled model-cost map
# instead of downloading it, and no client sends telemetry.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_TELEMETRY", "False")
os.environ.setdefault("LANGSMITH_TRACING", "false")
os.environ.setdefault("LANGCHAIN_TRACING_V2", "false")
os.environ.setdefault("LOGFIRE_IGNORE_NO_CONFIG", "1")

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]

MODEL = "smollm2"
KEY = "unused"


class City(BaseModel):
    city: str
    country: str


def get_weather(city: str) -> str:
    """Current weather for a city."""
    return json.dumps({"city": city, "temperature_c": 21})


WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


# --- no client reaches the internet -------------------------------------------


def _local(address: Any) -> bool:
    if not isinstance(address, tuple):
        return True  # a Unix socket
    host = address[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Offline(AssertionError):
    pass


@pytest.fixture(scope="module", autouse=True)
def offline() -> Iterator[list[Any]]:
    """Every connection the clients open goes to this machine; anything else
    is refused and recorded (a client that swallows the error still fails
    the test at teardown)."""
    refused: list[Any] = []
    connect, connect_ex = socket.socket.connect, socket.socket.connect_ex

    def guarded(real: Any) -> Any:
        def call(sock: socket.socket, address: Any) -> Any:
            if not _local(address):
                refused.append(address)
                raise Offline(f"a client tried to reach {address!r}")
            return real(sock, address)

        return call

    socket.socket.connect = guarded(connect)  # type: ignore[method-assign]
    socket.socket.connect_ex = guarded(connect_ex)  # type: ignore[method-assign]
    try:
        yield refused
    finally:
        socket.socket.connect, socket.socket.connect_ex = connect, connect_ex  # type: ignore[method-assign]
    assert refused == [], f"clients tried to reach the internet: {refused}"


@pytest.fixture(scope="module")
def server(smollm2_server: Server) -> Iterator[Server]:
    """The session's server on the default model (``tests.support.process``)."""
    yield smollm2_server
    # LiteLLM keeps the OpenAI client it made, and its pooled connection, for
    # the process: closed here, or the shared server's drain at the end of
    # the session waits out its graceful timeout for that connection.
    litellm = sys.modules.get("litellm")
    if litellm is not None:
        cached = getattr(litellm.in_memory_llm_clients_cache, "cache_dict", {})
        for client in list(cached.values()):
            if isinstance(client, openai.OpenAI):
                client.close()
        litellm.in_memory_llm_clients_cache.flush_cache()
    # Connections other clients pool and never close are theirs to leak:
    # collected here, not in a later module.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def prefilled(server: Server) -> float:
    """The engine's count of prompt tokens computed by prefill."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    (value,) = re.findall(r"^gezel_prompt_tokens_prefilled_total (\S+)$", text, re.M)
    return float(value)


# --- openai ------------------------------------------------------------------


def test_openai_chat_with_n_choices_streamed(server: Server) -> None:
    """The SDK's defaults (no temperature, no gezel fields); n choices of one
    prompt, each its own random stream, the prompt computed once."""
    messages: Any = [{"role": "user", "content": "Write one short sentence about the sea."}]
    before = prefilled(server)
    r = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, n=4, seed=7
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.message.content for c in r.choices)
    assert len({c.message.content for c in r.choices}) > 1
    assert r.usage is not None
    prompt = r.usage.prompt_tokens
    assert prompt > 0
    # Computed once: the first choice prefilled what the cache lacked, each
    # sibling seeded from it and computed its last token only.
    details = r.usage.prompt_tokens_details
    assert details is not None
    assert prefilled(server) - before == prompt - (details.cached_tokens or 0) + 3
    texts = ["", ""]
    for chunk in server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, n=2, seed=7, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    # Choice i samples with seed + i, streamed or not.
    assert texts == [r.choices[0].message.content, r.choices[1].message.content]


def test_openai_legacy_completions(server: Server) -> None:
    prompt = "The capital of France is"
    r = server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, echo=True, logprobs=1
    )
    (choice,) = r.choices
    assert choice.text.startswith(prompt)
    assert "Paris" in choice.text
    assert choice.logprobs is not None
    assert choice.logprobs.tokens is not None
    assert "".join(choice.logprobs.tokens) == choice.text
    streamed = "".join(
        c.choices[0].text
        for c in server.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True, stop=["."]
        )
        if c.choices
    )
    assert streamed
    assert "." not in streamed
    assert choice.text[len(prompt) :].startswith(streamed)


# --- LangChain -----------------------------------------------------------------


@pytest.fixture
def langchain(server: Server) -> Iterator[Any]:
    """``ChatOpenAI`` pointed at the server, given an HTTP client the test
    closes (LangChain's own default is cached for the process)."""
    import openai
    from langchain_openai import ChatOpenAI

    with openai.DefaultHttpxClient() as http:

        def make(max_tokens: int) -> Any:
            return ChatOpenAI(
                model=MODEL,
                base_url=f"{server.url}/v1",
                api_key=KEY,
                max_retries=0,
                max_tokens=max_tokens,
                http_client=http,
            )

        yield make


def test_langchain_invoke(langchain: Any) -> None:
    reply = langchain(12).invoke("What is the capital of France?")
    assert isinstance(reply.content, str)
    assert reply.content
    assert reply.response_metadata["finish_reason"] in ("stop", "length")
    assert reply.usage_metadata is not None
    assert reply.usage_metadata["input_tokens"] > 0


def test_langchain_bind_tools(langchain: Any) -> None:
    llm = langchain(48).bind_tools([get_weather], tool_choice="get_weather")
    reply = llm.invoke("What is the weather in Paris?")
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather"
    assert isinstance(call["args"]["city"], str)
    assert reply.response_metadata["finish_reason"] == "tool_calls"


def test_langchain_with_structured_output(langchain: Any) -> None:
    llm = langchain(48).with_structured_output(City)
    answer = llm.invoke("Paris is the capital of which country? Give the city and country.")
    assert isinstance(answer, City)
    assert answer.city


# --- LiteLLM (its openai/ provider) --------------------------------------------


def test_litellm_openai_provider(server: Server) -> None:
    import litellm

    kw: dict[str, Any] = dict(
        model=f"openai/{MODEL}", api_base=f"{server.url}/v1", api_key=KEY, temperature=0
    )
    hello = [{"role": "user", "content": "Say hello."}]
    r = litellm.completion(**kw, messages=hello, max_tokens=12)
    text = r.choices[0].message.content
    assert text
    assert r.usage.prompt_tokens > 0
    stream = litellm.completion(**kw, messages=hello, max_tokens=12, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == text
    called = litellm.completion(
        **kw,
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_tokens=48,
    )
    (call,) = called.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)


# --- Pydantic AI -----------------------------------------------------------------


def _run_agent(server: Server, make: Any, prompt: str) -> Any:
    """``await agent.run(prompt)`` as an asyncio program, with an OpenAI
    client closed when it ends."""
    import openai
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    async def main() -> Any:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        async with client:
            model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client))
            return await make(model).run(prompt)

    return asyncio.run(main())


def test_pydantic_ai_structured_output(server: Server) -> None:
    """The default output mode: a ``final_result`` tool the model must call.
    Greedy: sampled at the default temperature (1.0), the 135M model once
    named the country and left the city empty (a fresh-clone CI run), which
    says nothing of the server; greedily it names both."""
    from pydantic_ai import Agent

    def make(model: Any) -> Any:
        return Agent(model, output_type=City, model_settings={"max_tokens": 48, "temperature": 0})

    result = _run_agent(
        server, make, "Paris is the capital of which country? Give the city and country."
    )
    assert isinstance(result.output, City)
    assert result.output.city
    assert result.output.country


def test_pydantic_ai_function_tool(server: Server) -> None:
    """A function tool the agent runs (forced on the first step, as the
    Pydantic AI docs show for a per-step ``tool_choice``), its result sent
    back, then the structured answer."""
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.settings import ModelSettings, ToolOrOutput

    def settings(ctx: RunContext[None]) -> ModelSettings:
        # The tool on the first step, then only the output tool.
        first = ctx.run_step <= 1
        choice = ["weather"] if first else ToolOrOutput(function_tools=[])
        return {"max_tokens": 48, "tool_choice": choice}

    calls: list[str] = []

    def make(model: Any) -> Any:
        agent = Agent(model, output_type=City, model_settings=settings)

        @agent.tool_plain
        def weather(city: str) -> str:
            """Current weather for a city."""
            calls.append(city)
            return get_weather(city)

        return agent

    result = _run_agent(
        server, make, "What is the weather in Paris? Then name the city and its country."
    )
    assert isinstance(result.output, City)
    assert len(calls) == 1
    returned = [
        part
        for message in result.all_messages()
        for part in message.parts
        if part.part_kind == "tool-return" and part.tool_name == "weather"
    ]
    assert len(returned) == 1


# --- instructor -------------------------------------------------------------------


def test_instructor_response_model(server: Server) -> None:
    import instructor

    client = instructor.from_openai(server.client)  # its default mode: a forced tool call
    answer = client.chat.completions.create(
        model=MODEL,
        response_model=City,
        messages=[{"role": "user", "content": "Paris is the capital of which country?"}],
        max_tokens=48,
        max_retries=0,
        # Greedy: sampled at 1.0, the random-weight demo model sometimes writes an empty city.
        temperature=0,
    )
    assert isinstance(answer, City)
    assert answer.city
