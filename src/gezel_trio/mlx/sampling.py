"""A request's sampler: what turns a sequence's logprobs into its next token.

``make_sampler`` gives the one shared ``greedy`` function for greedy
requests (mlx-lm's ``BatchGenerator`` batches the sampling of sequences
whose sampler is the same object) and a ``Sampling`` otherwise. A
``Sampling`` says what distribution it draws from (``logits``: the
filtered, temperature-scaled logits), so a verify step can rejection-sample
against exactly the distribution plain decoding samples
(``mlx.speculation``).
"""

from __future__ import annotations

from typing import Any, Final

import attrs
import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..core.request import SamplingParams

__all__ = ["Sampling", "greedy", "make_sampler"]

_SEED_MASK: Final = (1 << 64) - 1

# A temperature or a top_p below this samples greedily (vLLM's
# _SAMPLING_EPS). Temperature: 1/1e-40 is infinite in float32, and every
# logprob times it is -inf or NaN, so the draw was noise. top_p: the most
# likely token alone holds at least 1/vocab of the mass (1e-5 for 100k
# tokens), so a smaller nucleus is that token; and mlx-lm's apply_top_p,
# given a top_p that rounds to 0 in float32 (1e-300), indexes past the
# vocabulary and draws noise.
_GREEDY_BELOW: Final = 1e-5
# Below this temperature the scaled logprobs are float32: in float16 (max
# 65504) the best token's logprob, down to -ln(262144) = -12.5, times
# 1/1e-5 overflows to -inf with every other token's, and the draw is noise.
_FLOAT32_BELOW: Final = 1e-3


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


@attrs.define
class Sampling:
    """Temperature, top-k, top-p and min-p sampling, with a private key
    stream where the request gave a seed."""

    temperature: float
    top_k: int  # 0: no filter
    top_p: float
    min_p: float
    key: Any = None  # the seed's key stream, split once per draw

    @property
    def seeded(self) -> bool:
        return self.key is not None

    def logits(self, logprobs: mx.array) -> mx.array:
        """The logits this sampler draws from (any leading shape): its
        filters' survivors, scaled by the temperature; a filtered token's
        is ``-inf``."""
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        if self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p > 0:
            logprobs = apply_min_p(logprobs, self.min_p)
        if self.temperature < _FLOAT32_BELOW:
            logprobs = logprobs.astype(mx.float32)
        scaled: mx.array = logprobs * (1.0 / self.temperature)
        return scaled

    def __call__(self, logprobs: mx.array) -> mx.array:
        logits = self.logits(logprobs)
        if self.key is None:
            return mx.random.categorical(logits)
        # A private key stream per sequence: the same seed gives the same
        # tokens whatever else is in the batch.
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logits, key=sub)


def make_sampler(p: SamplingParams, vocab: int) -> Any:
    """``greedy`` or a ``Sampling`` for ``p`` over a ``vocab``-token model
    (0: unknown)."""
    if p.temperature < _GREEDY_BELOW or p.top_p < _GREEDY_BELOW:
        return greedy
    # top_k at or above the vocabulary keeps every token: no filter at all.
    top_k = p.top_k if 0 < p.top_k < vocab or not vocab else 0
    # Any integer seeds: its low 64 bits are the key (OpenAI's negative
    # int64 seeds included).
    key = mx.random.key(p.seed & _SEED_MASK) if p.seed is not None else None
    return Sampling(p.temperature, top_k, p.top_p, p.min_p, key)
