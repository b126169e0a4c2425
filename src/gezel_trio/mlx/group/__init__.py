"""One model over the ranks of an ``mlx.distributed`` group (``mlx.launch``).

Under ``mlx.launch`` every rank runs ``gezel-trio serve`` with the same
flags. Each loads the model and keeps its part of it (``shard``: mlx-lm's
tensor-parallel split where the model's class has one and its heads divide
the group, else a run of layers per rank, ``pipeline``). Rank 0 runs
everything else: HTTP, the scheduler, the host
loop and its prompt-cache index. Its backend is a ``GroupBackend``: every
backend call that changes what the ranks hold or computes with the model
(``insert``, ``step``, ``remove``, captures and the cache's block copies)
is first sent to the other ranks as an order, then run on rank 0's own
``MlxBackend``. The other ranks run ``follow``: the same calls, in the same
order, on their own ``MlxBackend``, so every forward pass meets its
collectives on every rank.

**States.** A cache state (a captured sequence, a block, a seed) is one
shard per rank. Rank 0's prompt cache holds ``Held`` handles; each rank
keeps its own shard of the same state under the handle's number (a
``Table``), numbered in the order calls return them, which is the same on
every rank because every rank ran the same calls. A handle rank 0 lets go
of is dropped on every rank with the next order.

**Agreement.** Greedy tokens agree because every rank computes the same
all-reduced logits. Sampled ones agree because every rank seeds MLX's
random state from rank 0's at start and then draws in the same order.
Speculation is off under a group (its gate decides from each rank's own
wall times, and its rejection sampling draws from numpy). Each order
carries rank 0's count of states made so far and a digest of the tokens
of its last step; a rank whose own differ stops with an error naming the
step, instead of computing on with another text.

**A rank that fails.** A rank that exits closes its sockets, and rank 0's
next collective raises: the group is lost (``GroupLost``, an engine
failure), every live request fails with it, later calls raise it at once,
and the server exits 1; ``mlx.launch`` also stops the group when a rank
exits non-zero. A rank that stalls (alive, not answering) would hold rank
0 in its collective for good, so a watchdog (``--group-timeout``) times
each call sent to the group: past the limit rank 0 fails every request (the
engine's ``die``: ``/health`` answers 503), and exits 1 a few seconds
later, whatever its host thread is blocked in.

**The wire.** An order is pickled and sent over a TCP connection from
each rank to rank 0 (opened at start: rank 0's address from the ring's
hostfile, its port shared with one ``all_sum``), so a rank waiting for
work sleeps in ``recv``: waiting in the ring's ``all_sum`` busy-waits a
whole core. Without a hostfile (another backend) the orders ride
``all_sum``s over a byte array (its size, then its bytes; the other ranks
add zeros), as ``mlx_lm.server`` shares its requests.

**The parts.** ``sharding`` (each rank's part of the model), ``wire`` (the
orders and how they travel), ``states`` (the states every rank holds its
shard of, and their files), ``rank0`` (``GroupBackend``, the decorator
over rank 0's backend, and its watchdog), ``follower`` (``follow``).
"""

from __future__ import annotations

from .follower import DivergedError, follow
from .rank0 import GroupBackend
from .sharding import Sharding, pipeline, rank_group, shard
from .states import Held
from .wire import GroupLost

__all__ = [
    "DivergedError",
    "GroupBackend",
    "GroupLost",
    "Held",
    "Sharding",
    "follow",
    "pipeline",
    "rank_group",
    "shard",
]
