"""Grammar processors driving real mlx-lm generation on the tiny demo models.

The demo models have random weights: left alone they write nonsense words and
practically never emit EOS. So every output checked here is valid only
because the grammar made it so, and every ``finish_reason == "stop"`` before
``max_tokens`` is the grammar forcing EOS once its sentence is complete.

Two test-side processors shape the random model without touching validity:

* ``Nudge`` raises the logits of tokens that close JSON (quotes, braces,
  brackets). A grammar with unbounded strings (``json_object``) is otherwise
  a random walk that may not close within ``max_tokens``; the nudge only
  shortens it, the grammar still decides what is allowed.
* ``ForceAt`` makes the model emit a given token at a given step (say
  ``<tool_call>`` or ``</think>``), standing in for a model that decides to
  call a tool or stop thinking. It runs before the grammar processor, so
  the grammar still has the last word.

Runs are deterministic: greedy needs no seed, sampling is seeded per run.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # no stubs installed
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load

from gezel_trio.core.errors import InvalidRequest
from gezel_trio.mlx.constraints import GrammarProcessor, GrammarTokenizer, make_grammar_processor
from gezel_trio.shaping.grammar import Constraint, build_constraint

pytestmark = pytest.mark.slow

EOS = (1, 3)  # <|endoftext|>, <|im_end|>
THINK_END = 5  # </think>
TOOL_CALL = 6  # <tool_call>
MAX_TOKENS = 200

Processor = Callable[[mx.array, mx.array], mx.array]

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
SEARCH_PARAMS = {
    "type": "object",
    "properties": {"q": {"type": "string", "maxLength": 10}},
    "required": ["q"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "search", "parameters": SEARCH_PARAMS}},
]
# Bounded strings, numbers and arrays: the grammar itself is finite, so it
# must end (and force EOS) within MAX_TOKENS whatever the model does.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 8},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
CALL_RE = re.compile(r"<tool_call>\n(\{.*\})\n</tool_call>", re.DOTALL)


class Loaded:
    """A demo model with its tokenizer and grammar tokenizer."""

    def __init__(self, path: Path) -> None:
        self.model, self.tokenizer = load(str(path))
        self.grammar_tokenizer = GrammarTokenizer(self.tokenizer._tokenizer, eos_ids=EOS)
        self.vocab = int(self.model(mx.array([[2]])).shape[-1])
        self.prompt = self.tokenizer.encode("Tell me about the weather in the hills today.")

    def processor(self, c: Constraint, **kw: Any) -> GrammarProcessor:
        return make_grammar_processor(c, self.grammar_tokenizer, vocab_width=self.vocab, **kw)

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(tokens)))


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def lm(request: pytest.FixtureRequest, dense_model: Path, hybrid_model: Path) -> Loaded:
    return Loaded(dense_model if request.param == "dense" else hybrid_model)


@pytest.fixture(scope="module")
def dense(dense_model: Path) -> Loaded:
    return Loaded(dense_model)


def generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    processors: Sequence[Sequence[Processor]],
    *,
    temp: float,
    seed: int = 0,
    max_tokens: int = MAX_TOKENS,
) -> list[tuple[list[int], str]]:
    """Run ``BatchGenerator`` to the end; (tokens, finish_reason) per prompt."""
    mx.random.seed(seed)
    gen = BatchGenerator(model, stop_tokens=[[e] for e in EOS], sampler=make_sampler(temp=temp))
    try:
        uids = gen.insert(
            [list(p) for p in prompts],
            max_tokens=[max_tokens] * len(prompts),
            logits_processors=[list(p) for p in processors],
        )
        tokens: dict[int, list[int]] = {u: [] for u in uids}
        finish: dict[int, str] = {}
        while len(finish) < len(uids):
            _, responses = gen.next()
            for r in responses:
                tokens[r.uid].append(r.token)
                if r.finish_reason is not None:
                    finish[r.uid] = r.finish_reason
    finally:
        gen.close()
    return [(tokens[u], finish[u]) for u in uids]


class Nudge:
    """Adds ``bias`` to the tokens whose text closes JSON (see module docstring)."""

    def __init__(self, lm: Loaded, bias: float = 4.0) -> None:
        vocab = lm.tokenizer._tokenizer.get_vocab()
        ids = [
            i
            for t, i in vocab.items()
            if any(ch in t for ch in '"}]') and not any(ch in t for ch in "{[")
        ]
        self._ids = mx.array(ids)
        self._bias = bias

    def __call__(self, _tokens: mx.array, logits: mx.array) -> mx.array:
        logits[:, self._ids] = logits[:, self._ids] + self._bias
        return logits


class ForceAt:
    """Makes ``token`` overwhelmingly likely at decode step ``step`` (0-based)."""

    def __init__(self, step: int, token: int) -> None:
        self._step = step
        self._token = token
        self._calls = 0

    def __call__(self, _tokens: mx.array, logits: mx.array) -> mx.array:
        if self._calls == self._step:
            logits[:, self._token] = logits[:, self._token] + 1e4
        self._calls += 1
        return logits


def constraint(**kw: Any) -> Constraint:
    args: dict[str, Any] = {
        "response_format": None,
        "tools": None,
        "tool_choice": None,
        "tool_grammar": None,
    }
    args.update(kw)
    c = build_constraint(**args)
    assert c is not None
    return c


def body(lm: Loaded, tokens: list[int]) -> str:
    """The generated text without its final EOS."""
    if tokens and tokens[-1] in EOS:
        tokens = tokens[:-1]
    return lm.decode(tokens)


def allowed(logits: mx.array) -> set[int]:
    return {int(i) for i in np.flatnonzero(np.isfinite(np.array(logits[0])))}


# --- end to end: the grammar alone makes random weights valid ---------------


@pytest.mark.parametrize(("temp", "seed"), [(0.0, 0), (1.0, 0), (1.0, 1)])
def test_json_object(lm: Loaded, temp: float, seed: int) -> None:
    c = constraint(response_format={"type": "json_object"})
    proc = lm.processor(c)
    [(tokens, finish)] = generate(lm.model, [lm.prompt], [[Nudge(lm), proc]], temp=temp, seed=seed)
    assert finish == "stop"
    assert len(tokens) < MAX_TOKENS
    assert isinstance(json.loads(body(lm, tokens)), dict)
    assert proc.error is None


@pytest.mark.parametrize(("temp", "seed"), [(0.0, 0), (1.0, 0), (1.0, 1)])
def test_json_schema(lm: Loaded, temp: float, seed: int) -> None:
    c = constraint(response_format={"type": "json_schema", "json_schema": {"schema": PERSON}})
    [(tokens, finish)] = generate(lm.model, [lm.prompt], [[lm.processor(c)]], temp=temp, seed=seed)
    assert finish == "stop"
    jsonschema.validate(json.loads(body(lm, tokens)), PERSON)


@pytest.mark.parametrize(("temp", "seed"), [(0.0, 0), (1.0, 2)])
def test_forced_tool_call(lm: Loaded, temp: float, seed: int) -> None:
    c = constraint(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "search"}})
    [(tokens, finish)] = generate(lm.model, [lm.prompt], [[lm.processor(c)]], temp=temp, seed=seed)
    assert finish == "stop"
    assert tokens[0] == TOOL_CALL  # the special token, not "<tool_call>" spelled out
    match = CALL_RE.fullmatch(body(lm, tokens))
    assert match is not None
    payload = json.loads(match.group(1))
    assert list(payload) == ["name", "arguments"]
    assert payload["name"] == "search"
    jsonschema.validate(payload["arguments"], SEARCH_PARAMS)


def test_required_tool_call(lm: Loaded) -> None:
    c = constraint(tools=TOOLS, tool_choice="required")
    for seed in range(2):
        [(tokens, finish)] = generate(lm.model, [lm.prompt], [[lm.processor(c)]], temp=1, seed=seed)
        assert finish == "stop"
        match = CALL_RE.fullmatch(body(lm, tokens))
        assert match is not None
        payload = json.loads(match.group(1))
        params = {"get_weather": WEATHER_PARAMS, "search": SEARCH_PARAMS}[payload["name"]]
        jsonschema.validate(payload["arguments"], params)


def test_name_only_constrains_the_call_the_model_opens(lm: Loaded) -> None:
    c = constraint(tools=TOOLS, tool_grammar={"mode": "name-only"})
    proc = lm.processor(c)
    procs: list[Processor] = [ForceAt(3, TOOL_CALL), Nudge(lm, 6.0), proc]
    [(tokens, _finish)] = generate(lm.model, [lm.prompt], [procs], temp=0.0, max_tokens=120)
    assert tokens[3] == TOOL_CALL
    assert TOOL_CALL not in tokens[:3]  # free text before the call
    text = body(lm, tokens)
    match = re.search(r"<tool_call>\n(\{.*?\})\n</tool_call>", text, re.DOTALL)
    assert match is not None, text
    payload = json.loads(match.group(1))
    assert payload["name"] in ("get_weather", "search")
    assert isinstance(payload["arguments"], dict)
    assert proc.error is None


def test_name_only_leaves_text_free(lm: Loaded) -> None:
    c = constraint(tools=TOOLS, tool_grammar={"mode": "name-only"})
    free = generate(lm.model, [lm.prompt], [[]], temp=0.0, max_tokens=40)
    constrained = generate(lm.model, [lm.prompt], [[lm.processor(c)]], temp=0.0, max_tokens=40)
    # Greedy nonsense never hits a forbidden token, so the mask changes nothing.
    assert constrained == free


def test_constrained_and_free_sequences_share_a_batch(lm: Loaded) -> None:
    c = constraint(response_format={"type": "json_schema", "json_schema": {"schema": PERSON}})
    proc = lm.processor(c)
    other = lm.tokenizer.encode("Once upon a time")
    (json_tokens, json_finish), (free_tokens, free_finish) = generate(
        lm.model, [lm.prompt, other], [[proc], []], temp=1.0, seed=3
    )
    assert json_finish == "stop"
    jsonschema.validate(json.loads(body(lm, json_tokens)), PERSON)
    # Called once per step for this sequence only, plus the step BatchGenerator
    # runs ahead before it sees the EOS (its token is discarded).
    assert len(proc.mask_seconds) == len(json_tokens) + 1
    assert free_finish == "length"  # random weights: no EOS without a grammar
    assert len(free_tokens) == MAX_TOKENS
    assert not body(lm, free_tokens).startswith("{")


def test_thinking_is_free_until_the_end_tag(lm: Loaded) -> None:
    c = constraint(response_format={"type": "json_schema", "json_schema": {"schema": PERSON}})
    proc = lm.processor(c, start_after_token=THINK_END)
    procs: list[Processor] = [ForceAt(4, THINK_END), proc]
    [(tokens, finish)] = generate(lm.model, [lm.prompt], [procs], temp=0.0)
    assert finish == "stop"
    assert tokens[4] == THINK_END
    assert not lm.decode(tokens[:4]).lstrip().startswith("{")  # unconstrained thoughts
    jsonschema.validate(json.loads(body(lm, tokens[5:])), PERSON)
    assert len(proc.mask_seconds) == len(tokens) - 5 + 1  # +1: the step run ahead


class EosFirst:
    """The model with its end-of-turn tokens winning every step."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __call__(self, inputs: mx.array, cache: Any = None, **kw: Any) -> mx.array:
        logits = self._model(inputs, cache=cache, **kw)
        boost = np.zeros(logits.shape[-1], dtype=np.float32)
        boost[list(EOS)] = 50.0
        return logits + mx.array(boost)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def test_the_turn_cannot_end_inside_the_think_block_before_a_forced_output(dense: Loaded) -> None:
    """A forced output follows the think block: a model that would end its
    turn at once thinks until the block is closed (here by force, as the
    thinking budget closes it), then gives the output."""
    c = constraint(response_format={"type": "json_schema", "json_schema": {"schema": PERSON}})
    grammar = dense.processor(c, start_after_token=THINK_END)
    procs: list[Processor] = [ForceAt(5, THINK_END), grammar]
    [(tokens, finish)] = generate(EosFirst(dense.model), [dense.prompt], [procs], temp=1.0, seed=3)
    assert not set(tokens[:5]) & set(EOS)
    assert tokens[5] == THINK_END
    assert finish == "stop"
    jsonschema.validate(json.loads(body(dense, tokens[6:])), PERSON)


class PaddedLogits:
    """The model with ``extra`` logits columns that would win if left unmasked."""

    def __init__(self, model: Any, extra: int) -> None:
        self._model = model
        self._extra = extra

    def __call__(self, inputs: mx.array, cache: Any = None, **kw: Any) -> mx.array:
        logits = self._model(inputs, cache=cache, **kw)
        pad = mx.full((*logits.shape[:-1], self._extra), 50.0, dtype=logits.dtype)
        return mx.concatenate([logits, pad], axis=-1)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def test_padded_vocabulary_columns_are_never_sampled(lm: Loaded) -> None:
    padded = PaddedLogits(lm.model, 61)
    c = constraint(tools=TOOLS, tool_choice="required")
    proc = make_grammar_processor(c, lm.grammar_tokenizer, vocab_width=lm.vocab + 61)
    [(tokens, finish)] = generate(padded, [lm.prompt], [[proc]], temp=1.0, seed=4)
    assert finish == "stop"
    assert max(tokens) < lm.vocab
    assert CALL_RE.fullmatch(body(lm, tokens)) is not None


def test_mid_stream_matcher_failure_forces_eos(
    lm: Loaded, caplog: pytest.LogCaptureFixture
) -> None:
    # Compiles (llguidance builds lexer states lazily) but runs out of lexer
    # states a few tokens in: the sequence must end, not the engine.
    schema = {"type": "string", "pattern": "^(.{0,100}){0,100}$"}
    c = constraint(response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    proc = lm.processor(c)
    with caplog.at_level(logging.WARNING, logger="gezel_trio.mlx.constraints"):
        [(tokens, finish)] = generate(lm.model, [lm.prompt], [[proc]], temp=1.0, seed=0)
    assert finish == "stop"
    assert tokens[-1] in EOS
    assert proc.error is not None
    assert "forcing EOS" in caplog.text


def test_mask_time_per_step(lm: Loaded) -> None:
    c = constraint(tools=TOOLS, tool_choice="required")
    procs = [lm.processor(c) for _ in range(4)]
    generate(lm.model, [lm.prompt] * 4, [[p] for p in procs], temp=1.0, seed=5)
    times = np.array([t for p in procs for t in p.mask_seconds]) * 1e3
    median, p99 = float(np.median(times)), float(np.percentile(times, 99))
    print(f"\nmask ms/step over {times.size} steps: median {median:.3f}, p99 {p99:.3f}")
    assert median < 5.0  # generous: measured ~0.3 ms on the 2173-token demo vocabulary


# --- the processor called directly ----------------------------------------


def test_logits_untouched_but_for_the_end_of_turn_until_start_token(dense: Loaded) -> None:
    c = constraint(response_format={"type": "json_object"})
    proc = dense.processor(c, start_after_token=THINK_END)
    logits = mx.random.normal((1, dense.vocab))
    others = [i for i in range(dense.vocab) if i not in EOS]

    def untouched_but_eos(out: mx.array) -> bool:
        return bool(mx.all(mx.isinf(out[:, list(EOS)]))) and bool(
            mx.array_equal(out[:, others], logits[:, others])
        )

    context = list(dense.prompt)
    assert untouched_but_eos(proc(mx.array(context), logits))
    for token in (500, 501, 4):
        context.append(token)
        assert untouched_but_eos(proc(mx.array(context), logits))
        assert not proc.active
    context.append(THINK_END)
    masked = proc(mx.array(context), logits)
    assert proc.active
    ids = allowed(masked)
    assert ids
    assert all(dense.decode([i]).startswith("{") for i in ids)


def test_only_eos_once_the_grammar_is_complete(dense: Loaded) -> None:
    c = constraint(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "search"}})
    proc = dense.processor(c)
    text = '<tool_call>\n{"name": "search", "arguments": {"q": "rain"}}\n</tool_call>'
    ids = dense.grammar_tokenizer.llg.tokenize_str(text, parse_special=True)
    logits = mx.zeros((1, dense.vocab))
    context = list(dense.prompt)
    proc(mx.array(context), logits)
    for token in ids:
        context.append(token)
        out = proc(mx.array(context), logits)
    assert proc.finished
    assert proc.error is None
    assert allowed(out) == set(EOS)


def test_rejected_token_forces_eos_without_raising(
    dense: Loaded, caplog: pytest.LogCaptureFixture
) -> None:
    proc = dense.processor(constraint(response_format={"type": "json_object"}))
    logits = mx.zeros((1, dense.vocab))
    context = [*dense.prompt]
    proc(mx.array(context), logits)
    context.append(dense.tokenizer.encode(" hello")[-1])  # not "{": the mask forbade it
    with caplog.at_level(logging.WARNING, logger="gezel_trio.mlx.constraints"):
        out = proc(mx.array(context), logits)
    assert proc.error is not None
    assert proc.finished
    assert allowed(out) == set(EOS)
    assert "forcing EOS" in caplog.text


def test_out_of_vocabulary_id_forces_eos(dense: Loaded) -> None:
    # A padded column can only be sampled if something unmasked it; still no raise.
    proc = make_grammar_processor(
        constraint(response_format={"type": "json_object"}),
        dense.grammar_tokenizer,
        vocab_width=dense.vocab + 8,
    )
    logits = mx.zeros((1, dense.vocab + 8))
    proc(mx.array(dense.prompt), logits)
    out = proc(mx.array([*dense.prompt, dense.vocab + 3]), logits)
    assert proc.error is not None
    assert allowed(out) == set(EOS)


def test_padded_and_truncated_widths(dense: Loaded) -> None:
    c = constraint(response_format={"type": "json_object"})
    context = mx.array(dense.prompt)
    base = allowed(dense.processor(c)(context, mx.zeros((1, dense.vocab))))
    wide = make_grammar_processor(c, dense.grammar_tokenizer, vocab_width=dense.vocab + 64)
    out = wide(context, mx.full((1, dense.vocab + 64), 100.0))
    assert out.shape == (1, dense.vocab + 64)
    assert allowed(out) == base
    assert bool(mx.all(mx.isinf(out[:, dense.vocab :])))
    # Logits narrower than the tokenizer: ids past the width cannot be masked in.
    width = min(base) + 1
    narrow = make_grammar_processor(c, dense.grammar_tokenizer, vocab_width=width)
    assert allowed(narrow(context, mx.zeros((1, width)))) == {min(base)}


def test_resumed_sequence_replays_generated_tokens(dense: Loaded) -> None:
    c = constraint(response_format={"type": "json_schema", "json_schema": {"schema": PERSON}})
    live = dense.processor(c)
    [(tokens, _)] = generate(dense.model, [dense.prompt], [[live]], temp=1.0, seed=6)
    cut = len(tokens) // 2
    first = dense.processor(c)
    logits = mx.zeros((1, dense.vocab))
    context = list(dense.prompt)
    first(mx.array(context), logits)
    for token in tokens[:cut]:
        context.append(token)
        expected = first(mx.array(context), logits)
    resumed = dense.processor(c, generated=tokens[:cut])
    # The resumed prompt ends with the last generated token; it is not re-fed.
    assert allowed(resumed(mx.array(context), logits)) == allowed(expected)


def test_matcher_errors_surface_as_invalid_request(dense: Loaded) -> None:
    import llguidance

    missing = Constraint(
        "tool_call",
        llguidance.LLMatcher.grammar_from_lark('start: <tool_cal> "x"'),
        special_tokens=("<tool_cal>",),
    )
    with pytest.raises(InvalidRequest) as exc:
        dense.processor(missing)
    assert exc.value.param == "tool_choice"
    assert "<tool_cal>" in exc.value.message
    unknown_special = Constraint(
        "json_schema", llguidance.LLMatcher.grammar_from_lark('start: <nope> "x"')
    )
    with pytest.raises(InvalidRequest) as exc:
        dense.processor(unknown_special)
    assert exc.value.param == "response_format"


def test_grammar_tokenizer_vocabulary(dense: Loaded) -> None:
    gt = dense.grammar_tokenizer
    assert gt.vocab_size == dense.vocab == 2173
    assert gt.eos_ids == EOS
    assert gt.llg.is_special_token(TOOL_CALL)
    with pytest.raises(TypeError):
        GrammarTokenizer(object(), eos_ids=EOS)
