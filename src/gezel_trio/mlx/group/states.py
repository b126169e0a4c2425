"""The states every rank holds its shard of: rank 0's handles on them,
each rank's table of its own, the backend calls that take or return them,
and each rank's files of the states rank 0 persists."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from ...core.backend import Admission, Captured, StepOutput
from ...core.shared_dir import temp_is_stale, temp_name

__all__ = [
    "CALLS",
    "STATE_CALLS",
    "Held",
    "ShardFiles",
    "Table",
    "check_shard",
    "digest",
    "local_of",
    "map_args",
    "map_result",
    "method_of",
    "number_of",
    "shard_meta",
]


@attrs.define(eq=False)
class Held:
    """Rank 0's handle on a state each rank holds its shard of: ``local``
    is rank 0's shard, ``number`` names the others'."""

    number: int
    local: Any


@attrs.define
class Table:
    """The states this rank holds, by number, and the next number: every
    rank numbers the states its calls return in the same order."""

    held: dict[int, Any] = attrs.Factory(dict)
    made: int = 0

    def keep(self, state: Any) -> int:
        number = self.made
        self.made += 1
        self.held[number] = state
        return number


def _walk(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with each state in it replaced by ``leaf(state)``: the
    states a backend call takes or returns, in one fixed order."""
    if isinstance(value, StepOutput):
        tokens = tuple(
            attrs.evolve(t, state=leaf(t.state)) if t.state is not None else t for t in value.tokens
        )
        return attrs.evolve(value, tokens=tokens)
    if isinstance(value, Captured):
        return attrs.evolve(value, state=leaf(value.state))
    if isinstance(value, Admission):
        seed = value.seed_state
        return attrs.evolve(value, seed_state=leaf(seed)) if seed is not None else value
    raise TypeError(f"no states known in {type(value).__name__}")


# The calls that go to every rank, and how their arguments and results hold
# states. ``args``: "state" an argument that is one, "states" a sequence of
# them, "admissions" Admissions with seeds, "" none. ``result``: how the
# result holds them.
CALLS: dict[str, tuple[tuple[str, ...], str]] = {
    "insert": (("admissions",), ""),
    "remove": (("",), "captured_by_rid"),
    "capture": (("",), "captured"),
    "state_blocks": (("state", ""), "blocks"),
    "state_rest": (("state",), "rest"),
    "join_state": (("states", "", "state"), "state"),
    "step": (("",), "step"),
    "reset": (("",), ""),
    "reclaim": ((), ""),
}
# Of those, the calls of the backend's state codec (``states``).
STATE_CALLS = frozenset({"state_blocks", "state_rest", "join_state"})


def method_of(local: Any, name: str) -> Any:
    """The local backend's method that runs the call ``name``."""
    return getattr(local.states if name in STATE_CALLS else local, name)


def map_args(kind: str, value: Any, leaf: Callable[[Any], Any]) -> Any:
    if kind == "state":
        return leaf(value) if value is not None else None
    if kind == "states":
        return [leaf(v) for v in value]
    if kind == "admissions":
        return [_walk(a, leaf) for a in value]
    return value


def map_result(kind: str, value: Any, leaf: Callable[[Any], Any]) -> Any:
    if kind == "state":
        return leaf(value)
    if kind == "rest":
        state, nbytes = value
        return (leaf(state) if state is not None else None), nbytes
    if kind == "blocks":
        return [(leaf(block), nbytes) for block, nbytes in value]
    if kind == "captured":
        return _walk(value, leaf) if value is not None else None
    if kind == "captured_by_rid":
        return {rid: _walk(c, leaf) for rid, c in value.items()}
    if kind == "step":
        return _walk(value, leaf)
    return value


def digest(out: StepOutput) -> str:
    """What a step emitted, to compare across ranks."""
    seen = [(t.rid, t.token, t.finish) for t in out.tokens]
    return hashlib.sha256(repr(seen).encode()).hexdigest()[:16]


def number_of(state: Any) -> int:
    if not isinstance(state, Held):
        raise TypeError(f"a state from outside the group: {type(state).__name__}")
    return state.number


def local_of(state: Any) -> Any:
    return state.local if isinstance(state, Held) else state


def shard_meta(rank: int, size: int) -> dict[str, str]:
    return {"gezel_rank": str(rank), "gezel_world_size": str(size)}


def check_shard(meta: dict[str, str], name: str, rank: int, size: int) -> None:
    """Raises unless ``meta`` is of rank ``rank``'s shard, in a group of
    ``size``, of the entry whose file is ``name``."""
    theirs = meta.get("gezel_rank"), meta.get("gezel_world_size")
    if theirs != (str(rank), str(size)):
        raise ValueError(
            f"written by rank {theirs[0]} of a group of {theirs[1]}, not rank {rank} of {size}"
        )
    if meta.get("gezel_file") != name:
        raise ValueError("a shard of another entry")


# A shard's temp file while it is written.
_TMP_SUFFIX = ".tmp.safetensors"


@attrs.define
class ShardFiles:
    """A rank's own files of the states rank 0 persists: rank ``r`` of ``n``
    keeps its shard of the entry in ``DIR/NAME.gzc`` (rank 0's file, sealed
    by the disk cache) as ``DIR/rank{r}of{n}/NAME.safetensors``. ``DIR`` is
    rank 0's path: on other machines, the same path on theirs (the same
    ``--persist-dir``, as ``mlx.launch`` gives every rank the same flags)."""

    local: Any
    rank: int
    size: int
    swept: set[Path] = attrs.Factory(set)

    def path(self, directory: str, name: str) -> Path:
        return Path(directory) / f"rank{self.rank}of{self.size}" / f"{name}.safetensors"

    def dump(self, state: Any, directory: str, name: str, metadata: dict[str, str]) -> None:
        final = self.path(directory, name)
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.parent not in self.swept:
            self.swept.add(final.parent)
            for old in final.parent.glob(".*" + _TMP_SUFFIX):
                if temp_is_stale(old):
                    old.unlink(missing_ok=True)
        tmp = final.with_name(temp_name(name, _TMP_SUFFIX))
        try:
            self.local.states.dump_state(
                state, {**metadata, **shard_meta(self.rank, self.size)}, tmp
            )
            # No fsync: a shard torn by a crash fails its load, and the
            # entry is a miss on every rank (``load``).
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)

    def load(self, directory: str, name: str) -> Any:
        path = self.path(directory, name)
        state, meta = self.local.states.load_state(path.read_bytes(), path)
        check_shard(meta, name, self.rank, self.size)
        return state

    def forget(self, directory: str, name: str) -> None:
        self.path(directory, name).unlink(missing_ok=True)
