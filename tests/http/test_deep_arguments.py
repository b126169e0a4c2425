"""Tool-call arguments in a history are JSON inside a string, read after
the body's own nesting bound: arguments nested past Python's recursion
limit are text that does not parse, rendered as sent, never a 500."""

from __future__ import annotations

from typing import Any

import httpx2 as httpx
import pytest

from tests.support.process import Server

_DEEP = "[" * 1_500 + "]" * 1_500


def _chat(dense_server: Server) -> httpx.Response:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": _DEEP}}
    body: dict[str, Any] = {
        "messages": [
            {"role": "user", "content": "Go."},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"},
        ],
        "max_tokens": 2,
    }
    return httpx.post(f"{dense_server.url}/v1/chat/completions", json=body, timeout=60)


def _responses(dense_server: Server) -> httpx.Response:
    body: dict[str, Any] = {
        "input": [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": _DEEP},
            {"type": "function_call_output", "call_id": "c1", "output": "done"},
        ],
        "max_output_tokens": 2,
    }
    return httpx.post(f"{dense_server.url}/v1/responses", json=body, timeout=60)


@pytest.mark.parametrize("send", [_chat, _responses], ids=["chat", "responses"])
def test_arguments_nested_past_the_recursion_limit_are_rendered_as_text(
    dense_server: Server, send: Any
) -> None:
    resp = send(dense_server)
    assert resp.status_code == 200, resp.text[:300]
    assert httpx.get(f"{dense_server.url}/health").json()["status"] in ("ok", "degraded")
