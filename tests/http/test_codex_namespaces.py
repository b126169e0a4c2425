"""Codex's ``namespace`` tools (``tests/support/codex.py``
``CODEX_NAMESPACE_TOOL``) through the real server and the official ``openai``
SDK: the tools inside are shown to the model under names of their own, a
call of one comes back as Codex reads it (``name`` the inner tool's,
``namespace`` the group's), and the history Codex re-sends with that call
renders as it was generated, so the prompt cache serves it.

Tool kinds this server cannot run, wherever they sit, are left out of the
prompt and named in ``x-gezel-ignored-tools``, never a 400.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from gezel_trio.http.openai_responses import items_to_messages
from gezel_trio.http.responses_wire import parse_responses_request, structure_items
from tests.support.codex import (
    CODEX_NAMESPACE_TOOL,
    CODEX_TOOLS,
    ORDERS_NAMESPACE,
    codex_request,
)
from tests.support.process import Server

_USER = {"role": "user", "content": [{"type": "input_text", "text": "Where is order A1?"}]}
_TOOLS = [*CODEX_TOOLS, CODEX_NAMESPACE_TOOL]
_INNER = {t["name"] for t in CODEX_NAMESPACE_TOOL["tools"]}


def _body(history: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    body = codex_request("m", history, tools=_TOOLS, stream=False, temperature=0, **extra)
    body.pop("client_metadata")
    return body


def test_codex_request_with_a_namespace_answers(dense_server: Server) -> None:
    raw = dense_server.client.responses.with_raw_response.create(
        **_body([_USER], max_output_tokens=8)
    )
    assert raw.status_code == 200
    assert raw.headers["x-gezel-ignored-tools"] == "web_search"
    r = raw.parse()
    assert r.status in ("completed", "incomplete")
    echoed = [t.model_dump(exclude_none=True) for t in r.tools]
    assert [t["type"] for t in echoed] == ["function", "function", "custom", "namespace"]
    assert echoed[3]["name"] == ORDERS_NAMESPACE
    assert [t["name"] for t in echoed[3]["tools"]] == ["lookup_order", "cancel_order"]


def _namespaced_call(r: Any) -> dict[str, Any]:
    (call,) = [i.model_dump(exclude_none=True) for i in r.output if i.type == "function_call"]
    return call


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "function", "name": "lookup_order", "namespace": ORDERS_NAMESPACE},
        {
            "type": "allowed_tools",
            "mode": "required",
            "tools": [{"type": "function", "name": "lookup_order", "namespace": ORDERS_NAMESPACE}],
        },
    ],
)
def test_a_forced_namespaced_call_comes_back_in_codex_shape(
    dense_server: Server, choice: dict[str, Any]
) -> None:
    r = dense_server.client.responses.create(
        **_body([_USER], tool_choice=choice, max_output_tokens=60)
    )
    call = _namespaced_call(r)
    assert call["name"] == "lookup_order"
    assert call["namespace"] == ORDERS_NAMESPACE
    assert json.loads(call["arguments"])["order_id"] in ("A1", "B2")


def test_a_streamed_namespaced_call_carries_its_namespace(dense_server: Server) -> None:
    """Codex streams: the item as added and as done names the tool as the
    request wrote it."""
    choice = {"type": "function", "name": "cancel_order", "namespace": ORDERS_NAMESPACE}
    body = _body([_USER], tool_choice=choice, max_output_tokens=60)
    body.pop("stream")
    with dense_server.client.responses.stream(**body) as stream:
        events = [e.model_dump(exclude_none=True) for e in stream]
    items = [
        e["item"]
        for e in events
        if e["type"] in ("response.output_item.added", "response.output_item.done")
        and e["item"]["type"] == "function_call"
    ]
    assert len(items) == 2, events
    assert {(i["namespace"], i["name"]) for i in items} == {(ORDERS_NAMESPACE, "cancel_order")}
    assert _namespaced_call(stream.get_final_response())["namespace"] == ORDERS_NAMESPACE


def test_required_names_only_tools_the_request_has(dense_server: Server) -> None:
    """``required`` over every tool: whichever the model picks, a namespaced
    one carries its namespace and a plain one none."""
    plain = {t["name"] for t in CODEX_TOOLS if "name" in t}
    for seed in range(3):
        body = _body([_USER], tool_choice="required", max_output_tokens=60)
        r = dense_server.client.responses.create(
            **body | {"temperature": 1.0, "extra_body": {"seed": seed}}
        )
        calls = [i.model_dump(exclude_none=True) for i in r.output if "call" in i.type]
        assert len(calls) == 1, calls
        (call,) = calls
        if call.get("namespace") is not None:
            assert (call["namespace"], call["name"]) in {(ORDERS_NAMESPACE, n) for n in _INNER}
        else:
            assert call["name"] in plain


def test_re_sent_namespaced_call_reuses_the_cache(dense_server: Server) -> None:
    """Codex's loop: a namespaced call, its output, a reply, the next ask,
    the whole history re-sent each turn: each turn reads the previous prompt
    and its reply from the cache, the namespaced call included."""
    choice = {"type": "function", "name": "lookup_order", "namespace": ORDERS_NAMESPACE}
    off = {"effort": "none"}
    first = dense_server.client.responses.create(
        **_body([_USER], tool_choice=choice, max_output_tokens=60, reasoning=off)
    )
    assert first.status == "completed", first
    call = _namespaced_call(first)
    # As Codex re-sends a model's call: its fields, without the server's id.
    resent = {k: call[k] for k in ("type", "call_id", "name", "namespace", "arguments")}
    history: list[dict[str, Any]] = [
        _USER,
        resent,
        {"type": "function_call_output", "call_id": call["call_id"], "output": "Shipped."},
    ]
    turns = []
    for ask in ("Thanks. And order B2?", "Cancel it then."):
        r = dense_server.client.responses.create(
            **_body(history, max_output_tokens=8, reasoning=off)
        )
        assert r.usage is not None
        turns.append((r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens, r))
        history += [i.model_dump(exclude_none=True) for i in r.output]
        history.append({"role": "user", "content": [{"type": "input_text", "text": ask}]})
    (prompt, _, reply), (_, cached, _) = turns
    assert reply.usage is not None
    assert cached >= prompt + reply.usage.output_tokens - 1, turns


def test_a_namespaced_call_renders_under_the_name_the_model_was_shown() -> None:
    """The re-sent call (``name`` and ``namespace``) is rendered under the
    flat name the tool was served under, so it reads as generated."""
    req = parse_responses_request({"input": "x", "tools": _TOOLS})
    shown = {t.name for t in req.served_tools}
    assert req.namespaced == {
        "mcp__orders__lookup_order": (ORDERS_NAMESPACE, "lookup_order"),
        "mcp__orders__cancel_order": (ORDERS_NAMESPACE, "cancel_order"),
    }
    items = structure_items(
        [
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "lookup_order",
                "namespace": ORDERS_NAMESPACE,
                "arguments": "{}",
            }
        ]
    )
    (message,) = items_to_messages(items)
    (rendered,) = message["tool_calls"]
    assert rendered["function"]["name"] in shown
    assert rendered["function"]["name"] == "mcp__orders__lookup_order"


def test_tool_kinds_this_server_cannot_run_are_named_not_refused(dense_server: Server) -> None:
    namespace = {
        **CODEX_NAMESPACE_TOOL,
        "tools": [*CODEX_NAMESPACE_TOOL["tools"], {"type": "tool_search", "execution": "client"}],
    }
    tools = [
        *CODEX_TOOLS,
        namespace,
        {"type": "image_generation", "output_format": "png"},
        {"type": "a_kind_from_next_year", "name": "later"},
    ]
    raw = dense_server.client.responses.with_raw_response.create(
        **_body([_USER], max_output_tokens=4) | {"tools": tools}
    )
    assert raw.status_code == 200
    assert raw.headers["x-gezel-ignored-tools"] == (
        "web_search, tool_search, image_generation, a_kind_from_next_year"
    )


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        # A flattened name that another tool already has.
        (
            [
                {"type": "function", "name": "mcp__orders__lookup_order"},
                CODEX_NAMESPACE_TOOL,
            ],
            "tools[1].tools[0].name",
        ),
        # The same tool twice in one namespace.
        (
            [
                {
                    **CODEX_NAMESPACE_TOOL,
                    "tools": [CODEX_NAMESPACE_TOOL["tools"][0]] * 2,
                }
            ],
            "tools[0].tools[1].name",
        ),
        ([{"type": "namespace", "name": "", "tools": []}], "tools[0].name"),
    ],
)
def test_namespace_name_clashes_are_400_naming_them(
    dense_server: Server, tools: list[dict[str, Any]], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        dense_server.client.responses.create(model="m", input="x", tools=tools)  # type: ignore[arg-type]
    assert info.value.body is not None
    assert info.value.body["param"] == param, info.value.body  # type: ignore[index]


def test_flat_names_of_codex_namespaces() -> None:
    """Codex's default namespace adds nothing (its "lite" protocol puts its
    own tools there); one without a trailing separator is joined with
    ``__``."""
    exec_command = CODEX_TOOLS[0]
    req = parse_responses_request(
        {
            "input": "x",
            "tools": [
                {"type": "namespace", "name": "functions", "tools": [exec_command]},
                {"type": "namespace", "name": "docs", "tools": [{**exec_command, "name": "find"}]},
            ],
        }
    )
    assert [t.name for t in req.served_tools] == ["exec_command", "docs__find"]
    assert req.namespaced == {
        "exec_command": ("functions", "exec_command"),
        "docs__find": ("docs", "find"),
    }
