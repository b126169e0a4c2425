"""Rejection sampling of proposals (``mlx.speculation.rejection_sample``)
keeps the target's distribution: a chi-square test on a small vocabulary.

The target here is a model whose distribution at each position does not
depend on the tokens before it, so two emitted tokens must be distributed
as ``p0 x p1``. Each of 40,000 rows runs one verify step over a proposal of
two tokens; a row whose first proposed token was rejected draws its second
token in the next step, from ``p1`` alone (``fresh``), as decoding would.
A draw that breaks the distribution (a rejection followed by a draw from
``p`` instead of the residual, simulated here) must fail the same test: it
can tell.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gezel_trio.mlx.speculation import rejection_sample

ROWS = 40_000
NEG = -math.inf
# Position 0's and 1's target logits over a 5-token vocabulary; token 4 at
# position 1 is filtered out (a top-k's -inf).
P0 = [1.2, 0.3, -0.5, 0.9, -1.0]
P1 = [0.1, 1.5, -0.2, 0.4, NEG]


def _probs(logits: list[float]) -> np.ndarray:
    z = np.exp(np.array(logits) - max(logits))
    out: np.ndarray = z / z.sum()
    return out


def _chi2_limit(df: int) -> float:
    """The chi-square quantile at p = 0.001 (Wilson-Hilferty)."""
    z, h = 3.0902, 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def _chi2(counts: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    # A cell the target gives no mass to must stay empty.
    assert counts[expected == 0].sum() == 0
    live = expected > 0
    stat = float((((counts - expected) ** 2)[live] / expected[live]).sum())
    return stat, int(live.sum()) - 1


def _emitted(drafts: np.ndarray, draft_probs: np.ndarray | None) -> np.ndarray:
    """The (first, second) tokens each row emits."""
    rng = np.random.default_rng(11)
    target = np.broadcast_to(np.array([P0, P1, P1], dtype=np.float32)[None], (ROWS, 3, 5))
    m_, follow_ = rejection_sample(target, drafts.tolist(), rng, draft_probs)
    m, follow = np.array(m_), np.array(follow_)
    # Rejected at 0: the next step draws the second token from p1.
    later = rng.choice(5, size=ROWS, p=_probs(P1))
    first = np.where(m >= 1, drafts[:, 0], follow)
    second = np.where(m == 2, drafts[:, 1], np.where(m == 1, follow, later))
    return np.stack([first, second], axis=1)


def _broken(drafts: np.ndarray, draft_probs: np.ndarray | None) -> np.ndarray:
    """The same, but a rejection followed by a draw from ``p`` itself, not
    the residual: the distribution the test must tell apart."""
    rng = np.random.default_rng(3)
    p = [_probs(P0), _probs(P1)]
    out = np.empty_like(drafts)
    for r in range(ROWS):
        for j in range(2):
            d = drafts[r, j]
            q_d = 1.0 if draft_probs is None else draft_probs[r, j, d]
            if rng.random() < min(1.0, p[j][d] / q_d):
                out[r, j] = d
                continue
            out[r, j] = rng.choice(5, p=p[j])
            if j == 0:
                out[r, 1] = rng.choice(5, p=p[1])
            break
    return out


def _joint(tokens: np.ndarray) -> np.ndarray:
    counts = np.zeros((5, 5))
    np.add.at(counts, (tokens[:, 0], tokens[:, 1]), 1)
    return counts.ravel()


EXPECTED = ROWS * np.outer(_probs(P0), _probs(P1)).ravel()


@pytest.mark.parametrize(
    "drafts",
    [
        [0, 1],  # each position's likeliest token
        [2, 4],  # an unlikely one, then one the filter removed
        [4, 3],
    ],
)
def test_a_certain_proposal_a_lookup_keeps_the_distribution(drafts: list[int]) -> None:
    rows = np.tile(np.array(drafts, dtype=np.int32), (ROWS, 1))
    tokens = _emitted(rows, None)
    stat, df = _chi2(_joint(tokens), EXPECTED)
    assert stat < _chi2_limit(df), (stat, df)
    # A proposal the filter removed is never accepted.
    if drafts[1] == 4:
        assert not (tokens[:, 1] == 4).any()
    broken, df = _chi2(_joint(_broken(rows, None)), EXPECTED)
    assert broken > 3 * _chi2_limit(df), broken


def test_a_draft_models_proposals_keep_the_distribution() -> None:
    """Drafts drawn from another distribution ``q`` (a draft model's),
    per row, and accepted with probability min(1, p/q)."""
    rng = np.random.default_rng(5)
    q0 = _probs([0.0, 1.0, 0.5, -0.5, 0.2])
    q1 = _probs([1.0, 0.0, 0.0, 0.3, 0.8])  # gives mass to the filtered token
    drafts = np.stack(
        [rng.choice(5, size=ROWS, p=q0), rng.choice(5, size=ROWS, p=q1)], axis=1
    ).astype(np.int32)
    q = np.broadcast_to(np.stack([q0, q1])[None], (ROWS, 2, 5))
    tokens = _emitted(drafts, q)
    stat, df = _chi2(_joint(tokens), EXPECTED)
    assert stat < _chi2_limit(df), (stat, df)
    broken, df = _chi2(_joint(_broken(drafts, q)), EXPECTED)
    assert broken > 3 * _chi2_limit(df), broken
