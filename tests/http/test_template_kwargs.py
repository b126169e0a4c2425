"""``chat_template_kwargs`` cannot name what the renderer sets itself.

Sent as a template kwarg, ``chat_template`` replaced the model's template
with no compile check or size cap, and the other names transformers takes
as its own arguments (``tokenize``, ``tools``, ...) made the render fail,
so the fallback render without kwargs silently dropped every other key
(``enable_thinking`` with them). Each is a 400 naming
``chat_template_kwargs.<key>`` on every endpoint that takes the kwargs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gezel_trio.core.errors import InvalidRequest
from gezel_trio.http import checks
from gezel_trio.http.openai_wire import (
    parse_chat_request,
    parse_tokenize_request,
    parse_warm_request,
)
from gezel_trio.http.responses_wire import parse_responses_request

USER = [{"role": "user", "content": "hi"}]
PARSERS: list[tuple[str, Callable[[Any], Any], dict[str, Any]]] = [
    ("chat", parse_chat_request, {"messages": USER}),
    ("tokenize", parse_tokenize_request, {"messages": USER}),
    ("warm", parse_warm_request, {"cache_id": "c", "messages": USER}),
    ("responses", parse_responses_request, {"input": "hi"}),
]


@pytest.mark.parametrize(("name", "parse", "body"), PARSERS, ids=[p[0] for p in PARSERS])
@pytest.mark.parametrize(
    "key", ["chat_template", "tokenize", "tools", "add_generation_prompt", "messages", "documents"]
)
def test_a_reserved_key_is_a_400_naming_it(
    name: str, parse: Callable[[Any], Any], body: dict[str, Any], key: str
) -> None:
    kwargs = {"enable_thinking": False, key: "{{ 'x' * 20000000 }}"}
    with pytest.raises(InvalidRequest) as caught:
        parse({**body, "chat_template_kwargs": kwargs})
    assert caught.value.param == f"chat_template_kwargs.{key}"


@pytest.mark.parametrize(("name", "parse", "body"), PARSERS, ids=[p[0] for p in PARSERS])
def test_ordinary_kwargs_still_pass(
    name: str, parse: Callable[[Any], Any], body: dict[str, Any]
) -> None:
    parse({**body, "chat_template_kwargs": {"enable_thinking": False, "reasoning_budget": 64}})


def _schema(i: int, chars: int) -> dict[str, Any]:
    return {"type": "object", "description": f"{i}" + "d" * chars}


def test_the_schema_check_memo_is_bounded_by_bytes() -> None:
    """256 distinct 8 MB schemas were all kept; the memo now holds at most
    its byte bound, and a schema past the bound is checked but not kept."""
    memo = checks._SCHEMA_PROBLEMS
    for i in range(6):
        checks.check_parameters(_schema(i, 1_500_000), "tools[0].function.parameters")
        assert memo.held_chars() <= 4_000_000
    before = memo.held_chars()
    checks.check_parameters(_schema(99, 5_000_000), "tools[0].function.parameters")
    assert memo.held_chars() <= before + 0  # too large to keep


def test_a_memo_answers_again_without_checking() -> None:
    seen: list[str] = []

    def check(text: str) -> str | None:
        seen.append(text)
        return None if text == "ok" else "bad"

    memo = checks._ProblemMemo(check, 10)
    assert memo.get("ok") is None
    assert memo.get("ok") is None
    assert memo.get("bad") == "bad"
    assert seen == ["ok", "bad"]
    memo.get("x" * 9)  # evicts the older entries to stay within 10 characters
    assert memo.held_chars() <= 10
