"""Requests that could kill the server, fail every batch-mate or slip
through, against the real server process and the openai SDK.

Each is sent while a healthy greedy stream runs; the bad request gets its
answer (a 400 naming the field, or a 200 where the documented semantics
serve it) and the healthy stream finishes byte-identical to running alone.
What is refused before any model runs (non-finite numbers, the HTTP
errors' envelope, an oversized body) is checked on the scripted engine's
server.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import openai
import pytest

from gezel_trio.http.app import HttpSettings
from tests.support.process import FIXED, Server
from tests.support.scripted import scripted_server

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "Say something."}]
HEALTHY: dict[str, Any] = dict(
    model="demo",
    messages=[{"role": "user", "content": "Tell me about the harbour."}],
    max_tokens=48,
    temperature=0,
)


@pytest.fixture(scope="module")
def server(dense_server: Server) -> Server:
    """The session's server on the dense demo model (``tests.support.process``)."""
    return dense_server


@pytest.fixture(scope="module")
def scripted() -> Iterator[Server]:
    """The scripted engine's server, for what is refused before any model
    runs."""
    with scripted_server() as server:
        yield server


@pytest.fixture(scope="module")
def alone(server: Server) -> str:
    return _healthy_stream(server.client, threading.Event())


def _healthy_stream(client: openai.OpenAI, started: threading.Event) -> str:
    parts = []
    for chunk in client.chat.completions.create(**HEALTHY, stream=True, extra_body=FIXED):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            started.set()
    return "".join(parts)


def beside_a_healthy_stream(server: Server, alone: str, body: dict[str, Any]) -> httpx.Response:
    """Send ``body`` while a greedy stream is mid-flight; the stream must end
    exactly as it does alone."""
    started = threading.Event()
    out: list[str] = []
    worker = threading.Thread(target=lambda: out.append(_healthy_stream(server.client, started)))
    worker.start()
    try:
        assert started.wait(60), "the healthy stream never started"
        response = server.post(json.dumps(body).encode())
    finally:
        worker.join(120)
    assert out == [alone], "the healthy stream was harmed"
    return response


def assert_refused(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"seed": 2**70}, "seed"),
        ({"logit_bias": {"999999999": 5}}, "logit_bias"),
        ({"logit_bias": {"1000000000000000000000000000000": 5}}, "logit_bias"),
        ({"logit_bias": {"²": 5}}, "logit_bias"),
        ({"temperature": 10**400}, "temperature"),
        ({"tools": [{"type": "function", "function": {"name": 5}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools[0].function.name",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "required": 3}},
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        ({"chat_template_override": "{% for x in %}"}, "chat_template_override"),
        ({"chat_template_override": "x" * 70_000}, "chat_template_override"),
        ({"chat_template_override": "{{ 'x' * 20000000 }}"}, "chat_template_override"),
        (
            {
                "chat_template_override": "{% for a in range(100000) %}"
                "{% for b in range(100000) %}{% endfor %}{% endfor %}"
            },
            "chat_template_override",
        ),
        (
            {"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}},
            "chat_template_kwargs.chat_template",
        ),
        (
            {"chat_template_kwargs": {"tokenize": True, "enable_thinking": False}},
            "chat_template_kwargs.tokenize",
        ),
        ({"cache_id": "a\u0000snapshot"}, "cache_id"),
        ({"prompt_cache_key": "line\nbreak"}, "prompt_cache_key"),
        ({"modalities": ["text", "audio"]}, "modalities[1]"),
        ({"metadata": {"k": {"nested": 1}}}, "metadata.k"),
    ],
)
def test_bad_requests_get_a_400_naming_the_field_and_harm_nobody(
    server: Server, alone: str, extra: dict[str, Any], param: str
) -> None:
    body = {"messages": USER, "max_tokens": 4, **extra}
    assert_refused(beside_a_healthy_stream(server, alone, body), param)


def test_a_lone_surrogate_is_a_400_naming_the_message(server: Server, alone: str) -> None:
    body = {"messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 4}
    assert_refused(beside_a_healthy_stream(server, alone, body), "messages[0].content")


def test_non_finite_numbers_are_refused(scripted: Server) -> None:
    r = scripted.post(b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}')
    assert r.status_code == 400
    assert "NaN" in r.json()["error"]["message"]
    overflow = b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 1e999}}'
    assert_refused(scripted.post(overflow), "logit_bias.5")


@pytest.mark.parametrize(
    "extra",
    [
        {"seed": -1},  # OpenAI clients' "random"
        {"seed": -(2**63)},
        {"seed": 2**64 - 1},
        {"top_k": 1_000_000},  # past the vocabulary: no filter (documented clamp)
        {"logit_bias": {"5": -100, "7": 100}},
    ],
)
def test_values_the_model_can_serve_are_served_beside_a_healthy_stream(
    server: Server, alone: str, extra: dict[str, Any]
) -> None:
    body = {"messages": USER, "max_tokens": 4, "temperature": 0.7, **extra}
    r = beside_a_healthy_stream(server, alone, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_an_unknown_field_is_ignored_and_named_beside_a_healthy_stream(
    server: Server, alone: str
) -> None:
    body = {"messages": USER, "max_tokens": 4, "frobnicate": True}
    r = beside_a_healthy_stream(server, alone, body)
    assert r.status_code == 200, r.text
    assert r.headers["x-gezel-ignored-fields"] == "frobnicate"


def test_openai_request_fields_are_accepted(server: Server) -> None:
    r = server.client.chat.completions.create(
        model="demo",
        messages=USER,  # type: ignore[arg-type]
        max_tokens=3,
        store=False,
        metadata={"team": "harbour"},
        service_tier="auto",
        user="someone",
        parallel_tool_calls=True,
        modalities=["text"],
        prediction={"type": "content", "content": "ahoy"},
        safety_identifier="hash-123",
        verbosity="low",
        prompt_cache_key="harbour-session",
        reasoning_effort="low",
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    stats = httpx.get(f"{server.url}/v1/cache/stats", timeout=10).json()["data"]
    assert "harbour-session" in [e["cache_id"] for e in stats], "prompt_cache_key is a cache id"


def test_an_sdk_dumped_assistant_message_replays(server: Server) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            },
        }
    ]
    first = server.client.chat.completions.create(
        model="demo",
        messages=USER,  # type: ignore[arg-type]
        max_tokens=4,
    )
    dumped = first.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= dumped.keys()
    call = {
        "id": "call_1",
        "index": 0,
        "type": "function",
        "function": {"name": "lookup", "arguments": '{"q": "tides"}'},
    }
    history = [
        *USER,
        dumped,
        {"role": "user", "content": "Look it up."},
        {**dumped, "content": None, "tool_calls": [call], "annotations": []},
        {"role": "tool", "tool_call_id": "call_1", "content": "high tide at noon"},
    ]
    r = server.client.chat.completions.create(
        model="demo",
        messages=history,  # type: ignore[arg-type]
        tools=tools,  # type: ignore[arg-type]
        max_tokens=3,
    )
    assert r.choices[0].message is not None


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/no/such/route", 404),
        ("GET", "/v1/chat/completions", 405),
        ("PUT", "/v1/models", 405),
        ("GET", "/v1/cache/warm", 405),
    ],
)
def test_http_errors_are_the_openai_envelope(
    scripted: Server, method: str, path: str, status: int
) -> None:
    r = httpx.request(method, f"{scripted.url}{path}", timeout=10)
    assert r.status_code == status
    assert r.headers["content-type"].startswith("application/json")
    assert set(r.json()["error"]) >= {"message", "type", "code"}


def test_an_oversized_body_is_a_413_envelope() -> None:
    # What --max-body-mb 0.01 sets (tests/server/test_settings.py reads the flag).
    with scripted_server(http=HttpSettings(max_body_bytes=int(0.01 * 2**20))) as srv:
        r = srv.post(json.dumps({"messages": [{"role": "user", "content": "x" * 20_000}]}).encode())
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "body_too_large"


def test_warm_accepts_model_and_keeps_a_history_ending_in_a_user_turn(server: Server) -> None:
    messages = [
        {"role": "system", "content": "You keep the harbour ledger."},
        {"role": "user", "content": "How many ships came in?"},
    ]
    r = httpx.post(
        f"{server.url}/v1/cache/warm",
        json={"cache_id": "ledger-warm", "model": "demo", "messages": messages},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "warmed"
    turn = server.client.chat.completions.create(
        model="demo",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=2,
        extra_body={"cache_id": "ledger-warm"},
    )
    assert turn.usage is not None
    # The whole prompt but its last token came from the warmed entry.
    assert turn.usage.model_dump()["cached_tokens"] == turn.usage.prompt_tokens - 1
