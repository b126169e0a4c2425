"""What the engine knows of the loaded model (a frozen value)."""

from __future__ import annotations

import attrs

__all__ = ["ModelInfo"]


@attrs.frozen
class ModelInfo:
    model_id: str
    context_length: int
    eos_ids: frozenset[int]
    framing_markers: tuple[str, ...]
    # False when some cache layer may be unable to rewind (linear attention,
    # sliding windows): the engine then plants prompt snapshots.
    trimmable: bool
    # Identifies the model for on-disk cache files (mlx.fingerprint).
    fingerprint: str = ""
    # Whether sequences may join a batch that is already decoding.
    continuous_batching: bool = True
    # ``(<think>, </think>)`` token ids and texts when the model thinks in such blocks.
    think_ids: tuple[int, int] | None = None
    think_markers: tuple[str, str] | None = None
    # The tool-call markup family of the chat template (``shaping.toolcalls.resolve_format``).
    tool_format: str | None = None
    # Width of the model's logits: every token id a request names (logit_bias)
    # must be below it. 0: unknown (no such check).
    vocab_size: int = 0
    # Whether the model takes images (a vision-language model).
    vision: bool = False
