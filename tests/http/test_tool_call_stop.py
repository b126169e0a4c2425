"""``--stop-at-tool-call-end``: a model that declares a ``tool_call_parser``
(and lists no ``</tool_call>`` eos) ends its turn at its first closed call,
which still parses and streams as ``tool_calls``.

The demo model stands in for such a model: a copy of it whose
``generation_config.json`` declares a parser. A forced call (``tool_choice:
required``, greedy) is generated the same way with and without the stop;
without it the grammar's EOS follows the call, with it the turn ends on
``</tool_call>`` itself, one token sooner.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from gezel_trio.mlx.loading import tool_call_stop_ids
from tests.support.inprocess import served

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "enum": ["a.txt", "b.txt"]}},
                "required": ["path"],
                "additionalProperties": False,
            },
        },
    }
]
BODY: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Read a file."}],
    "tools": TOOLS,
    "tool_choice": "required",
    "max_tokens": 64,
    "temperature": 0,
}


def test_only_a_model_that_declares_a_parser_stops_at_the_call_end() -> None:
    added = {5: "</tool_call>", 6: "<tool_call>", 7: "<|im_end|>"}
    assert tool_call_stop_ids({"tool_call_parser": "laguna_v1"}, added) == {5}
    assert tool_call_stop_ids({}, added) == set()
    assert tool_call_stop_ids({"tool_call_parser": ""}, added) == set()
    assert tool_call_stop_ids({"tool_call_parser": "hermes"}, {6: "<tool_call>"}) == set()


@pytest.fixture
def parser_model(dense_model: Path, tmp_path: Path) -> Path:
    """The demo model, declaring a server-side tool-call parser."""
    model = tmp_path / "declares-parser"
    model.mkdir()
    for f in dense_model.iterdir():
        if f.name != "generation_config.json":
            (model / f.name).symlink_to(f)
    config = json.loads((dense_model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(
        json.dumps({**config, "tool_call_parser": "hermes"})
    )
    return model


async def _stream(url: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The streamed call's deltas, and the last chunk (finish and usage)."""
    deltas: list[dict[str, Any]] = []
    last: dict[str, Any] = {}
    body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    async with (
        httpx.AsyncClient(base_url=url, timeout=120) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                deltas.append(choice["delta"])
                if choice["finish_reason"]:
                    last["finish_reason"] = choice["finish_reason"]
            if chunk.get("usage"):
                last["usage"] = chunk["usage"]
    return deltas, last


async def _completion_tokens(url: str) -> tuple[int, dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        r = await client.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 200
    body = r.json()
    return body["usage"]["completion_tokens"], body["choices"][0]


async def test_the_turn_ends_at_the_call_end_and_the_call_streams_whole(
    parser_model: Path,
) -> None:
    async with served(parser_model) as (_, url):
        without, choice = await _completion_tokens(url)
    assert choice["finish_reason"] == "tool_calls"
    async with served(parser_model, stop_at_tool_call_end=True) as (_, url):
        deltas, last = await _stream(url)
        stopped, stopped_choice = await _completion_tokens(url)
    # The grammar's EOS after the call is never generated: the stop came first.
    assert stopped == without - 1
    functions = [c["function"] for c in stopped_choice["message"]["tool_calls"]]
    assert functions == [c["function"] for c in choice["message"]["tool_calls"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls") or ()]
    assert calls[0]["function"]["name"] == "read_file"
    arguments = json.loads("".join(tc["function"]["arguments"] for tc in calls))
    assert arguments["path"] in ("a.txt", "b.txt")
    assert "</tool_call>" not in "".join(d.get("content") or "" for d in deltas)
    assert last["finish_reason"] == "tool_calls"
    assert last["usage"]["completion_tokens"] == stopped


async def test_a_model_that_declares_no_parser_is_left_alone(dense_model: Path) -> None:
    async with served(dense_model) as (_, url):
        without, _ = await _completion_tokens(url)
    async with served(dense_model, stop_at_tool_call_end=True) as (_, url):
        stopped, choice = await _completion_tokens(url)
    assert stopped == without
    assert choice["finish_reason"] == "tool_calls"
