"""How each request's next token is chosen on this model: its sampler and
logits processors (logit bias, penalties, ``min_tokens``, the thinking
budget, the grammar), the per-sequence failure boundary around them, its
logprobs, and the compiler of its grammar (``core.backend.ConstraintCompiler``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Sequence
from typing import Any, Final

import mlx.core as mx
from mlx_lm.sample_utils import (
    make_frequency_penalty,
    make_presence_penalty,
    make_repetition_penalty,
)

from ..core.constraint import Constraint
from ..core.errors import InvalidRequest
from ..core.request import GenerationRequest, SamplingParams
from ..shaping.grammar import GRAMMAR_FORMATS, ToolFormatName, build_constraint
from ..shaping.reasoning import prompt_opens_thinking_tokens
from .constraints import GrammarTokenizer, make_grammar_processor
from .mlx_lm_surface import hf_tokenizer
from .sampling import Sampling, greedy, make_sampler

__all__ = ["Compiler", "Decoding"]

log = logging.getLogger("gezel_trio.mlx")

Sampler = Any  # Callable[[mx.array], mx.array]
LogitsProcessor = Any  # Callable[[mx.array, mx.array], mx.array]

# What a non-finite logprob (a masked token's -inf; NaN if logits broke) is
# reported as: JSON has no -Infinity. vLLM's OpenAI server floors every
# logprob at this value.
_LOGPROB_FLOOR: Final = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _LOGPROB_FLOOR


class _Faults:
    """The per-sequence failure boundary inside ``BatchGenerator.next()``.

    mlx-lm calls each sequence's sampler and logits processors while it
    builds the whole batch's step. Each one is wrapped: if it raises, the
    sequence is marked failed and gets a harmless value (the logits
    unchanged, the greedy token), so the step completes for everyone; the
    host then fails and removes the marked sequence before the next step.
    MLX evaluates lazily, so this catches what raises while a sequence's
    operations are built; an error that only surfaces when the batch is
    evaluated is the shared step's - which is why token ids are checked
    against the vocabulary before admission.
    """

    def __init__(self) -> None:
        self.failed: dict[int, Exception] = {}

    def take(self) -> tuple[tuple[int, Exception], ...]:
        out = tuple(self.failed.items())
        self.failed.clear()
        return out

    def sampler(self, rid: int, fn: Sampler) -> Sampler:
        def guarded_sampler(logprobs: mx.array) -> mx.array:
            if rid not in self.failed:
                try:
                    sampled: mx.array = fn(logprobs)
                    return sampled
                except Exception as exc:
                    self.failed[rid] = exc
            fallback: mx.array = mx.argmax(logprobs, axis=-1)
            return fallback

        return guarded_sampler

    def processor(self, rid: int, fn: LogitsProcessor) -> LogitsProcessor:
        def guarded_processor(tokens: mx.array, logits: mx.array) -> mx.array:
            if rid not in self.failed:
                try:
                    out: mx.array = fn(tokens, logits)
                    return out
                except Exception as exc:
                    self.failed[rid] = exc
            return logits

        return guarded_processor


def _last_token(tokens: mx.array) -> int | None:
    last: Any = tokens[-1].item() if tokens.size else None
    return None if last is None else int(last)


def _thinking_budget(budget: int, think_ids: tuple[int, int], inside: bool) -> LogitsProcessor:
    """Force ``</think>`` once ``budget`` thinking tokens were generated.

    Called before each sampling; from the second call on, the context's last
    token is the one sampled by the previous call, which is how it tracks
    whether generation is inside the block and how much it has spent.
    """
    start, end = think_ids
    state = {"inside": inside, "spent": 0, "calls": 0}

    def budget_processor(tokens: mx.array, logits: mx.array) -> mx.array:
        state["calls"] += 1
        if state["calls"] > 1:
            last = _last_token(tokens)
            if last == start:
                state["inside"] = True
            elif last == end:
                state["inside"] = False
            elif state["inside"]:
                state["spent"] += 1
        if state["inside"] and state["spent"] >= budget:
            forced = mx.full(logits.shape, -mx.inf, dtype=logits.dtype)
            forced[:, end] = 0.0
            return forced
        return logits

    return budget_processor


def _make_processors(
    p: SamplingParams, min_tokens: int, eos_ids: Sequence[int], vocab: int
) -> list[LogitsProcessor]:
    procs: list[LogitsProcessor] = []
    if p.logit_bias:
        # An index past the logits is not an error in MLX but a wild write
        # (SIGSEGV): never build one.
        bad = [i for i, _ in p.logit_bias if not 0 <= i < (vocab or i + 1)]
        if bad:
            raise InvalidRequest(
                f"logit_bias token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                param="logit_bias",
            )
        idx = mx.array([i for i, _ in p.logit_bias])
        vals = mx.array([b for _, b in p.logit_bias])

        def bias(_tokens: mx.array, logits: mx.array) -> mx.array:
            logits[:, idx] = logits[:, idx] + vals
            return logits

        procs.append(bias)
    if p.repetition_penalty is not None and p.repetition_penalty != 1.0:
        procs.append(make_repetition_penalty(p.repetition_penalty, p.repetition_context_size))
    if p.presence_penalty:
        procs.append(make_presence_penalty(p.presence_penalty, p.repetition_context_size))
    if p.frequency_penalty:
        procs.append(make_frequency_penalty(p.frequency_penalty, p.repetition_context_size))
    if min_tokens > 0 and eos_ids:
        eos = mx.array(list(eos_ids))
        seen = [0]

        def hold_eos(_tokens: mx.array, logits: mx.array) -> mx.array:
            if seen[0] < min_tokens:
                logits[:, eos] = -mx.inf
            seen[0] += 1
            return logits

        procs.append(hold_eos)
    return procs


class Compiler:
    """``backend.ConstraintCompiler`` over llguidance with this model's vocabulary."""

    def __init__(
        self,
        grammar_tok: GrammarTokenizer,
        *,
        tool_format: str | None,
        think_markers: tuple[str, str] | None = None,
    ) -> None:
        self._llg = grammar_tok.llg
        # The thinking tokens free text may hold under tool_grammar (a model
        # that opens its own think block, as GLM and Gemma 4 do).
        self._text_tokens = grammar_tok.added_tokens_in(think_markers or ())
        self._format: ToolFormatName | None = next(
            (f for f in GRAMMAR_FORMATS if f == tool_format), None
        )

    def compile(
        self,
        *,
        response_format: Any,
        tools: Any,
        tool_choice: Any,
        tool_grammar: Any,
        custom_tools: Any = None,
    ) -> Constraint | None:
        forced = tool_choice not in (None, "auto", "none")
        if self._format is None and (forced or tool_grammar):
            raise InvalidRequest(
                "tool-call constraints need a model whose chat template has Hermes, "
                "Qwen3-Coder, Gemma 4 or GLM tool calls, or no tool syntax at all "
                "(the generic format)",
                param="tool_choice" if forced else "tool_grammar",
            )
        return build_constraint(
            response_format=response_format,
            tools=tools,
            tool_choice=tool_choice,
            tool_grammar=tool_grammar,
            tool_format=self._format or "hermes",
            llg_tokenizer=self._llg,
            custom_tools=custom_tools,
            text_tokens=self._text_tokens,
        )


class Decoding:
    """The samplers, processors and logprobs of this model's requests, and
    the failure boundary (``_Faults``) each sequence's own code runs in."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        eos_ids: Collection[int],
        vocab_size: int,
        vocab_width: int,
        think_ids: tuple[int, int] | None,
    ) -> None:
        self._eos_ids = frozenset(eos_ids)
        self._vocab_size = vocab_size
        self._vocab_width = vocab_width
        self._think_ids = think_ids
        self.faults = _Faults()
        # Requests that asked for logprobs: how many alternatives each wants.
        self.logprobs: dict[int, int] = {}
        self.grammar_tok: GrammarTokenizer | None = None
        try:
            self.grammar_tok = GrammarTokenizer(hf_tokenizer(tokenizer), eos_ids=self._eos_ids)
        except (TypeError, ValueError) as exc:
            log.warning("constrained decoding unavailable for this tokenizer: %s", exc)

    def compiler(
        self, tool_format: str | None, think_markers: tuple[str, str] | None
    ) -> Compiler | None:
        """The grammar compiler over this vocabulary; ``None`` where the
        tokenizer cannot constrain decoding."""
        if self.grammar_tok is None:
            return None
        return Compiler(self.grammar_tok, tool_format=tool_format, think_markers=think_markers)

    def sampler(self, rid: int, r: GenerationRequest) -> tuple[Any, Sampler, list[LogitsProcessor]]:
        """The request's sampling (``greedy`` or a ``Sampling``), and its
        sampler and processors inside the sequence's failure boundary."""
        sampling = make_sampler(r.sampling, self._vocab_size)
        sampler = sampling
        if sampling is not greedy:  # the shared greedy sampler cannot fail per sequence
            sampler = self.faults.sampler(rid, sampling)
        procs = [self.faults.processor(rid, p) for p in self.processors(r)]
        return sampling, sampler, procs

    def started(self, rid: int, r: GenerationRequest) -> None:
        """The sequence is in its generator: its logprobs are reported."""
        if r.top_logprobs is not None:
            self.logprobs[rid] = r.top_logprobs

    @staticmethod
    def unseeded(sampling: Any) -> Sampling | None:
        """``sampling`` where it is a ``Sampling`` without a seed (speculation
        rejection-samples it), else ``None``."""
        return sampling if isinstance(sampling, Sampling) and not sampling.seeded else None

    def forget(self, rid: int) -> None:
        self.logprobs.pop(rid, None)
        self.faults.failed.pop(rid, None)

    def processors(self, r: GenerationRequest) -> list[LogitsProcessor]:
        eos = sorted(self._eos_ids)
        # A grammar decides when the output may end; holding EOS back would
        # leave it nothing to allow once the grammar is complete.
        min_tokens = 0 if r.constraint is not None else r.min_tokens
        procs = _make_processors(r.sampling, min_tokens, eos, self._vocab_size)
        think = self._think_ids
        inside = think is not None and prompt_opens_thinking_tokens(r.prompt, think)
        if r.max_thinking_tokens is not None and think is not None:
            procs.append(_thinking_budget(r.max_thinking_tokens, think, inside))
        if r.constraint is not None:
            if self.grammar_tok is None:
                raise InvalidRequest(
                    "this model cannot constrain decoding", param="response_format"
                )
            procs.append(
                make_grammar_processor(
                    r.constraint,
                    self.grammar_tok,
                    vocab_width=self._vocab_width or self.grammar_tok.vocab_size,
                    eos_ids=eos,
                    start_after_token=think[1] if inside and think is not None else None,
                    budget=r.max_tokens,
                )
            )
        return procs

    def token_logprobs(
        self, rid: int, token: int, logprobs: Any
    ) -> tuple[float | None, tuple[tuple[int, float], ...]]:
        k = self.logprobs.get(rid)
        if k is None or logprobs is None:
            return None, ()
        chosen = _finite(float(logprobs[token].item()))
        if k == 0:
            return chosen, ()
        idx = mx.argpartition(-logprobs, kth=k - 1)[:k]
        ids: Any = idx.tolist()
        vals: Any = logprobs[idx].tolist()
        # A token a grammar, min_tokens or a thinking budget masked is -inf:
        # floored as vLLM floors it, so every step lists k alternatives.
        pairs = sorted(
            ((int(i), _finite(float(v))) for i, v in zip(ids, vals, strict=True)),
            key=lambda t: -t[1],
        )
        return chosen, tuple(pairs)
