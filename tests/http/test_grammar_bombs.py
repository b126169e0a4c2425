"""Grammars and schemas built to overflow or stall llguidance are 400s.

llguidance compiles recursively on the native stack; past its depth a
request was a SIGSEGV that took every other request down with the process.
These run against a server process of their own, so a regression fails
here (the server gone, the request unanswered) instead of killing pytest.
Each bomb is well past the depth that crashed llguidance 1.9.1 on an 8 MiB
stack (2,700 chained rules, 3,500 terminals, 920 "$ref"-linked objects).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from tests.support.fuzzing import (
    Request,
    bomb_request,
    check,
    health_ok,
    many_alternatives,
    nested_groups,
    nested_parens,
    ref_chain,
    rule_chain,
    send,
    terminal_chain,
)
from tests.support.process import Server, start_server, stop_server


@pytest.fixture(scope="module")
def bombed(dense_model: Path) -> Iterator[tuple[Server, httpx.Client]]:
    srv = start_server(dense_model, "--max-tokens-default", "4")
    client = httpx.Client(base_url=srv.url, timeout=60)
    try:
        yield srv, client
    finally:
        client.close()
        assert stop_server(srv) == 0


def _refused(bombed: tuple[Server, httpx.Client], req: Request) -> dict[str, Any]:
    """The 400's error object; the server must be up and well after it."""
    srv, client = bombed
    started = time.perf_counter()
    try:
        resp = send(client, req)
    except httpx.HTTPError as exc:
        pytest.fail(f"no answer ({exc!r}); server exit status {srv.proc.poll()}")
    seconds = time.perf_counter() - started
    assert srv.proc.poll() is None, "the server died"
    assert health_ok(client) is None
    assert check(resp) == ()
    assert resp.status_code == 400, resp.text[:300]
    # Refused before compiling: well under a second even on a loaded host.
    assert seconds < 5, seconds
    error: dict[str, Any] = resp.json()["error"]
    return error


@pytest.mark.parametrize("carrier", ["responses", "chat"])
def test_a_chain_of_3000_rules_is_a_400_naming_the_limit(
    bombed: tuple[Server, httpx.Client], carrier: str
) -> None:
    error = _refused(bombed, bomb_request(carrier, rule_chain(3_000)))
    where = "tools[0].format" if carrier == "responses" else "tools[0].custom.format.grammar"
    assert error["param"] == f"{where}.definition"
    assert "1000 rules" in error["message"]


@pytest.mark.parametrize(
    ("grammar", "limit"),
    [
        (rule_chain(900), "200 deep"),
        (terminal_chain(4_000), "1000 rules"),
        (many_alternatives(5_000), "2000 alternatives"),
        (nested_parens(200), "nest"),
        (f"start: /{nested_groups(900)}/", "100 deep"),
        ("start: %json " + json.dumps(ref_chain(1_000)), "256 levels"),
    ],
    ids=["rule-chain", "terminal-chain", "alternatives", "parens", "regex-groups", "json-refs"],
)
def test_a_deep_or_wide_lark_grammar_is_a_400(
    bombed: tuple[Server, httpx.Client], grammar: str, limit: str
) -> None:
    error = _refused(bombed, bomb_request("responses", grammar))
    assert error["param"] == "tools[0].format.definition"
    assert limit in error["message"]


def test_a_deeply_nested_regex_grammar_is_a_400(bombed: tuple[Server, httpx.Client]) -> None:
    error = _refused(bombed, bomb_request("chat_regex", nested_groups(900)))
    assert error["param"] == "tools[0].custom.format.grammar.definition"


@pytest.mark.parametrize(
    ("carrier", "part"),
    [
        ("response_format", "response_format.json_schema.schema"),
        ("text_format", "response_format.json_schema.schema"),
    ],
)
def test_a_chain_of_1000_ref_linked_schemas_is_a_400(
    bombed: tuple[Server, httpx.Client], carrier: str, part: str
) -> None:
    error = _refused(bombed, bomb_request(carrier, ref_chain(1_000)))
    assert "256 levels" in error["message"]
    assert part in error["message"]


@pytest.mark.parametrize(
    ("carrier", "part"),
    [
        ("parameters", "tools[0].function.parameters"),
        ("input_schema", "tools[0].function.parameters"),
    ],
)
def test_a_tool_schema_deeper_than_the_limit_with_its_refs_is_a_400(
    bombed: tuple[Server, httpx.Client], carrier: str, part: str
) -> None:
    # A tool's schema is also in the prompt: 100 links (300 levels) fit the
    # demo model's context, which a 1,000-link chain would not.
    error = _refused(bombed, bomb_request(carrier, ref_chain(100)))
    assert "256 levels" in error["message"]
    assert part in error["message"]
