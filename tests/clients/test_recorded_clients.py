"""The requests the real coding-agent CLIs sent, replayed without them.

``tests/fixtures/clients/<client>-<version>/request-N.json`` are requests
recorded from the real binaries (``bench._recorder`` in front of a gezel
server; ``python -m bench agent --client ...`` drives them), one session
each, in order (Claude Code's retries of a reply cut at its output cap
included; opencode's title requests, which share no prompt with the
session, left out); user paths, device ids and keys are scrubbed (README.md
there).

Replayed over the in-process app on the scripted engine (tokens are
characters; the model does not matter here): Claude Code's first request is
~33,600 tokens, which a real model on a CPU prefills for minutes. Asserted is
what a user of each CLI needs:

* every request answers 200, and every tool it declares reaches the prompt
  (none refused, none dropped);
* turn over turn, the prompt cache reads at least the previous prompt less
  one 64-token block: whatever the CLI re-sends changed (Claude Code's
  billing line, its per-request reminders) costs no prefill beyond the new
  turn.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from gezel_trio.core.request import GenerationRequest
from gezel_trio.http.app import HttpSettings, create_app
from gezel_trio.http.tool_namespaces import flat_name
from gezel_trio.testing import EOS, ScriptedBackend, open_test_engine

FIXTURES = Path(__file__).parent.parent / "fixtures" / "clients"
BLOCK = 64  # the prompt cache's block: a prompt may lose at most its last partial one
SESSIONS = sorted(p.parent.name for p in FIXTURES.glob("*/request-1.json"))
_FORWARDED = ("anthropic-version", "anthropic-beta", "content-type")


def turns(session: str) -> list[dict[str, Any]]:
    paths = sorted(
        (FIXTURES / session).glob("request-*.json"), key=lambda p: int(p.stem.split("-")[1])
    )
    return [json.loads(p.read_text()) for p in paths]


def tool_names(body: dict[str, Any]) -> list[str]:
    """The names of the tools a request declares, in any protocol (a
    function tool's name is nested in chat completions)."""
    names = []
    for tool in body.get("tools") or []:
        if tool.get("type") == "namespace":
            # Codex's sub-agent tools: each shown under its flat name.
            names += [flat_name(tool["name"], t["name"]) for t in tool.get("tools") or []]
            continue
        name = tool.get("name") or (tool.get("function") or {}).get("name")
        if name and tool.get("type") not in _HOSTED:
            names.append(name)
    return names


# Hosted tools a server does not run; they are ignored and reported.
_HOSTED = {"web_search", "web_search_preview"}


def usage(path: str, body: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, tokens read from the cache) of a JSON answer."""
    u = body["usage"]
    if path.startswith("/v1/messages"):
        read = u.get("cache_read_input_tokens") or 0
        return u["input_tokens"] + read + (u.get("cache_creation_input_tokens") or 0), read
    if path.startswith("/v1/responses"):
        return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]
    return u["prompt_tokens"], (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _reply(_rid: int, request: GenerationRequest) -> Sequence[int]:
    return [*map(ord, "ok"), EOS][: request.max_tokens]


async def _replay(session: str) -> list[tuple[int, int, str]]:
    """Each turn's (prompt tokens, cached tokens, prompt text)."""
    prompts: list[str] = []

    def script(rid: int, request: GenerationRequest) -> Sequence[int]:
        prompts.append("".join(map(chr, request.prompt)))
        return _reply(rid, request)

    backend = ScriptedBackend(script=script, prefill_step=8192, context_length=1 << 20)
    out = []
    async with open_test_engine(backend, cache_budget_mb=2048) as t:
        async with create_app(t.engine, HttpSettings()).test_app() as app:
            client = app.test_client()
            for record in turns(session):
                body = {**record["body"], "stream": False}
                headers = {k: v for k, v in record["headers"].items() if k in _FORWARDED}
                r = await client.post(record["path"], json=body, headers=headers)
                text = await r.get_data(as_text=True)
                assert r.status_code == 200, text[:2000]
                prompt, cached = usage(record["path"], json.loads(text))
                out.append((prompt, cached, prompts[-1]))
    return out


@pytest.mark.parametrize("session", SESSIONS)
async def test_every_turn_answers_with_its_tools_in_the_prompt(session: str) -> None:
    replayed = await _replay(session)
    for record, (_, _, prompt) in zip(turns(session), replayed, strict=True):
        missing = [n for n in tool_names(record["body"]) if f'"{n}"' not in prompt]
        assert not missing, missing


# Requests whose CLI rewrote the history it had sent before: the cache can
# only read what the two prompts share.
REWRITTEN = {
    # ``--continue`` after a turn cut at the output cap: Claude Code replaces
    # that turn's "Output token limit hit" retries with "Continue from where
    # you left off." and an assistant turn "No response requested.".
    ("claude-code-2.1.197", 5),
    # Likewise the next ``--continue``: that turn's retries are dropped and
    # its user text joined with the new one.
    ("claude-code-2.1.197", 9),
}


def _shared(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("session", SESSIONS)
async def test_each_request_reads_the_previous_prompt_from_the_cache(session: str) -> None:
    replayed = await _replay(session)
    assert len(replayed) >= 2
    pairs = enumerate(itertools.pairwise(replayed), start=2)
    for n, ((before, _, old), (_, read, new)) in pairs:
        if (session, n) in REWRITTEN:
            assert _shared(old, new) < before - BLOCK  # the rewrite is real
            assert read >= _shared(old, new) - BLOCK, (n, before, read)
        else:
            assert read >= before - BLOCK, (n, before, read)
