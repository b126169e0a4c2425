"""What the engine knows of the loaded model (a frozen value)."""

from __future__ import annotations

import attrs

__all__ = ["GroupInfo", "KvFootprint", "ModelInfo"]


@attrs.frozen
class GroupInfo:
    """The ``mlx.distributed`` group one model is split over (``mlx.launch``):
    how many ranks, and how the model is split."""

    world_size: int
    split: str


@attrs.frozen
class KvFootprint:
    """What one sequence's KV cache takes, in bytes, as a function of its
    length: ``per_token`` for the layers that keep every token, each
    ``windowed`` ``(window, per_token)`` pair for layers that keep at most
    ``window`` tokens (sliding windows, rotating caches), and ``fixed`` for
    state whose size does not grow (linear attention, recurrent layers)."""

    per_token: int
    windowed: tuple[tuple[int, int], ...] = ()
    fixed: int = 0

    def bytes_for(self, tokens: int) -> int:
        held = sum(per * min(tokens, window) for window, per in self.windowed)
        return self.per_token * tokens + held + self.fixed


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
    # What a sequence's KV takes (``None``: unknown, nothing is estimated),
    # and the bytes the memory limit (or the machine) leaves for the KV of
    # running sequences once the weights are loaded (0: unknown).
    kv: KvFootprint | None = None
    kv_room: int = 0
    # The ranks the model is split over; ``None``: one process.
    group: GroupInfo | None = None
