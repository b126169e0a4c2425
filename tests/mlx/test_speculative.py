"""Speculation inside the batched step (``mlx.speculation``) on the real MLX
backend: greedy outputs are token for token what plain decoding gives, with
proposals verified and accepted (so the test could fail), in batches where
sequences accept different numbers of tokens (holes in the shared cache),
beside sequences that cannot speculate (sampled, processed, opted out); a
finished sequence's cache entry is the dense cache plain decoding leaves.

On the dense tiny demo model held as float32, as the CPU backend holds it.
Its random weights loop, so its own outputs recur and the lookup proposes.
A gate that always pays makes every proposal verified: the measured gate
would refuse some on this model, and the test is about correctness.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from gezel_trio import (
    EngineConfig,
    GenerationRequest,
    SamplingParams,
    open_engine,
)
from gezel_trio.core.request import CacheRequest
from gezel_trio.http.app import HttpSettings, create_app
from gezel_trio.mlx import speculation
from gezel_trio.mlx.loading import hold_float32
from gezel_trio.mlx.sampling import Sampling, greedy, make_sampler
from gezel_trio.mlx.speculation.lookup import NgramLookup, RecentBySalt, RecentSequences
from tests.support.generate import text_and_usage
from tests.support.speculation import TOKENS, AlwaysPays, prompts_of, run

HANG = 60


@pytest.fixture(scope="module")
def model(dense_model: Path) -> tuple[Any, Any]:
    m, tok = load(str(dense_model))
    hold_float32(m)
    mx.eval(m.parameters())
    return m, tok


def test_lookup_proposes_what_followed_the_latest_occurrence() -> None:
    lookup = NgramLookup(max_n=3, min_n=2)
    lookup.extend([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3])
    # The suffix (1, 2, 3) last occurred before 7, 8 (not before 9).
    assert lookup.propose(2) == [7, 8]
    assert lookup.propose(0) == []
    # The longest recurring suffix wins; a single token never proposes.
    lookup.extend([7, 4])
    assert lookup.propose(3) == []  # (7, 4) never occurred; 1-grams are not used
    lookup.extend([1, 2])
    assert lookup.propose(3) == [3, 7, 4]
    # A copy that reaches the end continues with what it proposed: a loop.
    loop = NgramLookup(max_n=3, min_n=2)
    loop.extend([5, 1, 2, 3, 1, 2, 3, 1, 2])
    assert loop.propose(5) == [3, 1, 2, 3, 1]
    assert NgramLookup.accepted([3, 7, 9], [3, 7, 4]) == 2
    assert NgramLookup.accepted([5], [3]) == 0
    with pytest.raises(ValueError, match="min_n"):
        NgramLookup(max_n=1, min_n=2)


def test_greedy_speculation_is_plain_decoding_token_for_token(model: tuple[Any, Any]) -> None:
    m, tok = model
    prompts = prompts_of(tok)
    for batch in ([prompts[0]], prompts):
        plain, _, _, _ = run(m, batch, spec=False)
        spec, _, stats, holey = run(m, batch, spec=True)
        assert spec == plain
        # Proposals were verified and some accepted: the comparison could fail.
        assert stats.verify_steps > 0
        assert stats.num_accepted_tokens > 0
    # In the batch, sequences accepted different counts: holes were made.
    assert any(holey)


def test_rejected_proposals_leave_plain_decoding_untouched(
    model: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every proposal of two or more tokens has its last one wrong: each
    verify rejects part of what it was given, and the text is plain's."""
    m, tok = model
    prompts = prompts_of(tok)
    plain, _, _, _ = run(m, prompts, spec=False)
    real = NgramLookup.propose

    def spoiled(self: NgramLookup, k: int) -> list[int]:
        out = real(self, k)
        return [*out[:-1], (out[-1] + 1) % 1000] if len(out) >= 2 else out

    monkeypatch.setattr(NgramLookup, "propose", spoiled)
    spec, _, stats, holey = run(m, prompts, spec=True)
    assert spec == plain
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert any(holey)


def test_a_finished_sequence_leaves_the_dense_cache_plain_decoding_leaves(
    model: tuple[Any, Any],
) -> None:
    m, tok = model
    prompts = prompts_of(tok)
    # Budgets that end sequences inside an accepted run of tokens.
    budgets = [TOKENS - 1, TOKENS // 2 + 1, TOKENS - 5]
    plain, plain_end, _, _ = run(m, prompts, spec=False, max_tokens=budgets)
    spec, spec_end, stats, _ = run(m, prompts, spec=True, max_tokens=budgets)
    assert stats.num_accepted_tokens > 0
    assert spec == plain
    for a, b in zip(plain_end, spec_end, strict=True):
        assert a.all_tokens == b.all_tokens
        for ca, cb in zip(a.prompt_cache, b.prompt_cache, strict=True):
            assert cb.offset == ca.offset == len(b.all_tokens)
            assert ca.keys.shape == cb.keys.shape
            assert mx.allclose(ca.keys[..., : ca.offset, :], cb.keys, atol=1e-4).item()
            assert mx.allclose(ca.values[..., : ca.offset, :], cb.values, atol=1e-4).item()


def test_only_greedy_unprocessed_sequences_that_did_not_opt_out_propose(
    model: tuple[Any, Any],
) -> None:
    m, tok = model
    prompts = prompts_of(tok)
    seen: list[int] = []

    def processor(tokens: mx.array, logits: mx.array) -> mx.array:
        seen.append(int(tokens.size))
        return logits

    def samplers() -> list[Any]:
        # A seeded sampler keeps its key stream: a new one per run.
        return [greedy, make_sampler(SamplingParams(temperature=0.8, seed=7), 0), greedy]

    processors: list[list[Any]] = [[], [], [processor]]
    plain, _, _, _ = run(m, prompts, spec=False, samplers=samplers(), processors=processors)
    plain_seen = list(seen)
    seen.clear()
    spec, _, stats, _ = run(m, prompts, spec=True, samplers=samplers(), processors=processors)
    # The sampled sequence keeps its seeded stream, the processed one sees
    # the same contexts, the greedy one speculates: all three as plain.
    assert spec == plain
    assert seen == plain_seen
    assert stats.num_drafts > 0
    # Opted out, the only speculating sequence makes nothing verified.
    first_uid = 0  # BatchGenerator numbers uids from 0 in each generator
    _, _, none, _ = run(
        m, prompts, spec=True, samplers=samplers(), processors=processors, opted_out={first_uid}
    )
    assert none.num_drafts == 0
    assert none.verify_steps == 0


def test_sampled_sequences_speculate_by_rejection_sampling(model: tuple[Any, Any]) -> None:
    """An unseeded sampled sequence verifies its proposals too. Near
    temperature 0 its distribution is the greedy choice, so it must write
    greedy decoding's text (wrong positions or verdicts would not); warmer,
    the cache it leaves is the one its tokens give. (The random weights'
    logits are flat: above ~0.1 their samples never recur.)"""
    m, tok = model
    prompts = prompts_of(tok)
    mx.random.seed(3)
    plain, _, _, _ = run(m, prompts, spec=False)
    cold = [make_sampler(SamplingParams(temperature=1e-4), 0) for _ in prompts]
    assert all(isinstance(s, Sampling) for s in cold)
    spec, _, stats, _ = run(m, prompts, spec=True, samplers=cold)
    assert spec == plain
    assert stats.num_drafts > 0
    assert stats.num_accepted_tokens > 0

    warm = [make_sampler(SamplingParams(temperature=0.03), 0) for _ in prompts]
    _, ends, stats, holey = run(m, prompts, spec=True, samplers=warm)
    assert stats.num_drafts > 0
    assert any(holey)
    for end in ends:
        fresh = make_prompt_cache(m)
        m(mx.array(end.all_tokens)[None], cache=fresh)
        for want, got in zip(fresh, end.prompt_cache, strict=True):
            assert got.offset == want.offset == len(end.all_tokens)
            assert mx.allclose(want.keys[..., : want.offset, :], got.keys, atol=1e-4).item()


def test_a_model_with_recurrent_layers_is_refused_by_name(hybrid_model: Path) -> None:
    m, _ = load(str(hybrid_model))
    why = speculation.speculation_blocker(make_prompt_cache(m))
    assert why is not None
    assert "cannot drop rejected tokens" in why
    assert speculation.speculation_blocker([c for c in make_prompt_cache(m) if False]) is None


_SOURCE = Path(speculation.__file__).read_text()


def _counter(engine: Any, name: str) -> float:
    for line in engine.metrics.exposition().decode().splitlines():
        if line.startswith(f"gezel_spec_decode_num_{name}_total "):
            return float(line.split()[1])
    raise AssertionError(f"no gezel_spec_decode_num_{name}_total in /metrics")


async def _greedy_text(
    engine: Any,
    prompt: tuple[int, ...],
    *,
    speculate: bool = True,
    sampling: SamplingParams | None = None,
) -> tuple[str, Any]:
    sampling = sampling or SamplingParams(temperature=0.0)
    request = GenerationRequest(prompt, TOKENS, sampling, ignore_eos=True, speculate=speculate)
    return await text_and_usage(engine, request)


async def test_the_engine_speculates_by_default_and_counts_it(
    dense_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = _SOURCE[:400]
    messages = [{"role": "user", "content": f"{text}\nAgain:\n{text}"}]
    with trio.fail_after(HANG):
        async with open_engine(
            EngineConfig.from_flags(model=dense_model, speculation="off")
        ) as engine:
            prompt = (await engine.render_chat(messages)).tokens
            plain, usage = await _greedy_text(engine, prompt)
            assert _counter(engine, "draft_tokens") == 0
            assert usage.draft_tokens == 0
        async with open_engine(EngineConfig(model=dense_model)) as engine:
            # Opted out: the same text, nothing proposed.
            text, usage = await _greedy_text(engine, prompt, speculate=False)
            assert text == plain
            assert _counter(engine, "draft_tokens") == usage.draft_tokens == 0
            # Cached prompt now; with speculation, the same text again.
            text, usage = await _greedy_text(engine, prompt)
            assert text == plain
            drafted = _counter(engine, "draft_tokens")
            accepted = _counter(engine, "accepted_tokens")
            assert drafted > 0
            assert 0 < accepted <= drafted
            assert 0 < _counter(engine, "drafts") <= drafted
            # The request's own usage counts what was proposed for it.
            assert (usage.draft_tokens, usage.accepted_draft_tokens) == (drafted, accepted)
            # An unseeded sampled request speculates (near temperature 0 it
            # is the greedy text); a seeded one does not. Which requests may
            # is what is tested here, not the gate's timing: the first
            # request's verify, measured slow on a loaded machine, kept a
            # fresh-clone CI run's 48 sampled tokens from proposing any.
            monkeypatch.setattr(speculation.gate.Gate, "pays", AlwaysPays.pays)
            cold = SamplingParams(temperature=1e-4)
            text, usage = await _greedy_text(engine, prompt, sampling=cold)
            assert text == plain
            assert usage.accepted_draft_tokens > 0
            seeded = SamplingParams(temperature=1e-4, seed=5)
            text, usage = await _greedy_text(engine, prompt, sampling=seeded)
            assert usage.draft_tokens == 0


def test_a_failing_lookup_costs_its_sequence_only_speculation(
    model: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    m, tok = model
    prompts = prompts_of(tok)
    plain, _, _, _ = run(m, prompts, spec=False)
    real = NgramLookup.propose
    broken = prompts[1][:4]

    def failing(self: NgramLookup, k: int) -> list[int]:
        if self.tokens[:4] == broken:
            raise RuntimeError("a proposer bug")
        return real(self, k)

    monkeypatch.setattr(NgramLookup, "propose", failing)
    spec, _, stats, _ = run(m, prompts, spec=True)
    # Every sequence wrote plain's text; the others still speculated.
    assert spec == plain
    assert stats.num_accepted_tokens > 0
    assert [r for r in caplog.records if "the lookup of uid" in r.getMessage()]


def test_the_gate_pays_for_the_batch_and_never_slows_a_sequence_that_gains_nothing() -> None:
    gate = speculation.gate.Gate()
    assert not gate.pays(4, 4, 8.0, 4)  # no plain step measured yet
    gate.note_plain(4, 0.100)
    assert gate.pays(4, 4, 8.0, 4)  # a shape never verified is tried once
    gate.note_verify(4, 4, 0.150)
    # Every sequence proposes: throughput decides, (4 + 8) / 0.15 > 4 / 0.1.
    assert gate.pays(4, 4, 8.0, 4)
    assert not gate.pays(4, 4, 1.0, 4)  # (4 + 1) / 0.15 < 4 / 0.1
    # One sequence proposes nothing: a step 1.5 times as long slows it by
    # as much, taken only for a large gain of the batch's (1.5 times its
    # tokens per second), never for more than 1.5 times a plain step.
    assert gate.pays(4, 4, 30.0, 3)  # (4 + 30) / 0.15 = 5.7 times 4 / 0.1
    assert not gate.pays(4, 4, 3.0, 3)  # (4 + 3) / 0.15 is 1.17 times: not enough
    gate.note_verify(4, 3, 0.160)
    assert not gate.pays(4, 3, 30.0, 3)  # 1.6 plain steps: however much it gains
    gate.note_verify(4, 2, 0.105)  # within 1.1 plain steps: throughput decides
    assert gate.pays(4, 2, 2.0, 1)
    # A refused shape is verified again after _RETRY_AFTER refusals in a
    # row (a measurement may have been taken beside other work).
    again = speculation.gate.Gate()
    again.note_plain(4, 0.100)
    again.note_verify(4, 4, 0.150)
    verdicts = [again.pays(4, 4, 1.0, 4) for _ in range(speculation.gate.RETRY_AFTER)]
    assert verdicts == [False] * (speculation.gate.RETRY_AFTER - 1) + [True]
    assert not again.pays(4, 4, 1.0, 4)
    # A drafting step is priced apart from the lookup's: its own shape is
    # tried once, then measured.
    gate.note_plain(1, 0.050)
    assert gate.pays(1, 4, 2.0, 1, drafted=True)
    gate.note_verify(1, 4, 0.200, drafted=True)  # the draft's passes: (1 + 2) / 0.2 < 1 / 0.05
    assert not gate.pays(1, 4, 2.0, 1, drafted=True)
    assert gate.pays(4, 4, 8.0, 4)  # the lookup's verify times are its own
    # A larger batch's drafting step is not tried where the smaller one's,
    # scaled by the sequences drafted for, says it cannot pay.
    gate.note_plain(2, 0.060)
    assert not gate.pays(2, 4, 4.0, 2, drafted=True)  # about 0.4 s: (2 + 4) / 0.4 < 2 / 0.06


async def test_every_protocols_usage_says_what_speculation_proposed(
    dense_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every proposal verified: the measured gate may refuse them on this model.
    monkeypatch.setattr(speculation.batch, "Gate", AlwaysPays)
    text = _SOURCE[:400]
    content = f"{text}\nAgain:\n{text}"
    calls = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": content}]}),
        ("/v1/completions", {}),  # the chat's rendered prompt, as token ids
        ("/v1/responses", {"input": content}),
        ("/v1/messages", {"messages": [{"role": "user", "content": content}]}),
    ]
    with trio.fail_after(HANG):
        async with open_engine(EngineConfig(model=dense_model)) as engine:
            rendered = await engine.render_chat([{"role": "user", "content": content}])
            calls[1][1]["prompt"] = list(rendered.tokens)
            async with create_app(engine, HttpSettings()).test_app() as app:
                client = app.test_client()
                for path, body in calls:
                    limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
                    request = {"model": "m", limit: TOKENS, "temperature": 0, **body}
                    r = await client.post(path, json=request)
                    assert r.status_code == 200, await r.get_data(as_text=True)
                    usage = (await r.get_json())["usage"]
                    details = {
                        "/v1/responses": "output_tokens_details",
                        "/v1/messages": "speculation",
                    }.get(path, "completion_tokens_details")
                    counts = usage[details]
                    assert set(counts) >= {
                        "accepted_prediction_tokens",
                        "rejected_prediction_tokens",
                    }, usage
                    assert counts["accepted_prediction_tokens"] > 0, (path, usage)


def test_recent_sequences_propose_what_another_sequence_held() -> None:
    recent = RecentSequences(budget=40, max_n=3, min_n=3)
    recent.add([1, 2, 3, 4, 5, 6])
    assert recent.propose([9, 1, 2, 3], 2) == [4, 5]
    # Never past a remembered sequence's end, nor from a 2-token suffix.
    assert recent.propose([4, 5, 6], 3) == []
    assert recent.propose([9, 2, 3], 2) == []  # (9, 2, 3) never occurred
    assert recent.propose([2, 3], 2) == []
    # The latest occurrence wins; a full index drops its older half.
    recent.add([1, 2, 3, 7, 7, 7])
    assert recent.propose([1, 2, 3], 1) == [7]
    for start in range(100, 160, 10):
        recent.add(list(range(start, start + 9)))
    assert len(recent) <= 40
    assert recent.propose([1, 2, 3], 1) == []  # forgotten
    assert recent.propose([150, 151, 152], 2) == [153, 154]
    # Salts share nothing.
    by_salt = RecentBySalt(partitions=2)
    by_salt.of("a").add([1, 2, 3, 4, 5])
    assert by_salt.of("a").propose([1, 2, 3], 1) == [4]
    assert by_salt.of("b").propose([1, 2, 3], 1) == []
    assert by_salt.of("").propose([1, 2, 3], 1) == []


def test_a_sequence_proposes_from_what_a_finished_one_wrote(model: tuple[Any, Any]) -> None:
    """A retried request (the same prompt again) proposes its answer from
    the first one's output from the first step; alone, its own tokens
    propose later and less. Either way the text is plain decoding's."""
    m, tok = model
    prompt = tok.encode("a fox")
    (plain,), _, _, _ = run(m, [prompt], spec=False)
    accepted = {}
    for shared in (False, True):
        recent = RecentBySalt() if shared else None
        gen = BatchGenerator(m, completion_batch_size=4, prefill_batch_size=4, stop_tokens=None)
        stats = speculation.SpecStats()
        speculation.install(gen, 3, speculation.Roster(), stats, recent)
        type(gen._generation_batch).gate = AlwaysPays()
        try:
            for turn in range(2):
                before = stats.num_accepted_tokens
                gen.insert([prompt], max_tokens=[TOKENS], samplers=[greedy])
                out: list[int] = []
                done = False
                while not done:
                    _, responses = gen.next()
                    for r in responses:
                        out.append(r.token)
                        done = done or r.finish_reason is not None
                assert out == plain
                accepted[shared, turn] = stats.num_accepted_tokens - before
        finally:
            gen.close()
    assert accepted[True, 0] == accepted[False, 0]  # nothing remembered yet
    assert accepted[True, 1] > accepted[False, 1]


async def test_a_salt_proposes_only_from_its_own_salts_sequences(
    dense_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tenants (cache salts) share no remembered sequences: a retry under
    another salt proposes nothing from the first answer, under the same
    salt it does."""
    monkeypatch.setattr(speculation.batch, "Gate", AlwaysPays)
    with trio.fail_after(HANG):
        async with open_engine(EngineConfig(model=dense_model)) as engine:
            prompt = (await engine.render_chat([{"role": "user", "content": "a fox"}])).tokens
            accepted = []
            for salt in ("a", "b", "a"):
                request = GenerationRequest(
                    prompt,
                    TOKENS,
                    SamplingParams(temperature=0.0),
                    ignore_eos=True,
                    cache=CacheRequest(salt=salt),
                )
                _, usage = await text_and_usage(engine, request)
                accepted.append(usage.accepted_draft_tokens)
    assert accepted[1] == accepted[0]  # the first answer is not salt b's
    assert accepted[2] > accepted[0]
