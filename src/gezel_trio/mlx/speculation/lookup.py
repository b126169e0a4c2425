"""Draft-free proposals: what followed the last few tokens the previous
time they occurred in the same sequence (prompt lookup decoding).

Agent traffic repeats what it has seen: a file the model edits comes back
in the patch, a tool's output is quoted, the previous answer is restated.
When the last ``n`` tokens of a sequence (its prompt and its output) occurred
before, the tokens that followed them then are a cheap guess at what comes
now, and the target model verifies the guess in one forward pass
(``mlx.speculation``). No second model, no training: a table from each
n-gram to where it last ended.

``NgramLookup`` indexes one sequence incrementally (O(``max_n``) per token)
and proposes from the longest n-gram, ``max_n`` down to ``min_n``, that
occurred before; the most recent occurrence wins (what recurs in agent
traffic is usually the latest version). A copy that reaches the sequence's
end continues with what it proposed, so a run or a loop is proposed whole.
Pure Python, no MLX: it runs on the host thread between steps.

``RecentSequences`` is the same index over the sequences that finished
lately (their prompts and outputs, bounded by a token budget), shared by
every sequence of the backend with the same cache salt (``RecentBySalt``:
a tenant's sequences never propose another tenant's tokens, whose speed
would tell what they held): a file another agent read, a tool's output
another request quoted, the answer a retried request wrote before. A
sequence proposes from it where its own tokens propose nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["NgramLookup", "RecentBySalt", "RecentSequences"]


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


# Between two sequences in ``RecentSequences``: no n-gram that spans it
# matches a real sequence's suffix (token ids are >= 0).
_GAP = -1


class RecentSequences:
    """An n-gram index over the sequences that finished lately, at most
    ``budget`` tokens (the older half is dropped when it is full)."""

    def __init__(self, budget: int = 65_536, max_n: int = 4, min_n: int = 3) -> None:
        self.budget = budget
        self._index = NgramLookup(max_n, min_n)

    def __len__(self) -> int:
        return len(self._index.tokens)

    def add(self, tokens: Sequence[int]) -> None:
        """Remember a finished sequence's tokens (its most recent ``budget /
        2`` at most)."""
        tokens = list(tokens[-(self.budget // 2) :])
        if len(tokens) <= self._index.min_n:
            return
        index = self._index
        if len(index.tokens) + len(tokens) + 1 > self.budget:
            kept = index.tokens[len(index.tokens) // 2 :]
            if _GAP in kept:
                kept = kept[kept.index(_GAP) + 1 :]  # from a sequence's start
            index = self._index = NgramLookup(index.max_n, index.min_n)
            index.extend(kept)
        index.extend([*tokens, _GAP])

    def propose(self, suffix: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest of ``suffix``'s last
        ``max_n`` down to ``min_n`` tokens the latest time a remembered
        sequence held them (never past that sequence's end)."""
        index = self._index
        if k <= 0 or len(suffix) < index.min_n or not index.tokens:
            return []
        index._enter()
        toks = index.tokens
        for n in range(min(index.max_n, len(suffix)), index.min_n - 1, -1):
            end = index._ends.get(tuple(suffix[len(suffix) - n :]))
            if end is not None:
                out = toks[end : end + k]
                return out[: out.index(_GAP)] if _GAP in out else out
        return []


class RecentBySalt:
    """One ``RecentSequences`` per cache salt, for the ``partitions`` salts
    used last."""

    def __init__(self, partitions: int = 8, budget: int = 65_536) -> None:
        self.partitions = partitions
        self.budget = budget
        self._of: OrderedDict[str, RecentSequences] = OrderedDict()

    def of(self, salt: str) -> RecentSequences:
        recent = self._of.get(salt)
        if recent is None:
            recent = self._of[salt] = RecentSequences(self.budget)
            while len(self._of) > self.partitions:
                self._of.popitem(last=False)
        self._of.move_to_end(salt)
        return recent
