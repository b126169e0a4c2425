"""The prompt-cache lifecycle on the real MLX engine, both demo models.

Turns replay the transcript the way an agent does in a tool loop: the
assistant's reasoning comes back as ``reasoning_content`` with its tool call,
so the template re-renders exactly what was generated. Generation is limited
(by ``logit_bias``) to whole-word tokens whose text re-encodes to the same
token, so a re-rendered reply tokenizes as it was generated, as it does with
a trained model; random weights would otherwise emit token splits that no
tokenizer reproduces.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import trio
from tokenizers import Tokenizer

from gezel_trio import (
    Delta,
    Engine,
    EngineConfig,
    Failed,
    Finished,
    GenerationRequest,
    SamplingParams,
    Usage,
    open_engine,
)
from gezel_trio.core.cache_plan import SNAPSHOT_MARGIN, common_prefix
from gezel_trio.core.request import CacheRequest

HANG = 120
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look something up",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]
SYSTEM = "You are a careful assistant. Use the lookup tool when facts are needed. " * 4


class Words:
    """Whole-word tokens of the demo tokenizer, and a decoder for replays."""

    def __init__(self, model: Path) -> None:
        self.tok = Tokenizer.from_file(str(model / "tokenizer.json"))
        ids = []
        for i in range(self.tok.get_vocab_size()):
            text = self.tok.decode([i])
            if re.fullmatch(r" [a-z]{3,}", text) and self.tok.encode(text).ids == [i]:
                ids.append(i)
        self.bias = tuple((i, 100.0) for i in ids)

    def text(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids))


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def model(kind: str, dense_model: Path, hybrid_model: Path) -> Path:
    return dense_model if kind == "dense" else hybrid_model


class Turn:
    def __init__(
        self,
        prompt: tuple[int, ...],
        generated: list[int],
        usage: Usage,
        boundaries: tuple[int, ...] = (),
    ) -> None:
        self.prompt = prompt
        self.generated = generated
        self.usage = usage
        self.boundaries = boundaries


async def turn(
    engine: Engine,
    words: Words,
    messages: list[dict[str, Any]],
    *,
    thinking: bool = True,
    max_tokens: int = 10,
    **cache: Any,
) -> Turn:
    rendered = await engine.render_chat(
        messages, tools=TOOLS, template_kwargs={"enable_thinking": thinking}
    )
    req = GenerationRequest(
        rendered.tokens,
        max_tokens,
        SamplingParams(temperature=0.0, logit_bias=words.bias),
        ignore_eos=True,
        # As the HTTP layer does: checkpoints where the template's messages end.
        cache=CacheRequest(boundaries=rendered.boundaries, **cache),
    )
    generated: list[int] = []
    with engine.submit_nowait(req) as handle:
        async for _, event in handle:
            match event:
                case Delta(tokens=tokens):
                    generated += tokens
                case Finished(usage=usage):
                    return Turn(rendered.tokens, generated, usage, rendered.boundaries)
                case Failed(error=error):
                    raise error
    raise AssertionError("no terminal event")


def tool_round(words: Words, t: Turn, n: int) -> list[dict[str, Any]]:
    call = {"id": f"c{n}", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    return [
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": words.text(t.generated),
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": f"c{n}", "content": f"result number {n}"},
    ]


async def test_multi_turn_session_prefills_only_what_is_new(kind: str, model: Path) -> None:
    words = Words(model)
    with trio.fail_after(HANG):
        async with open_engine(EngineConfig(model=model)) as engine:
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What is the weather in Oslo and Bergen?"},
            ]
            t1 = await turn(engine, words, messages, cache_id="s")
            assert t1.usage.cached_tokens == 0
            previous = t1
            exact_replays = 0
            for n, thinking in enumerate([True, False, True], start=1):
                messages += tool_round(words, previous, n)
                t = await turn(engine, words, messages, thinking=thinking, cache_id="s")
                held = previous.prompt + tuple(previous.generated)
                if kind == "dense":
                    # Post-generation state, trimmed to exactly what is shared.
                    expected = min(common_prefix(held, t.prompt), len(t.prompt) - 1)
                    assert t.usage.cached_tokens == expected
                    assert expected >= len(held) - SNAPSHOT_MARGIN
                elif common_prefix(held, t.prompt) == len(held):
                    # The replay is exact: the post-generation state serves.
                    assert t.usage.cached_tokens == len(held)
                    exact_replays += 1
                else:
                    # The reply was re-rendered: the checkpoint at the end of the
                    # previous turn's history serves (never beyond what is shared).
                    shared = common_prefix(previous.prompt, t.prompt)
                    kept = [b for b in previous.boundaries if b <= shared]
                    assert kept, "the renderer found a boundary the next turn shares"
                    assert max(kept) <= t.usage.cached_tokens <= shared
                    assert t.usage.cached_tokens >= len(previous.prompt) - SNAPSHOT_MARGIN
                assert t.usage.input_tokens == len(t.prompt)
                previous = t
            if kind == "hybrid":
                assert exact_replays >= 1, "a tool loop reuses the post-generation state"


async def test_plain_client_reuses_the_longest_cached_prefix(kind: str, model: Path) -> None:
    words = Words(model)
    with trio.fail_after(HANG):
        async with open_engine(EngineConfig(model=model)) as engine:
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Look up the tallest mountain."},
            ]
            t1 = await turn(engine, words, messages)
            messages += tool_round(words, t1, 1)
            t2 = await turn(engine, words, messages)
            assert t2.usage.cached_tokens >= len(t1.prompt) - SNAPSHOT_MARGIN


async def test_restart_with_the_same_persist_dir_is_a_disk_hit(
    kind: str, model: Path, tmp_path: Path
) -> None:
    words = Words(model)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Find the population of Paris."},
    ]
    config = EngineConfig.from_flags(model=model, persist_dir=tmp_path)
    with trio.fail_after(HANG):
        async with open_engine(config) as engine:
            t1 = await turn(engine, words, messages, cache_id="persisted")
        # Leaving the block shut the engine down, which flushed to disk.
        messages += tool_round(words, t1, 1)
        async with open_engine(config) as engine:
            t2 = await turn(engine, words, messages, cache_id="persisted")
            named = [e.cache_id for e in engine.cache_view if e.kind != "anonymous"]
            assert named == ["persisted"]
        async with open_engine(EngineConfig(model=model)) as engine:
            warm = await turn(engine, words, messages[:2], cache_id="persisted")
            messages_b = messages[:2] + tool_round(words, warm, 1)
            in_memory = await turn(engine, words, messages_b, cache_id="persisted")
        assert t2.usage.cached_tokens == in_memory.usage.cached_tokens > 0
        # Another model's fingerprint never loads the entry.
        other = EngineConfig.from_flags(
            model=model, persist_dir=tmp_path, model_fingerprint="another-model"
        )
        async with open_engine(other) as engine:
            t3 = await turn(engine, words, messages, cache_id="persisted")
            assert t3.usage.cached_tokens == 0


async def test_cancelled_decode_is_saved_and_the_retry_reuses_it(kind: str, model: Path) -> None:
    words = Words(model)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Tell me about rivers."},
    ]
    with trio.fail_after(HANG):
        async with open_engine(EngineConfig(model=model)) as engine:
            # As turn() renders the retry: thinking on, explicitly.
            rendered = await engine.render_chat(
                messages, tools=TOOLS, template_kwargs={"enable_thinking": True}
            )
            req = GenerationRequest(
                rendered.tokens,
                10_000,
                SamplingParams(temperature=0.0, logit_bias=words.bias),
                ignore_eos=True,
                cache=CacheRequest(cache_id="c"),
            )
            with engine.submit_nowait(req) as handle:
                seen = 0
                async for _, event in handle:
                    if isinstance(event, Delta):
                        seen += 1
                        if seen == 3:
                            break
            await engine.wait_until(lambda _: any(e.cache_id == "c" for e in engine.cache_view))
            retry = await turn(engine, words, messages, cache_id="c")
            # Dense: the saved decode state, trimmed; hybrid: the checkpoint
            # kept before the prompt's last token for exactly this retry.
            assert retry.usage.cached_tokens == len(rendered.tokens) - 1


async def test_cancelled_prefill_saves_the_last_chunk_edge(kind: str, model: Path) -> None:
    words = Words(model)
    long_system = " ".join(["The archive holds records of every river and mountain."] * 40)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": long_system},
        {"role": "user", "content": "Summarize the archive."},
    ]
    step = 64
    with trio.fail_after(HANG):
        async with open_engine(
            EngineConfig.from_flags(model=model, prefill_step_size=step)
        ) as engine:
            rendered = await engine.render_chat(messages, tools=TOOLS)
            assert len(rendered.tokens) > 6 * step
            greedy = SamplingParams(temperature=0.0)
            req = GenerationRequest(rendered.tokens, 5, greedy, cache=CacheRequest(cache_id="p"))
            done_at_cancel = 0
            with engine.submit_nowait(req) as handle:
                async for _, event in handle:
                    if getattr(event, "done", 0) >= 3 * step:
                        done_at_cancel = event.done  # type: ignore[attr-defined]
                        break
            # The cancellation save shows in the cache view published after it.
            await engine.wait_until(lambda _: any(e.cache_id == "p" for e in engine.cache_view))
            entry = next(e for e in engine.cache_view if e.cache_id == "p")
            # Everything prefilled before the cancel is kept, and no more.
            assert done_at_cancel <= entry.tokens <= done_at_cancel + step
            retry = await turn(engine, words, messages, cache_id="p")
            assert retry.usage.cached_tokens == entry.tokens


async def test_cancelled_while_queued_saves_nothing(model: Path) -> None:
    words = Words(model)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Wait your turn."}]
    with trio.fail_after(HANG):
        async with open_engine(EngineConfig.from_flags(model=model, max_concurrency=1)) as engine:
            rendered = await engine.render_chat(messages)
            blocker = GenerationRequest(rendered.tokens, 10_000, ignore_eos=True)
            with engine.submit_nowait(blocker) as first:
                async for _, event in first:
                    if isinstance(event, Delta):
                        break
                queued = GenerationRequest(rendered.tokens, 4, cache=CacheRequest(cache_id="never"))
                with engine.submit_nowait(queued):
                    assert len(engine.state().queued) == 1
            await engine.wait_until(lambda s: s.running == () and s.live == 0)
            assert all(e.cache_id != "never" for e in engine.cache_view)
            del words
