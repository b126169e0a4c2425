"""What a backend measures, as one value: ``Backend.figures()`` once per step.

A figure that ``/metrics`` shows declares its metric on its field
(``metric``): its name, its help and whether it is a gauge or a counter.
The metrics publisher walks the fields (``published``), so a new figure is
a field here and the code of the part that measures it; nothing between
them (the host loop's report, the engine's link, the collector) names it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import attrs

__all__ = [
    "BackendFigures",
    "MemoryFigures",
    "Metric",
    "RankStep",
    "SpecFigures",
    "metric",
    "published",
]


@attrs.frozen
class Metric:
    """How ``/metrics`` shows one figure."""

    name: str
    help: str
    kind: Literal["gauge", "counter"] = "gauge"


def metric(name: str, help: str, kind: Literal["gauge", "counter"] = "gauge") -> Any:
    """An ``int`` figure, 0 until measured, that ``/metrics`` shows as ``name``."""
    return attrs.field(default=0, metadata={"metric": Metric(name, help, kind)})


def _spec(name: str, help: str) -> Any:
    # vLLM's spec_decode counters (vllm:spec_decode_num_drafts ...).
    return metric(f"gezel_spec_decode_num_{name}", help, "counter")


@attrs.frozen
class MemoryFigures:
    """A backend's memory, in bytes, read on the host thread: live, the peak
    of live since the start, the buffer cache (freed buffers kept for
    reuse) and its cap (0: unknown)."""

    # Live memory's gauge is the step report's own reading (``memory_in_use``).
    active: int = 0
    peak: int = metric("gezel_mlx_peak_memory_bytes", "The peak of live MLX memory.")
    cache: int = metric(
        "gezel_mlx_cache_memory_bytes",
        "MLX's buffer cache: freed buffers kept for reuse, given back at idle.",
    )
    cache_limit: int = metric(
        "gezel_mlx_cache_limit_bytes", "The cap on MLX's buffer cache (0: MLX's own, unknown)."
    )


@attrs.frozen
class SpecFigures:
    """What speculative decoding did since the start (``mlx.speculation``),
    as vLLM counts it: sequences that verified a proposal (summed over
    steps), tokens proposed, tokens accepted; the steps that verified; and
    of the tokens, those a draft model proposed (``--draft-model``)."""

    num_drafts: int = _spec("drafts", "Sequences that verified proposed tokens, summed over steps.")
    num_draft_tokens: int = _spec("draft_tokens", "Tokens proposed for verification.")
    num_accepted_tokens: int = _spec("accepted_tokens", "Proposed tokens the model accepted.")
    verify_steps: int = 0
    # Of the proposed and accepted tokens, those a draft model proposed.
    draft_model_tokens: int = _spec(
        "draft_model_tokens",
        "Of the proposed tokens, those the draft model proposed (--draft-model).",
    )
    draft_model_accepted_tokens: int = _spec(
        "draft_model_accepted_tokens", "Of the accepted tokens, those the draft model proposed."
    )


@attrs.frozen
class RankStep:
    """One rank of a group (``mlx.group``): how many steps it has finished,
    and when it said so last (``time.monotonic`` on the host thread)."""

    rank: int
    steps: int
    at: float


@attrs.frozen
class BackendFigures:
    """Everything a backend measured, read on the host thread after each
    step: ``/metrics`` shows the fields that declare a metric, ``/health``
    each rank's last step (empty for one process)."""

    memory: MemoryFigures = attrs.field(factory=MemoryFigures)
    speculation: SpecFigures = attrs.field(factory=SpecFigures)
    ranks: tuple[RankStep, ...] = ()


def published(figures: Any) -> Iterator[tuple[Metric, int]]:
    """Each figure of ``figures`` (an attrs instance, walked depth first)
    that declares a metric, with its value."""
    for field in attrs.fields(type(figures)):
        value = getattr(figures, field.name)
        declared = field.metadata.get("metric")
        if declared is not None:
            yield declared, int(value)
        elif attrs.has(type(value)):
            yield from published(value)
