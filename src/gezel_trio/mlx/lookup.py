"""Draft-free proposals: what followed the last few tokens the previous
time they occurred in the same sequence (prompt lookup decoding).

Agent traffic repeats what it has seen: a file the model edits comes back
in the patch, a tool's output is quoted, the previous answer is restated.
When the last ``n`` tokens of a sequence (its prompt and its output) occurred
before, the tokens that followed them then are a cheap guess at what comes
now, and the target model verifies the guess in one forward pass
(``mlx.speculative``). No second model, no training: a table from each
n-gram to where it last ended.

``NgramLookup`` indexes one sequence incrementally (O(``max_n``) per token)
and proposes from the longest n-gram, ``max_n`` down to ``min_n``, that
occurred before; the most recent occurrence wins (what recurs in agent
traffic is usually the latest version). A copy that reaches the sequence's
end continues with what it proposed, so a run or a loop is proposed whole.
Pure Python, no MLX: it runs on the host thread between steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["NgramLookup"]


class NgramLookup:
    """The n-gram index of one growing token sequence."""

    def __init__(self, max_n: int = 4, min_n: int = 2) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self.tokens: list[int] = []
        # n-gram -> the index just past its latest occurrence (n = len(key)).
        self._ends: dict[tuple[int, ...], int] = {}
        # Each new token's n-grams are entered one token late, so that the
        # latest occurrence of the sequence's own suffix is an earlier one.
        self._entered = 0

    def extend(self, tokens: Iterable[int]) -> None:
        self.tokens.extend(tokens)

    def _enter(self) -> None:
        """Index every n-gram that ends before the last token."""
        toks, ends = self.tokens, self._ends
        stop = len(toks) - 1
        for end in range(max(self._entered, 1), stop + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                ends[tuple(toks[end - n : end])] = end
        self._entered = max(self._entered, stop + 1)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest recurring suffix."""
        if k <= 0 or len(self.tokens) < self.min_n + 1:
            return []
        self._enter()
        toks = self.tokens
        for n in range(min(self.max_n, len(toks) - 1), self.min_n - 1, -1):
            end = self._ends.get(tuple(toks[len(toks) - n :]))
            if end is not None:
                # Copy on from there; a copy that reaches the end goes on
                # copying what it just proposed (a run or loop continues).
                out: list[int] = []
                for src in range(end, end + k):
                    out.append(toks[src] if src < len(toks) else out[src - len(toks)])
                return out
        return []

    @staticmethod
    def accepted(proposal: Sequence[int], targets: Sequence[int]) -> int:
        """How many leading proposed tokens the target's own choices confirm."""
        m = 0
        for p, t in zip(proposal, targets, strict=False):
            if p != t:
                break
            m += 1
        return m
