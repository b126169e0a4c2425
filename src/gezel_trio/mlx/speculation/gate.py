"""When a verify step pays (``Gate``), and what speculation did
(``SpecStats``)."""

from __future__ import annotations

from collections import deque
from typing import Any

import attrs

from ...core.backend import SpecFigures

__all__ = ["PRIOR_RATE", "RETRY_AFTER", "Gate", "SpecStats", "ema"]


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
PRIOR_RATE = 0.5


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
RETRY_AFTER = 64


def ema(old: float | None, new: float) -> float:
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
class Gate:
    """When a verify step pays, from measured wall times: of a plain step
    per batch size, and of a verify step per batch size and width (tokens
    fed per sequence), the least of the last ``_SAMPLES`` of each. A shape
    never verified is tried once, a refused lookup shape again after
    ``RETRY_AFTER`` refusals."""

    plain_times: dict[int, deque[float]] = attrs.Factory(dict)
    # Keyed by batch, width and whether a draft model proposed (its passes
    # are part of the step's time).
    verify_times: dict[tuple[int, int, bool], deque[float]] = attrs.Factory(dict)
    # Refusals in a row of each measured lookup shape (``RETRY_AFTER``).
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
        self.refused[batch, width] = 0 if n >= RETRY_AFTER else n
        return n >= RETRY_AFTER
