"""The lane's generation batch that verifies proposals in its step
(``SpeculativeBatch``), and ``install``, which makes it a generator's
(the package's docstring tells how)."""

from __future__ import annotations

import logging
import time
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.generate import BatchGenerator

from ...tuning.step_threads import StepThreads
from ..mlx_lm_surface import GenerationBatchBase, install_generation_batch, with_holes
from ..sampling import greedy
from .draft import DraftModel, DraftPool, DraftState
from .gate import PRIOR_RATE, Gate, SpecStats, ema
from .lookup import NgramLookup, RecentBySalt
from .roster import Roster, rejection_sample

log = logging.getLogger("gezel_trio.mlx")

__all__ = ["SpeculativeBatch", "install"]


def _ints(a: mx.array) -> list[int]:
    out: list[int] = a.tolist()  # type: ignore[assignment]
    return out


class SpeculativeBatch(GenerationBatchBase):
    """The lane's generation batch, verifying proposals in the step. Its
    class attributes are set per generator by ``install``."""

    num_draft: int = 0
    roster: Roster
    # The sequences that finished lately, per salt, shared by the lanes.
    recent: RecentBySalt | None = None
    # A draft model (``mlx.speculation.draft``), and the states finished sequences left.
    draft: DraftModel | None = None
    pool: DraftPool | None = None
    stats: SpecStats
    gate: Gate
    # OpenBLAS's threads per step (``tuning.step_threads``): a verify's rows.
    threads: StepThreads | None = None

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
        self._rate = [PRIOR_RATE] * len(self.uids)
        self._draft_states = [None] * len(self.uids)

    def extend(self, batch: Any) -> None:
        super().extend(batch)
        self._known = None  # the new sequences' are still computing
        self._lookups.extend([None] * len(batch.uids))
        self._cooldown.extend([(0, 1)] * len(batch.uids))
        self._rate.extend([PRIOR_RATE] * len(batch.uids))
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
            and self.max_tokens[i] - self.num_tokens[i] >= 2
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
        budget = min(self.num_draft, self.max_tokens[i] - self.num_tokens[i] - 1)
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
                mx.eval(self.next_tokens)
                pending, synced = _ints(self.next_tokens), True
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
                    self._rate[i] = 0.98 * self._rate[i] + 0.02 * PRIOR_RATE
        return self._plain(start, synced)

    def _plain(self, start: float, synced: bool) -> list[Any]:
        """mlx-lm's own step; ``synced``: its input was waited for here."""
        tokens, lps = self.plain_step()
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
            left: int = self.max_tokens[i] - self.num_tokens[i] - 1
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
            mx.eval(self.next_tokens)
            known = _ints(self.next_tokens)
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
        inputs = mx.array(rows, dtype=self.next_tokens.dtype)
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
                    ctx = self.token_context[e].update_and_fetch(inputs[e : e + 1, 0])
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
        mx.eval(sampled, targets, self.next_logprobs, context, drawn)
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
                    self.next_logprobs[i],
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
                self._rate[i] = ema(self._rate[i], m / len(p))
                # All rejected: wait, longer each time in a row.
                span = self._cooldown[i][1]
                self._cooldown[i] = (span, min(2 * span, 32)) if m == 0 else (0, 1)
        self.stats.verify_steps += 1

        # Every sequence wrote k + 1 slots; keep each one's valid ones.
        extra = [k + 1 - v for v in valid]
        shared = min(extra)
        rest = [e - shared for e in extra]
        for j, c in enumerate(self.prompt_cache):
            if shared:
                c.trim(shared)
            if any(rest):
                # A layer that has had no holes yet is replaced by one that
                # can take them, holding its state.
                holey = self.prompt_cache[j] = with_holes(c)
                holey.reject(rest)
        self.set_pending(
            inputs[:, 0],
            list(self.next_logprobs),
            mx.array(next_tokens, dtype=inputs.dtype),
            next_logprobs,
        )
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
                self.num_tokens[i] += 1
                if self.num_tokens[i] >= self.max_tokens[i]:
                    finish = "length"
                if self.matchers[i].advance(token):
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
            "gate": Gate(),
            "threads": threads,
        },
    )
    empty: Any = cls
    install_generation_batch(gen, empty.empty(gen.model, gen.sampler))
