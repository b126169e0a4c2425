"""Anthropic's cache diagnostics compare what this server renders: what it
takes out of every prompt before rendering (Claude Code's billing line,
which changes on every request) changes no diagnosis, and a change that
does reach the prompt is still named. In-process over the scripted engine."""

from __future__ import annotations

from typing import Any

from gezel_trio.http.app import HttpSettings, create_app
from gezel_trio.testing import ScriptedBackend, open_test_engine

RULES = "You are a coding agent. Read a file before you edit it. " * 4


def _body(cch: str, rules: str, previous: str | None) -> dict[str, Any]:
    header = "x-anthropic-billing-header: "
    header += f"cc_version=2.1.197.{cch[:3]}; cc_entrypoint=cli; cch={cch};"
    return {
        "model": "m",
        "max_tokens": 2,
        "system": [
            {"type": "text", "text": header},
            {"type": "text", "text": rules, "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [{"role": "user", "content": "Say hello."}],
        "diagnostics": {"previous_message_id": previous},
    }


async def _diagnose(second_rules: str) -> Any:
    async with open_test_engine(ScriptedBackend(prefill_step=64)) as t:
        async with create_app(t.engine, HttpSettings()).test_app() as app:
            client = app.test_client()
            r = await client.post("/v1/messages", json=_body("1f2e3", RULES, None))
            assert r.status_code == 200
            first = await r.get_json()
            r = await client.post("/v1/messages", json=_body("9c0d1", second_rules, first["id"]))
            assert r.status_code == 200
            return (await r.get_json())["diagnostics"]


async def test_a_new_billing_line_is_no_system_change() -> None:
    assert await _diagnose(RULES) is None


async def test_a_changed_instruction_is_still_a_system_change() -> None:
    diagnostics = await _diagnose(RULES.replace("Read", "Open", 1))
    assert diagnostics["cache_miss_reason"]["type"] == "system_changed"
