"""A field the server does not implement is ignored and reported, at any
depth and on every protocol: the response names its path in the
``x-gezel-ignored-fields`` header, a log line names it once, and
``gezel_ignored_fields_total`` counts it by name. ``--strict-fields``
refuses it instead (a 400 naming it); a known field with a bad value is a
400 either way.

In-process over the scripted backend: the model does not matter here."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from quart import typing as quart_typing

from gezel_trio import cli
from gezel_trio.core.errors import InvalidRequest
from gezel_trio.core.request import GenerationRequest
from gezel_trio.http.app import HttpSettings, create_app
from gezel_trio.http.edge import IGNORED_FIELDS_HEADER
from gezel_trio.http.openai_wire import parse_chat_request
from gezel_trio.http.strict import collecting_fields
from gezel_trio.profiles import STANDARD
from gezel_trio.testing import ScriptedBackend, open_test_engine

USER = [{"role": "user", "content": "hi"}]

# Each protocol's body, an unknown field at the top and one nested in it,
# and the paths the header names.
CASES = [
    pytest.param(
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi", "cache_hint": 1}]},
            ],
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "top_level_extra": True,
        },
        [
            "messages[1].content[0].cache_hint",
            "stream_options.continuous_usage_stats",
            "top_level_extra",
        ],
        id="chat",
    ),
    pytest.param(
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2, "stream_options": {"include_usage": True, "x": 1}},
        ["stream_options.x"],
        id="completions",
    ),
    pytest.param(
        "/v1/responses",
        {
            "input": [
                {"type": "message", "role": "user", "content": "hi", "status": "completed", "z": 0}
            ],
            "max_output_tokens": 2,
            "context_management": [{"type": "compaction", "compact_threshold": 1000}],
            "text": {"format": {"type": "text"}, "verbosity_hint": "x"},
            "newer": {"a": 1},
        },
        ["input[0].z", "newer", "text.verbosity_hint"],
        id="responses",
    ),
    pytest.param(
        "/v1/messages",
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi", "future": {}}]}
            ],
            "max_tokens": 2,
            "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
            "tool_choice": {"type": "auto", "later": 1},
            "brand_new": 1,
        },
        ["brand_new", "messages[0].content[0].future", "tool_choice.later"],
        id="messages",
    ),
    pytest.param(
        "/v1/cache/warm",
        {"cache_id": "c1", "messages": [{"role": "user", "content": "hi", "weight": 1}], "w": 2},
        ["messages[0].weight", "w"],
        id="cache-warm",
    ),
    pytest.param(
        "/v1/messages/count_tokens",
        {"messages": [{"role": "user", "content": "hi", "pinned": True}]},
        ["messages[0].pinned"],
        id="count-tokens",
    ),
    pytest.param(
        "/detokenize",
        {"tokens": [104, 105], "skip_special": True},
        ["skip_special"],
        id="detokenize",
    ),
    pytest.param(
        "/tokenize",
        {"prompt": "hi", "add_bos": True},
        ["add_bos"],
        id="tokenize",
    ),
]


def _script(_rid: int, request: GenerationRequest) -> Sequence[int]:
    return [104, 105][: request.max_tokens]


@asynccontextmanager
async def _client(
    settings: HttpSettings | None = None,
) -> AsyncIterator[quart_typing.TestClientProtocol]:
    async with open_test_engine(ScriptedBackend(script=_script)) as t:
        async with create_app(t.engine, settings or HttpSettings()).test_app() as app:
            yield app.test_client()


def _named(header: str | None) -> list[str]:
    return sorted(header.split(", ")) if header else []


@pytest.mark.parametrize(("path", "body", "paths"), CASES)
async def test_unknown_fields_are_ignored_and_named(
    path: str, body: dict[str, Any], paths: list[str]
) -> None:
    async with _client() as client:
        r = await client.post(path, json=body)
        assert r.status_code == 200, await r.get_data(as_text=True)
        assert _named(r.headers.get(IGNORED_FIELDS_HEADER)) == paths


@pytest.mark.parametrize(("path", "body", "paths"), CASES)
async def test_strict_fields_refuses_them_by_name(
    path: str, body: dict[str, Any], paths: list[str]
) -> None:
    async with _client(HttpSettings(strict_fields=True)) as client:
        r = await client.post(path, json=body)
        assert r.status_code == 400
        error = (await r.get_json())["error"]
        # Anthropic's envelope has no param: the message names the path.
        assert any(p in (error.get("param") or error["message"]) for p in paths), error
        assert "unknown field" in error["message"]
        assert IGNORED_FIELDS_HEADER not in r.headers


async def test_a_later_refusal_names_them_too() -> None:
    # Refused after its body was read: the ignored fields are still named.
    async with _client() as client:
        body = {"input": "hi", "previous_response_id": "resp_nope", "q": 1}
        r = await client.post("/v1/responses", json=body)
        assert r.status_code == 400
        assert (await r.get_json())["error"]["param"] == "previous_response_id"
        assert r.headers[IGNORED_FIELDS_HEADER] == "q"


async def test_a_request_without_unknown_fields_has_no_header() -> None:
    async with _client() as client:
        r = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
        assert r.status_code == 200
        assert IGNORED_FIELDS_HEADER not in r.headers


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": USER, "stream": True, "max_tokens": 2, "q": 1}),
        ("/v1/completions", {"prompt": "hi", "stream": True, "max_tokens": 2, "q": 1}),
        ("/v1/responses", {"input": "hi", "stream": True, "max_output_tokens": 2, "q": 1}),
        ("/v1/messages", {"messages": USER, "stream": True, "max_tokens": 2, "q": 1}),
    ],
)
async def test_a_stream_carries_the_header(path: str, body: dict[str, Any]) -> None:
    async with _client() as client:
        r = await client.post(path, json=body)
        assert r.status_code == 200
        assert r.headers[IGNORED_FIELDS_HEADER] == "q"
        assert "text/event-stream" in r.headers["Content-Type"]
        assert await r.get_data(as_text=True)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": USER, "temperature": "hot", "q": 1}, "temperature"),
        (
            "/v1/chat/completions",
            {"messages": USER, "tool_grammar": {"mode": "all", "allowed_names": []}},
            "tool_grammar.mode",
        ),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "q": 1}, "max_tokens"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 0, "q": 1}, "max_output_tokens"),
        ("/v1/messages", {"messages": USER, "max_tokens": -1, "q": 1}, "max_tokens"),
    ],
)
@pytest.mark.parametrize("strict", [False, True])
async def test_a_known_field_with_a_bad_value_is_still_a_400(
    path: str, body: dict[str, Any], param: str, strict: bool
) -> None:
    async with _client(HttpSettings(strict_fields=strict)) as client:
        r = await client.post(path, json=body)
        assert r.status_code == 400
        error = (await r.get_json())["error"]
        assert param in (error.get("param") or error["message"])


async def test_the_counter_counts_by_name_and_the_log_names_each_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gezel_trio.http")
    body = {"messages": [{"role": "user", "content": "hi", "q": 1}], "max_tokens": 2, "q": 2}
    async with _client() as client:
        for _ in range(3):
            r = await client.post("/v1/chat/completions", json=body)
            assert r.headers[IGNORED_FIELDS_HEADER] == "messages[0].q, q"
        r = await client.post("/v1/messages", json={"messages": USER, "max_tokens": 2, "q": 3})
        assert r.status_code == 200
        metrics = (await (await client.get("/metrics")).get_data(as_text=True)).splitlines()
    # One count per request that carried the name, wherever it sat.
    assert 'gezel_ignored_fields_total{field="q"} 4.0' in metrics
    logged = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(logged) == 1, logged
    assert "'q'" in logged[0]
    assert "messages[0].q" in logged[0]


async def test_the_header_and_the_labels_are_bounded() -> None:
    # 300 unknown names: the header names the first few and how many more;
    # the counter's labels stop at a cap, the rest counted as "other".
    many = {f"f{i:03}": i for i in range(300)}
    long_name = "n" * 5000
    async with _client() as client:
        r = await client.post(
            "/v1/chat/completions",
            json={"messages": USER, "max_tokens": 2, **many, long_name: 1},
        )
        assert r.status_code == 200
        header = r.headers[IGNORED_FIELDS_HEADER]
        assert len(header) <= 1024
        named = header.split(", ")
        assert named[0] == "f000"
        assert named[-1].startswith("+")
        assert len(named) - 1 + int(named[-1][1:]) == 301
        metrics = (await (await client.get("/metrics")).get_data(as_text=True)).splitlines()
    labels = [line for line in metrics if line.startswith("gezel_ignored_fields_total{")]
    assert 'gezel_ignored_fields_total{field="other"} ' in "\n".join(labels) + " "
    assert len(labels) <= 65
    assert sum(float(line.rsplit(" ", 1)[1]) for line in labels) == 301
    assert all(len(line) < 300 for line in labels)


async def test_an_odd_name_is_quoted_in_the_header() -> None:
    async with _client() as client:
        r = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi", "a, b\n\u00e9": 1}]},
        )
        assert r.status_code == 200
        assert r.headers[IGNORED_FIELDS_HEADER] == 'messages[0]["a, b\\n\\u00e9"]'


# The gezel app's newer client: a tool_grammar field this server predates.
NEWER_CLIENT = {
    "messages": USER,
    "tools": [{"type": "function", "function": {"name": "a", "parameters": {}}}],
    "tool_grammar": {"format": "hermes", "mode": "name-only", "future_knob": True},
}


def test_a_newer_clients_extension_field_is_dropped_and_placed() -> None:
    with collecting_fields(strict=False) as report:
        req = parse_chat_request(NEWER_CLIENT)
    assert req.tool_grammar is not None
    assert req.tool_grammar.mode == "name-only"
    assert report.ignored.header() == "tool_grammar.future_knob"


def test_without_a_report_an_unknown_field_is_refused() -> None:
    # A wire module's parse called on its own (no request around it).
    with pytest.raises(InvalidRequest) as caught:
        parse_chat_request(NEWER_CLIENT)
    assert caught.value.param == "tool_grammar.future_knob"


@pytest.mark.parametrize("strict", [False, True])
async def test_the_openapi_document_says_which(strict: bool) -> None:
    async with _client(HttpSettings(strict_fields=strict)) as client:
        doc = await (await client.get("/openapi.json")).get_json()
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert chat.get("additionalProperties", True) is not strict


def test_the_flag_sets_it(tmp_path: Path) -> None:
    def config(*argv: str) -> Any:
        return cli.server_config(cli._parser(STANDARD).parse_args(["serve", *argv]), tmp_path)

    assert config().http.strict_fields is False
    assert config("--strict-fields").http.strict_fields is True
