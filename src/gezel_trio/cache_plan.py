"""Prompt-cache planning: how much of a cached state a prompt can reuse, where
to cut snapshots, and whether a captured snapshot is sound.

Pure functions over token sequences (no MLX, no Trio, no clock), shared by the
host thread's cache service and the tests.

Why snapshots: linear-attention (``ArraysCache``) and wrapped sliding-window
layers cannot rewind even one token. The state after a turn holds the
generated tokens, and the next turn's prompt re-renders that reply
differently (thinking stripped, re-tokenized), so the post-turn state is not
a prefix of the next prompt and is worthless. Instead the engine cuts the
prompt at ``len(prompt) - SNAPSHOT_MARGIN`` and keeps the state at that cut:
the last few tokens of a prompt (``...<|im_start|>assistant\\n``) re-merge
under BPE once the next turn continues the text, so a cut right at the end
misses the next prompt by a token or two; 16 tokens back is safely inside
text both turns share, at a cost of at most 16 re-prefilled tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import attrs

__all__ = [
    "SNAPSHOT_MARGIN",
    "SeedPlan",
    "common_prefix",
    "plan_seed",
    "snapshot_cut",
    "snapshot_is_sound",
    "split_segments",
]

SNAPSHOT_MARGIN = 16

SeedMode = Literal["fresh", "extend", "trim", "divergent"]


@attrs.frozen
class SeedPlan:
    """How a request starts from a cached state.

    ``reuse`` prompt tokens come from the cache (that is what usage reports as
    ``cached_tokens``); ``trim`` tokens are cut off the end of the cached state
    first (trimmable caches only). ``divergent`` means the entry exists but
    cannot serve this prompt: it is untrimmable and not a prefix of it.
    """

    mode: SeedMode
    reuse: int = 0
    trim: int = 0
    cached_len: int = 0
    lcp: int = 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix, comparing blocks at C speed first."""
    n = min(len(a), len(b))
    i, block = 0, 512
    while i < n:
        j = min(i + block, n)
        if a[i:j] == b[i:j]:
            i = j
            continue
        while a[i] == b[i]:
            i += 1
        return i
    return n


def plan_seed(cached: Sequence[int] | None, prompt: Sequence[int], trimmable: bool) -> SeedPlan:
    """Plan reuse of a cached state whose KV holds exactly ``cached`` tokens.

    At least one prompt token is always left to prefill: the model must run
    on something to produce the first token's logits.
    """
    if not cached:
        return SeedPlan("fresh")
    lcp = common_prefix(cached, prompt)
    usable = min(lcp, len(prompt) - 1)
    n = len(cached)
    if usable == n:
        return SeedPlan("extend", reuse=n, cached_len=n, lcp=lcp)
    if not trimmable:
        return SeedPlan("divergent", cached_len=n, lcp=lcp)
    if usable == 0:
        return SeedPlan("fresh", cached_len=n, lcp=lcp)
    return SeedPlan("trim", reuse=usable, trim=n - usable, cached_len=n, lcp=lcp)


def split_segments(prompt: Sequence[int], reuse: int, cuts: Iterable[int]) -> list[list[int]]:
    """``prompt[reuse:]`` split at the absolute token indices in ``cuts``
    (those strictly inside it); the engine stops at each segment end, which is
    where snapshots are taken."""
    edges = sorted({c for c in cuts if reuse < c < len(prompt)})
    out: list[list[int]] = []
    start = reuse
    for edge in (*edges, len(prompt)):
        out.append(list(prompt[start:edge]))
        start = edge
    return out


def snapshot_is_sound(
    tokens: Sequence[int],
    prompt: Sequence[int],
    boundary: int,
    offsets: Iterable[int | None],
) -> bool:
    """A captured state may be kept only if its tokens are exactly the
    prompt's first ``boundary`` tokens and every layer that tracks a position
    agrees (``None`` offsets belong to layers that keep no position)."""
    if boundary <= 0 or len(tokens) != boundary:
        return False
    if tuple(tokens) != tuple(prompt[:boundary]):
        return False
    return all(off is None or off == boundary for off in offsets)


def snapshot_cut(prompt_len: int, reuse: int, margin: int = SNAPSHOT_MARGIN) -> int | None:
    """Where to plant the session snapshot, or ``None`` when the cut would not
    extend what the request already reuses."""
    cut = prompt_len - margin
    return cut if cut > reuse else None
