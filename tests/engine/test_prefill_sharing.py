"""``n > 1``: n sequences of one prompt share one prefill.

The first member admitted computes the prompt; the others wait, holding
their slots, until its state at ``len(prompt) - 1`` is in the prompt cache,
then seed from it and join the batch at the step it starts decoding. The
scripted engine checks the protocol deterministically under MockClock (who
prefills, when the siblings start, a prefiller that leaves early); the real
MLX engine on both demo models checks that siblings seeded from the shared
prompt generate exactly what a sequence alone would.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from gezel_trio import (
    ChatFinished,
    ChatRequest,
    Delta,
    Engine,
    EngineConfig,
    Failed,
    Finished,
    GenerationRequest,
    InvalidRequest,
    Progress,
    QueueFull,
    SamplingParams,
    TextDelta,
    open_engine,
)
from gezel_trio.testing import ScriptedBackend, open_test_engine

PROMPT = tuple(ord(c) for c in "user: a prompt long enough for several prefill chunks\nassistant:")
HANG = 120


def run(scenario: object) -> None:
    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))  # type: ignore[arg-type]


async def drain(engine: Engine, request: GenerationRequest, n: int) -> list[tuple[int, object]]:
    with engine.submit_nowait(request, n) as group:
        return [pair async for pair in group]


@pytest.mark.parametrize("trimmable", [True, False])
def test_the_prompt_is_prefilled_once_and_the_siblings_decode_together(trimmable: bool) -> None:
    async def scenario() -> None:
        async with open_test_engine(ScriptedBackend(trimmable=trimmable)) as t:
            events = await drain(t.engine, GenerationRequest(PROMPT, max_tokens=5), 3)
            prefilling = {i for i, e in events if isinstance(e, Progress)}
            assert prefilling == {0}  # one member computed the prompt
            finished = {i: e for i, e in events if isinstance(e, Finished)}
            assert sorted(finished) == [0, 1, 2]
            assert finished[0].usage.cached_tokens == 0
            for i in (1, 2):  # the siblings seeded from it: nothing left but the last token
                assert finished[i].usage.cached_tokens == len(PROMPT) - 1
                assert finished[i].usage.input_tokens == len(PROMPT)
            # They joined the batch at the step the prefiller started decoding:
            # every member's first token comes before any member's second.
            deltas = [(i, e.usage.output_tokens) for i, e in events if isinstance(e, Delta)]
            firsts = [k for k, (_, out) in enumerate(deltas) if out == 1]
            seconds = [k for k, (_, out) in enumerate(deltas) if out == 2]
            assert len(firsts) == 3
            assert max(firsts) < min(seconds)
            await t.engine.wait_until(lambda s: s.live == 0)
            totals = t.engine.cache_totals
            assert totals.hits >= 2

    run(scenario)


def test_members_sample_with_seed_plus_their_index() -> None:
    seen: dict[int, int | None] = {}

    def script(rid: int, request: GenerationRequest) -> list[int]:
        seen[rid] = request.sampling.seed
        return [ord("x")] * request.max_tokens

    async def scenario() -> None:
        async with open_test_engine(ScriptedBackend(script=script)) as t:
            request = GenerationRequest(PROMPT, max_tokens=2, sampling=SamplingParams(seed=40))
            await drain(t.engine, request, 3)

    run(scenario)
    assert sorted(seen.values()) == [40, 41, 42]


def test_a_prefiller_that_leaves_hands_the_prompt_to_a_sibling() -> None:
    async def scenario() -> None:
        async with open_test_engine(ScriptedBackend(prefill_step=4)) as t:
            request = GenerationRequest(PROMPT, max_tokens=3)
            bp = t.breakpoints.add("prefill", index=2)
            with t.engine.submit_nowait(request, 3) as group:
                await bp.reached()
                # The world is stopped after the prefiller's second chunk; it
                # alone is withdrawn (white-box: groups withdraw as a whole).
                t.engine.link.withdraw(group.rids[0])
                bp.release()
                events = [pair async for pair in group]
            ends = {i: e for i, e in events if isinstance(e, Finished | Failed)}
            assert isinstance(ends[0], Failed)
            assert isinstance(ends[1], Finished)
            assert isinstance(ends[2], Finished)
            # The sibling that took over seeded from what the first had saved
            # (two chunks), and the last one from the whole prompt.
            assert ends[1].usage.cached_tokens == 8
            assert ends[2].usage.cached_tokens == len(PROMPT) - 1

    run(scenario)


def test_n_is_bounded_by_max_concurrency_and_the_queue() -> None:
    async def scenario() -> None:
        async with open_test_engine(ScriptedBackend(), max_concurrency=2, max_queue=1) as t:
            request = GenerationRequest(PROMPT, max_tokens=2)
            with pytest.raises(InvalidRequest) as err:
                t.engine.submit_nowait(request, 3)
            assert err.value.param == "n"
            with pytest.raises(InvalidRequest):
                await t.engine.prepare_chat(ChatRequest([{"role": "user", "content": "hi"}], n=3))
            with t.engine.submit_nowait(request, 2):
                with pytest.raises(QueueFull):  # two slots taken, one queue place left
                    t.engine.submit_nowait(request, 2)
            assert t.engine.state().live == 0

    run(scenario)


def test_chat_choices_are_shaped_each_with_its_index() -> None:
    async def scenario() -> None:
        async with open_test_engine(ScriptedBackend()) as t:
            chat = ChatRequest([{"role": "user", "content": "hello"}], max_tokens=4, n=2)
            prepared = await t.engine.prepare_chat(chat)
            texts: dict[int, str] = {0: "", 1: ""}
            finished = {}
            with t.engine.submit_chat_nowait(prepared) as group:
                async for choice, event in group:
                    if isinstance(event, TextDelta):
                        texts[choice.index] += event.text
                    elif isinstance(event, ChatFinished):
                        finished[choice.index] = event
                usage = group.usage
            assert texts[0] == texts[1]
            assert len(texts[0]) == 4
            assert [finished[i].message["content"] for i in (0, 1)] == [texts[0], texts[1]]
            assert usage is not None
            assert usage.input_tokens == len(prepared.request.prompt)
            assert usage.output_tokens == 8
            assert usage.cached_tokens == 0

    run(scenario)


# --- the real MLX backend ---------------------------------------------------


async def _greedy_choices(engine: Engine, text: str, n: int) -> list[tuple[str, Finished]]:
    rendered = await engine.render_chat(
        [{"role": "user", "content": text}], template_kwargs={"enable_thinking": False}
    )
    request = GenerationRequest(
        rendered.tokens, max_tokens=8, sampling=SamplingParams(temperature=0.0), ignore_eos=True
    )
    texts = [""] * n
    ends: dict[int, Finished] = {}
    for i, event in await drain(engine, request, n):
        match event:
            case Delta(text=text):
                texts[i] += text
            case Finished():
                ends[i] = event
            case Failed(error=error):
                raise error
    return [(texts[i], ends[i]) for i in range(n)]


@pytest.mark.slow
async def test_siblings_seeded_from_the_shared_prompt_match_a_sequence_alone(
    any_model: Path,
) -> None:
    """Greedy choices are identical to the same prompt decoded alone: the
    state the siblings seed from is the prompt's, exactly."""
    with trio.fail_after(HANG):
        async with open_engine(
            EngineConfig.from_flags(model=any_model, max_concurrency=4)
        ) as engine:
            choices = await _greedy_choices(engine, "Count the sheep, three at a time.", 3)
            ((alone, _),) = await _greedy_choices(engine, "Count the sheep, three at a time.", 1)
    texts = [text for text, _ in choices]
    assert alone
    assert texts == [alone] * 3
    prompt = choices[0][1].usage.input_tokens
    assert sorted(f.usage.cached_tokens for _, f in choices) == [0, prompt - 1, prompt - 1]
