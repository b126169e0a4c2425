"""Anthropic Messages (``/v1/messages``, ``/v1/messages/count_tokens``) driven
by the official ``anthropic`` SDK, its responses validated strictly
against the SDK's own models (``_strict_response_validation``).

Three kinds of test:

* pure: a Claude-Code-shaped conversation mapped onto the chat template's
  roles, and the stream translator fed a scripted event sequence (thinking,
  text, two tool calls, a stop sequence, a failure) and read back by the SDK
  through a mock transport - shapes a random model would rarely produce;
* the dense demo model (fast, deterministic): stream framing and pings while
  prefilling, stop sequences, forced ``tool_use`` (the grammar's doing on
  random weights), thinking budgets, count_tokens, errors, the API key;
* the default model, SmolLM2: create, stream, forced ``tool_use`` and a
  re-sent history that reads the prompt cache. Kept short: it decodes a few
  tokens a second on CI's CPUs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx2 as httpx
import jsonschema
import pytest

from gezel_trio.core.errors import GezelError
from gezel_trio.core.events import Failed, Progress, Queued, Started, Usage
from gezel_trio.engine import ChatFinished
from gezel_trio.http.anthropic_messages import _Events, chat_request, message_body
from gezel_trio.http.anthropic_wire import parse_messages_request
from gezel_trio.http.app import HttpSettings
from gezel_trio.shaping.shaper import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallDone
from tests.support.process import Server, start_server, stop_server
from tests.support.scripted import scripted_server

if TYPE_CHECKING:
    import anthropic

KEY = "sekrit-key"

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Bergen", "Paris"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER},
    {"name": "get_time", "input_schema": TIME, "cache_control": {"type": "ephemeral"}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def _client(url: str, **kw: Any) -> anthropic.Anthropic:
    import anthropic

    return anthropic.Anthropic(
        base_url=url, api_key=KEY, max_retries=0, _strict_response_validation=True, **kw
    )


# --- pure: the mapping and the translator -------------------------------------


def test_a_claude_code_conversation_maps_onto_template_roles() -> None:
    req = parse_messages_request(
        {
            "model": "claude-sonnet-4-5",
            "max_tokens": 64,
            "system": [
                {
                    "type": "text",
                    "text": "You are an agent.",
                    "cache_control": {"type": "ephemeral"},
                }
            ],
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "<reminder>"},
                        {
                            "type": "text",
                            "text": "Weather in Oslo?",
                            "cache_control": {"type": "ephemeral", "ttl": "1h"},
                        },
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Need the tool.", "signature": "abc"},
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "text", "text": "Checking."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Oslo", "unit": "celsius"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "-3 C"}],
                            "cache_control": {"type": "ephemeral"},
                        },
                        {"type": "text", "text": "And Bergen?"},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_2",
                            "content": "timeout",
                            "is_error": True,
                        }
                    ],
                },
                {"role": "system", "content": [{"type": "text", "text": "Answer now."}]},
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "document",
                            "source": {"type": "text", "media_type": "text/plain", "data": "Rain."},
                            "title": "Forecast",
                            "citations": {"enabled": True},
                        },
                        {
                            "type": "document",
                            "source": {
                                "type": "content",
                                "content": [{"type": "text", "text": "Sun."}],
                            },
                            "context": "Yesterday",
                        },
                    ],
                },
                {"role": "user", "content": "Thanks."},
                {"role": "user", "content": "Go on."},
            ],
            "tools": TOOLS,
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
            "metadata": {"user_id": "u-1"},
            "stop_sequences": ["END"],
            "temperature": 0.5,
            "top_k": 40,
        }
    )
    chat = chat_request(req)
    call_1 = {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}
    assert list(chat.messages) == [
        {"role": "system", "content": "You are an agent.\n\nBe brief."},
        {"role": "user", "content": "<reminder>\n\nWeather in Oslo?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Need the tool.",
            "tool_calls": [{"id": "toolu_1", "type": "function", "function": call_1}],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "-3 C"},
        {"role": "user", "content": "And Bergen?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "toolu_2",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": {}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout"},
        # A system message after the first turn stays where it was sent.
        {"role": "system", "content": "Answer now."},
        # Consecutive user turns are one turn, as Anthropic combines them;
        # text documents are paragraphs of theirs.
        {"role": "user", "content": "Forecast\n\nRain.\n\nYesterday\n\nSun.\n\nThanks.\n\nGo on."},
    ]
    assert chat.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER,
                "description": "Current weather in a city",
            },
        },
        {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
    ]
    assert chat.tool_choice == "auto"
    assert chat.stop == ("END",)
    assert (chat.sampling.temperature, chat.sampling.top_k, chat.max_tokens) == (0.5, 40, 64)


def test_claude_codes_trailing_system_message_renders_as_its_next_request_sends_it() -> None:
    """Claude Code 2.1.197 sends its mid-conversation system message after
    the user's turn, and on the next request as a reminder block of that
    turn, after the user's text with a line break added: both map onto the
    same conversation up to the new text."""

    def mapped(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        body = {"model": "m", "max_tokens": 8, "messages": messages}
        return list(chat_request(parse_messages_request(body)).messages)

    agents = "Available agent types for the Agent tool:\n- Explore: read-only search."
    first = mapped(
        [
            {"role": "user", "content": [{"type": "text", "text": "Say hello."}]},
            {"role": "system", "content": agents},
        ]
    )
    later = "Output token limit hit. Resume directly."
    second = mapped(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Say hello.\n"},
                    {"type": "text", "text": f"<system-reminder>\n{agents}\n</system-reminder>\n"},
                    {"type": "text", "text": later},
                ],
            }
        ]
    )
    reminder = f"Say hello.\n\n<system-reminder>\n{agents}\n</system-reminder>"
    assert first == [{"role": "user", "content": reminder}]
    assert second == [{"role": "user", "content": f"{reminder}\n\n{later}"}]


def _total_tokens(left: int, end: str = "") -> dict[str, Any]:
    # Claude Code's countdown attachment after a tool result (its
    # ``totalTokensReminder`` setting), as its binary writes it.
    text = f"<system-reminder>\n<total_tokens>{left} tokens left</total_tokens>\n</system-reminder>"
    return {"type": "text", "text": text + end}


def _tool_round(n: int, left: int, end: str = "") -> list[dict[str, Any]]:
    call = {"type": "tool_use", "id": f"toolu_{n}", "name": "Read", "input": {"file_path": "a.py"}}
    result = {"type": "tool_result", "tool_use_id": f"toolu_{n}", "content": f"line {n}"}
    return [
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result, _total_tokens(left, end)]},
    ]


@pytest.mark.parametrize("end", ["", "\n"], ids=["as-sent", "line-break-added"])
def test_a_new_total_tokens_countdown_leaves_the_earlier_ones_in_place(end: str) -> None:
    """Each request carries a new ``<total_tokens>`` countdown after its
    newest tool result and keeps the earlier ones as they were (or with a
    line break added): the previous request's conversation is a prefix of
    the next one's, so the countdown costs no prefill beyond the new round."""

    def mapped(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        body = {"model": "m", "max_tokens": 8, "messages": messages}
        return list(chat_request(parse_messages_request(body)).messages)

    ask = {"role": "user", "content": "Read a.py."}
    before = mapped([ask, *_tool_round(1, 181_000)])
    rounds = [ask, *_tool_round(1, 181_000, end), *_tool_round(2, 180_250)]
    after = mapped(rounds)
    assert after[: len(before)] == before
    assert "180250 tokens left" in after[-1]["content"]


@pytest.mark.parametrize(
    ("extra", "choice", "kwargs", "budget"),
    [
        ({"tool_choice": {"type": "any"}}, "required", {}, None),
        (
            {"tool_choice": {"type": "tool", "name": "get_time"}},
            {"type": "function", "function": {"name": "get_time"}},
            {},
            None,
        ),
        ({"tool_choice": {"type": "none"}}, "none", {}, None),
        ({"thinking": {"type": "enabled", "budget_tokens": 9}}, None, {"enable_thinking": True}, 9),
        ({"thinking": {"type": "adaptive"}}, None, {"enable_thinking": True}, None),
        ({"thinking": {"type": "disabled"}}, None, {"enable_thinking": False}, None),
    ],
)
def test_tool_choice_and_thinking_map_onto_the_engine(
    extra: dict[str, Any], choice: Any, kwargs: dict[str, Any], budget: int | None
) -> None:
    body = {"max_tokens": 32, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    chat = chat_request(parse_messages_request({**body, **extra}))
    assert chat.tool_choice == choice
    assert dict(chat.template_kwargs) == kwargs
    assert chat.max_thinking_tokens == budget


USAGE = Usage(
    input_tokens=40, output_tokens=12, cached_tokens=30, prompt_tps=1.0, generation_tps=1.0
)


def _serve(stream: bytes, whole: dict[str, Any]) -> anthropic.Anthropic:
    """An SDK client whose server is the translator's output."""

    def handler(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("stream"):
            return httpx.Response(
                200, content=stream, headers={"content-type": "text/event-stream"}
            )
        return httpx.Response(200, json=whole)

    http = httpx.Client(transport=httpx.MockTransport(handler))
    return _client("http://test", http_client=http)


def _translate(events: list[Any]) -> bytes:
    translator = _Events("msg_1", "demo", 40, show_thinking=True)
    out = translator.opening()
    for event in events:
        out += translator.render(event, None)  # type: ignore[arg-type]
    return b"".join(out)


def streamed_start(stream: bytes) -> dict[str, Any]:
    """The usage ``message_start`` carries in a translated stream."""
    for line in stream.decode().splitlines():
        if line.startswith("data: ") and '"message_start"' in line:
            usage: dict[str, Any] = json.loads(line[6:])["message"]["usage"]
            return usage
    raise AssertionError("no message_start")


ASK: dict[str, Any] = {
    "model": "demo",
    "max_tokens": 64,
    "messages": [{"role": "user", "content": "?"}],
}


def test_the_stream_and_the_message_body_parse_to_the_same_message() -> None:
    message = {
        "role": "assistant",
        "content": "Calling.",
        "reasoning_content": "Let me think.",
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            },
            {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": ""}},
        ],
    }
    finished = ChatFinished("tool_calls", USAGE, message)
    admitted = Usage(
        input_tokens=40, output_tokens=0, cached_tokens=30, prompt_tps=0, generation_tps=0
    )
    events = [
        Queued(0),
        Started(admitted),
        Progress(16, 40),
        ReasoningDelta("Let me "),
        ReasoningDelta("think."),
        TextDelta("Calling."),
        ToolCallDelta(0, "call_a", "get_weather"),
        ToolCallDelta(0, arguments='{"city": '),
        ToolCallDelta(0, arguments='"Oslo"}'),
        ToolCallDone(0, "call_a", "get_weather", '{"city": "Oslo"}'),
        ToolCallDelta(1, "call_b", "get_time"),
        ToolCallDone(1, "call_b", "get_time", ""),
        finished,
    ]
    stream = _translate(events)
    # message_start waits for the admission; while queued, an SSE comment
    # alone. Then one ping with message_start, one per liveness note.
    assert stream.startswith(b": queued 0\n\nevent: message_start\n")
    assert stream.count(b"event: ping\n") == 2
    client = _serve(stream, message_body("msg_1", "demo", finished, show_thinking=True))
    whole = client.messages.create(**ASK)
    with client.messages.stream(**ASK) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_message()
    assert kinds[0] == "message_start"
    assert kinds[-1] == "message_stop"
    start = streamed_start(stream)
    assert (start["input_tokens"], start["cache_read_input_tokens"]) == (10, 30)
    for m in (whole, streamed):
        assert [b.type for b in m.content] == ["thinking", "text", "tool_use", "tool_use"]
        thinking, text, call_a, call_b = m.content
        assert thinking.type == "thinking"
        assert thinking.thinking == "Let me think."
        assert text.type == "text"
        assert text.text == "Calling."
        assert call_a.type == "tool_use"
        assert (call_a.id, call_a.name, call_a.input) == ("call_a", "get_weather", {"city": "Oslo"})
        assert call_b.type == "tool_use"
        assert (call_b.name, call_b.input) == ("get_time", {})
        assert m.stop_reason == "tool_use"
        assert m.stop_sequence is None
        assert m.usage.input_tokens == 10
        assert m.usage.cache_read_input_tokens == 30
        assert m.usage.cache_creation_input_tokens == 0
        assert m.usage.output_tokens == 12
    assert whole.content[0].signature == streamed.content[0].signature != ""  # type: ignore[union-attr]


def test_a_stop_sequence_is_reported_and_a_late_failure_is_an_error_event() -> None:
    import anthropic

    message = {"role": "assistant", "content": "one two"}
    finished = ChatFinished("stop", USAGE, message, stop_sequence="three")
    client = _serve(_translate([TextDelta("one "), TextDelta("two"), finished]), {})
    with client.messages.stream(**ASK) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "three")
    assert final.content[0].text == "one two"  # type: ignore[union-attr]

    failed = _translate([TextDelta("one "), Failed(GezelError("the engine failed"))])
    assert failed.endswith(b"\n\n")
    client = _serve(failed, {})
    with pytest.raises(anthropic.APIStatusError, match="the engine failed"):
        with client.messages.stream(**ASK) as s:
            s.get_final_message()


# --- the dense demo model ------------------------------------------------------


@pytest.fixture(scope="module")
def dense(dense_model: Path) -> Iterator[Server]:
    # Small prefill steps: a prompt of a few dozen tokens reports progress
    # (and so pings) several times.
    srv = start_server(dense_model, "--prefill-step-size", "16", "--api-key", KEY)
    yield srv
    assert stop_server(srv) == 0


@pytest.fixture(scope="module")
def client(dense: Server) -> Iterator[anthropic.Anthropic]:
    with _client(dense.url) as c:
        yield c


NO_THINK = {"thinking": {"type": "disabled"}}
HELLO = [{"role": "user", "content": "Tell me about the harbour in the morning."}]


@pytest.mark.slow
def test_stream_framing_pings_and_final_message_match_create(
    dense: Server, client: anthropic.Anthropic
) -> None:
    kw: dict[str, Any] = dict(model="demo", max_tokens=10, messages=HELLO, **NO_THINK)
    whole = client.messages.create(**kw, extra_body={"temperature": 0})
    with client.messages.stream(**kw, extra_body={"temperature": 0}) as s:
        text = "".join(s.text_stream)
        streamed = s.get_final_message()
    assert text == whole.content[0].text == streamed.content[0].text  # type: ignore[union-attr]
    assert whole.stop_reason == streamed.stop_reason == "max_tokens"
    assert whole.usage.output_tokens == streamed.usage.output_tokens == 10
    # The second run found the first one's prompt in the cache.
    total = whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
    assert streamed.usage.input_tokens + (streamed.usage.cache_read_input_tokens or 0) == total
    assert (streamed.usage.cache_read_input_tokens or 0) > 0

    # The raw events: Anthropic's order, with pings while the prompt is prefilled.
    long = [{"role": "user", "content": "Describe the harbour, " * 30}]
    body = {"model": "demo", "max_tokens": 4, "messages": long, "stream": True, **NO_THINK}
    r = httpx.post(
        f"{dense.url}/v1/messages",
        json=body,
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
        timeout=60,
    )
    assert r.status_code == 200
    names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert names[0] == "message_start"
    assert names[-2:] == ["message_delta", "message_stop"]
    first_block = names.index("content_block_start")
    assert names[:first_block].count("ping") >= 4  # the opening one, then prefill progress
    assert names[first_block:-2] == [
        "content_block_start",
        *["content_block_delta"] * (len(names) - first_block - 4),
        "content_block_stop",
    ]


@pytest.mark.slow
def test_message_start_carries_the_cached_prompt_known_at_admission(
    client: anthropic.Anthropic,
) -> None:
    # A system block pinned by cache_control: turn one writes it into a pin
    # (cache_creation), turn two reads the whole first turn from the cache.
    system: list[Any] = [
        {
            "type": "text",
            "text": "You keep the lighthouse log at Bergen harbour.",
            "cache_control": {"type": "ephemeral"},
        }
    ]
    ask: list[Any] = [{"role": "user", "content": "What did the night watch note?"}]
    kw: dict[str, Any] = dict(model="demo", max_tokens=6, system=system, **NO_THINK)

    def turn(messages: list[Any]) -> tuple[Any, Any, Any]:
        with client.messages.stream(**kw, messages=messages, extra_body={"temperature": 0}) as s:
            events = list(s)
            final = s.get_final_message()
        assert events[0].type == "message_start"
        (delta,) = [e for e in events if e.type == "message_delta"]
        return events[0].message.usage, delta.usage, final

    start, end, first = turn(ask)
    assert (end.cache_creation_input_tokens or 0) > 0
    assert start.cache_creation_input_tokens == end.cache_creation_input_tokens
    assert start.input_tokens == end.input_tokens
    assert start.output_tokens == 0

    history = [
        *ask,
        {"role": "assistant", "content": [c.model_dump(exclude_none=True) for c in first.content]},
        {"role": "user", "content": "And the morning watch?"},
    ]
    start, end, second = turn(history)
    assert (start.cache_read_input_tokens or 0) > 0
    assert start.cache_read_input_tokens == end.cache_read_input_tokens
    assert start.cache_creation_input_tokens == end.cache_creation_input_tokens
    assert start.input_tokens == end.input_tokens
    # The SDK's final message keeps message_delta's figures.
    assert second.usage.cache_read_input_tokens == start.cache_read_input_tokens


@pytest.mark.slow
def test_a_stop_sequence_ends_the_text_and_is_named(client: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = dict(model="demo", max_tokens=16, messages=HELLO, **NO_THINK)
    free = client.messages.create(**kw, extra_body={"temperature": 0})
    text = free.content[0].text  # type: ignore[union-attr]
    stop = text[len(text) // 2 :][:4]
    assert stop.strip(), text
    cut = client.messages.create(
        **kw, stop_sequences=["zzq-never", stop], extra_body={"temperature": 0}
    )
    assert cut.stop_reason == "stop_sequence"
    assert cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]


def _validate_calls(message: Any) -> list[Any]:
    calls = [b for b in message.content if b.type == "tool_use"]
    assert calls, message
    for call in calls:
        jsonschema.validate(call.input, SCHEMAS[call.name])
    assert message.stop_reason == "tool_use"
    return calls


@pytest.mark.slow
def test_forced_tool_use_validates_and_the_result_goes_back(client: anthropic.Anthropic) -> None:
    ask: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]
    forced = client.messages.create(
        model="demo",
        max_tokens=200,
        messages=ask,
        tools=TOOLS,
        tool_choice={"type": "any"},
        **NO_THINK,
    )
    (call,) = _validate_calls(forced)
    with client.messages.stream(
        model="demo",
        max_tokens=200,
        messages=ask,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
        **NO_THINK,
    ) as s:
        (named,) = _validate_calls(s.get_final_message())
    assert named.name == "get_time"
    # With thinking on and a budget that would leave no room, the forced
    # call still gets room to close.
    thought = client.messages.create(
        model="demo",
        max_tokens=200,
        messages=ask,
        tools=TOOLS,
        tool_choice={"type": "any"},
        thinking={"type": "enabled", "budget_tokens": 190},
    )
    assert thought.content[0].type == "thinking"
    _validate_calls(thought)

    # The next turn: the assistant's tool_use and the user's tool_result, re-sent.
    history = [
        *ask,
        {"role": "assistant", "content": [c.model_dump(exclude_none=True) for c in forced.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "-3 C"}],
        },
    ]
    after = client.messages.create(
        model="demo", max_tokens=8, messages=history, tools=TOOLS, **NO_THINK
    )
    assert after.usage.cache_read_input_tokens is not None
    assert after.usage.cache_read_input_tokens > 0


@pytest.mark.slow
def test_a_thinking_budget_closes_the_thinking_block(client: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = dict(
        model="demo", max_tokens=40, messages=HELLO, extra_body={"temperature": 0}
    )
    shown = client.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 6})
    assert shown.content[0].type == "thinking"
    assert shown.content[0].thinking
    assert shown.content[0].signature
    assert shown.usage.output_tokens > 6  # thinking closed, the answer went on
    hidden = client.messages.create(
        **kw, thinking={"type": "enabled", "budget_tokens": 6, "display": "omitted"}
    )
    assert hidden.content[0].type == "thinking"
    assert hidden.content[0].thinking == ""
    assert hidden.content[0].signature
    off = client.messages.create(**kw, **NO_THINK)
    assert all(b.type != "thinking" for b in off.content)


@pytest.mark.slow
def test_output_config_format_constrains_the_answer(client: anthropic.Anthropic) -> None:
    answer = client.messages.create(
        model="demo",
        max_tokens=120,
        messages=[{"role": "user", "content": "Weather in Oslo, as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": WEATHER}},
        **NO_THINK,
    )
    assert answer.stop_reason == "end_turn", answer
    jsonschema.validate(json.loads(answer.content[0].text), WEATHER)  # type: ignore[union-attr]


@pytest.mark.slow
def test_count_tokens_is_the_prompt_a_request_renders(client: anthropic.Anthropic) -> None:
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    kw: dict[str, Any] = dict(model="demo", messages=HELLO, system=system, tools=TOOLS)
    counted = client.messages.count_tokens(**kw, **NO_THINK)
    made = client.messages.create(**kw, **NO_THINK, max_tokens=1)
    # The cache_control breakpoints pin prefixes: computed, written into a
    # pin and read from the cache sum to the prompt, as Anthropic counts.
    assert counted.input_tokens == made.usage.input_tokens + (
        made.usage.cache_read_input_tokens or 0
    ) + (made.usage.cache_creation_input_tokens or 0)
    assert (
        client.messages.count_tokens(model="demo", messages=HELLO).input_tokens
        < counted.input_tokens
    )


@pytest.mark.slow
def test_what_agent_clients_send_is_accepted(client: anthropic.Anthropic) -> None:
    """Claude-Code-shaped: the beta route (``?beta=true``, ``anthropic-beta``),
    a system message inside ``messages``, ``cache_control`` everywhere,
    metadata and the SDK's newer fields."""
    message = client.beta.messages.create(
        model="claude-sonnet-4-5",
        max_tokens=4,
        betas=["interleaved-thinking-2025-05-14", "context-management-2025-06-27"],
        system=[
            {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}
        ],
        messages=[
            {"role": "system", "content": "Use the tools."},  # type: ignore[list-item]
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "hi",
                        "cache_control": {"type": "ephemeral", "ttl": "5m"},
                    }
                ],
            },
        ],
        tools=TOOLS,
        metadata={"user_id": "user_abc"},
        context_management={"edits": []},
        fallbacks="default",
        service_tier="auto",
        **NO_THINK,
    )
    assert message.type == "message"
    assert message.usage.output_tokens >= 1


@pytest.mark.slow
def test_anthropic_defined_tools_are_left_out_and_named(client: anthropic.Anthropic) -> None:
    """Claude Code's web search asks with the server tool alone; a text
    editor or bash tool beside a client tool: the server runs none of
    them, so the model is shown the client tools only and the response
    names the others (as on Responses)."""
    tools: list[Any] = [
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 8},
        {"name": "read", "description": "Read a file", "input_schema": {"type": "object"}},
        {"type": "bash_20250124", "name": "bash"},
    ]
    raw = client.messages.with_raw_response.create(
        model="demo", max_tokens=4, messages=HELLO, tools=tools
    )
    assert raw.headers["x-gezel-ignored-tools"] == "web_search_20250305, bash_20250124"
    assert raw.parse().content
    counted = client.messages.count_tokens(model="demo", messages=HELLO, tools=tools)
    alone = client.messages.count_tokens(model="demo", messages=HELLO, tools=tools[1:2])
    assert counted.input_tokens == alone.input_tokens


@pytest.fixture(scope="module")
def scripted() -> Iterator[Server]:
    """The scripted engine's server with the same key: what a request is
    refused for does not depend on the model."""
    with scripted_server(http=HttpSettings(api_key=(KEY,))) as srv:
        yield srv


def test_errors_are_anthropic_errors(scripted: Server) -> None:
    import anthropic

    with _client(scripted.url) as client, pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="demo", max_tokens=0, messages=HELLO)
    assert bad.value.body["type"] == "error"  # type: ignore[index]
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "max_tokens" in bad.value.body["error"]["message"]  # type: ignore[index]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"messages": HELLO, "temperature": 5}, "temperature"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "document",
                                "source": {
                                    "type": "base64",
                                    "media_type": "application/pdf",
                                    "data": "JVBERi0=",
                                },
                            }
                        ],
                    }
                ]
            },
            "content[0].source.type: PDF documents are not supported",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "web_search_tool_result", "tool_use_id": "s", "content": []}
                        ],
                    }
                ]
            },
            "web_search_tool_result",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}
                        ],
                    }
                ]
            },
            "content[0].source.url: remote image URLs are not fetched",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "iVBORw0KGgo=",
                                },
                            }
                        ],
                    }
                ]
            },
            "takes no images (it is text-only)",
        ),
        ({"messages": [*HELLO, {"role": "assistant", "content": "Sure"}]}, "prefill"),
        ({"messages": [{"role": "system", "content": ""}]}, "nothing to answer"),
        ({"messages": HELLO, "thread": {"type": "create"}}, "thread: server-held threads"),
        (
            {"messages": HELLO, "thinking": {"type": "enabled", "budget_tokens": 64}},
            "budget_tokens",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "source",
        ),
    ]
    for body, named in cases:
        r = httpx.post(
            f"{scripted.url}/v1/messages",
            json={"model": "demo", "max_tokens": 8, **body},
            headers={"x-api-key": KEY},
            timeout=30,
        )
        assert r.status_code == 400, (body, r.text)
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert named in r.json()["error"]["message"], (body, r.text)


@pytest.mark.slow
def test_a_forced_tool_that_is_not_declared_is_an_anthropic_error(dense: Server) -> None:
    # The grammar compiler names it: a model that can constrain decoding.
    import anthropic

    body = {"messages": HELLO, "tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}
    r = httpx.post(
        f"{dense.url}/v1/messages",
        json={"model": "demo", "max_tokens": 8, **body},
        headers={"x-api-key": KEY},
        timeout=30,
    )
    assert r.status_code == 400, (body, r.text)
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "nope" in r.json()["error"]["message"], (body, r.text)

    # A field the server does not implement is ignored and named, not refused.
    r = httpx.post(
        f"{dense.url}/v1/messages",
        json={"model": "demo", "max_tokens": 2, "messages": HELLO, "frobnicate": 1},
        headers={"x-api-key": KEY},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-gezel-ignored-fields"] == "frobnicate"

    with (
        anthropic.Anthropic(base_url=dense.url, api_key="wrong", max_retries=0) as wrong,
        pytest.raises(anthropic.AuthenticationError) as auth,
    ):
        wrong.messages.create(model="demo", max_tokens=1, messages=HELLO)
    assert auth.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    assert httpx.get(f"{dense.url}/v1/messages/nope", headers={"x-api-key": KEY}).json() == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "no route GET /v1/messages/nope"},
    }
    # Bearer keys still work on every route; other routes keep the OpenAI envelope.
    with anthropic.Anthropic(base_url=dense.url, auth_token=KEY, max_retries=0) as bearer:
        assert bearer.messages.count_tokens(model="demo", messages=HELLO).input_tokens > 0
    assert httpx.get(f"{dense.url}/v1/models").json()["error"]["code"] == "invalid_api_key"


# --- the default model ---------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_server: Server) -> Server:
    """The session's server on the default model (``tests.support.process``):
    no API key there, so the key the client sends is not checked (the dense
    server above checks keys)."""
    return smollm2_server


@pytest.fixture(scope="module")
def smol(smollm2: Server) -> Iterator[anthropic.Anthropic]:
    with _client(smollm2.url) as c:
        yield c


@pytest.mark.slow
def test_smollm2_answers_streams_and_reads_the_cache_on_the_next_turn(
    smol: anthropic.Anthropic,
) -> None:
    ask = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    first = smol.messages.create(
        model="smollm2", max_tokens=8, messages=ask, extra_body={"temperature": 0}
    )
    answer = first.content[0].text  # type: ignore[union-attr]
    assert "Paris" in answer
    history = [
        *ask,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And of Italy?"},
    ]
    with smol.messages.stream(
        model="smollm2", max_tokens=8, messages=history, extra_body={"temperature": 0}
    ) as s:
        text = "".join(s.text_stream)
        second = s.get_final_message()
    assert text == second.content[0].text  # type: ignore[union-attr]
    assert "Rome" in text
    # The re-sent history was served from the prompt cache.
    assert second.usage.cache_read_input_tokens is not None
    assert second.usage.cache_read_input_tokens > 0


@pytest.mark.slow
def test_smollm2_forced_tool_use_streams_input_that_validates(smol: anthropic.Anthropic) -> None:
    # tool_choice "any" is checked on the demo model; one forced call here.
    with smol.messages.stream(
        model="smollm2",
        max_tokens=200,
        messages=[{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
    ) as s:
        (call,) = _validate_calls(s.get_final_message())
    assert call.input == {"city": "Paris", "unit": "celsius"}
