"""Speculation inside the batched decode step: each sequence's proposed
tokens are verified in the same forward pass as everyone's next token, and
each sequence keeps its own accepted prefix.

mlx-lm's ``GenerationBatch`` feeds one token per sequence per step.
``SpeculativeBatch`` (the lane's generation batch, ``install``) feeds
``k + 1`` when some sequence has a proposal (``mlx.lookup``): its pending
next token and up to ``k`` proposed tokens; a sequence with a shorter
proposal (or none) is padded, and its padding is rejected. The target's
greedy choice at every position decides how many proposed tokens each
sequence accepts (``m``); it emits its pending token and those ``m``, and
the target's choice after them is its next pending token, exactly what
plain decoding would have emitted at each position. A step with no
proposal anywhere is mlx-lm's own, pipelined step.

**The cache.** mlx-lm's ``BatchKVCache`` keeps every sequence's keys in one
array ending at the same slot, so sequences cannot drop different numbers
of rejected positions. The cache drops the rejections all share (``trim``)
and marks each sequence's other rejected slots as holes (``HoleyKVCache``):
attention masks them, and the sequence's RoPE offset goes back by as many,
so positions stay contiguous. Holes cost memory until the sequence ends or
is extracted (``extract`` gathers the valid slots, so the prompt cache
stores a plain, dense entry). Only models whose every layer is a plain
``KVCache`` speculate: a sliding window or a recurrent state cannot take
holes (``speculation_blocker`` names the layer).

**A draft model** (``--draft-model``, ``mlx.draft``) proposes where the
lookup cannot copy a whole proposal. Its passes need the pending token, so
a drafting step waits for the step in flight; it is priced apart by the
gate (its verify times are kept apart from the lookup's, and include the
draft's passes), and a step the gate refuses falls back to the lookup's
own, pipelined step.

**Who speculates.** A sequence sampled greedily, or sampled with no seed
(``Roster.sampled``), with no logits processor (no grammar, bias,
``min_tokens``, thinking budget), not opted out (``disable_speculation``),
with at least two tokens of budget left. A sampled sequence's proposals
are rejection-sampled against its own sampler's distribution at each
position (``rejection_sample``), so its tokens are distributed as plain
sampling's; a seeded one does not speculate, since how many draws its key
stream gives would depend on the gate, and its seed promises the same
tokens whatever else is in the batch. Its
proposals go through a gate: a sequence whose proposals were all rejected
waits a growing number of steps before it proposes again, and a step
speculates only while the measured cost of a verify step against a plain
one is paid by the tokens the batch is expected to accept.

**Greedy identity.** Verifying ``k + 1`` positions in one pass computes
each position's logits in a larger matmul than decoding does, so float
summation may differ in the last bits and a near tie may flip. The tests
check identity where it holds (the demo models at float32) and docs say
what was measured.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models.cache import BatchKVCache, KVCache

from ..core.backend import SpecFigures
from ..tuning.step_threads import StepThreads
from .draft import DraftModel, DraftPool, DraftState
from .kv_quant import BatchQuantizedKVCache, QuantizedKV
from .lookup import NgramLookup, RecentBySalt
from .sampling import Sampling, greedy

log = logging.getLogger("gezel_trio.mlx")

__all__ = [
    "HoleyKVCache",
    "Roster",
    "SpecStats",
    "SpeculativeBatch",
    "install",
    "rejection_sample",
    "speculation_blocker",
]


def speculation_blocker(layout: Sequence[Any]) -> str | None:
    """Why a model whose per-layer caches look like ``layout`` cannot
    speculate; ``None``: it can."""
    for i, c in enumerate(layout):
        if type(c) not in (KVCache, QuantizedKV):
            return f"layer {i} keeps a {type(c).__name__}, which cannot drop rejected tokens"
    return None


def _ints(a: mx.array) -> list[int]:
    out: list[int] = a.tolist()  # type: ignore[assignment]
    return out


# --- the cache ----------------------------------------------------------------------


class HoleyKVCache(BatchKVCache):  # type: ignore[misc]  # mlx-lm is untyped
    """A ``BatchKVCache`` whose sequences may have masked slots (holes):
    rejected proposals that other sequences' accepted tokens sit beside.
    A plain ``BatchKVCache`` becomes one in place (``of``)."""

    holes: mx.array | None = None  # (batch, slots) bool, as wide as ``keys``
    quantized_twin: type[Any]  # set below the quantized class

    @classmethod
    def of(cls, cache: BatchKVCache) -> HoleyKVCache:
        if not isinstance(cache, HoleyKVCache):
            quantized = isinstance(cache, BatchQuantizedKVCache)
            cache.__class__ = HoleyQuantizedKVCache if quantized else HoleyKVCache
        holey: HoleyKVCache = cache
        return holey

    def _fit(self) -> None:
        """Holes as wide as the keys' slots (new slots are not holes)."""
        if self.holes is None or self.keys is None:
            return
        width, slots = self.holes.shape[1], _slots(self.keys)
        if width < slots:
            pad = mx.zeros((self.holes.shape[0], slots - width), dtype=mx.bool_)
            self.holes = mx.concatenate([self.holes, pad], axis=1)
        elif width > slots:
            self.holes = self.holes[:, :slots]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        prev = self._idx
        out = super().update_and_fetch(keys, values)
        if self.holes is not None:
            self._fit()
            assert self.holes is not None
            # The slots just written hold real tokens, whatever they held before.
            self.holes[:, prev : self._idx] = False
        return out

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        mask = super().make_mask(N, return_array=return_array, **kwargs)
        if self.holes is None or self._idx == 0:
            return mask
        B = self.holes.shape[0]
        # Slots at and past the end are about to be written: never holes.
        holes = mx.concatenate(
            [self.holes[:, : self._idx], mx.zeros((B, N), dtype=mx.bool_)], axis=1
        )
        return mask & ~holes[:, None, None, :]

    def reject(self, extra: Sequence[int]) -> None:
        """Sequence ``i``'s last ``extra[i]`` slots are holes now; its RoPE
        offset goes back by as many."""
        width = max(extra)
        if width == 0:
            return
        B = len(extra)
        if self.holes is None:
            slots = _slots(self.keys) if self.keys is not None else self._idx
            self.holes = mx.zeros((B, slots), dtype=mx.bool_)
        self._fit()
        assert self.holes is not None
        cols = mx.arange(width)[None, :]
        starts = mx.array([width - e for e in extra])[:, None]
        seg = cols >= starts
        lo = self._idx - width
        self.holes[:, lo : self._idx] = self.holes[:, lo : self._idx] | seg
        back: mx.array = mx.array(list(extra))
        self.offset: mx.array = self.offset - back

    def filter(self, batch_indices: Any) -> None:
        if self.holes is not None:
            holes = self.holes[batch_indices]
            shift = min(self.left_padding[batch_indices].tolist())
            super().filter(batch_indices)
            self.holes = holes[:, shift:] if shift > 0 else holes
        else:
            super().filter(batch_indices)

    def extend(self, other: Any) -> None:
        mine, theirs = self.holes, getattr(other, "holes", None)
        if mine is None and theirs is None:
            super().extend(other)
            return
        # The same right-justification BatchKVCache.extend gives the keys.
        max_idx = max(self._idx, other._idx)
        sizes = [_slots(c.keys) for c in (self, other) if c.keys is not None]
        max_size = max(sizes) if sizes else 0

        def padded(c: Any, holes: mx.array | None) -> mx.array:
            B = c.offset.shape[0]
            width = _slots(c.keys) if c.keys is not None else 0
            h = holes if holes is not None else mx.zeros((B, width), dtype=mx.bool_)
            h = h[:, :width]
            if h.shape[1] < width:
                h = mx.concatenate([h, mx.zeros((B, width - h.shape[1]), dtype=mx.bool_)], 1)
            left = max_idx - c._idx
            right = max_size - width - left
            if right < 0:
                h = h[:, :right]
                right = 0
            return mx.pad(h, [(0, 0), (left, right)]) if left or right else h

        joined = mx.concatenate([padded(self, mine), padded(other, theirs)], axis=0)
        super().extend(other)
        self.holes = joined

    def extract(self, idx: int) -> Any:
        if self.holes is None:
            return super().extract(idx)
        padding = self.left_padding.tolist()[idx]
        row: list[bool] = self.holes[idx, padding : self._idx].tolist()  # type: ignore[assignment]
        valid = mx.array([padding + s for s, hole in enumerate(row) if not hole])

        def gather(a: mx.array) -> mx.array:
            return mx.contiguous(mx.take(a[idx : idx + 1], valid, axis=2))

        cache = (
            QuantizedKV(self.group_size, self.bits)
            if isinstance(self, BatchQuantizedKVCache)
            else KVCache()
        )
        cache.keys, cache.values = tree_map(gather, (self.keys, self.values))
        cache.offset = len(row) - sum(row)
        return cache


class HoleyQuantizedKVCache(HoleyKVCache, BatchQuantizedKVCache):
    """A quantized batch cache with holes (``--kv-bits``)."""


# A holey layer that ``--quantized-kv-start`` quantizes in place keeps its
# holes (``kv_quant.quantize_batch_layer``).
HoleyKVCache.quantized_twin = HoleyQuantizedKVCache


def _slots(keys: Any) -> int:
    """The slots a layer's keys hold: an array, or a quantized triple."""
    first = keys[0] if isinstance(keys, tuple) else keys
    return int(first.shape[2])


# --- sampled sequences ------------------------------------------------------------


@attrs.define
class Roster:
    """How a lane's sequences speculate, by uid: the opted-out never; a
    sampled one against its ``Sampling`` (unseeded ones only)."""

    opted_out: set[int] = attrs.Factory(set)
    sampled: dict[int, Sampling] = attrs.Factory(dict)
    # A salted request's cache salt: its lookups share only with its salt.
    salts: dict[int, str] = attrs.Factory(dict)

    def forget(self, uid: int) -> None:
        self.opted_out.discard(uid)
        self.sampled.pop(uid, None)
        self.salts.pop(uid, None)


def rejection_sample(
    logits: np.ndarray,
    drafts: Sequence[Sequence[int]],
    rng: np.random.Generator,
    draft_probs: np.ndarray | None = None,
) -> tuple[list[int], list[int]]:
    """Speculative sampling (Leviathan et al., Chen et al., 2023) of ``R``
    rows' drafts: each row's accepted count ``m`` and the token after them.

    ``logits`` (R, k + 1, V) is the distribution each row's sampler draws
    from at each position, ``drafts[r]`` row ``r``'s proposed tokens (at
    most ``k``), and ``draft_probs`` (R, k, V) the distribution a draft
    model drew them from; ``None``: each was certain (a lookup). Position
    ``j``'s draft ``d`` is accepted with probability ``min(1, p(d) / q(d))``;
    at a row's first rejection its next token is drawn from ``max(p - q, 0)``
    normalised (a certain draft: ``p`` without ``d``), and after all its
    drafts from ``p``. The tokens a row emits are then distributed as
    drawing each from ``p`` would be.

    On the host, in numpy: each position's normaliser is a sum of ``V``
    exponentials, and MLX's CPU ``exp`` took 12 ns per element here against
    numpy's 0.45 (9 ms against 0.35 for 4 rows of 3 positions over SmolLM2's
    49,152 tokens).
    """
    z = np.asarray(logits, dtype=np.float32)
    if any(len(d) >= z.shape[1] for d in drafts):
        raise ValueError(f"a draft longer than the {z.shape[1] - 1} positions verified")
    weights = np.exp(z - z.max(axis=-1, keepdims=True))
    totals = weights.sum(axis=-1)
    accepted: list[int] = []
    follow: list[int] = []
    for r, d in enumerate(drafts):
        m = len(d)
        for j, token in enumerate(d):
            ratio = weights[r, j, token] / totals[r, j]
            if draft_probs is not None:
                ratio /= draft_probs[r, j, token]
            if not rng.random() < ratio:
                m = j
                break
        w = weights[r, m]
        if m < len(d):
            if draft_probs is None:
                w = w.copy()
                w[d[m]] = 0.0
            else:
                w = np.maximum(w / totals[r, m] - draft_probs[r, m], 0.0)
        cdf = np.cumsum(w, dtype=np.float64)
        pick = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
        accepted.append(m)
        follow.append(min(pick, w.shape[0] - 1))
    return accepted, follow


# --- the gate and the figures ----------------------------------------------------------


@attrs.define
class SpecStats:
    """What speculation did, counted as it goes (vLLM's names);
    ``figures()`` is the frozen copy a step's report carries to ``/metrics``."""

    num_drafts: int = 0  # sequences that verified a proposal, summed over steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    verify_steps: int = 0
    plain_steps: int = 0
    # Waits for the step in flight to check a guess of its token, and those
    # after which no guess held (the step went on plainly, unpipelined).
    guess_waits: int = 0
    guess_misses: int = 0
    # Of the proposed and accepted tokens, a draft model's (the rest: the lookup's).
    model_draft_tokens: int = 0
    model_accepted_tokens: int = 0

    def figures(self) -> SpecFigures:
        return SpecFigures(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            self.verify_steps,
            self.model_draft_tokens,
            self.model_accepted_tokens,
        )


# What a sequence's proposals are expected to get accepted at before any
# was verified: accepted tokens per proposed token.
_PRIOR_RATE = 0.5


# How much longer than a plain step a verify step may take when some of the
# batch's sequences propose nothing: they gain nothing from it, and one
# request's speculation must not slow the rest for its own gain.
_HARM = 1.1
# ... unless the batch's tokens per second would grow by this factor, and
# then by at most this much: a step of 4 where 3 sequences copy 3 tokens
# each gives the batch (4 + 9) tokens for a step's 1.3, and costs the
# fourth sequence 30%.
_HARM_PAID = 1.5
_HARM_MAX = 1.5


# A lookup shape the gate refused this many times in a row is verified
# once more: one measurement taken while other work ran (a prefill chunk
# queued before it) must not keep a shape refused for good. One verify in
# 64 refusals costs at most a step's fraction of a percent where it never
# pays; a draft model's shapes are not re-tried (their passes cost more).
_RETRY_AFTER = 64


def _ema(old: float | None, new: float) -> float:
    return new if old is None else 0.8 * old + 0.2 * new


# Wall times the gate keeps per shape; it reads their minimum. Other work
# only ever adds to a step's time (a prefill chunk queued before it, a
# first use's allocations, the host's other threads), so the smallest of
# the recent ones is the step's own cost, and one slow sample cannot keep
# a shape refused; a cost that grows with the context shows within as
# many steps.
_SAMPLES = 8


def _note(times: dict[Any, deque[float]], key: Any, seconds: float) -> None:
    kept = times.get(key)
    if kept is None:
        kept = times[key] = deque(maxlen=_SAMPLES)
    kept.append(seconds)


@attrs.define
class _Gate:
    """When a verify step pays, from measured wall times: of a plain step
    per batch size, and of a verify step per batch size and width (tokens
    fed per sequence), the least of the last ``_SAMPLES`` of each. A shape
    never verified is tried once, a refused lookup shape again after
    ``_RETRY_AFTER`` refusals."""

    plain_times: dict[int, deque[float]] = attrs.Factory(dict)
    # Keyed by batch, width and whether a draft model proposed (its passes
    # are part of the step's time).
    verify_times: dict[tuple[int, int, bool], deque[float]] = attrs.Factory(dict)
    # Refusals in a row of each measured lookup shape (``_RETRY_AFTER``).
    refused: dict[tuple[int, int], int] = attrs.Factory(dict)

    def note_plain(self, batch: int, seconds: float) -> None:
        _note(self.plain_times, batch, seconds)

    def note_verify(self, batch: int, width: int, seconds: float, drafted: bool = False) -> None:
        _note(self.verify_times, (batch, width, drafted), seconds)

    def plain_s(self, batch: int) -> float | None:
        kept = self.plain_times.get(batch)
        return min(kept) if kept else None

    def verify_s(self, batch: int, width: int, drafted: bool = False) -> float | None:
        kept = self.verify_times.get((batch, width, drafted))
        return min(kept) if kept else None

    def pays(
        self, batch: int, width: int, expected: float, proposing: int, drafted: bool = False
    ) -> bool:
        """Whether a verify step of ``width`` over ``batch`` sequences, of
        which ``proposing`` propose and are expected to get ``expected``
        proposed tokens accepted, yields more tokens per second than plain
        steps without slowing the sequences that propose nothing by more
        than ``_HARM`` (or ``_HARM_MAX``, for a gain of ``_HARM_PAID``)."""
        plain = self.plain_s(batch)
        if plain is None:
            return False  # plain steps come first: measure one
        verify = self.verify_s(batch, width, drafted)
        if verify is None and drafted:
            # A draft's passes grow with the sequences it drafts for: from
            # a smaller batch's drafting step, as if each sequence cost as
            # much as one did there. Untried only where that might pay.
            tried = sorted(
                (b, min(t)) for (b, w, d), t in self.verify_times.items() if d and w == width
            )
            if tried:
                below = [bt for bt in tried if bt[0] < batch]
                b, t = below[-1] if below else tried[0]
                verify = t * batch / b
        if verify is None:
            return True
        gain = (batch + expected) / verify / (batch / plain)
        ok = gain > 1
        if proposing < batch and verify > _HARM * plain:
            # The sequences that propose nothing would be slowed: only for
            # a large gain of the batch's, and never by more than _HARM_MAX.
            ok = gain >= _HARM_PAID and verify <= _HARM_MAX * plain
        if ok or drafted:
            return ok
        n = self.refused.get((batch, width), 0) + 1
        self.refused[batch, width] = 0 if n >= _RETRY_AFTER else n
        return n >= _RETRY_AFTER


# --- the batch ----------------------------------------------------------------------


class SpeculativeBatch(GenerationBatch):  # type: ignore[misc]  # mlx-lm is untyped
    """The lane's generation batch, verifying proposals in the step. Its
    class attributes are set per generator by ``install``."""

    num_draft: int = 0
    roster: Roster
    # The sequences that finished lately, per salt, shared by the lanes.
    recent: RecentBySalt | None = None
    # A draft model (``mlx.draft``), and the states finished sequences left.
    draft: DraftModel | None = None
    pool: DraftPool | None = None
    stats: SpecStats
    gate: _Gate
    # OpenBLAS's threads per step (``tuning.step_threads``): a verify's rows.
    threads: StepThreads | None = None
    # GenerationBatch's, set in its __init__.
    _next_tokens: Any
    _next_logprobs: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._after_verify = False
        # Plain steps to take before waiting for a step in flight again, and
        # the next such pause (waits that ended in plain steps back off).
        self._waits = (0, 1)
        # Each sequence's (proposed, accepted) in the verify step just taken.
        self._drafts: list[tuple[int, int]] = []
        # The pending next tokens as host ints, where a verify step chose them.
        self._known: list[int] | None = None
        self._lookups: list[NgramLookup | None] = []
        self._cooldown: list[tuple[int, int]] = []  # (steps to wait, next wait)
        self._rate: list[float] = []  # accepted per proposed token, recent
        self._draft_states: list[DraftState | None] = []
        # The sampled sequences' verdicts and draws (unseeded requests only).
        self._rng = np.random.default_rng()
        super().__init__(*args, **kwargs)
        self._lookups = [None] * len(self.uids)
        self._cooldown = [(0, 1)] * len(self.uids)
        self._rate = [_PRIOR_RATE] * len(self.uids)
        self._draft_states = [None] * len(self.uids)

    def extend(self, batch: Any) -> None:
        super().extend(batch)
        self._known = None  # the new sequences' are still computing
        self._lookups.extend([None] * len(batch.uids))
        self._cooldown.extend([(0, 1)] * len(batch.uids))
        self._rate.extend([_PRIOR_RATE] * len(batch.uids))
        self._draft_states.extend([None] * len(batch.uids))

    def filter(self, keep: list[int]) -> None:
        if self.pool is not None:
            kept = set(keep)
            for i, state in enumerate(self._draft_states):
                if state is not None and i not in kept:
                    self.pool.put(state)
        super().filter(keep)
        if self._known is not None:
            self._known = [self._known[i] for i in keep]
        self._lookups = [self._lookups[i] for i in keep]
        self._cooldown = [self._cooldown[i] for i in keep]
        self._rate = [self._rate[i] for i in keep]
        self._draft_states = [self._draft_states[i] for i in keep]

    def extract_cache(self, idx: int, drop: int = 0) -> list[Any]:
        """Sequence ``idx``'s cache, dense, without its last ``drop`` tokens."""
        layers = [c.extract(idx) for c in self.prompt_cache]
        if drop:
            for c in layers:
                end = c.offset - drop
                c.keys, c.values = tree_map(lambda a, end=end: a[..., :end, :], (c.keys, c.values))
                c.offset = end
        return layers

    # -- proposals ------------------------------------------------------------------

    def _eligible(self, i: int) -> bool:
        return (
            (self.samplers[i] is greedy or self.uids[i] in self.roster.sampled)
            and not self.logits_processors[i]
            and self.uids[i] not in self.roster.opted_out
            and self.max_tokens[i] - self._num_tokens[i] >= 2
        )

    def _proposals(self, pending: list[int] | None) -> list[list[int]]:
        """Each sequence's proposal. With ``pending`` (its next tokens, known
        after a verify step) up to K tokens to follow it; without (a plain
        step computes them still) up to K + 1, the first a guess of the
        pending token, so that nothing waits for the step in flight."""
        out: list[list[int]] = []
        for i in range(len(self.uids)):
            wait, span = self._cooldown[i]
            if wait > 0:
                self._cooldown[i] = (wait - 1, span)
                out.append([])
                continue
            if not self._eligible(i):
                out.append([])
                continue
            try:
                out.append(self._propose(i, pending))
            except Exception:
                # A proposer's fault is this sequence's alone, and costs it
                # only speculation: it decodes on, plainly.
                log.exception(
                    "speculation: the lookup of uid %d failed; it decodes plainly", self.uids[i]
                )
                self.roster.opted_out.add(self.uids[i])
                out.append([])
        return out

    def _propose(self, i: int, pending: list[int] | None) -> list[int]:
        lookup = self._lookups[i]
        if lookup is None:
            lookup = self._lookups[i] = NgramLookup()
        lookup.extend(self.tokens[i][len(lookup.tokens) :])
        budget = min(self.num_draft, self.max_tokens[i] - self._num_tokens[i] - 1)
        if pending is not None:
            budget -= 1  # the pending token is known: no guess of it leads
            lookup.tokens.append(pending[i])
        try:
            own = lookup.propose(budget + 1)
            if own or self.recent is None:
                return own
            # Nothing recurs in the sequence itself: what another
            # sequence of its salt held after the same tokens.
            salt = self.roster.salts.get(self.uids[i], "")
            return self.recent.of(salt).propose(lookup.tokens, budget + 1)
        finally:
            if pending is not None:
                lookup.tokens.pop()

    # -- the step -------------------------------------------------------------------

    def next(self) -> list[Any]:
        if not self.uids:
            return []
        emitted: list[list[int]]
        logprobs: list[list[mx.array]]
        start = time.perf_counter()
        known, self._known = self._known, None
        looked_up: list[list[int]] | None = None
        if self.draft is not None and self.num_draft > 0:
            drafted_step, looked_up = self._draft_step(known, start)
            if drafted_step is not None:
                return drafted_step
        wait, span = self._waits
        if known is None and wait > 0:
            # Waits for the step in flight lately ended in plain steps: go
            # on pipelined for a while.
            self._waits = (wait - 1, span)
            return self._plain(start, False)
        proposals: list[list[int]] = []
        if looked_up is not None:
            proposals = looked_up
        elif self.num_draft > 0 and any(self._eligible(i) for i in range(len(self.uids))):
            proposals = self._proposals(known)
        guessed = 0 if known is not None else 1  # a guess of the pending token leads
        drafted = sum(max(0, len(p) - guessed) for p in proposals)
        B = len(self.uids)
        width = 1 + max((len(p) - guessed for p in proposals), default=0)
        expected = sum(
            r * max(0, len(p) - guessed) for r, p in zip(self._rate, proposals, strict=False)
        )
        proposing = sum(1 for p in proposals if len(p) > guessed)
        pending: list[int] | None = known
        synced = False
        if drafted and self.gate.pays(B, width, expected, proposing):
            if pending is None:
                # Wait for the step in flight; keep the proposals whose
                # guess of its token was right.
                mx.eval(self._next_tokens)
                pending, synced = _ints(self._next_tokens), True
                self.stats.guess_waits += 1
                # The verify's own time, not the wait for work in flight
                # (the last step, a prefill chunk queued before it).
                start = time.perf_counter()
                held = []
                for i, p in enumerate(proposals):
                    if len(p) > 1 and p[0] == pending[i]:
                        held.append(p[1:])
                        continue
                    held.append([])
                    if p:
                        # A wrong guess cost this wait: back off as from a
                        # rejection, so misses do not wait every step.
                        span = self._cooldown[i][1]
                        self._cooldown[i] = (span, min(2 * span, 32))
                proposals = held
                width = 1 + max(len(p) for p in proposals)
                proposing = sum(1 for p in proposals if p)
                expected = sum(r * len(p) for r, p in zip(self._rate, proposals, strict=True))
            if not synced or (proposing and self.gate.pays(B, width, expected, proposing)):
                emitted, logprobs = self._verify(pending, proposals)
                self.gate.note_verify(B, width, time.perf_counter() - start)
                self._after_verify = True
                if synced:
                    self._waits = (0, 1)
                return self._responses(emitted, logprobs)
            if not proposing:
                self.stats.guess_misses += 1
            # The wait bought nothing (the guesses missed, or what held did
            # not pay): the next ones wait 1, 2, 4 ... 64 steps.
            self._waits = (span, min(2 * span, 64))
        elif drafted:
            # Refused: each proposer's remembered rate drifts back to the
            # prior, so a bad spell is not refused forever.
            for i, p in enumerate(proposals):
                if p:
                    self._rate[i] = 0.98 * self._rate[i] + 0.02 * _PRIOR_RATE
        return self._plain(start, synced)

    def _plain(self, start: float, synced: bool) -> list[Any]:
        """mlx-lm's own step; ``synced``: its input was waited for here."""
        tokens, lps = self._step()
        emitted, logprobs = [[t] for t in tokens], [[lp] for lp in lps]
        self._drafts = []
        self.stats.plain_steps += 1
        # A plain step right after a verify one (its input already computed)
        # or after waiting here did not take a step's time.
        if not self._after_verify and not synced:
            self.gate.note_plain(len(self.uids), time.perf_counter() - start)
        self._after_verify = False
        return self._responses(emitted, logprobs)

    def _draft_step(
        self, known: list[int] | None, start: float
    ) -> tuple[list[Any] | None, list[list[int]] | None]:
        """A step whose proposals come from the lookup where it copies a
        whole proposal, and from the draft model elsewhere. Where the draft
        has nothing to add (the lookup fills every ready sequence's
        proposal) or the gate does not expect a drafting step to pay, no
        step: the lookup's proposals are given back (a guess of the pending
        token first where it is still computing), for the lookup's own
        gate, harm rule and pipelining to decide on."""
        B = len(self.uids)
        k = self.num_draft
        ready = [i for i in range(B) if self._cooldown[i][0] == 0 and self._eligible(i)]
        if not ready:
            return None, None
        proposals = self._proposals(known)
        guessed = 1 if known is None else 0

        def budget(i: int) -> int:
            left: int = self.max_tokens[i] - self._num_tokens[i] - 1
            return min(k, left)

        def drafts_for(i: int, proposal: list[int], lead: int) -> bool:
            # The lookup's copy costs no pass of the draft.
            short = len(proposal) - lead < budget(i)
            return short and self.uids[i] not in self.roster.opted_out

        if not any(drafts_for(i, proposals[i], guessed) for i in ready):
            return None, proposals
        expected = sum(self._rate[i] * k for i in ready)
        if not self.gate.pays(B, 1 + k, expected, len(ready), drafted=True):
            return None, proposals
        synced = known is None
        if known is None:
            mx.eval(self._next_tokens)
            known = _ints(self._next_tokens)
            start = time.perf_counter()  # as in ``next``: the step's own time
            # A proposal whose guess of the pending token missed is the draft's to make.
            proposals = [
                p[1:] if len(p) > 1 and p[0] == known[i] else [] for i, p in enumerate(proposals)
            ]
        by_model: set[int] = set()  # the sequences whose proposal the draft made
        for i in ready:
            if not drafts_for(i, proposals[i], 0):
                continue
            try:
                proposals[i] = self._draw(i, known[i], budget(i))
                by_model.add(i)
            except Exception:
                log.exception(
                    "speculation: the draft model failed for uid %d; it decodes plainly",
                    self.uids[i],
                )
                self.roster.opted_out.add(self.uids[i])
                self._draft_states[i] = None
                proposals[i] = []
        if not any(proposals):
            return self._plain(start, synced), None
        drafted = bool(by_model)
        width = 1 + k if drafted else 1 + max(len(p) for p in proposals)
        if not drafted:
            # The draft proposed nothing: a lookup verify, which the
            # lookup's own gate (and harm rule) decides on.
            proposing = sum(1 for p in proposals if p)
            expected = sum(r * len(p) for r, p in zip(self._rate, proposals, strict=True))
            if not self.gate.pays(B, width, expected, proposing):
                return self._plain(start, synced), None
        emitted, logprobs = self._verify(known, proposals, by_model)
        # Its time leaves out the wait for the step in flight.
        self.gate.note_verify(B, width, time.perf_counter() - start, drafted=drafted)
        self._after_verify = True
        return self._responses(emitted, logprobs), None

    def _draw(self, i: int, pending: int, budget: int) -> list[int]:
        """Sequence ``i``'s draft proposal after its ``pending`` token."""
        assert self.draft is not None
        tokens = [*self.tokens[i], pending]
        state = self._draft_states[i]
        if state is None:
            salt = self.roster.salts.get(self.uids[i], "")
            taken = self.pool.take(tokens, salt) if self.pool is not None else None
            state = self._draft_states[i] = taken or self.draft.state(salt)
        return self.draft.propose(state, tokens, budget)

    def _verify(
        self,
        pending: list[int],
        proposals: list[list[int]],
        by_model: frozenset[int] | set[int] = frozenset(),
    ) -> tuple[list[list[int]], list[list[mx.array]]]:
        """Verify ``proposals`` after ``pending``; ``by_model``: the
        sequences whose proposal a draft model made (counted apart)."""
        B = len(self.uids)
        k = max(len(p) for p in proposals)
        rows = [[pending[i], *p, *([pending[i]] * (k - len(p)))] for i, p in enumerate(proposals)]
        inputs = mx.array(rows, dtype=self._next_tokens.dtype)
        if self.threads is not None:
            self.threads.before_step(B * (k + 1), prefilling=False)
        logits = self.model(inputs, cache=self.prompt_cache)

        # Position 0 is every sequence's plain step: its processors and sampler.
        first = logits[:, 0, :]
        context = []
        if any(self.logits_processors):
            processed = []
            for e in range(B):
                row = first[e : e + 1]
                processors = self.logits_processors[e] or ()
                if processors:
                    ctx = self._token_context[e].update_and_fetch(inputs[e : e + 1, 0])
                    context.append(ctx)
                    for processor in processors:
                        row = processor(ctx, row)
                processed.append(row)
            first = mx.concatenate(processed, axis=0)
        first_lp = first - mx.logsumexp(first, axis=-1, keepdims=True)
        samplers = [self.fallback_sampler if s is None else s for s in self.samplers]
        if all(s is samplers[0] for s in samplers):
            sampled = samplers[0](first_lp)
        else:
            sampled = mx.concatenate([s(first_lp[e : e + 1]) for e, s in enumerate(samplers)], 0)
        # The later positions, for the greedy sequences that proposed: the
        # argmax of the logits is the log-softmax's, and the log-softmax
        # itself (each emitted token's logprobs) stays lazy, computed only
        # for a request that reads its logprobs.
        rest_lp = logits[:, 1:, :] - mx.logsumexp(logits[:, 1:, :], axis=-1, keepdims=True)
        targets = mx.argmax(logits[:, 1:, :], axis=-1)
        # The sampled ones' proposals are rejection-sampled.
        drawn_rows, drawn = self._draws(first_lp, logits[:, 1:, :], proposals)
        mx.eval(sampled, targets, self._next_logprobs, context, drawn)
        firsts = _ints(sampled)
        chosen: list[list[int]] = targets.tolist()  # type: ignore[assignment]
        draws: dict[int, tuple[int, int]] = {}
        if drawn is not None:
            drafts = [proposals[i] for i in drawn_rows]
            ms, follows = rejection_sample(np.array(drawn), drafts, self._rng)
            draws = {row: (m, t) for row, m, t in zip(drawn_rows, ms, follows, strict=True)}

        emitted: list[list[int]] = []
        logprobs: list[list[mx.array]] = []
        next_tokens: list[int] = []
        next_logprobs: list[mx.array] = []
        valid: list[int] = []
        self._drafts = [(0, 0)] * B
        for i, p in enumerate(proposals):
            drawn_here = draws.get(i)
            if drawn_here is None:
                # The greedy choice after pending (firsts), then after each proposal.
                after = [firsts[i], *chosen[i]]
                m = NgramLookup.accepted(p, after)
                follow = after[m]
            else:
                m, follow = drawn_here
            emitted.append([pending[i], *p[:m]])
            logprobs.append(
                [
                    self._next_logprobs[i],
                    *(rest_lp[i, j - 1] if j else first_lp[i] for j in range(m)),
                ]
            )
            next_tokens.append(follow)
            next_logprobs.append(first_lp[i] if m == 0 else rest_lp[i, m - 1])
            valid.append(1 + m)
            self.tokens[i].extend(emitted[-1])
            self._drafts[i] = (len(p), m)
            if p:
                self.stats.num_drafts += 1
                self.stats.num_draft_tokens += len(p)
                self.stats.num_accepted_tokens += m
                if i in by_model:
                    self.stats.model_draft_tokens += len(p)
                    self.stats.model_accepted_tokens += m
                self._rate[i] = _ema(self._rate[i], m / len(p))
                # All rejected: wait, longer each time in a row.
                span = self._cooldown[i][1]
                self._cooldown[i] = (span, min(2 * span, 32)) if m == 0 else (0, 1)
        self.stats.verify_steps += 1

        # Every sequence wrote k + 1 slots; keep each one's valid ones.
        extra = [k + 1 - v for v in valid]
        shared = min(extra)
        rest = [e - shared for e in extra]
        for c in self.prompt_cache:
            if shared:
                c.trim(shared)
            if any(rest):
                HoleyKVCache.of(c).reject(rest)
        self._current_tokens = inputs[:, 0]
        self._current_logprobs = list(self._next_logprobs)
        self._next_tokens = mx.array(next_tokens, dtype=inputs.dtype)
        self._next_logprobs = next_logprobs
        self._known = next_tokens
        return emitted, logprobs

    def _draws(
        self, first_lp: mx.array, rest: mx.array, proposals: list[list[int]]
    ) -> tuple[list[int], mx.array | None]:
        """The rows of the sampled sequences that proposed, and the logits
        each one's sampler draws from at each position (for
        ``rejection_sample``). A sequence whose sampler cannot give its
        distribution loses its proposal (it emits what its own sampler draws
        after the pending token) and is opted out."""
        rows: list[int] = []
        logits: list[mx.array] = []
        for i, p in enumerate(proposals):
            sampling = self.roster.sampled.get(self.uids[i]) if p else None
            if sampling is None:
                continue
            try:
                # The filters and the temperature see each position's logits
                # shifted to a maximum of 0 (a log-softmax but for a constant,
                # which no filter's verdict depends on).
                later = rest[i] - mx.max(rest[i], axis=-1, keepdims=True)
                lp = mx.concatenate([first_lp[i : i + 1], later], axis=0)
                logits.append(sampling.logits(lp)[None])
            except Exception:
                log.exception(
                    "speculation: the sampler of uid %d failed; it decodes plainly", self.uids[i]
                )
                self.roster.opted_out.add(self.uids[i])
                proposals[i] = []
                continue
            rows.append(i)
        if not rows:
            return [], None
        return rows, mx.concatenate(logits, axis=0)

    def _responses(self, emitted: list[list[int]], logprobs: list[list[mx.array]]) -> list[Any]:
        """mlx-lm's ``next`` over several tokens per sequence: each counts
        against ``max_tokens`` and the stop matcher, and a sequence that
        finishes drops what it fed past its last token."""
        keep: list[int] = []
        responses: list[Any] = []
        for i in range(len(self.uids)):
            finished = False
            toks = emitted[i]
            first = len(responses)
            for j, token in enumerate(toks):
                finish = None
                self._num_tokens[i] += 1
                if self._num_tokens[i] >= self.max_tokens[i]:
                    finish = "length"
                if self._matchers[i].advance(token):
                    finish = "stop"
                if finish is None:
                    responses.append(
                        self.Response(self.uids[i], token, logprobs[i][j], None, None, None)
                    )
                    continue
                drop = len(toks) - 1 - j
                if drop:
                    del self.tokens[i][-drop:]
                if self.recent is not None:
                    salt = self.roster.salts.get(self.uids[i], "")
                    self.recent.of(salt).add(self.tokens[i])
                responses.append(
                    self.Response(
                        self.uids[i],
                        token,
                        logprobs[i][j],
                        finish,
                        self.extract_cache(i, drop),
                        self.tokens[i],
                    )
                )
                finished = True
                break
            if self._drafts and self._drafts[i][0]:
                # What this step proposed and accepted, on its first token.
                responses[first].drafted, responses[first].accepted = self._drafts[i]
            if not finished:
                keep.append(i)
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses


def install(
    gen: BatchGenerator,
    num_draft: int,
    roster: Roster,
    stats: SpecStats,
    recent: RecentBySalt | None = None,
    draft: DraftModel | None = None,
    pool: DraftPool | None = None,
    threads: StepThreads | None = None,
) -> None:
    """Make ``gen``'s generation batch a ``SpeculativeBatch`` proposing up to
    ``num_draft`` tokens for its greedy sequences and the sampled ones in
    ``roster`` (its opted-out never), from their own tokens and from
    ``recent``'s, and from ``draft`` (its finished states kept in ``pool``);
    ``threads`` is told each verify's rows. Call before anything was
    inserted."""
    cls = type(
        "LaneSpeculativeBatch",
        (SpeculativeBatch,),
        {
            "num_draft": num_draft,
            "roster": roster,
            "recent": recent,
            "draft": draft,
            "pool": pool,
            "stats": stats,
            "gate": _Gate(),
            "threads": threads,
        },
    )
    empty: Any = cls
    gen._generation_batch = empty.empty(gen.model, gen.sampler)
