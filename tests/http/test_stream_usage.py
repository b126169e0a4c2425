"""The prompt's cached share where streaming clients read it, through the
real OpenAI SDK on the dense demo model: chat's usage chunks
(``stream_options.include_usage``) and Responses' ``response.completed``
on the second turn of a conversation report the tokens the first turn left
in the prompt cache. (Anthropic's ``message_start`` is covered with the
Messages tests.)

Each test uses a system prompt of its own: the session-wide server's cache
is shared with other modules.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tests.support.process import Server


def _system() -> str:
    return f"You answer questions about the harbour ferries ({uuid.uuid4().hex[:8]})."


@pytest.mark.slow
def test_chat_usage_chunks_count_the_cached_prompt(dense_server: Server) -> None:
    client = dense_server.client
    ask: list[Any] = [
        {"role": "system", "content": _system()},
        {"role": "user", "content": "When does the first ferry leave?"},
    ]
    first = client.chat.completions.create(model="demo", messages=ask, max_tokens=4, temperature=0)
    assert first.usage is not None
    history = [
        *ask,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And the last one?"},
    ]
    chunks = list(
        client.chat.completions.create(
            model="demo",
            messages=history,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    final = chunks[-1]
    assert final.choices == []
    assert final.usage is not None
    details = final.usage.prompt_tokens_details
    assert details is not None
    cached = details.cached_tokens or 0
    # The first turn's prompt is read from the cache; the new turn is computed.
    assert first.usage.prompt_tokens - 1 <= cached < final.usage.prompt_tokens
    # Every chunk with usage on the way reports the same split.
    seen = [c.usage for c in chunks[:-1] if c.usage is not None]
    assert seen
    for usage in seen:
        assert usage.prompt_tokens == final.usage.prompt_tokens
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == cached


@pytest.mark.slow
def test_responses_completed_counts_the_cached_prompt(dense_server: Server) -> None:
    client = dense_server.client
    system = _system()  # instructions do not carry over with previous_response_id
    first = client.responses.create(
        model="demo",
        instructions=system,
        input="When does the first ferry leave?",
        max_output_tokens=16,
        temperature=0,
    )
    assert first.usage is not None
    events = list(
        client.responses.create(
            model="demo",
            instructions=system,
            previous_response_id=first.id,
            input="And the last one?",
            max_output_tokens=16,
            temperature=0,
            stream=True,
        )
    )
    # OpenAI's created and in_progress carry ``usage: null``; the counts
    # come with the end.
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert all(e.response.usage is None for e in events[:2])  # type: ignore[union-attr]
    end = events[-1]
    # At max_output_tokens on random weights: incomplete, with the same usage.
    assert end.type in ("response.completed", "response.incomplete")
    usage = end.response.usage  # type: ignore[union-attr]
    assert usage is not None
    assert first.usage.input_tokens - 1 <= usage.input_tokens_details.cached_tokens
    assert usage.input_tokens_details.cached_tokens < usage.input_tokens
