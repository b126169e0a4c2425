"""Speculation inside the batched decode step: each sequence's proposed
tokens are verified in the same forward pass as everyone's next token, and
each sequence keeps its own accepted prefix.

mlx-lm's ``GenerationBatch`` feeds one token per sequence per step.
``SpeculativeBatch`` (the lane's generation batch, ``install``) feeds
``k + 1`` when some sequence has a proposal (``mlx.speculation.lookup``): its pending
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
and marks each sequence's other rejected slots as holes (the seam's
``HoleyKVCache``, ``mlx.mlx_lm_surface``): attention masks them, and the
sequence's RoPE offset goes back by as many, so positions stay contiguous.
Holes cost memory until the sequence ends or is extracted (``extract``
gathers the valid slots, so the prompt cache stores a plain, dense entry).
Only models whose every layer is a plain ``KVCache`` speculate: a sliding
window or a recurrent state cannot take holes (``speculation_blocker``
names the layer).

**A draft model** (``--draft-model``, ``mlx.speculation.draft``) proposes where the
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

from .batch import SpeculativeBatch, install
from .draft import DraftModel, DraftPool, DraftState, check_pair
from .gate import SpecStats
from .lookup import NgramLookup, RecentBySalt, RecentSequences
from .roster import Roster, rejection_sample, speculation_blocker

__all__ = [
    "DraftModel",
    "DraftPool",
    "DraftState",
    "NgramLookup",
    "RecentBySalt",
    "RecentSequences",
    "Roster",
    "SpecStats",
    "SpeculativeBatch",
    "check_pair",
    "install",
    "rejection_sample",
    "speculation_blocker",
]
