"""What ``--drop-past-tool-calls`` costs the prompt cache, on the demo model
(a Hermes-style template) through the real server: an agent loop of forced
calls and their results, turn by turn, with the rule and without.

Each turn's history renders as the previous prompt, minus the empty think
block the generation prompt had, then that turn's call (or, with the rule,
no call) and its result. With the rule the cache serves each turn exactly up
to the end of the previous history: the call it generated and cached is not
in the new prompt, and everything after it is prefilled again. Without the
rule the call is rendered, and the cache serves at least as far (further
where the reply ledger spells the call with its generated ids; on the demo
model it does not, as a forced call ends with ``<|endoftext|>`` where the
template writes ``<|im_end|>``). With the rule every later prompt is shorter
by the calls left out. docs/migrating-from-the-seed.md has the figures.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import httpx2 as httpx

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
# The generation prompt's empty think block, which the history does not repeat.
THINK_BLOCK = 4


async def _loop(model: Path, drop: bool, turns: int = 4) -> list[tuple[int, int]]:
    """(prompt tokens, cached tokens) per turn."""
    rows = []
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. " * 8},
        {"role": "user", "content": "Read the files one by one."},
    ]
    async with (
        served(model, drop_past_tool_calls=drop) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=120) as client,
    ):
        for turn in range(turns):
            body = {
                "messages": messages,
                "tools": TOOLS,
                "tool_choice": "required",
                "max_tokens": 48,
                "temperature": 0,
                "cache_id": "agent",
            }
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200
            usage, message = r.json()["usage"], r.json()["choices"][0]["message"]
            rows.append((usage["prompt_tokens"], usage["cached_tokens"]))
            (call,) = message["tool_calls"]
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            result = f"file {turn}: " + "lorem ipsum " * 6
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return rows


async def test_the_rule_serves_each_turn_up_to_the_previous_history(
    dense_model: Path,
) -> None:
    kept = await _loop(dense_model, drop=False)
    dropped = await _loop(dense_model, drop=True)
    assert kept[0] == dropped[0]  # no history yet: the same first prompt
    for (before, _), (_, cached) in itertools.pairwise(dropped):
        assert cached == before - THINK_BLOCK
    for (before, _), (_, cached) in itertools.pairwise(kept):
        assert cached >= before - THINK_BLOCK
    # Each call left out makes every later prompt (and its prefill) shorter.
    grew_kept = [b[0] - a[0] for a, b in itertools.pairwise(kept)]
    grew_dropped = [b[0] - a[0] for a, b in itertools.pairwise(dropped)]
    assert all(d < k for d, k in zip(grew_dropped, grew_kept, strict=True))
