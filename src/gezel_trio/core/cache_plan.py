"""Prompt-cache planning: shared prefixes, where to cut snapshots, and whether
a captured snapshot is sound.

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
text both turns share, at a cost of at most 16 re-prefilled tokens. That
margin is the fallback: where the renderer can locate message boundaries
(``RenderedPrompt.boundaries``) the cuts go exactly there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "SNAPSHOT_MARGIN",
    "common_prefix",
    "snapshot_cut",
    "snapshot_is_sound",
    "split_segments",
]

SNAPSHOT_MARGIN = 16


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix (of token lists or of texts),
    comparing blocks at C speed first."""
    n = min(len(a), len(b))
    i, block = 0, 512
    while i < n:
        j = min(i + block, n)
        if a[i:j] == b[i:j]:
            i = j
            continue
        # Bounded: slices of a tuple and a list never compare equal, so
        # this loop may be reached with the two blocks alike.
        while i < j and a[i] == b[i]:
            i += 1
        if i < j:
            return i
    return n


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
