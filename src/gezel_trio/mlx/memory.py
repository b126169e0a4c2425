"""MLX's process-wide memory limits: the buffer cache and the wired limit.

MLX keeps freed Metal buffers for reuse (its buffer cache) and may wire
(pin) memory so the OS cannot page it out. Both are process-global, set
once the model is loaded, and the wired limit again after each
``BatchGenerator`` is built (mlx-lm wires Metal's whole recommended working
set in its constructor).

Two policies (``EngineConfig.mlx_memory_policy``):

* ``quarter`` (ours): the buffer cache at a quarter of the ceiling
  (``memory_limit_mb``; MLX's own cap without one), so cached buffers never
  crowd out live ones; the wired limit only where ``wired_limit_mb`` says.
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

import logging

import attrs
import mlx.core as mx

from ..core.config import EngineConfig
from ..core.settings import MIB

__all__ = [
    "MemoryLimits",
    "apply_buffer_cache_limit",
    "apply_wired_limit",
    "log_limits",
    "memory_limits",
    "recommended_working_set",
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


def memory_limits(config: EngineConfig, recommended: int = 0) -> MemoryLimits:
    """The limits ``config``'s policy sets, given Metal's recommended working
    set in bytes (0: unknown, or no Metal device)."""
    ceiling = int(config.memory_limit_mb * MIB) if config.memory_limit_mb else None
    planned = int(config.wired_limit_mb * MIB) if config.wired_limit_mb else None
    if config.mlx_memory_policy == "quarter":
        quarter = None if config.memory_limit_mb is None else int(config.memory_limit_mb * MIB / 4)
        return MemoryLimits(ceiling, planned, quarter)
    known = [b for b in (ceiling, recommended) if b]
    ceiling = min(known) if known else None
    wired = min(planned, ceiling) if planned and ceiling else planned or ceiling
    scale = wired or ceiling
    cache = max(_CACHE_FLOOR, min(_CACHE_CEILING, scale // 16)) if scale else _CACHE_WITHOUT_CEILING
    return MemoryLimits(ceiling, wired, cache)


def recommended_working_set() -> int:
    """Metal's recommended working set in bytes; 0 without a Metal device."""
    if not mx.metal.is_available():
        return 0
    return int(mx.device_info().get("max_recommended_working_set_size", 0) or 0)


def apply_buffer_cache_limit(limits: MemoryLimits) -> None:
    if limits.buffer_cache is not None:
        mx.set_cache_limit(limits.buffer_cache)


def apply_wired_limit(limits: MemoryLimits) -> None:
    """Wire at most ``limits.wired``; nothing to do without a Metal device."""
    if limits.wired is not None and mx.metal.is_available():
        mx.set_wired_limit(limits.wired)


def log_limits(config: EngineConfig, limits: MemoryLimits) -> None:
    """One line on stderr: what was set, and what cannot apply here."""
    shown = [
        ("ceiling", limits.ceiling, "none"),
        ("wired", limits.wired, "MLX's own"),
        ("buffer cache", limits.buffer_cache, "MLX's own"),
    ]
    text = ", ".join(
        f"{name} {unset if b is None else f'{b / MIB:.0f} MB'}" for name, b, unset in shown
    )
    log.info("MLX memory (%s policy): %s", config.mlx_memory_policy, text)
    if limits.wired is not None and not mx.metal.is_available():
        log.info("no Metal device: the wired limit (%.0f MB) has no effect", limits.wired / MIB)
