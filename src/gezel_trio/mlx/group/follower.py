"""A rank other than 0: rank 0's orders run on its own backend, in order,
until rank 0 closes the group."""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import mlx.core as mx

from .states import CALLS, ShardFiles, Table, digest, map_args, map_result, method_of
from .wire import Order, Wire, log_times

__all__ = ["DivergedError", "follow"]

log = logging.getLogger("gezel_trio.mlx")


class DivergedError(RuntimeError):
    """A rank computed other tokens (or made other states) than rank 0."""


# The orders of rank 0's disk cache (``GroupBackend.dump_state`` and the rest).
_FILE_ORDERS = frozenset({"dump_shard", "load_shard", "forget_shard"})


def _on_file_order(order: Order, files: ShardFiles, table: Table, wire: Wire) -> None:
    """A rank's part of rank 0's cache file work. A failed write or delete
    is logged and costs a later miss; a load is agreed: every rank holds
    the loaded state, or none does."""
    if order.name == "load_shard":
        files.local.states.ready_state_checks()  # as rank 0 does: the model runs once
        try:
            state = files.load(*order.args)
        except Exception as exc:
            log.warning("rank %d: no usable shard of %s: %s", files.rank, order.args[1], exc)
            state, failed = None, 1
        else:
            failed = 0
        if wire.count(failed) == 0:
            table.keep(state)
        return
    try:
        if order.name == "dump_shard":
            number, *rest = order.args
            files.dump(table.held[number], *rest)
        else:
            files.forget(*order.args)
    except Exception:
        log.exception(
            "rank %d: %s of %s failed",
            files.rank,
            order.name,
            order.args[2 if order.name == "dump_shard" else 1],
        )


def follow(local: Any, group: Any, stream: Any) -> None:
    """A rank other than 0: run rank 0's orders on ``local`` (its own
    ``MlxBackend``) until rank 0 closes; raises ``DivergedError`` where its
    own results part from rank 0's."""
    wire = Wire(group, stream)
    table = Table()
    mx.random.seed(wire.seed())
    rank = group.rank()
    files = ShardFiles(local, int(rank), int(group.size()))
    last_step: str | None = None
    steps = 0
    # How long after rank 0 began sending a step's order this rank had it
    # (the latest ones: a long-lived rank keeps a bounded record).
    arrivals: collections.deque[float] = collections.deque(maxlen=100_000)
    try:
        while True:
            order: Order | None = wire.receive()
            if order is None:
                log_times(
                    "rank %d received %d step orders, each %.1f us (median) / %.1f us (p90) "
                    "after rank 0 began sending it",
                    arrivals,
                    int(rank),
                )
                return
            if order.name == "step":
                arrivals.append(time.monotonic() - order.sent_at)
            for number in order.released:
                table.held.pop(number, None)
            if order.made != table.made or (
                order.last_step is not None and order.last_step != last_step
            ):
                raise DivergedError(
                    f"rank {rank} parted from rank 0 after step {steps}: "
                    f"{table.made} states made against {order.made}, "
                    f"tokens {last_step} against {order.last_step}"
                )
            if order.name in _FILE_ORDERS:
                _on_file_order(order, files, table, wire)
                continue
            kinds, result = CALLS[order.name]
            held = table.held.__getitem__
            args = tuple(map_args(k, a, held) for k, a in zip(kinds, order.args, strict=True))
            try:
                out = method_of(local, order.name)(*args)
            except Exception:
                # Rank 0's call raised too, or the next order says it did not.
                log.exception("rank %d: %s failed", rank, order.name)
                continue
            if order.name == "step":
                last_step = digest(out)
                steps += 1
                wire.ack(steps)
            map_result(result, out, table.keep)
    finally:
        wire.close()
        local.close()
