"""``/v1/responses`` through the real server and the official ``openai`` SDK:
plain and streamed (``create(stream=True)`` and ``responses.stream``), a
``previous_response_id`` chain that the prompt cache serves, a function tool
round trip, ``text.format`` JSON schemas, store / get / delete, background
responses and their cancellation, and stored responses surviving a restart
(``--persist-dir``). On the tiny dense demo model: random weights, so every
valid call or JSON document is the grammar's doing. The refusals and
ignored fields, which do not depend on the model, are checked on the
scripted engine's server."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pydantic
import pytest
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
)

from tests.support.process import Server, start_server, stop_server
from tests.support.scripted import scripted_server

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Bergen"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}
]


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    population: int = pydantic.Field(ge=0, le=1000)


@pytest.fixture(scope="module")
def persist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("persist")


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def server(
    request: pytest.FixtureRequest, dense_model: Path, hybrid_model: Path, persist: Path
) -> Iterator[Server]:
    model = dense_model if request.param == "dense" else hybrid_model
    srv = start_server(model, "--persist-dir", str(persist / request.param))
    yield srv
    assert stop_server(srv) == 0


@pytest.fixture(scope="module")
def scripted() -> Iterator[Server]:
    """The scripted engine's server: refusals and ignored fields do not
    depend on the model."""
    with scripted_server() as server:
        yield server


def _create(server: Server, **kw: Any) -> Any:
    kw.setdefault("model", "demo")
    kw.setdefault("temperature", 0)
    return server.client.responses.create(**kw)


def test_create_returns_a_response_object(server: Server) -> None:
    r = _create(server, input="Write a few words.", max_output_tokens=8, instructions="Be brief.")
    assert r.object == "response"
    assert r.id.startswith("resp_")
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.instructions == "Be brief."
    (msg,) = r.output
    assert isinstance(msg, ResponseOutputMessage)
    assert msg.role == "assistant"
    assert msg.content[0].type == "output_text"
    assert r.output_text
    assert r.usage is not None
    assert r.usage.output_tokens == 8
    assert r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + 8


def test_streamed_events_follow_the_documented_sequence(server: Server) -> None:
    kw: dict[str, Any] = dict(input="Write a few words.", max_output_tokens=10)
    whole = _create(server, **kw)
    events = list(_create(server, **kw, stream=True))
    assert isinstance(events[0], ResponseCreatedEvent)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == text
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 10
    # A streamed response is stored too, before its last event is sent.
    assert server.client.responses.retrieve(final.id).output_text == text


def test_reasoning_effort_switches_thinking_and_returns_reasoning_items(server: Server) -> None:
    kw: dict[str, Any] = dict(input="Hi.", max_output_tokens=8)
    events = list(_create(server, **kw, reasoning={"effort": "low"}, stream=True))
    types = [e.type for e in events]
    deltas = types.count("response.reasoning_text.delta")
    assert deltas > 0
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * deltas,
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    (item,) = events[-1].response.output
    assert item.type == "reasoning"
    assert item.content[0].text == "".join(
        e.delta for e in events if e.type == "response.reasoning_text.delta"
    )
    # The item goes back as input as the SDK dumps it; effort none: no thinking.
    off = _create(
        server,
        input=[{"role": "user", "content": "Hi."}, item.model_dump(exclude_none=True)],
        reasoning={"effort": "none"},
        max_output_tokens=4,
    )
    assert [i.type for i in off.output] == ["message"]


def test_stream_helper_parses_json_schema_output(server: Server) -> None:
    with server.client.responses.stream(
        model="demo",
        input="Name a city.",
        text_format=City,
        max_output_tokens=200,
        temperature=0,
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.status == "completed"
    parsed = final.output_parsed
    assert isinstance(parsed, City)
    assert City.model_validate_json(final.output_text) == parsed


def test_parse_with_a_json_schema_text_format(server: Server) -> None:
    r = server.client.responses.parse(
        model="demo", input="Name a city.", text_format=City, max_output_tokens=200, temperature=0
    )
    assert r.status == "completed"
    assert isinstance(r.output_parsed, City)
    assert r.text.format.type == "json_schema"
    obj = _create(
        server,
        input="Any JSON.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=200,
    )
    # Any object may be long: it parses once it is complete.
    assert obj.output_text.startswith("{")
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


def test_previous_response_id_chain_reports_growing_cached_tokens(server: Server) -> None:
    cached, inputs = [], []
    previous = None
    for turn in ("Tell me about the harbour.", "And the boats?", "And the lighthouse?"):
        r = _create(
            server,
            input=turn,
            instructions="You are a guide.",
            previous_response_id=previous,
            max_output_tokens=6,
        )
        assert r.previous_response_id == previous
        cached.append(r.usage.input_tokens_details.cached_tokens)
        inputs.append(r.usage.input_tokens)
        previous = r.id
    # Each turn's prompt holds the previous one, which the cache serves.
    assert inputs[0] < inputs[1] < inputs[2]
    assert cached[0] < cached[1] < cached[2]
    # All but the previous turn's generation prompt (which the template
    # renders differently in history): turn 3 reuses more than turn 1's prompt.
    assert cached[1] > inputs[0] * 2 // 3
    assert cached[2] > inputs[0]


def test_function_tool_round_trip(server: Server) -> None:
    r = _create(
        server,
        input="What is the weather in Oslo?",
        tools=TOOLS,
        tool_choice="required",
        max_output_tokens=120,
        temperature=1.0,
    )
    assert r.status == "completed"
    calls = [item for item in r.output if isinstance(item, ResponseFunctionToolCall)]
    assert calls, r.output
    call = calls[0]
    assert call.name == "get_weather"
    assert call.call_id
    args = json.loads(call.arguments)
    assert args["city"] in ("Oslo", "Bergen")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    # Continued from the stored response ...
    follow = _create(
        server, input=[result], previous_response_id=r.id, tools=TOOLS, max_output_tokens=8
    )
    assert follow.output_text
    # ... or with the whole conversation replayed, as a stateless client does.
    replay = _create(
        server,
        input=[
            {"role": "user", "content": "What is the weather in Oslo?"},
            *[item.model_dump(exclude_none=True) for item in r.output],
            result,
        ],
        tools=TOOLS,
        max_output_tokens=8,
        store=False,
    )
    assert replay.output_text == follow.output_text
    assert replay.usage.input_tokens == follow.usage.input_tokens


def test_a_forced_call_cut_short_is_incomplete_never_completed(server: Server) -> None:
    # Too few tokens for the shortest call (about 26 here): the call is
    # reported incomplete, streamed or not, and a continuation never replays it.
    kw: dict[str, Any] = dict(
        input="Weather in Oslo?", tools=TOOLS, tool_choice="required", max_output_tokens=20
    )
    r = _create(server, **kw)
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls
    assert all(call.status == "incomplete" for call in calls)
    events = list(_create(server, **kw, stream=True))
    assert events[-1].type == "response.incomplete"
    assert not any(e.type == "response.completed" for e in events)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.model_dump() for i in done] == [i.model_dump() for i in events[-1].response.output]
    follow = _create(server, input="Try again.", previous_response_id=r.id, max_output_tokens=2)
    replay = _create(
        server,
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            *[i.model_dump(exclude_none=True) for i in r.output if i.type != "function_call"],
            {"role": "user", "content": "Try again."},
        ],
        max_output_tokens=2,
        store=False,
    )
    assert follow.usage.input_tokens == replay.usage.input_tokens


def test_function_call_arguments_stream(server: Server) -> None:
    events = list(
        _create(
            server,
            input="Weather in Bergen?",
            tools=TOOLS,
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=120,
            temperature=1.0,
            stream=True,
        )
    )
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(done.arguments) == json.loads(deltas)
    final = events[-1]
    assert isinstance(final, ResponseCompletedEvent)
    (call,) = [i for i in final.response.output if i.type == "function_call"]
    assert call.arguments == done.arguments


def test_store_get_delete(server: Server) -> None:
    r = _create(server, input="Hello.", max_output_tokens=4, metadata={"k": "v"})
    got = server.client.responses.retrieve(r.id)
    assert got.id == r.id
    assert got.output_text == r.output_text
    assert got.metadata == {"k": "v"}
    server.client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        server.client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        server.client.responses.delete(r.id)
    unstored = _create(server, input="Hello.", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        server.client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as err:
        _create(server, input="Hi.", previous_response_id=unstored.id, max_output_tokens=4)
    assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]


def _wait(server: Server, rid: str, *statuses: str) -> Any:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = server.client.responses.retrieve(rid)
        if r.status in statuses:
            return r
        time.sleep(0.05)
    raise AssertionError(f"{rid} never reached {statuses}")


def test_background_response_runs_and_can_be_cancelled(server: Server) -> None:
    r = _create(server, input="Hello.", max_output_tokens=6, background=True)
    assert r.background is True
    assert r.status in ("queued", "in_progress")
    done = _wait(server, r.id, "completed", "incomplete")
    assert done.usage.output_tokens == 6
    assert done.output_text

    long = _create(server, input="Tell me everything.", max_output_tokens=4000, background=True)
    _wait(server, long.id, "in_progress")
    cancelled = server.client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert server.client.responses.retrieve(long.id).status == "cancelled"
    # Cancelling again returns it as it is; a foreground response cannot be.
    assert server.client.responses.cancel(long.id).status == "cancelled"
    foreground = _create(server, input="Hi.", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        server.client.responses.cancel(foreground.id)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        # Tools of a kind this server cannot run (web_search, an unknown kind)
        # are ignored and named in a header (tests/http/test_codex*.py); a
        # type that is no kind at all is refused.
        ({"input": "x", "tools": [{"type": 7}]}, "tools[0].type", "string"),
        ({"input": "x", "tools": [{"type": "namespace"}]}, "tools[0].name", "required"),
        (
            {"input": [{"type": "computer_call_output", "call_id": "c"}]},
            "input[0].type",
            "computer_call_output",
        ),
        ({"input": "x", "truncation": "auto"}, "truncation", "auto"),
        ({"input": "x", "background": True, "store": False}, "background", "store"),
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id", "not found"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", ">= 1"),
        ({"input": "x", "conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "instructions"),
        ({}, "input", "required"),
    ],
)
def test_refusals_name_the_field(
    scripted: Server, body: dict[str, Any], param: str, words: str
) -> None:
    resp = httpx.post(f"{scripted.url}/v1/responses", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param
    assert words in error["message"]


def test_an_unknown_field_is_ignored_and_named(scripted: Server) -> None:
    body = {
        "input": "x",
        "max_output_tokens": 2,
        "temprature": 1,
        "context_management": [],
        "newer": {},
    }
    resp = httpx.post(f"{scripted.url}/v1/responses", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-gezel-ignored-fields"] == "temprature, newer"


def test_fields_the_sdk_sends_are_accepted(server: Server) -> None:
    # Newer SDK fields with nothing to change here: accepted, not refused.
    r = _create(
        server,
        input=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "input_text",
                        "text": "Hello.",
                        "prompt_cache_breakpoint": {"mode": "explicit"},
                    }
                ],
            }
        ],
        tools=[{**TOOLS[0], "defer_loading": False, "output_schema": None}],
        reasoning={"context": "auto"},
        max_output_tokens=2,
        extra_body={"prompt_cache_options": {"mode": "implicit"}},
    )
    assert r.usage.output_tokens == 2


def test_stored_responses_survive_a_restart(dense_model: Path, tmp_path: Path) -> None:
    srv = start_server(dense_model, "--persist-dir", str(tmp_path))
    try:
        first = _create(srv, input="Tell me about the harbour.", max_output_tokens=6)
        second = _create(
            srv, input="And the boats?", previous_response_id=first.id, max_output_tokens=6
        )
    finally:
        assert stop_server(srv) == 0
    assert len(list((tmp_path / "responses").glob("*.json"))) == 2
    srv = start_server(dense_model, "--persist-dir", str(tmp_path))
    try:
        again = srv.client.responses.retrieve(second.id)
        assert again.output_text == second.output_text
        third = _create(
            srv, input="And the lighthouse?", previous_response_id=second.id, max_output_tokens=6
        )
        # The chain's prompt-cache entry was flushed to disk with the rest.
        assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens - 8
    finally:
        assert stop_server(srv) == 0
