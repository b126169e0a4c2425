"""An error quotes an offending value at most ``MAX_SHOWN`` characters: a
2 MB field once made a 2 MB error. Each body below puts a 2 MB value where
an error names or quotes it; every answer is a small 400 that still names
the field and says how long the value was. The bound is the wire's, not
the model's: the server runs the scripted engine."""

from __future__ import annotations

from typing import Any

import httpx2 as httpx
import trio

from gezel_trio.http.app import HttpSettings
from tests.support.inprocess import served_scripted

HANG = 120
HUGE = "x" * 2_000_000
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

CASES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"messages": [{"role": HUGE, "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": USER, "reasoning_effort": HUGE}),
    (
        "/v1/chat/completions",
        {"messages": USER, "tools": [{**TOOL, "function": {**TOOL["function"], "name": HUGE}}]},
    ),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": HUGE}}),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": HUGE}),
    ("/v1/responses", {"input": [{"type": HUGE}]}),
    ("/v1/responses", {"input": "hi", "previous_response_id": HUGE}),
    (
        "/v1/messages",
        {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": HUGE}]}]},
    ),
]


async def test_an_error_quotes_at_most_a_bounded_part_of_a_huge_value() -> None:
    with trio.fail_after(HANG):
        async with served_scripted() as (_engine, url), httpx.AsyncClient(base_url=url) as client:
            for path, body in CASES:
                r = await client.post(path, json=body, timeout=HANG)
                assert 400 <= r.status_code < 500, (path, r.status_code)
                assert len(r.content) < 2_000, (path, r.content[:300])
                error = r.json()["error"]
                # Anthropic's envelope has no param: its message names the field.
                assert error.get("param") or "content" in error["message"], path


async def test_a_quoted_value_is_cut_with_its_full_length() -> None:
    # An unknown field is refused only under --strict-fields (ignored otherwise).
    with trio.fail_after(HANG):
        async with (
            served_scripted(HttpSettings(strict_fields=True)) as (_engine, url),
            httpx.AsyncClient(base_url=url) as client,
        ):
            r = await client.post("/v1/chat/completions", json={"messages": USER, HUGE: 1})
            assert r.status_code == 400
            error = r.json()["error"]
            assert "unknown field 'xxxx" in error["message"]
            assert "... (2000000 characters)" in error["message"]
            assert error["param"] == "x" * 200 + "... (2000000 characters)"


async def test_a_huge_unknown_field_is_named_in_a_bounded_header() -> None:
    with trio.fail_after(HANG):
        async with served_scripted() as (_engine, url), httpx.AsyncClient(base_url=url) as client:
            body = {"messages": USER, "max_tokens": 1, HUGE: 1}
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text[:300]
            named = r.headers["x-gezel-ignored-fields"]
            assert named == '["' + "x" * 64 + '... (2000000 characters)"]'
