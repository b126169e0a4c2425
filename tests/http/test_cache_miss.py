"""Every cache miss says why, through the real SDKs on the dense demo model.

``usage.cache_miss`` on chat completions, completions, Responses and
Messages: a changed system prompt names the system message, the token and
both sides' text; a prompt the cache held whole reports ``null``; the
``gezel_prompt_cache_misses`` counter moves by reason. Anthropic's cache
diagnostics (``diagnostics.previous_message_id``) give each
``cache_miss_reason`` in its case, on the message and on ``message_start``.

Each test uses system prompts of its own, so the session-wide server's
cache (other modules share it) cannot make a miss or a hit of its prompts.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx2 as httpx
import pytest

from gezel_trio.core.events import CacheMiss
from gezel_trio.core.prepare import ChatRequest
from gezel_trio.http.cache_diagnostics import (
    FingerprintStore,
    compare,
    fingerprint,
    system_block,
)
from tests.support.process import Server

if TYPE_CHECKING:
    import anthropic


def _system(topic: str) -> tuple[str, str]:
    """Two system prompts of a fresh conversation that differ in one word
    well inside them."""
    tag = uuid.uuid4().hex[:8]
    head = f"You are the {topic} assistant {tag}. Keep every answer"
    tail = " and mention the tide tables when they matter to the question."
    return f"{head} short{tail}", f"{head} detailed{tail}"


QUESTION = "When does the first ferry leave the harbour?"


def _misses(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    found = re.findall(r'^gezel_prompt_cache_misses_total\{reason="(\w+)"\} (\S+)$', text, re.M)
    return {reason: float(value) for reason, value in found}


def _chat(server: Server, system: str) -> Any:
    return server.client.chat.completions.create(
        model="demo",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": QUESTION}],
        max_tokens=2,
        temperature=0,
    )


@pytest.mark.slow
def test_a_changed_system_prompt_is_named_with_its_token_and_both_sides(
    dense_server: Server,
) -> None:
    short, detailed = _system("ferry")
    _chat(dense_server, short)
    before = _misses(dense_server)
    usage = _chat(dense_server, detailed).usage
    assert usage is not None
    miss = usage.model_extra["cache_miss"]
    assert miss["reason"] == "diverged"
    assert (miss["message"], miss["role"]) == (0, "system")
    assert miss["reused"] == usage.prompt_tokens_details.cached_tokens == miss["token"]
    assert 0 < miss["token"] < usage.prompt_tokens
    assert miss["common"]
    assert "Keep every answer".endswith(miss["common"].strip()[-4:])
    assert "short" in miss["cached"]
    assert "detailed" in miss["prompt"]
    after = _misses(dense_server)
    assert after["diverged"] == before.get("diverged", 0) + 1


@pytest.mark.slow
def test_a_model_that_cannot_rewind_names_the_checkpoint_it_restarted_from(
    hybrid_server: Server,
) -> None:
    # The hybrid demo model keeps states only at message boundaries: a change
    # inside the system prompt restarts from before it.
    short, detailed = _system("ferry")
    _chat(hybrid_server, short)
    usage = _chat(hybrid_server, detailed).usage
    assert usage is not None
    miss = usage.model_extra["cache_miss"]
    assert (miss["reason"], miss["message"], miss["role"]) == ("checkpoint", 0, "system")
    assert miss["reused"] == usage.prompt_tokens_details.cached_tokens < miss["token"]
    assert "short" in miss["cached"]
    assert "detailed" in miss["prompt"]


@pytest.mark.slow
def test_the_default_model_names_the_system_message_too(smollm2_server: Server) -> None:
    short, detailed = _system("ferry")
    _chat(smollm2_server, short)
    usage = _chat(smollm2_server, detailed).usage
    assert usage is not None
    miss = usage.model_extra["cache_miss"]
    assert (miss["reason"], miss["message"], miss["role"]) == ("diverged", 0, "system")
    assert "short" in miss["cached"]
    assert "detailed" in miss["prompt"]


@pytest.mark.slow
def test_a_prompt_the_cache_held_whole_reports_no_miss(dense_server: Server) -> None:
    short, _ = _system("harbour")
    _chat(dense_server, short)
    before = _misses(dense_server)
    usage = _chat(dense_server, short).usage
    assert usage is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    assert usage.model_extra["cache_miss"] is None
    assert _misses(dense_server)["full"] == before.get("full", 0) + 1


@pytest.mark.slow
def test_a_changed_user_turn_names_that_message(dense_server: Server) -> None:
    short, _ = _system("lighthouse")
    client = dense_server.client
    for question in ("How tall is it?", "Who keeps it?"):
        usage = client.chat.completions.create(
            model="demo",
            messages=[
                {"role": "system", "content": short},
                {"role": "user", "content": question},
            ],
            max_tokens=2,
        ).usage
    assert usage is not None
    miss = usage.model_extra["cache_miss"]
    assert (miss["reason"], miss["message"], miss["role"]) == ("diverged", 1, "user")


@pytest.mark.slow
def test_completions_and_responses_carry_the_miss_in_usage(dense_server: Server) -> None:
    short, detailed = _system("pier")
    client = dense_server.client
    for prompt in (short, detailed):
        completion = client.completions.create(model="demo", prompt=prompt, max_tokens=2)
    assert completion.usage is not None
    miss = completion.usage.model_extra["cache_miss"]
    assert miss["reason"] == "diverged"
    assert "detailed" in miss["prompt"]
    assert miss["message"] is None  # a raw prompt has no messages
    short, detailed = _system("quay")
    for instructions in (short, detailed):
        response = client.responses.create(
            model="demo", instructions=instructions, input=QUESTION, max_output_tokens=16
        )
    assert response.usage is not None
    miss = response.usage.model_extra["cache_miss"]
    assert (miss["reason"], miss["role"]) == ("diverged", "system")
    assert "short" in miss["cached"]
    assert "detailed" in miss["prompt"]


# --- Messages and Anthropic's cache diagnostics --------------------------------


@pytest.fixture(scope="module")
def claude(dense_server: Server) -> Iterator[anthropic.Anthropic]:
    import anthropic

    with anthropic.Anthropic(
        base_url=dense_server.url,
        api_key="unused",
        max_retries=0,
        _strict_response_validation=True,
        default_headers={"anthropic-beta": "cache-diagnosis-2026-04-07"},
    ) as client:
        yield client


TOOL: Any = {
    "name": "tide",
    "description": "Tide tables",
    "input_schema": {"type": "object", "properties": {}},
}


def _ask(client: anthropic.Anthropic, system: str, previous: str | None, **kw: Any) -> Any:
    messages = kw.pop("messages", [{"role": "user", "content": QUESTION}])
    return client.messages.create(
        model=kw.pop("model", "demo"),
        system=system,
        messages=messages,
        max_tokens=2,
        thinking={"type": "disabled"},
        diagnostics={"previous_message_id": previous},
        **kw,
    )


def _reason(message: Any) -> Any:
    assert message.diagnostics is not None
    return message.diagnostics.cache_miss_reason


@pytest.mark.slow
def test_messages_usage_names_the_system_block(claude: anthropic.Anthropic) -> None:
    short, detailed = _system("marina")
    first = _ask(claude, short, None)
    assert first.diagnostics is None  # the first turn opts in, with nothing to compare
    second = _ask(claude, detailed, first.id)
    miss = second.usage.model_extra["cache_miss"]
    assert (miss["reason"], miss["message"], miss["role"]) == ("diverged", 0, "system")
    assert second.usage.cache_read_input_tokens == miss["reused"]
    reason = _reason(second)
    assert reason.type == "system_changed"
    assert (
        0
        < reason.cache_missed_input_tokens
        <= first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    )


@pytest.mark.slow
def test_a_changed_line_in_a_later_system_block_names_that_block(
    claude: anthropic.Anthropic,
) -> None:
    # Claude Code's shape: several system blocks, the volatile one not first
    # (here a date; the billing header is handled before rendering).
    tag = uuid.uuid4().hex[:8]
    blocks = [
        f"You are a coding agent {tag}.",
        "Follow the repository's style and run the tests before you answer.",
    ]
    for day in ("2026-12-01", "2026-12-02"):
        system: Any = [
            *({"type": "text", "text": t} for t in blocks),
            {"type": "text", "text": f"Today's date: {day}. Working directory: /src/app"},
        ]
        message = claude.messages.create(
            model="demo",
            system=system,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=2,
            thinking={"type": "disabled"},
        )
    miss = message.usage.model_extra["cache_miss"]
    assert (miss["reason"], miss["role"], miss["block"]) == ("diverged", "system", 2)
    assert "12-01" in miss["common"] + miss["cached"]
    assert "12-02" in miss["common"] + miss["prompt"]


@pytest.mark.slow
def test_each_cache_miss_reason_in_its_case(claude: anthropic.Anthropic) -> None:
    short, _ = _system("dock")
    first = _ask(claude, short, None, tools=[TOOL])
    # Only a new turn appended: nothing to diagnose.
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "At six."},
        {"role": "user", "content": "And the last?"},
    ]
    appended = _ask(claude, short, first.id, tools=[TOOL], messages=history)
    assert appended.diagnostics is None
    cases = {
        "model_changed": _ask(claude, short, first.id, tools=[TOOL], model="demo-other"),
        "tools_changed": _ask(claude, short, first.id),
        "messages_changed": _ask(
            claude, short, appended.id, tools=[TOOL], messages=[*history[:1], history[2]]
        ),
        "unavailable": _ask(claude, short, first.id, tools=[TOOL], tool_choice={"type": "any"}),
        "previous_message_not_found": _ask(claude, short, "msg_nobody", tools=[TOOL]),
    }
    for expected, message in cases.items():
        assert _reason(message).type == expected, expected
    assert _reason(cases["model_changed"]).cache_missed_input_tokens > 0


@pytest.mark.slow
def test_message_start_carries_the_diagnostics(claude: anthropic.Anthropic) -> None:
    short, detailed = _system("slipway")
    first = _ask(claude, short, None)
    with claude.messages.stream(
        model="demo",
        system=detailed,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=2,
        thinking={"type": "disabled"},
        diagnostics={"previous_message_id": first.id},
    ) as stream:
        events = list(stream)
    start = next(e for e in events if e.type == "message_start")
    assert start.message.diagnostics is not None
    assert start.message.diagnostics.cache_miss_reason.type == "system_changed"
    # The final count rides on message_delta (the SDK's accumulated message
    # keeps only the fields it knows).
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.usage.model_extra["cache_miss"]["role"] == "system"


# --- the fingerprint store, pure -----------------------------------------------


def _print(system: str, *turns: str, model: str = "m") -> Any:
    messages = [{"role": "system", "content": system}]
    messages += [{"role": "user", "content": t} for t in turns]
    return fingerprint(model, ChatRequest(messages=messages), prompt_tokens=100)


def test_the_fingerprint_store_is_bounded_and_holds_digests_only() -> None:
    store = FingerprintStore(limit=2)
    for i in range(3):
        store.diagnose(f"msg_{i}", None, _print("secret system text"))
    assert len(store) == 2
    assert store.diagnose("msg_x", "msg_0", _print("s")) == {
        "cache_miss_reason": {"type": "previous_message_not_found"}
    }
    assert "secret" not in repr(store._prints)
    # The tokens missed are the previous prompt's from the first change on.
    old = _print("s", "a", "b")
    changed = compare(old, _print("s", "a", "c"))
    assert changed is not None
    assert changed["type"] == "messages_changed"
    assert 0 < changed["cache_missed_input_tokens"] < 100
    assert compare(old, _print("s", "a", "b", "c")) is None


def test_a_system_block_is_found_inside_it_or_at_its_start() -> None:
    blocks = ["header: cch=abc123;", "You are an agent.", "Rules: be brief."]
    inside = CacheMiss("diverged", 9, 9, 0, "system", "header: cch=", "abc123;", "def456;")
    assert system_block(blocks, inside) == 0
    start = CacheMiss(
        "diverged", 30, 30, 0, "system", "an agent.\n\n", "Rules: short.", "Rules: be"
    )
    assert system_block(blocks, start) == 2
    elsewhere = CacheMiss("diverged", 40, 40, 1, "user", "x", "y", "z")
    assert system_block(blocks, elsewhere) is None
