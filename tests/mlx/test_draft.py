"""A draft model proposing inside the batched step (``mlx.speculation.draft``), on the
real MLX backend: greedy decoding is token for token what plain decoding
gives whether the draft agrees with the target (the target as its own
draft) or often does not (the target with noise in its weights); the draft
really proposed (its passes and acceptances are counted apart from the
lookup's); a finished sequence's draft state seeds the next turn; a draft
that cannot propose for the target is refused by name, and one that fails
costs its sequence only speculation.

On the dense tiny demo model held as float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import load, load_tokenizer

from gezel_trio import EngineConfig, GenerationRequest, SamplingParams, open_engine
from gezel_trio.core.errors import ModelLoadError
from gezel_trio.mlx import speculation
from gezel_trio.mlx.loading import hold_float32
from gezel_trio.mlx.sampling import make_sampler
from gezel_trio.mlx.speculation.draft import DraftModel, DraftPool, check_pair
from gezel_trio.mlx.speculation.lookup import NgramLookup
from tests.support.generate import text_and_usage
from tests.support.speculation import TOKENS, AlwaysPays, oracle, prompts_of, run

HANG = 60


def _load(path: Path, noise: float = 0.0) -> tuple[Any, Any]:
    m, tok = load(str(path))
    hold_float32(m)
    if noise:
        # Another model with the same vocabulary: the target's weights,
        # each moved by ``noise`` of its own spread.
        flat = tree_flatten(m.parameters())
        keys = mx.random.split(mx.random.key(7), len(flat))
        moved = [
            (name, w + noise * mx.std(w) * mx.random.normal(w.shape, key=key))
            for (name, w), key in zip(flat, keys, strict=True)
        ]
        m.update(tree_unflatten(moved))
    mx.eval(m.parameters())
    return m, tok


@pytest.fixture(scope="module")
def target(dense_model: Path) -> tuple[Any, Any]:
    return _load(dense_model)


@pytest.fixture(scope="module")
def same(dense_model: Path) -> Any:
    return _load(dense_model)[0]


@pytest.fixture(scope="module")
def noisy(dense_model: Path) -> Any:
    return _load(dense_model, noise=0.2)[0]


def _short_prompts(tok: Any) -> list[list[int]]:
    """Prompts the lookup proposes little for at first: the draft's turn."""
    return [tok.encode("a fox"), tok.encode("the quick brown"), tok.encode("zebra")]


def test_draft_proposals_keep_greedy_decoding_token_for_token(
    target: tuple[Any, Any], same: Any, noisy: Any
) -> None:
    m, tok = target
    prompts = _short_prompts(tok) + prompts_of(tok)[:1]
    rates = {}
    for name, weights in (("same", same), ("noisy", noisy)):
        for batch in ([prompts[0]], prompts):
            plain, _, _, _ = run(m, batch, spec=False)
            draft = DraftModel(weights, name)
            spec, _, stats, _ = run(m, batch, spec=True, draft=draft)
            assert spec == plain, name
            # The draft proposed, and some of it was accepted: the
            # comparison could fail.
            assert draft.passes > 0
            assert stats.model_draft_tokens > 0
            assert stats.model_accepted_tokens > 0
        rates[name] = stats.model_accepted_tokens / stats.model_draft_tokens
    # The target as its own draft proposes the target's own choices; the
    # noisy one is often rejected (each rejection leaves holes to mask).
    assert rates["same"] > 0.9
    assert rates["noisy"] < rates["same"]


class _DraftOnly(speculation.gate.Gate):
    """A gate whose lookup shapes never pay and whose drafting ones do."""

    def pays(
        self, batch: int, width: int, expected: float, proposing: int, drafted: bool = False
    ) -> bool:
        return drafted


def test_where_the_lookup_fills_every_proposal_its_own_gate_decides(
    target: tuple[Any, Any], same: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lane with a draft model whose lookup copies whole proposals does
    not wait for the step in flight to verify them when the lookup's gate
    refuses: the draft adds nothing there, so the lookup's decision (and
    its pipelined step) stands. The lookup is an oracle of plain
    decoding's text, so it fills every proposal."""
    m, tok = target
    prompts = _short_prompts(tok)
    plain, _, _, _ = run(m, prompts, spec=False)

    monkeypatch.setattr(NgramLookup, "propose", oracle(prompts, plain, spoil=False))
    draft = DraftModel(same, "same")
    out, _, stats, _ = run(m, prompts, spec=True, draft=draft, gate=_DraftOnly())
    assert out == plain
    assert draft.passes == 0
    assert stats.verify_steps == 0
    assert stats.guess_waits == 0
    # With a gate that lets the lookup's shapes pay, the same proposals
    # are verified (the comparison above could fail).
    out, _, stats, _ = run(m, prompts, spec=True, draft=DraftModel(same, "same"))
    assert out == plain
    assert stats.verify_steps > 0
    assert stats.num_accepted_tokens > 0


def test_a_sampled_sequence_verifies_draft_proposals_by_rejection_sampling(
    target: tuple[Any, Any], same: Any
) -> None:
    m, tok = target
    prompts = _short_prompts(tok)[:2]
    plain, _, _, _ = run(m, prompts, spec=False)
    vocab = len(tok.get_vocab())
    # Near temperature 0 a sampled sequence writes the greedy text; its
    # draft proposals went through rejection sampling.
    cold = [make_sampler(SamplingParams(temperature=1e-4), vocab) for _ in prompts]
    spec, _, stats, _ = run(m, prompts, spec=True, samplers=cold, draft=DraftModel(same, "same"))
    assert spec == plain
    assert stats.model_accepted_tokens > 0


def test_a_finished_sequence_s_draft_state_seeds_the_next_turn(
    target: tuple[Any, Any], same: Any
) -> None:
    m, tok = target
    first = tok.encode("one turn of a conversation, then the next one: " * 3)
    pool = DraftPool()
    draft = DraftModel(same, "same")
    (out,), _, _, _ = run(m, [first], spec=True, draft=draft, pool=pool)
    assert len(pool) == 1
    assert draft.fed_tokens >= len(first)
    # Turn 2 begins with turn 1's prompt and answer.
    second = [*first, *out, *tok.encode(" and a question")]
    fed = draft.fed_tokens
    plain, _, _, _ = run(m, [second], spec=False)
    spec, _, stats, _ = run(m, [second], spec=True, draft=draft, pool=pool)
    assert spec == plain
    assert pool.hits == 1
    # It fed what is new since turn 1, not the whole prompt.
    assert draft.fed_tokens - fed < len(second) - len(first)
    assert stats.model_draft_tokens > 0


def test_a_draft_that_cannot_propose_for_the_target_is_refused_by_name(
    dense_model: Path, hybrid_model: Path, vision_model: Path
) -> None:
    m, tok = load(str(dense_model))
    hybrid, hybrid_tok = load(str(hybrid_model))
    with pytest.raises(ModelLoadError, match=r"draft model h: layer \d+ keeps a ArraysCache"):
        check_pair("h", hybrid, hybrid_tok, tok)
    # The vision demo model's tokenizer has an image token the others lack.
    with pytest.raises(ModelLoadError, match="draft model v: its vocabulary differs"):
        check_pair("v", m, load_tokenizer(vision_model), tok)
    check_pair("d", m, tok, tok)


async def test_the_engine_refuses_a_draft_model_it_cannot_use(
    dense_model: Path, hybrid_model: Path
) -> None:
    config = EngineConfig.from_flags(model=dense_model, draft_model=hybrid_model)
    with trio.fail_after(HANG), pytest.raises(ModelLoadError, match="draft model"):
        async with open_engine(config):
            pass


async def test_the_engine_drafts_with_a_draft_model_and_a_failing_draft_costs_only_speculation(
    dense_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    greedy = SamplingParams(temperature=0.0)

    def request(prompt: tuple[int, ...]) -> GenerationRequest:
        return GenerationRequest(prompt, TOKENS, greedy, ignore_eos=True)

    # On a model this small the draft's passes cost more than the verify
    # gains, and the measured gate would refuse it: this test is about
    # correctness, so every proposal is verified.
    monkeypatch.setattr(speculation.gate.Gate, "pays", AlwaysPays.pays)
    first, second = (5, 6, 7, 8), (9, 10, 11, 12)
    with trio.fail_after(HANG):
        async with open_engine(
            EngineConfig.from_flags(model=dense_model, speculation="off")
        ) as engine:
            plain = [(await text_and_usage(engine, request(p)))[0] for p in (first, second)]
        config = EngineConfig.from_flags(model=dense_model, draft_model=dense_model)
        async with open_engine(config) as engine:
            text, usage = await text_and_usage(engine, request(first))
            assert text == plain[0]
            assert usage.accepted_draft_tokens > 0
            # The draft model proposed, as /metrics counts it.
            assert _counter(engine, "draft_model_accepted_tokens") > 0
            assert _counter(engine, "draft_model_tokens") <= usage.draft_tokens
            # A draft model that raises: logged, that sequence decodes on plainly.
            real = DraftModel.propose

            def failing(self: DraftModel, state: Any, tokens: list[int], k: int) -> list[int]:
                if tokens[: len(second)] == list(second):
                    raise RuntimeError("a draft bug")
                return real(self, state, tokens, k)

            monkeypatch.setattr(DraftModel, "propose", failing)
            text, usage = await text_and_usage(engine, request(second))
            assert text == plain[1]
            assert [r for r in caplog.records if "the draft model failed" in r.getMessage()]


def _counter(engine: Any, name: str) -> float:
    for line in engine.metrics.exposition().decode().splitlines():
        if line.startswith(f"gezel_spec_decode_num_{name}_total "):
            return float(line.split()[1])
    raise AssertionError(f"no gezel_spec_decode_num_{name}_total in /metrics")


def test_the_pool_keeps_the_latest_states_within_its_budget_per_salt(same: Any) -> None:
    draft = DraftModel(same, "same")
    states = []
    for i in range(3):
        state = draft.state("s")
        draft.propose(state, list(range(10 + 100 * i, 40 + 100 * i)), 2)
        states.append(state)
    one = sum(c.nbytes for c in states[0].cache)
    pool = DraftPool(size=8, budget=2 * one + one // 2)
    for state in states:
        pool.put(state)
    # The oldest went for the budget.
    assert len(pool) == 2
    assert pool.nbytes <= pool.budget
    assert pool.take(states[0].fed, "s") is None
    # Another salt never takes it; its own salt does, by shared prefix.
    turn = [*states[2].fed[:20], 999]
    assert pool.take(turn, "other") is None
    assert pool.take(turn, "s") is states[2]
    assert len(pool) == 1
