"""A ``max_tokens`` beyond the context window, on every protocol.

By default it is cut to what the window leaves after the prompt, as
llama.cpp's server stops at the context's end: the answer runs to the end
of the window and ends the way each protocol says its budget ran out (chat
and legacy completions ``finish_reason: "length"``, Responses ``incomplete``
with reason ``max_output_tokens``, Messages ``stop_reason: "max_tokens"``),
and its usage adds up to the window. ``--strict-max-tokens`` keeps OpenAI's
400. A prompt that alone fills the window is refused either way.

The real server (hypercorn, the MLX backend) in the test's Trio run, on a
copy of the tiny dense demo model whose window is 256 tokens. Every request
is greedy and the demo model hardly ever samples its end token, so each
answer reaches the window's end (a ``stop`` here would say it did not).
The scripted engine checks the rule itself, and serves the refusals under
``--strict-max-tokens`` (no model runs for them) with the same window.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
import trio
import trio.testing

from gezel_trio import ChatRequest, InvalidRequest
from gezel_trio.testing import ScriptedBackend, open_test_engine
from tests.support.inprocess import served, served_scripted
from tests.support.models import with_context

CONTEXT = 256
HANG = 120
BIG = 16_384  # what the gezel app sends on every turn
ASK = "Tell me about the harbour in the morning."
CHAT = {
    "messages": [{"role": "user", "content": ASK}],
    "temperature": 0,
    "chat_template_kwargs": {"enable_thinking": False},
}
MESSAGES = {
    "model": "demo",
    "messages": [{"role": "user", "content": ASK}],
    "temperature": 0,
    "thinking": {"type": "disabled"},
}
RESPONSES = {"input": ASK, "temperature": 0, "reasoning": {"effort": "none"}}
COMPLETIONS = {"prompt": "The harbour in the morning", "temperature": 0}


@pytest.fixture(scope="module")
def short_model(dense_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_context(dense_model, tmp_path_factory.mktemp("short") / "model", CONTEXT)


def _short() -> ScriptedBackend:
    """The scripted engine with the short model's window: a refusal under
    ``--strict-max-tokens`` happens before any model runs."""
    return ScriptedBackend(context_length=CONTEXT)


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


@pytest.mark.slow
async def test_beyond_the_context_is_cut_to_fit_on_every_protocol(short_model: Path) -> None:
    with trio.fail_after(HANG):
        async with (
            served(short_model) as (_engine, url),
            httpx.AsyncClient(base_url=url, timeout=HANG) as client,
        ):
            for field in ("max_tokens", "max_completion_tokens"):
                chat = await _post(client, "/v1/chat/completions", {**CHAT, field: BIG})
                assert chat["choices"][0]["finish_reason"] == "length", field
                usage = chat["usage"]
                assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT
                assert usage["total_tokens"] == CONTEXT

            legacy = await _post(client, "/v1/completions", {**COMPLETIONS, "max_tokens": BIG})
            assert legacy["choices"][0]["finish_reason"] == "length"
            assert legacy["usage"]["total_tokens"] == CONTEXT

            response = await _post(client, "/v1/responses", {**RESPONSES, "max_output_tokens": BIG})
            assert response["status"] == "incomplete"
            assert response["incomplete_details"] == {"reason": "max_output_tokens"}
            assert response["max_output_tokens"] == BIG, "the request is echoed as sent"
            usage = response["usage"]
            assert usage["input_tokens"] + usage["output_tokens"] == CONTEXT

            message = await _post(client, "/v1/messages", {**MESSAGES, "max_tokens": BIG})
            assert message["stop_reason"] == "max_tokens"
            usage = message["usage"]
            prompt = (
                usage["input_tokens"]
                + usage["cache_read_input_tokens"]
                + usage["cache_creation_input_tokens"]
            )
            assert prompt + usage["output_tokens"] == CONTEXT

            # What fits is kept as asked.
            short = await _post(client, "/v1/chat/completions", {**CHAT, "max_tokens": 3})
            assert short["usage"]["completion_tokens"] == 3
            # A prompt that alone fills the window is still refused.
            r = await client.post(
                "/v1/chat/completions",
                json={**CHAT, "messages": [{"role": "user", "content": "x " * CONTEXT}]},
            )
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "messages"


@pytest.mark.slow
async def test_strict_max_tokens_keeps_the_400_on_every_protocol() -> None:
    asks = [
        ("/v1/chat/completions", {**CHAT, "max_tokens": BIG}),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": BIG}),
        ("/v1/completions", {**COMPLETIONS, "max_tokens": BIG}),
        ("/v1/responses", {**RESPONSES, "max_output_tokens": BIG}),
        ("/v1/messages", {**MESSAGES, "max_tokens": BIG}),
    ]
    with trio.fail_after(HANG):
        async with (
            served_scripted(backend=_short(), strict_max_tokens=True) as (_engine, url),
            httpx.AsyncClient(base_url=url, timeout=HANG) as client,
        ):
            for path, body in asks:
                r = await client.post(path, json=body)
                assert r.status_code == 400, (path, r.text)
                error = r.json()["error"]
                assert f"max_tokens={BIG} plus the prompt's" in error["message"], path
                assert f"exceeds the context window of {CONTEXT}" in error["message"], path
            fits = await _post(client, "/v1/chat/completions", {**CHAT, "max_tokens": 3})
            assert fits["usage"]["completion_tokens"] == 3


def test_the_cut_leaves_what_the_window_holds_and_strict_refuses() -> None:
    async def scenario() -> None:
        messages = [{"role": "user", "content": "What time is it in Oslo?"}]
        async with open_test_engine(ScriptedBackend(context_length=64)) as t:
            prepared = await t.engine.prepare_chat(ChatRequest(messages, max_tokens=10**9))
            prompt = len(prepared.request.prompt)
            assert prepared.request.max_tokens == 64 - prompt
            kept = await t.engine.prepare_chat(ChatRequest(messages, max_tokens=2))
            assert kept.request.max_tokens == 2
            with pytest.raises(InvalidRequest) as err:
                await t.engine.prepare_chat(ChatRequest([{"role": "user", "content": "x" * 64}]))
            assert err.value.param == "messages"
        async with open_test_engine(
            ScriptedBackend(context_length=64), strict_max_tokens=True
        ) as t:
            with pytest.raises(InvalidRequest) as err:
                await t.engine.prepare_chat(ChatRequest(messages, max_tokens=64))
            assert err.value.param == "max_tokens"
            assert t.engine.state().live == 0

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


# 2^63 and past it: no int64 anywhere on the way (the request's budget is cut
# in Python before any array sees it), so each is the window's rest too.
HUGE = [2**63 - 1, 2**63, 2**64, 10**38]
# Not a budget: a 400 naming the field (a number past 4,300 digits is not
# JSON Python reads; that is the body's 400).
NOT_A_BUDGET = ["-9223372036854775809", "0", "1e300", "1.8446744073709552e19", "9" * 5000]


@pytest.mark.slow
async def test_huge_budgets_are_cut_and_broken_ones_refused_on_every_protocol(
    short_model: Path,
) -> None:
    asks = [
        ("/v1/chat/completions", CHAT, "max_tokens"),
        ("/v1/chat/completions", CHAT, "max_completion_tokens"),
        ("/v1/completions", COMPLETIONS, "max_tokens"),
        ("/v1/responses", RESPONSES, "max_output_tokens"),
        ("/v1/messages", MESSAGES, "max_tokens"),
    ]
    with trio.fail_after(HANG):
        async with (
            served(short_model) as (_engine, url),
            httpx.AsyncClient(base_url=url, timeout=HANG) as client,
        ):
            for path, body, field in asks:
                for huge in HUGE:
                    answer = await _post(client, path, {**body, field: huge})
                    usage = answer["usage"]
                    if path == "/v1/messages":
                        assert answer["stop_reason"] == "max_tokens"
                        total = sum(usage[k] for k in ("input_tokens", "output_tokens"))
                        total += usage["cache_read_input_tokens"]
                        total += usage["cache_creation_input_tokens"]
                    elif path == "/v1/responses":
                        assert answer["incomplete_details"] == {"reason": "max_output_tokens"}
                        total = usage["input_tokens"] + usage["output_tokens"]
                    else:
                        assert answer["choices"][0]["finish_reason"] == "length"
                        total = usage["total_tokens"]
                    assert total == CONTEXT, (path, field, huge)
                for bad in NOT_A_BUDGET:
                    raw = json.dumps(body)[:-1] + f', "{field}": {bad}}}'
                    r = await client.post(
                        path, content=raw, headers={"content-type": "application/json"}
                    )
                    assert r.status_code == 400, (path, field, bad[:20], r.text)
                    if len(bad) < 100:
                        assert field in r.json()["error"]["message"], (path, r.text)


@pytest.mark.slow
async def test_strict_refuses_a_huge_budget_naming_it() -> None:
    with trio.fail_after(HANG):
        async with (
            served_scripted(backend=_short(), strict_max_tokens=True) as (_engine, url),
            httpx.AsyncClient(base_url=url, timeout=HANG) as client,
        ):
            for huge in HUGE:
                r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": huge})
                assert r.status_code == 400, r.text
                assert f"max_tokens={huge} plus the prompt's" in r.json()["error"]["message"]
