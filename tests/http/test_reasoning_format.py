"""``--reasoning-format`` and a request's ``reasoning_format`` on chat
completions, in-process over the scripted backend.

The backend here thinks in ``<think>`` blocks: its renderer opens one at the
end of the prompt when ``enable_thinking`` is on (as Qwen-style templates
do), and its script writes the block, the answer and, when asked, a tool
call. Each stream is read the way the seed's client reads it: only
``delta.content`` (and ``tool_calls``), split with its own ``<think>``
handling (``StreamingReasoningSplit`` of ``tests/support/seed_client.py``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx2 as httpx
import trio
import trio.testing

from gezel_trio.core.model import ModelInfo
from gezel_trio.core.request import GenerationRequest, RenderedPrompt
from gezel_trio.http.app import HttpSettings, create_app
from gezel_trio.testing import EOS, ScriptedBackend, open_test_engine
from gezel_trio.testing._scripted import CharRenderer
from tests.support.inprocess import served
from tests.support.seed_client import StreamingReasoningSplit

THINK, END_THINK = 0xE000, 0xE001  # the markers' ids: never rendered from text
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


class _OpeningRenderer(CharRenderer):
    def render(self, messages: Sequence[dict[str, Any]], **kw: Any) -> RenderedPrompt:
        rendered = super().render(messages, **kw)
        if kw["template_kwargs"].get("enable_thinking"):
            # The template leaves a think block open for the model.
            return attrs.evolve(rendered, tokens=(*rendered.tokens, THINK))
        return rendered


class ThinkingBackend(ScriptedBackend):
    def __init__(self, text: str) -> None:
        def script(_rid: int, _request: GenerationRequest) -> list[int]:
            return [ord(c) for c in text] + [EOS]

        super().__init__(script=script)
        self._think_info = attrs.evolve(
            super().info,
            think_ids=(THINK, END_THINK),
            think_markers=("<think>", "</think>"),
            tool_format="hermes",
        )
        self._opening = _OpeningRenderer()

    @property
    def info(self) -> ModelInfo:
        return self._think_info

    @property
    def renderer(self) -> CharRenderer:
        return self._opening


OPENED = "Let me see.\n</think>\n\nThe answer is 4."
OWN = "<think>\nLet me see.\n</think>\n\nThe answer is 4."


def post(
    text: str, body: dict[str, Any], settings: HttpSettings, path: str = "/v1/chat/completions"
) -> tuple[int, Any]:
    """POST ``body`` to chat completions over a backend that writes ``text``:
    the status and the JSON body, or the list of SSE payloads."""

    async def scenario() -> tuple[int, Any]:
        full = {**QUESTION, **body} if path == "/v1/chat/completions" else body
        async with (
            open_test_engine(ThinkingBackend(text)) as t,
            create_app(t.engine, settings).test_app() as app,
        ):
            if not body.get("stream"):
                r = await app.test_client().post(path, json=full)
                return r.status_code, await r.get_json()
            # The streaming connection: the body read as it is sent.
            async with app.test_client().request(
                "/v1/chat/completions",
                method="POST",
                headers={"Content-Type": "application/json"},
            ) as conn:
                await conn.send(json.dumps(full).encode())
                await conn.send_complete()
                data = b""
                while b"data: [DONE]" not in data:
                    data += await conn.receive()
            frames = [
                json.loads(line[6:])
                for line in data.decode().splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
            return conn.status_code or 0, frames

    return trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def client_reads(frames: list[dict[str, Any]], *, opens: bool) -> tuple[list[str], str]:
    """The visible text the client shows as each frame arrives (the last
    entry: its flush at the end of the turn), and the reasoning it kept."""
    split = StreamingReasoningSplit(opens_in_reasoning=opens)
    live, reasoning = [], ""
    for frame in frames:
        for choice in frame["choices"]:
            part = split.push(choice["delta"].get("content") or "")
            live.append(part.visible)
            reasoning += part.reasoning
    end = split.flush()
    return [*live, end.visible], reasoning + end.reasoning


NONE = HttpSettings(reasoning_format="none")
QUESTION = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 200}
THINKING = {"chat_template_kwargs": {"enable_thinking": True}}


def test_none_streams_an_opened_block_through_content_and_the_answer_live() -> None:
    status, frames = post(OPENED, {"stream": True, **THINKING}, NONE)
    assert status == 200
    deltas = [c["delta"] for f in frames for c in f["choices"]]
    assert not any("reasoning_content" in d or "reasoning" in d for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == OPENED
    live, reasoning = client_reads(frames, opens=True)
    assert reasoning == "Let me see.\n"
    assert "".join(live).strip() == "The answer is 4."
    # Live: the answer came frame by frame before the end, not in the flush.
    assert live[-1] == ""
    assert sum(1 for piece in live if piece) > 3


def test_none_streams_a_block_the_model_opened_itself() -> None:
    status, frames = post(OWN, {"stream": True}, NONE)
    assert status == 200
    live, reasoning = client_reads(frames, opens=False)
    assert reasoning == "\nLet me see.\n"
    assert "".join(live).strip() == "The answer is 4."
    assert live[-1] == ""


def test_auto_sends_reasoning_content_which_this_client_never_reads() -> None:
    # Today's default, kept for everyone but the seed profile: with a
    # template that opens the block, the client reading only content never
    # sees a close marker and holds the whole answer as reasoning.
    status, frames = post(OPENED, {"stream": True, **THINKING}, HttpSettings())
    assert status == 200
    deltas = [c["delta"] for f in frames for c in f["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Let me see."
    live, reasoning = client_reads(frames, opens=True)
    assert "".join(live) == ""
    assert reasoning == "The answer is 4."


def test_none_without_streaming_keeps_the_block_in_content() -> None:
    status, body = post(OPENED, THINKING, NONE)
    assert status == 200
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": OPENED}
    assert body["choices"][0]["finish_reason"] == "stop"


def test_a_request_field_overrides_the_server_setting() -> None:
    _, body = post(OPENED, {**THINKING, "reasoning_format": "none"}, HttpSettings())
    assert body["choices"][0]["message"]["content"] == OPENED
    for split in ("deepseek", "auto"):
        _, body = post(OPENED, {**THINKING, "reasoning_format": split}, NONE)
        message = body["choices"][0]["message"]
        assert message["content"] == "The answer is 4."
        assert message["reasoning_content"] == "Let me see."


def test_an_unknown_reasoning_format_is_a_400_naming_it() -> None:
    status, body = post(OPENED, {"reasoning_format": "deepseek-legacy"}, NONE)
    assert status == 400
    assert body["error"]["param"] == "reasoning_format"


def test_a_tool_call_after_the_block_still_streams_as_tool_calls() -> None:
    text = f"I will look it up.\n</think>\n\n{CALL}"
    body = {"stream": True, "tools": TOOLS, **THINKING}
    status, frames = post(text, body, NONE)
    assert status == 200
    deltas = [c["delta"] for f in frames for c in f["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls") or ()]
    assert calls[0]["function"]["name"] == "get_time"
    arguments = "".join(tc["function"]["arguments"] for tc in calls)
    assert json.loads(arguments) == {"city": "Oslo"}
    content = "".join(d.get("content") or "" for d in deltas)
    assert "<tool_call>" not in content
    assert content.startswith("I will look it up.\n</think>")
    assert frames[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_responses_and_messages_keep_their_typed_reasoning_under_none() -> None:
    # Their wire formats carry reasoning as its own item or block, which
    # their clients read; the setting is chat completions' alone.
    messages = {"model": "m", **QUESTION}
    status, body = post(OWN, messages, NONE, "/v1/messages")
    assert status == 200
    assert [b["type"] for b in body["content"]] == ["thinking", "text"]
    assert body["content"][0]["thinking"] == "Let me see."
    status, body = post(OWN, {"model": "m", "input": "2+2?"}, NONE, "/v1/responses")
    assert status == 200
    assert [item["type"] for item in body["output"]] == ["reasoning", "message"]


async def test_the_real_model_streams_a_budget_closed_block_through_content(
    dense_model: Path,
) -> None:
    # The demo template opens <think> when thinking is on; the random model
    # never closes it, so the thinking budget does, and the answer follows.
    body = {
        **QUESTION,
        **THINKING,
        "stream": True,
        "max_tokens": 24,
        "max_thinking_tokens": 6,
        "temperature": 0,
    }
    frames = []
    async with (
        served(dense_model, NONE) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=120) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                frames.append(json.loads(line[6:]))
    deltas = [c["delta"] for f in frames for c in f["choices"]]
    assert not any("reasoning_content" in d for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert content.count("</think>") == 1
    assert not content.startswith("<think>")  # the prompt opened it, not the model
    live, reasoning = client_reads(frames, opens=True)
    assert reasoning.strip()
    assert "".join(live).strip()
    assert live[-1] == ""  # the answer came live, none of it held to the end
