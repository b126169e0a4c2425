"""A draft model: a second, smaller model with the target's vocabulary
that proposes the tokens the target verifies (``--draft-model``).

Where the lookup (``mlx.speculation.lookup``) proposes only what recurs, a draft model
guesses new text too. Each speculating sequence has its own draft state
(``DraftState``): the draft's plain KV cache and the tokens it was fed.
Before proposing, the state catches up with the sequence: it trims what
it fed that the sequence did not keep (rejected proposals), feeds what the
sequence holds beyond that (its prompt on the first proposal, the tokens
accepted since), and decodes ``k`` greedy tokens. A greedy draft's proposal
is certain, so a sampled sequence verifies it by rejection sampling as it
verifies a lookup's (a point mass ``q``).

The draft runs per sequence, on the host thread, between the target's
steps: ``k`` passes of the draft per proposing sequence, and what they cost
is part of the verify step the gate measures (``mlx.speculation``), so a
draft that does not pay is not run.

A finished sequence's state is kept (``DraftPool``, per cache salt, the
``size`` latest within a byte budget): the next turn of a conversation,
whose tokens begin with the last turn's, takes it and feeds only what is
new, as the target's prompt cache serves the target. The pool lives in the process; the
draft's states are not written to disk (a restart's first turn feeds the
draft its whole prompt once).
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache

from ...core.errors import ModelLoadError

__all__ = ["DraftModel", "DraftPool", "DraftState", "check_pair"]


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share: a bisection over
    slice comparisons, which run in C (a 4,000-token sequence is compared
    every step)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo + 1 < hi:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def check_pair(name: str, draft: Any, draft_tokenizer: Any, tokenizer: Any) -> None:
    """Refuse, by name, a draft model that cannot propose for the target:
    another vocabulary, or a layer whose cache cannot drop rejected tokens."""
    mine, theirs = draft_tokenizer.get_vocab(), tokenizer.get_vocab()
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
        raise ModelLoadError(
            f"draft model {name}: its vocabulary differs from the target's "
            f"({len(mine)} against {len(theirs)} tokens; e.g. {differ}); a draft must "
            "share the target's tokenizer"
        )
    for i, c in enumerate(make_prompt_cache(draft)):
        if type(c) is not KVCache:
            raise ModelLoadError(
                f"draft model {name}: layer {i} keeps a {type(c).__name__}, which cannot "
                "drop rejected tokens; a draft needs plain attention layers"
            )


@attrs.define
class DraftState:
    """One sequence's draft cache and the tokens it holds."""

    cache: list[Any]
    fed: list[int] = attrs.Factory(list)
    salt: str = ""


@attrs.define
class DraftModel:
    """The draft and how it proposes; on the host thread only."""

    model: Any
    name: str
    # Tokens fed per pass when catching up with a long prompt.
    prefill_step: int = 512
    # Tokens it was fed to catch up, and passes it decoded, summed.
    fed_tokens: int = 0
    passes: int = 0

    def state(self, salt: str = "") -> DraftState:
        return DraftState(make_prompt_cache(self.model), salt=salt)

    def propose(self, state: DraftState, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``tokens``, the draft's greedy
        choices; ``state`` then holds ``tokens`` and the proposal but its
        last token."""
        if k <= 0 or not tokens:
            return []
        keep = min(_common_prefix(state.fed, tokens), len(tokens) - 1)
        if len(state.fed) > keep:
            trim_prompt_cache(state.cache, len(state.fed) - keep)
            del state.fed[keep:]
        feed = list(tokens[keep:])
        self.fed_tokens += len(feed)
        while len(feed) > self.prefill_step:
            head, feed = feed[: self.prefill_step], feed[self.prefill_step :]
            self.model(mx.array(head)[None], cache=state.cache)
            mx.eval([c.state for c in state.cache])
        logits = self.model(mx.array(feed)[None], cache=state.cache)[:, -1, :]
        out: list[mx.array] = []
        for j in range(k):
            token = mx.argmax(logits, axis=-1)
            out.append(token)
            if j + 1 < k:
                logits = self.model(token[None], cache=state.cache)[:, -1, :]
        drawn = mx.concatenate(out)
        mx.eval(drawn)
        self.passes += k
        proposal: list[int] = drawn.tolist()  # type: ignore[assignment]
        state.fed = [*tokens, *proposal[:-1]]
        return proposal


class DraftPool:
    """The draft states of sequences that finished lately, the ``size``
    latest within ``budget`` bytes of KV; a new sequence takes the one of
    its salt that shares the longest prefix with it (at least
    ``min_shared`` tokens)."""

    def __init__(self, size: int = 8, min_shared: int = 16, budget: int = 256 * 2**20) -> None:
        self.size = size
        self.min_shared = min_shared
        self.budget = budget
        self._states: list[tuple[DraftState, int]] = []
        self.hits = 0

    def __len__(self) -> int:
        return len(self._states)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self._states)

    def put(self, state: DraftState) -> None:
        if len(state.fed) < self.min_shared:
            return
        size = sum(c.nbytes for c in state.cache)
        if size > self.budget:
            return
        self._states.append((state, size))
        del self._states[: -self.size]
        while self.nbytes > self.budget:
            del self._states[0]

    def take(self, tokens: list[int], salt: str) -> DraftState | None:
        best, shared = -1, self.min_shared - 1
        for i, (s, _) in enumerate(self._states):
            if s.salt != salt:
                continue
            n = _common_prefix(s.fed, tokens)
            if n > shared:
                best, shared = i, n
        if best < 0:
            return None
        self.hits += 1
        return self._states.pop(best)[0]
