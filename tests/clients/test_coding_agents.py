"""Claude Code and Codex as they really call, through the real SDKs, on both
demo models and the default model (the session's shared servers).

The request bodies are the recorded shapes of ``bench.scenarios._agent_shapes``
(its docstring names the captures and the Codex commit they come from): no
gezel field anywhere. What is asserted is what a user of either agent needs:

* Claude Code (``anthropic`` SDK, streamed): every request's billing header
  changes (``cch=``, then the ``cc_prev_req=`` variant on its second line),
  turns carry ``tool_use`` / ``tool_result`` rounds, ``<system-reminder>``
  blocks and a mid-conversation ``system`` message; every turn after the
  first reads from the cache at least the previous prompt and the previous
  reply, less one 64-token block.
* Codex (``openai`` SDK, streamed): the first request, with its tools array
  (function tools, the freeform ``apply_patch`` with its Lark grammar, the
  hosted ``web_search``), ``store: false`` and the reasoning include,
  answers; the whole history is re-sent every turn and each turn reads the
  previous prompt and reply from the cache (less one block); a forced
  ``apply_patch`` call either parses with the independent ``lark`` package
  against that grammar or is reported incomplete.

Replies are short (``max_tokens`` 8 to 48) and greedy: the cache is what is
measured, not the text.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import anthropic
import lark
import openai
import pytest

from bench.scenarios._agent_shapes import (
    APPLY_PATCH_GRAMMAR,
    CC_HTTP_HEADERS,
    ClaudeCodeSession,
    CodexSession,
    lark_compatible,
)
from tests.support.process import Server

pytestmark = pytest.mark.slow

BLOCK = 64  # the prompt cache's block: a prompt may lose at most its last partial one


@pytest.fixture(scope="module", params=["dense", "hybrid", "smollm2"])
def server(request: pytest.FixtureRequest) -> Server:
    """Each session server in turn (``tests.support.process``)."""
    server: Server = request.getfixturevalue(f"{request.param}_server")
    return server


@pytest.fixture(scope="module")
def patch_parser() -> lark.Lark:
    return lark.Lark(lark_compatible(APPLY_PATCH_GRAMMAR))


# --- Claude Code ----------------------------------------------------------------


class Claude(NamedTuple):
    content: list[dict[str, Any]]
    prompt: int  # input_tokens + cache_read_input_tokens
    cached: int
    output: int


def _claude_turn(client: anthropic.Anthropic, body: dict[str, Any]) -> Claude:
    """One streamed request, its events folded into the reply's content
    blocks and usage (as Claude Code folds them)."""
    blocks: dict[int, dict[str, Any]] = {}
    partial: dict[int, str] = {}
    prompt = cached = output = 0
    with client.messages.create(**body, extra_headers=CC_HTTP_HEADERS) as events:
        for event in events:
            if event.type == "content_block_start":
                blocks[event.index] = event.content_block.model_dump()
            elif event.type == "content_block_delta":
                d = event.delta
                block = blocks[event.index]
                if d.type == "text_delta":
                    block["text"] += d.text
                elif d.type == "thinking_delta":
                    block["thinking"] += d.thinking
                elif d.type == "signature_delta":
                    block["signature"] = d.signature
                elif d.type == "input_json_delta":
                    partial[event.index] = partial.get(event.index, "") + d.partial_json
            elif event.type == "message_delta":
                # The final count (message_start's is sent before admission).
                u = event.usage
                cached = u.cache_read_input_tokens or 0
                prompt = (u.input_tokens or 0) + cached
                output = u.output_tokens
    for i, text in partial.items():
        blocks[i]["input"] = json.loads(text or "{}")
    return Claude([blocks[i] for i in sorted(blocks)], prompt, cached, output)


def test_claude_code_turns_keep_their_cache(server: Server) -> None:
    session = ClaudeCodeSession(max_tokens=8, prev_req=True, system_at=3, follow_up_at=4)
    headers: list[str] = []
    turns: list[tuple[int, int, int]] = []  # (prompt, cached, output) per turn
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as client:
        for _ in range(4):
            body = session.request()
            headers.append(body["system"][0]["text"])
            reply = _claude_turn(client, body)
            turns.append((reply.prompt, reply.cached, reply.output))
            session.record(reply.content)
    # The shapes did what they claim: a new header every request, the
    # cc_prev_req line from request 2 on, a system message mid-conversation,
    # tool rounds and reminders.
    assert len(set(headers)) == len(headers)
    assert all("\ncc_prev_req=req_" in h for h in headers[1:])
    roles = [m["role"] for m in session.messages]
    assert "system" in roles[1:-1]
    assert any(b.get("type") == "tool_result" for m in session.messages for b in m["content"]
               if isinstance(m["content"], list))  # fmt: skip
    print(f"claude-code turns (prompt, cached, output): {turns}")
    for n in range(1, len(turns)):
        prompt, _, output = turns[n - 1]
        cached = turns[n][1]
        # Everything before the new messages - the previous prompt and the
        # reply it produced - comes from the cache, whatever the header said.
        assert cached >= prompt + output - BLOCK, (
            f"turn {n + 1} read {cached} of {turns[n][0]} prompt tokens from the cache; "
            f"turn {n} had {prompt} prompt + {output} reply tokens"
        )


# --- Codex ------------------------------------------------------------------------


def _codex_turn(client: openai.OpenAI, body: dict[str, Any]) -> Any:
    """One streamed Codex request; the final response (completed or incomplete)."""
    final = None
    with client.responses.create(**body) as events:
        for event in events:
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert final is not None, "the stream ended without a final response event"
    return final


def test_codex_session_starts_and_reuses_its_history(
    server: Server, patch_parser: lark.Lark
) -> None:
    session = CodexSession(max_output_tokens=48)
    turns: list[tuple[int, int, int]] = []  # (input, cached, output) per turn
    patches: list[Any] = []
    # Codex's own tool_choice, then this test's forced freeform call, then Codex's again.
    choices: list[Any] = ["auto", {"type": "custom", "name": "apply_patch"}, "auto"]
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        for choice in choices:
            response = _codex_turn(client, session.request(tool_choice=choice))
            assert response.usage is not None
            u = response.usage
            turns.append((u.input_tokens, u.input_tokens_details.cached_tokens, u.output_tokens))
            if choice != "auto":
                patches.append(response)
            session.record(item.model_dump() for item in response.output)
    # Every request re-sent the whole history (never previous_response_id).
    assert session.input[0]["role"] == "developer"
    print(f"codex turns (input, cached, output): {turns}")
    for n in range(1, len(turns)):
        prompt, _, output = turns[n - 1]
        cached = turns[n][1]
        assert cached >= prompt + output - BLOCK, (
            f"turn {n + 1} read {cached} of {turns[n][0]} input tokens from the cache; "
            f"turn {n} had {prompt} input + {output} output tokens"
        )
    (forced,) = patches
    calls = [item for item in forced.output if item.type == "custom_tool_call"]
    if forced.status == "completed":
        assert [c.name for c in calls] == ["apply_patch"]
        patch_parser.parse(calls[0].input)  # raises if the input leaves the grammar
    else:
        # Cut by max_output_tokens (a random-weight model need not close the
        # patch): said so, never a truncated call labelled complete.
        assert forced.status == "incomplete"
        assert forced.incomplete_details is not None
        assert forced.incomplete_details.reason == "max_output_tokens"


def test_a_forced_apply_patch_call_parses_on_the_default_model(
    smollm2_server: Server, patch_parser: lark.Lark
) -> None:
    """The trained model, with room to finish: the call completes and parses."""
    session = CodexSession(max_output_tokens=256)
    body = session.request(tool_choice={"type": "custom", "name": "apply_patch"})
    with openai.OpenAI(
        base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0
    ) as client:
        response = _codex_turn(client, body)
    calls = [item for item in response.output if item.type == "custom_tool_call"]
    print(f"apply_patch ({response.status}): {[c.input for c in calls]!r}")
    assert response.status == "completed"
    assert [c.name for c in calls] == ["apply_patch"]
    assert patch_parser.parse(calls[0].input).data == "start"
