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
  ``apply_patch`` call parses with the independent ``lark`` package against
  that grammar (on the demo models, whose random weights need not close a
  patch, it may instead be reported incomplete, never cut and called complete).

* The OpenAI Agents SDK's ``CustomTool`` (the freeform kind Codex declares
  apply_patch as), forced on the default model: the tool gets a patch that
  parses.

Replies are short (8 to 16 tokens; a forced patch up to 192): the cache is
what is measured, not the text.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, NamedTuple

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

if TYPE_CHECKING:
    import anthropic

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
    prompt: int  # input + cache_creation + cache_read input tokens
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
                # The final count (message_start carries the same split, known at
                # admission; the output only comes here).
                u = event.usage
                cached = u.cache_read_input_tokens or 0
                # computed + written into cache_control pins + read
                prompt = (u.input_tokens or 0) + (u.cache_creation_input_tokens or 0) + cached
                output = u.output_tokens
    for i, text in partial.items():
        blocks[i]["input"] = json.loads(text or "{}")
    return Claude([blocks[i] for i in sorted(blocks)], prompt, cached, output)


def test_claude_code_turns_keep_their_cache(server: Server) -> None:
    import anthropic

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
    blocks = [b for m in session.messages if isinstance(m["content"], list) for b in m["content"]]
    assert any(b["type"] == "tool_result" for b in blocks)
    assert any("<system-reminder>" in b.get("text", "") for b in blocks)
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
    server: Server, patch_parser: lark.Lark, request: pytest.FixtureRequest
) -> None:
    session = CodexSession(max_output_tokens=16)
    turns: list[tuple[int, int, int]] = []  # (input, cached, output) per turn
    patches: list[Any] = []
    # Codex's own tool_choice, then a forced freeform call (with room to
    # finish the patch on the demo models), then Codex's again. The default
    # model's whole patch is the Agents SDK test's below; here its call is
    # cut short (its ~190 tokens took 40 s of CI's time a second time).
    forced = {"type": "custom", "name": "apply_patch"}
    limit = 48 if request.node.callspec.params["server"] == "smollm2" else 192
    plan: list[tuple[Any, int | None]] = [("auto", None), (forced, limit), ("auto", None)]
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        for choice, limit in plan:
            body = session.request(tool_choice=choice, max_output_tokens=limit)
            response = _codex_turn(client, body)
            assert response.usage is not None
            u = response.usage
            turns.append((u.input_tokens, u.input_tokens_details.cached_tokens, u.output_tokens))
            if choice is forced:
                patches.append(response)
            session.record(item.model_dump() for item in response.output)
    # Every request re-sent the whole history (never previous_response_id).
    assert session.input[0]["role"] == "developer"
    assert any(item["type"] == "custom_tool_call_output" for item in session.input)
    print(f"codex turns (input, cached, output): {turns}")
    for n in range(1, len(turns)):
        prompt, _, output = turns[n - 1]
        cached = turns[n][1]
        assert cached >= prompt + output - BLOCK, (
            f"turn {n + 1} read {cached} of {turns[n][0]} input tokens from the cache; "
            f"turn {n} had {prompt} input + {output} output tokens"
        )
    (patch,) = patches
    calls = [item for item in patch.output if item.type == "custom_tool_call"]
    print(f"apply_patch ({patch.status}): {[c.input for c in calls]!r}")
    if patch.status == "completed":
        # Whatever completes parses (the trained model usually finishes; at
        # temperature 1 it may still run past the budget).
        assert [c.name for c in calls] == ["apply_patch"]
        assert patch_parser.parse(calls[0].input).data == "start"
    else:
        # A random-weight model need not close the patch: cut by
        # max_output_tokens, said so, never a truncated call labelled complete.
        assert patch.status == "incomplete"
        assert patch.incomplete_details is not None
        assert patch.incomplete_details.reason == "max_output_tokens"


def test_an_agents_sdk_custom_tool_gets_a_patch_that_parses(
    smollm2_server: Server, patch_parser: lark.Lark
) -> None:
    """The OpenAI Agents SDK's ``CustomTool`` (a freeform tool, as Codex
    declares apply_patch) on the default model: the forced call reaches the
    tool as raw text inside the grammar, and the run ends with an answer."""
    from agents import Agent, CustomTool, ModelSettings, RunConfig, Runner
    from agents.exceptions import ModelBehaviorError
    from agents.models.openai_provider import OpenAIProvider

    patches: list[str] = []

    def apply_patch(_ctx: Any, patch: str) -> str:
        patches.append(patch)
        return "Success. Updated the following files:\nM harbour/ledger.py"

    grammar = {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_GRAMMAR}
    tool = CustomTool("apply_patch", "Edit files with a patch.", apply_patch, grammar)
    # Greedy: the patch closes in about 50 tokens and the answer after the
    # tool ends by itself in about 35; sampled at 1.0 the answer ran to the
    # 192-token budget in each run measured (three times the CPU, and the
    # answer left unchecked).
    settings = ModelSettings(tool_choice="apply_patch", max_tokens=192, store=False, temperature=0)
    agent = Agent(
        name="codex",
        instructions="You fix bugs by editing files with apply_patch.",
        tools=[tool],
        model_settings=settings,
    )

    async def main() -> Any:
        client = openai.AsyncOpenAI(
            base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0
        )
        config = RunConfig(
            model_provider=OpenAIProvider(openai_client=client),
            model="default",
            tracing_disabled=True,
        )
        try:
            task = "In harbour/ledger.py, change `0 < s.hour` to `0 <= s.hour`."
            return await Runner.run(agent, task, max_turns=3, run_config=config)
        finally:
            await client.close()

    try:
        result = asyncio.run(main())
    except ModelBehaviorError as exc:
        failure: ModelBehaviorError | None = exc
    else:
        failure = None
    if failure is not None:
        # The budget ran out (inside the patch, or in the answer after the
        # tool ran): the server said so, and the SDK stops. A patch the tool
        # got was complete: it parses.
        assert "max_output_tokens" in str(failure)
        for patch in patches:
            assert patch_parser.parse(patch).data == "start"
        return
    assert len(patches) == 1
    assert patch_parser.parse(patches[0]).data == "start"
    assert isinstance(result.final_output, str)
