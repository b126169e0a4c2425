"""Each rank's part of the model: tensor-parallel where mlx-lm's class
splits it and the heads divide the group, else a run of layers per rank."""

from __future__ import annotations

import logging
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from ...core.errors import ModelLoadError
from ...core.model import GroupInfo
from ..loading import LoadedModel

__all__ = ["PipelinedLlama", "Sharding", "pipeline", "rank_group", "shard"]

log = logging.getLogger("gezel_trio.mlx")


def rank_group() -> Any | None:
    """The ``mlx.distributed`` group this process was launched in (by
    ``mlx.launch``), or ``None`` when it runs alone."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init(strict=False)
    return group if group.size() > 1 else None


@attrs.frozen
class Sharding:
    """What ``MlxBackend`` calls on the model it loaded (its ``split``) under
    ``mlx.launch``: this rank keeps its part of it (``shard``, split as
    ``how`` asks: ``--group-split``), and the backend learns how."""

    group: Any
    how: str = "auto"

    def __call__(self, loaded: LoadedModel) -> GroupInfo:
        name = loaded.path.name
        if loaded.vision is not None:
            raise ModelLoadError(f"{name}: an image model is not split over ranks")
        split = shard(loaded.model, self.group, name, self.how)
        log.info("rank %d of %d: %s", self.group.rank(), self.group.size(), split)
        return GroupInfo(int(self.group.size()), split)


def shard(model: Any, group: Any, name: str, how: str = "auto") -> str:
    """Split ``model`` over ``group`` in place; says how: tensor-parallel
    (mlx-lm's ``shard``) where the class has it and the heads divide, else
    by layers (``pipeline``); ``how`` (``--group-split``) may ask for one.
    A model that cannot be split as asked is refused by name
    (``ModelLoadError``)."""
    n = group.size()
    tensor = _tensor_blocker(model, n) if how != "layers" else "--group-split layers"
    if tensor is None:
        try:
            model.shard(group)
        except AssertionError as exc:  # mlx-lm's own check, past ours
            raise ModelLoadError(
                f"{name}: mlx-lm's tensor-parallel split refused it ({exc}); "
                "try --group-split layers"
            ) from exc
        mx.eval(model.parameters())
        return f"tensor-parallel over {n} ranks"
    layers = _pipeline_blocker(model, n) if how != "tensor" else "--group-split tensor"
    if layers is None:
        split = pipeline(model, group)
        mx.eval(model.parameters())
        return split
    raise ModelLoadError(f"{name}: cannot be split over {n} ranks: {tensor}; {layers}")


def _tensor_blocker(model: Any, n: int) -> str | None:
    if not hasattr(model, "shard"):
        kind = f"{type(model).__module__}.{type(model).__name__}"
        return f"its mlx-lm class {kind} has no tensor-parallel split"
    # A vision-language export keeps its text model's settings apart.
    text = getattr(model, "language_model", model)
    args = getattr(text, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    if heads is not None and (heads % n or (kv_heads or 0) % n):
        return (
            f"its {heads} attention heads and {kv_heads} key/value heads are not "
            f"each a multiple of {n}"
        )
    vocab = getattr(args, "vocab_size", None)
    # Where mlx-lm splits an untied head by vocabulary (the class gathers
    # its logits over a ``sharding_group``), the vocabulary must divide.
    untied = not getattr(args, "tie_word_embeddings", True)
    if hasattr(text, "sharding_group") and untied and vocab and vocab % n:
        return f"its vocabulary of {vocab} tokens (the head's split) is not a multiple of {n}"
    return None


# The inner models whose forward pass ``PipelinedLlama`` reproduces (embed,
# masks, layers, norm), and those mlx-lm splits by layers itself.
_OWN_PIPELINE = {"mlx_lm.models.llama.LlamaModel"}


def _pipeline_blocker(model: Any, n: int) -> str | None:
    inner = getattr(model, "model", None)
    kind = f"{type(inner).__module__}.{type(inner).__name__}"
    if inner is None or (kind not in _OWN_PIPELINE and not hasattr(inner, "pipeline")):
        return f"no split by layers for {kind}"
    if len(inner.layers) < n:
        return f"its {len(inner.layers)} layers are fewer than {n} ranks"
    return None


def pipeline(model: Any, group: Any) -> str:
    """Split ``model`` by layers over ``group``: each rank keeps a run of
    consecutive layers (rank 0 the last ones, as mlx-lm's ``PipelineMixin``
    splits), every rank the embedding, the final norm and the head. A
    forward pass enters at the highest rank, each rank hands its hidden
    state down to the next (``send``/``recv``), and rank 0's output is
    gathered to every rank, so every rank computes the same logits; the
    arithmetic is one process's, layer for layer."""
    inner = model.model
    n, rank = group.size(), group.rank()
    kind = f"{type(inner).__module__}.{type(inner).__name__}"
    if kind not in _OWN_PIPELINE:
        inner.pipeline(group)
        start, end = inner.start_idx, inner.end_idx
        return f"by layers over {n} ranks: rank {rank} runs layers {start}-{end - 1}"
    count = len(inner.layers)
    base, extra = divmod(count, n)
    sizes = [base + (1 if r < extra else 0) for r in range(n)]
    start = sum(sizes[rank + 1 :])
    end = start + sizes[rank]
    model.model = PipelinedLlama(inner, start, end, group)
    return f"by layers over {n} ranks: rank {rank} runs layers {start}-{end - 1}"


# The settings of mlx-lm's llama inner model that the outer one reads
# (``make_cache``: its sliding window) or a reader of the model might.
_KEPT = ("args", "vocab_size", "num_hidden_layers", "layer_types", "sliding_window")


# mlx ships no type information for nn.Module, which mypy sees as Any.
class PipelinedLlama(nn.Module):  # type: ignore[misc]
    """A llama-style inner model over its run of layers, in the outer
    model's place for it (``model.model``). It keeps the inner model's
    parts under their own names (``embed_tokens``, ``layers``, ``norm``),
    so the outer model's head, its ``layers`` and ``make_cache``, and the
    weights' paths are as they were."""

    def __init__(self, inner: Any, start: int, end: int, group: Any) -> None:
        super().__init__()
        for name in _KEPT:
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers[start:end]
        self.norm = inner.norm
        self.fa_idx = next((i for i, la in enumerate(self.layers) if not la.use_sliding), 0)
        self.swa_idx = next((i for i, la in enumerate(self.layers) if la.use_sliding), None)
        self.group, self.rank, self.size = group, int(group.rank()), int(group.size())

    def __call__(
        self, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None
    ) -> mx.array:
        from mlx_lm.models.base import create_attention_mask

        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        fa_mask = create_attention_mask(h, cache[self.fa_idx])
        swa_mask = None
        if self.swa_idx is not None:
            swa_mask = create_attention_mask(
                h, cache[self.swa_idx], window_size=self.sliding_window
            )
        if self.rank < self.size - 1:
            h = mx.distributed.recv_like(h, self.rank + 1, group=self.group)
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, swa_mask if layer.use_sliding else fa_mask, cache=c)
        if self.rank != 0:
            h = mx.distributed.send(h, self.rank - 1, group=self.group)
            last = cache[-1]
            if last is not None and last.keys is not None:
                # A prefill evaluates only the caches: the send must be part of
                # what they depend on, or the rank below waits for it forever.
                keys = last.keys
                if isinstance(keys, tuple):
                    last.keys = (mx.depends(keys[0], h), *keys[1:])
                else:
                    last.keys = mx.depends(keys, h)
        h = mx.distributed.all_gather(h, group=self.group)[: h.shape[0]]
        out: mx.array = self.norm(h)
        return out
