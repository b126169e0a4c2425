"""A re-sent history reuses the prompt cache through the last reply, on
every protocol, with the real SDKs, as coding agents send it: the whole
conversation each turn, the assistant's replies as the SDK returned them.

Each turn must read from the cache the whole previous prompt and the
reply generated for it, all but its last token (the model never computed
that one), so it prefills only the new turn. The demo models' template
(Qwen-style) drops from old turns the empty think block its generation
prompt holds, and the stream trims a reply's first space: without the
server's reply ledger their turn 2 read only the previous prompt's head
(52 of 202 tokens on the dense demo through chat completions).

One conversation per protocol and model, on the session's shared servers
(default flags); the user turns differ per protocol, so no conversation
reads another's cache."""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING, Any

import openai
import pytest

from tests.support.process import Server

if TYPE_CHECKING:
    pass

pytestmark = pytest.mark.slow

# SmolLM2 answers these in 10 to 17 tokens and stops on its own, so every
# turn re-sends a reply that ended in its end-of-turn token.
SYSTEM = "You are a helpful assistant. Answer in a few words."
TURNS = ("Tell me one fact about the sea.", "And one about the sky?", "One more about hills?")
MAX_TOKENS = 48


@pytest.fixture(scope="module", params=["dense", "hybrid", "smollm2"])
def server(request: pytest.FixtureRequest) -> Server:
    found: Server = request.getfixturevalue(f"{request.param}_server")
    return found


def _check(turns: list[tuple[int, int, int]]) -> None:
    """``(prompt, cached, output)`` per turn: from turn 2 on, the cache
    served the previous prompt and all but the last token of its reply."""
    for (prompt, _, output), (_, cached, _) in pairwise(turns):
        assert cached >= prompt + output - 1, turns


def test_chat_completions_reuses_through_the_last_reply(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    turns = []
    for text in TURNS:
        history.append({"role": "user", "content": f"{text} (chat)"})
        reply = client.chat.completions.create(
            model="m",
            messages=history,
            max_tokens=MAX_TOKENS,
            temperature=0,  # type: ignore[arg-type]
        )
        usage = reply.usage
        assert usage is not None
        assert usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        turns.append((usage.prompt_tokens, cached, usage.completion_tokens))
        history.append({"role": "assistant", "content": reply.choices[0].message.content})
    _check(turns)


def test_messages_reuses_through_the_last_reply(server: Server) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    history: list[dict[str, Any]] = []
    turns = []
    for text in TURNS:
        history.append({"role": "user", "content": f"{text} (messages)"})
        with client.messages.stream(
            model="m",
            max_tokens=MAX_TOKENS,
            system=SYSTEM,
            messages=history,  # type: ignore[arg-type]
            extra_body={"temperature": 0},
        ) as stream:
            message = stream.get_final_message()
        usage = message.usage
        cached = usage.cache_read_input_tokens or 0
        written = usage.cache_creation_input_tokens or 0
        turns.append((usage.input_tokens + written + cached, cached, usage.output_tokens))
        blocks = [b.model_dump(exclude_none=True) for b in message.content]
        history.append({"role": "assistant", "content": blocks})
    _check(turns)


def test_responses_without_store_reuses_through_the_last_reply(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    history: list[Any] = []
    turns = []
    for text in TURNS:
        history.append({"role": "user", "content": f"{text} (responses)"})
        response = client.responses.create(
            model="m",
            instructions=SYSTEM,
            input=history,
            max_output_tokens=MAX_TOKENS,
            temperature=0,
            store=False,
            include=["reasoning.encrypted_content"],
        )
        usage = response.usage
        assert usage is not None
        turns.append(
            (usage.input_tokens, usage.input_tokens_details.cached_tokens, usage.output_tokens)
        )
        history += [item.model_dump(exclude_none=True) for item in response.output]
    _check(turns)


def test_responses_reasoning_items_carry_a_sealed_reply(dense_server: Server) -> None:
    """With thinking on, the demo model reasons (it never closes the block):
    its reasoning item carries ``encrypted_content``; sent back altered, it
    is ignored and the request still answers."""
    client = openai.OpenAI(base_url=f"{dense_server.url}/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Think about the tides."}]
    response = client.responses.create(
        model="m",
        input=ask,  # type: ignore[arg-type]
        max_output_tokens=12,
        store=False,
        include=["reasoning.encrypted_content"],
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    (item,) = [i for i in response.output if i.type == "reasoning"]
    blob = item.encrypted_content
    assert blob
    assert blob.startswith("g1.")
    plain = client.responses.create(
        model="m",
        input=ask,  # type: ignore[arg-type]
        max_output_tokens=4,
        store=False,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    assert all(i.encrypted_content is None for i in plain.output if i.type == "reasoning")
    mid = len(blob) // 2
    altered = blob[:mid] + ("A" if blob[mid] != "A" else "B") + blob[mid + 1 :]
    sent = {**item.model_dump(exclude_none=True), "encrypted_content": altered}
    again = client.responses.create(
        model="m",
        input=[*ask, sent, {"role": "user", "content": "And?"}],  # type: ignore[list-item]
        max_output_tokens=4,
        store=False,
        include=["reasoning.encrypted_content"],
    )
    assert again.status in ("completed", "incomplete")
