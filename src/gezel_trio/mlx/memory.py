"""MLX's process-wide memory limits: the buffer cache and the wired limit.

MLX keeps freed Metal buffers for reuse (its buffer cache) and may wire
(pin) memory so the OS cannot page it out. Both are process-global, set
once the model is loaded, and the wired limit again after each
``BatchGenerator`` is built (mlx-lm wires Metal's whole recommended working
set in its constructor).

Two policies (``MemorySettings.policy``, ``--mlx-memory-policy``):

* ``quarter`` (ours): the buffer cache at a quarter of the ceiling
  (``memory_limit_mb``), so cached buffers never crowd out live ones;
  without a ceiling, the seed's cap (a sixteenth of Metal's working set
  within 256 MB-4 GB, else 1 GB; MLX's own where that is smaller: 32 MB on
  the CPU), where MLX's own on Metal is its whole memory limit; the wired
  limit only where ``wired_limit_mb`` says.
* ``bounded`` (the seed sidecar's): the ceiling is the smaller of
  ``memory_limit_mb`` and Metal's recommended working set; the wired limit
  is ``wired_limit_mb`` (never above the ceiling) or, without one, the
  ceiling; the buffer cache is 1/16 of what is wired (or of the ceiling),
  kept within 256 MB-4 GB, and 1 GB with no ceiling at all. The seed's
  figures: an unbounded buffer cache let a ~62 GB working set keep another
  ~45 GB of freed buffers (a 65 -> 120 GB sawtooth until mlx-lm's coarse
  clear); a sixteenth keeps a small pool for fast reuse that never becomes
  a second model-sized one (just under 4 GB for a 27B's planned set).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from ..core.backend import MemoryFigures
from ..core.config import MemorySettings
from ..core.model import KvFootprint
from ..core.settings import MIB

__all__ = [
    "MemoryLimits",
    "apply_buffer_cache_limit",
    "apply_wired_limit",
    "clear_buffer_cache",
    "kv_footprint",
    "kv_room",
    "log_limits",
    "machine_memory",
    "memory_figures",
    "memory_limits",
    "recommended_working_set",
    "weight_bytes",
]

log = logging.getLogger("gezel_trio.mlx")

_CACHE_FLOOR = 256 * MIB
_CACHE_CEILING = 4096 * MIB
_CACHE_WITHOUT_CEILING = 1024 * MIB


@attrs.frozen
class MemoryLimits:
    """Bytes; ``None`` leaves MLX's (or mlx-lm's) own limit in place."""

    ceiling: int | None
    wired: int | None
    buffer_cache: int | None


def memory_limits(memory: MemorySettings, recommended: int = 0) -> MemoryLimits:
    """The limits ``memory``'s policy sets, given Metal's recommended working
    set in bytes (0: unknown, or no Metal device)."""
    ceiling = int(memory.limit_mb * MIB) if memory.limit_mb else None
    planned = int(memory.wired_limit_mb * MIB) if memory.wired_limit_mb else None
    if memory.policy == "quarter":
        if memory.limit_mb is not None:
            return MemoryLimits(ceiling, planned, int(memory.limit_mb * MIB / 4))
        # Never unbounded: MLX's own cap on Metal is its whole memory limit,
        # where freed buffers grew a second model-sized pool (see above).
        # Without a ceiling the cap is the seed's, from Metal's working set.
        return MemoryLimits(None, planned, _seed_cache(recommended))
    known = [b for b in (ceiling, recommended) if b]
    ceiling = min(known) if known else None
    wired = min(planned, ceiling) if planned and ceiling else planned or ceiling
    scale = wired or ceiling
    return MemoryLimits(ceiling, wired, _seed_cache(scale))


def _seed_cache(scale: int | None) -> int:
    """The seed's buffer-cache cap: 1/16 of ``scale`` within 256 MB-4 GB, 1 GB without one."""
    return max(_CACHE_FLOOR, min(_CACHE_CEILING, scale // 16)) if scale else _CACHE_WITHOUT_CEILING


def recommended_working_set() -> int:
    """Metal's recommended working set in bytes; 0 without a Metal device."""
    if not mx.metal.is_available():
        return 0
    return int(mx.device_info().get("max_recommended_working_set_size", 0) or 0)


def apply_buffer_cache_limit(limits: MemoryLimits) -> int | None:
    """Cap MLX's buffer cache; returns the cap in force (bytes; ``None``:
    MLX's own, unknown). Without a ceiling the default cap never raises a
    smaller one MLX already has (32 MB on the CPU)."""
    if limits.buffer_cache is None:
        return None
    previous = int(mx.set_cache_limit(limits.buffer_cache))
    if limits.ceiling is None and 0 < previous < limits.buffer_cache:
        mx.set_cache_limit(previous)
        return previous
    return limits.buffer_cache


def clear_buffer_cache() -> None:
    """Give MLX's buffer cache back to the system without holding the GIL.

    ``mx.clear_cache`` holds the GIL for the whole call, and on this Linux
    VM the call took 15-27 ms with the CPU's 32 MB cache full (unmapping
    its pages): the Trio thread, waiting for the GIL, stood still as long.
    Measured with a sampler thread beside ``bench decode`` on SmolLM2 at 8
    streams, where each round's last stream ended: task steps of 20-25 ms
    with 0.3 ms of their own CPU, the host thread in this call each time.
    The same C++ function called through ``ctypes`` (which releases the
    GIL) does the same work; it is found in the ``libmlx`` that ``mlx.core``
    already loaded, never loaded anew. Where it cannot be found, MLX's own
    binding is called.
    """
    native = _native_clear_cache()
    if native is None:
        mx.clear_cache()
    else:
        native()


@functools.cache
def _native_clear_cache() -> Callable[[], None] | None:
    """``mlx::core::clear_cache()`` from the loaded ``libmlx``, through
    ``ctypes``; ``None`` where that library or symbol is not there."""
    name = "libmlx.dylib" if sys.platform == "darwin" else "libmlx.so"
    path = Path(mx.__file__).parent / "lib" / name
    try:
        # RTLD_NOLOAD: the copy mlx.core uses, or nothing (never a second one).
        lib = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
        fn = lib["_ZN3mlx4core11clear_cacheEv"]
    except (OSError, AttributeError):
        return None
    fn.restype = None
    fn.argtypes = []
    return fn


def machine_memory() -> int:
    """The memory MLX may use here, in bytes: Metal's recommended working
    set, else the machine's physical memory (0: unknown)."""
    recommended = recommended_working_set()
    if recommended:
        return recommended
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


def weight_bytes(model: Any) -> int:
    return int(sum(v.nbytes for _, v in tree_flatten(model.parameters())))


def kv_room(memory: MemorySettings, weights: int) -> int:
    """Bytes left for running sequences' KV: the memory limit (or the
    machine's memory) less the weights; 0 when that leaves nothing (then
    nothing is estimated: the limit is below the weights)."""
    limit = int(memory.limit_mb * MIB) if memory.limit_mb else machine_memory()
    return max(0, limit - weights)


def kv_footprint(model: Any, stream: Any, cache: list[Any] | None = None) -> KvFootprint | None:
    """What one sequence's KV takes, measured on the model's own cache
    objects after a one-token forward: a plain layer's bytes per token are
    its keys' and values' bytes over the length they hold (mlx-lm allocates
    256 at a time), a rotating layer's are bounded by its window, and any
    other state (linear attention, convolutions) counts as fixed. ``None``
    when the model cannot be run this way (it is then not estimated).
    ``cache``: a fresh cache to measure (default: mlx-lm's for the model; a
    quantized layer's bytes are its packed keys', scales' and biases')."""
    cache = cache if cache is not None else make_prompt_cache(model)
    try:
        with mx.stream(stream):
            model(mx.array([[0]]), cache=cache)
            mx.eval([c.state for c in cache])
    except Exception as exc:  # an architecture this probe does not fit
        log.warning("KV per token unknown (%s: %s); no KV-aware admission", type(exc).__name__, exc)
        return None
    per_token, fixed = 0, 0
    windowed: dict[int, int] = {}
    for c in cache:
        arrays = [a for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]
        nbytes = sum(a.nbytes for a in arrays)
        if isinstance(c, QuantizedKVCache) and c.keys is not None:
            per_token += nbytes // max(1, int(c.keys[0].shape[2]))
        elif isinstance(c, KVCache | RotatingKVCache) and c.keys is not None:
            per = nbytes // max(1, int(c.keys.shape[2]))
            if isinstance(c, RotatingKVCache):
                windowed[c.max_size] = windowed.get(c.max_size, 0) + per
            else:
                per_token += per
        else:
            fixed += nbytes
    return KvFootprint(per_token, tuple(sorted(windowed.items())), fixed)


def memory_figures(cache_limit: int | None) -> MemoryFigures:
    """MLX's memory now (host thread): live, its peak, the buffer cache."""
    return MemoryFigures(
        active=int(mx.get_active_memory()),
        peak=int(mx.get_peak_memory()),
        cache=int(mx.get_cache_memory()),
        cache_limit=cache_limit or 0,
    )


def apply_wired_limit(limits: MemoryLimits) -> None:
    """Wire at most ``limits.wired``; nothing to do without a Metal device."""
    if limits.wired is not None and mx.metal.is_available():
        mx.set_wired_limit(limits.wired)


def log_limits(memory: MemorySettings, limits: MemoryLimits) -> None:
    """One line on stderr: what was set, and what cannot apply here."""
    shown = [
        ("ceiling", limits.ceiling, "none"),
        ("wired", limits.wired, "MLX's own"),
        ("buffer cache", limits.buffer_cache, "MLX's own"),
    ]
    text = ", ".join(
        f"{name} {unset if b is None else f'{b / MIB:.0f} MB'}" for name, b, unset in shown
    )
    log.info("MLX memory (%s policy): %s", memory.policy, text)
    if limits.wired is not None and not mx.metal.is_available():
        log.info("no Metal device: the wired limit (%.0f MB) has no effect", limits.wired / MIB)
