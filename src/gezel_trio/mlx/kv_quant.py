"""A quantized KV cache the batch can hold (``--kv-bits``).

mlx-lm quantizes a single sequence's cache (``QuantizedKVCache``) but its
``BatchGenerator`` builds plain ``BatchKVCache`` layers, and has no batched
quantized one. ``BatchQuantizedKVCache`` is that layer: ``BatchKVCache``'s
bookkeeping (left padding, per-row offsets, filter, extend, extract, merge,
trim) over keys and values held as ``mx.quantize``'s (packed, scales,
biases) triples, so the attention of every mlx-lm model takes its quantized
path (``scaled_dot_product_attention`` looks for the cache's ``bits``).
``QuantizedKV`` is mlx-lm's single-sequence layer that such a batch merges
from and extracts to; a model's cache (``layout``) holds one in place of
each plain ``KVCache`` layer whose head size the group size divides
(``plan``). Every token is quantized, from the first, unless
``--quantized-kv-start`` says otherwise (``KvStart``): then a lane's caches
stay unquantized until one of its sequences holds that many tokens, and
from then on the lane's every sequence is quantized (one batch holds one
format), as mlx-lm converts a single sequence's cache once it passes the
start.

Sliding-window and recurrent layers stay as they are, and so does an
attention layer whose head size the group does not divide.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    dynamic_roll,
    make_prompt_cache,
)

from ..core.config import KV_BITS
from ..core.errors import ModelLoadError
from .mlx_lm_surface import BatchCache, generation_batch, prompt_batch, taken_over, waiting_caches

__all__ = [
    "BatchQuantizedKVCache",
    "KvPlan",
    "KvStart",
    "QuantizedKV",
    "kv_format",
    "layout",
    "plan",
]


Triple = tuple[mx.array, mx.array, mx.array]


def kv_format(bits: int, group_size: int, start: int = 0) -> str:
    """The KV format's name, part of a stored state's fingerprint: ``""``
    unquantized; ``start``: quantized once a sequence holds that many
    tokens (a stored state's values depend on where its lane switched)."""
    if not bits:
        return ""
    return f"kv{bits}g{group_size}" + (f"s{start}" if start else "")


def layout(model: Any, bits: int, group_size: int, layers: frozenset[int]) -> list[Any]:
    """A fresh cache for ``model``: mlx-lm's, with the plain ``KVCache``
    layers in ``layers`` each a ``QuantizedKV`` when ``bits`` (0: as mlx-lm
    makes it)."""
    cache: list[Any] = list(make_prompt_cache(model))
    if not bits:
        return cache
    return [
        QuantizedKV(group_size, bits) if i in layers and type(c) is KVCache else c
        for i, c in enumerate(cache)
    ]


@attrs.frozen
class KvPlan:
    """Which attention layers ``--kv-bits`` quantizes: those whose key and
    value head sizes the group size divides (``layers``); each other plain
    KV layer's head sizes (``kept``) stay unquantized."""

    layers: frozenset[int]
    kept: dict[int, tuple[int, int]]

    def describe(self, group_size: int) -> str | None:
        """A line for the log on what stays unquantized, or ``None``."""
        if not self.kept:
            return None
        sizes = sorted({s for pair in self.kept.values() for s in pair})
        return (
            f"{len(self.kept)} attention layer(s) stay unquantized: head size "
            f"{'/'.join(map(str, sizes))} is not a multiple of the group size {group_size}"
            + ("" if self.layers else " (nothing is quantized)")
        )


def plan(model: Any, bits: int, group_size: int, stream: Any) -> KvPlan:
    """``model``'s ``KvPlan``, from a one-token forward pass; then one through
    the quantized cache, which raises ``ModelLoadError`` naming why this
    model's attention cannot run on it."""
    if bits not in KV_BITS:
        raise ModelLoadError(f"--kv-bits {bits}: KV bits are one of {KV_BITS}")
    probe: list[Any] = list(make_prompt_cache(model))
    with mx.stream(stream):
        model(mx.array([[0]]), cache=probe)
    layers, kept = set(), {}
    for i, c in enumerate(probe):
        if type(c) is not KVCache or c.keys is None:
            continue
        sizes = (int(c.keys.shape[-1]), int(c.values.shape[-1]))
        if all(s % group_size == 0 for s in sizes):
            layers.add(i)
        else:
            kept[i] = sizes
    out = KvPlan(frozenset(layers), kept)
    if not layers:
        return out
    cache = layout(model, bits, group_size, out.layers)
    try:
        with mx.stream(stream):
            model(mx.array([[0]]), cache=cache)
            mx.eval([c.state for c in cache])
    except Exception as exc:
        raise ModelLoadError(
            f"--kv-bits {bits} --kv-group-size {group_size}: this model's attention does "
            f"not run on a quantized KV cache ({type(exc).__name__}: {exc})"
        ) from exc
    return out


def _map(fn: Callable[[mx.array], mx.array], triple: Triple) -> Triple:
    out: Triple = tree_map(fn, triple)
    return out


class QuantizedKV(QuantizedKVCache):  # type: ignore[misc]  # mlx-lm is untyped
    """mlx-lm's ``QuantizedKVCache`` that a batch merges (``merge``)."""

    def size(self) -> int:
        return int(self.offset)

    @classmethod
    def from_state(cls, state: Any) -> QuantizedKV:
        """As stored: a file gives the triples back as lists."""
        obj: QuantizedKV = super().from_state(state)
        if obj.keys is not None:
            obj.keys, obj.values = tuple(obj.keys), tuple(obj.values)
        return obj

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)


class BatchQuantizedKVCache(BatchCache):
    """``BatchKVCache`` with quantized keys and values (see the module)."""

    keys: Triple | None
    values: Triple | None
    # BatchKVCache's, set in its __init__.
    offset: Any
    left_padding: Any

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8) -> None:
        super().__init__(left_padding)
        self.group_size = group_size
        self.bits = bits

    def _quantize(self, x: mx.array) -> Triple:
        w, scales, biases = mx.quantize(x, group_size=self.group_size, bits=self.bits)
        return w, scales, biases

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        prev, n = self.idx, keys.shape[2]
        qk, qv = self._quantize(keys), self._quantize(values)
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            slots = (self.step + n - 1) // self.step * self.step

            def grow(have: Triple | None, new: Triple) -> Triple:
                B, H = new[0].shape[:2]
                room = _map(lambda a: mx.zeros((B, H, slots, a.shape[3]), a.dtype), new)
                if have is None:
                    return room
                if prev % self.step != 0:
                    have = _map(lambda a: a[..., :prev, :], have)
                joined: Triple = tuple(  # type: ignore[assignment]
                    mx.concatenate([a, b], axis=2) for a, b in zip(have, room, strict=True)
                )
                return joined

            self.keys, self.values = grow(self.keys, qk), grow(self.values, qv)
        assert self.keys is not None
        assert self.values is not None
        self.offset = self.offset + n
        self.idx += n
        for have, new in ((self.keys, qk), (self.values, qv)):
            for a, b in zip(have, new, strict=True):
                a[..., prev : self.idx, :] = b
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Triple, Triple]:
        assert self.keys is not None
        assert self.values is not None
        idx = self.idx
        return _map(lambda a: a[..., :idx, :], self.keys), _map(
            lambda a: a[..., :idx, :], self.values
        )

    def finalize(self) -> None:
        if self.right_padding is not None:
            padding = self.right_padding
            if self.keys is not None and self.values is not None:
                self.keys = _map(lambda a: dynamic_roll(a, padding[:, None], axis=2), self.keys)
                self.values = _map(lambda a: dynamic_roll(a, padding[:, None], axis=2), self.values)
            self.offset = self.offset - padding
            self.left_padding += padding
            self.right_padding = None

    def filter(self, batch_indices: Any) -> None:
        if self.keys is not None and self.values is not None:
            self.keys = _map(lambda a: a[batch_indices], self.keys)
            self.values = _map(lambda a: a[batch_indices], self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())
        if shift > 0:
            if self.keys is not None and self.values is not None:
                self.keys = _map(lambda a: a[..., shift:, :], self.keys)
                self.values = _map(lambda a: a[..., shift:, :], self.values)
            self.idx -= shift
            self.left_padding -= shift

    def extend(self, other: Any) -> None:
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        max_idx = max(self.idx, other.idx)
        ref: Any = self if self.keys is not None else other
        max_size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def pad(c: Any) -> tuple[Triple, Triple, mx.array, mx.array]:
            kv: list[Triple] = []
            for have, like in ((c.keys, ref.keys), (c.values, ref.values)):
                if have is None:
                    have = _map(_empty_like(c.offset.shape[0]), like)
                left = max_idx - c.idx
                right = max_size - have[0].shape[2] - left
                if right < 0:
                    have = _map(_cut(right), have)
                    right = 0
                if left or right:
                    have = _map(_padded(left, right), have)
                kv.append(have)
            return kv[0], kv[1], c.offset, c.left_padding + (max_idx - c.idx)

        (k1, v1, o1, p1), (k2, v2, o2, p2) = pad(self), pad(other)
        self.keys = _map_pair(k1, k2)
        self.values = _map_pair(v1, v2)
        self.offset = mx.concatenate([o1, o2])
        self.left_padding = mx.concatenate([p1, p2])
        self.idx = max_idx

    def extract(self, idx: int) -> QuantizedKV:
        assert self.keys is not None
        assert self.values is not None
        padding = self.left_padding.tolist()[idx]
        end = self.idx
        cache = QuantizedKV(self.group_size, self.bits)
        cache.keys = _map(lambda a: mx.contiguous(a[idx : idx + 1, :, padding:end]), self.keys)
        cache.values = _map(lambda a: mx.contiguous(a[idx : idx + 1, :, padding:end]), self.values)
        cache.offset = end - padding
        return cache

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchQuantizedKVCache:
        first = caches[0]
        group_size, bits = first.group_size, first.bits
        if any((c.group_size, c.bits) != (group_size, bits) for c in caches):
            raise ValueError("cannot batch KV caches quantized differently")
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches), group_size, bits)
        padding = [longest - n for n in lengths]
        ref = next(c for c in caches if c.keys is not None)
        B = len(caches)

        def room(like: Triple) -> Triple:
            return _map(lambda a: mx.zeros((B, a.shape[1], longest, a.shape[3]), a.dtype), like)

        keys, values = room(ref.keys), room(ref.values)
        for i, (p, c) in enumerate(zip(padding, caches, strict=True)):
            if c.keys is None:
                continue
            n = c.offset
            for have, new in ((keys, c.keys), (values, c.values)):
                for a, b in zip(have, new, strict=True):
                    a[i : i + 1, :, p : p + n] = b[..., :n, :]
        cache = cls(padding, group_size, bits)
        cache.keys, cache.values = keys, values
        cache.offset += longest
        cache.idx = longest
        return cache

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(a.nbytes for a in (*self.keys, *self.values))


def _empty_like(rows: int) -> Callable[[mx.array], mx.array]:
    return lambda a: mx.zeros((rows, a.shape[1], 0, a.shape[3]), a.dtype)


def _cut(end: int) -> Callable[[mx.array], mx.array]:
    return lambda a: a[..., :end, :]


def _padded(left: int, right: int) -> Callable[[mx.array], mx.array]:
    return lambda a: mx.pad(a, [(0, 0), (0, 0), (left, right), (0, 0)])


def _map_pair(a: Triple, b: Triple) -> Triple:
    joined: Triple = tuple(  # type: ignore[assignment]
        mx.concatenate([x, y], axis=0) for x, y in zip(a, b, strict=True)
    )
    return joined


# --- quantizing once a sequence is long (``--quantized-kv-start``) ------------------


def quantized_layer(cache: KVCache, group_size: int, bits: int) -> QuantizedKV:
    """One sequence's plain layer as a ``QuantizedKV`` holding the same
    tokens (mlx-lm's ``KVCache.to_quantized``, cut to the tokens held)."""
    out = QuantizedKV(group_size, bits)
    out.offset = cache.offset
    if cache.keys is not None:
        n = cache.offset
        out.keys, out.values = (
            tuple(mx.quantize(a[..., :n, :], group_size=group_size, bits=bits))
            for a in (cache.keys, cache.values)
        )
    return out


def quantized_batch_layer(cache: Any, group_size: int, bits: int) -> BatchQuantizedKVCache:
    """A plain batch layer's quantized twin, to put in its place: a new
    ``BatchQuantizedKVCache`` holding its padding, offsets and slots (and
    its holes, where it has them), each slot's keys and values quantized as
    ``mx.quantize`` would quantize them alone (a group runs along one
    token's head). A quantized layer is itself."""
    if isinstance(cache, BatchQuantizedKVCache):
        return cache
    keys, values = cache.keys, cache.values
    twin: BatchQuantizedKVCache = taken_over(
        cache, BatchQuantizedKVCache, group_size=group_size, bits=bits
    )
    if keys is not None:
        twin.keys, twin.values = twin._quantize(keys), twin._quantize(values)
    return twin


@attrs.frozen
class KvStart:
    """``--quantized-kv-start``: a lane's attention layers stay unquantized
    until one of its sequences holds ``start`` tokens; then every layer in
    ``layers`` of the lane's every sequence (prefilling, decoding or
    waiting) is quantized, and sequences that join it later are
    quantized as they join. A lane that empties starts unquantized again.

    For one sequence this is mlx-lm's ``maybe_quantize_kv_cache``: the
    cache is converted after the model call (a prefill chunk or a decode
    step) that brought it to ``start`` tokens. In a batch the switch is the
    lane's, since a batch holds one format: a short sequence that shares a
    lane with a long one is quantized with it."""

    start: int
    bits: int
    group_size: int
    layers: frozenset[int]

    def holds_quantized(self, state: Sequence[Any]) -> bool:
        """Whether one sequence's state (a seed) is already quantized."""
        return any(isinstance(state[i], QuantizedKVCache) for i in self.layers)

    def quantize_state(self, state: Sequence[Any]) -> list[Any]:
        """One sequence's state with its plain planned layers quantized."""
        return [
            quantized_layer(c, self.group_size, self.bits)
            if i in self.layers and type(c) is KVCache
            else c
            for i, c in enumerate(state)
        ]

    def due(self, gen: Any) -> bool:
        """Whether a sequence of ``gen`` (mlx-lm's ``BatchGenerator``) holds
        ``start`` tokens: each batch's ``tokens`` are what its cache holds,
        counted on the host (reading the cache's offsets would wait for the
        step in flight)."""
        for batch in (prompt_batch(gen), generation_batch(gen)):
            if any(len(t) >= self.start for t in batch.tokens):
                return True
        return False

    def quantize_generator(self, gen: Any) -> None:
        """Quantize every planned layer ``gen`` holds, each replaced in its
        list by its quantized twin: the prefilling batch's, the decoding
        batch's, and the waiting sequences' seeds."""
        for batch in (prompt_batch(gen), generation_batch(gen)):
            layers = batch.prompt_cache
            for i, c in enumerate(layers):
                if i in self.layers:
                    layers[i] = quantized_batch_layer(c, self.group_size, self.bits)
        for waiting in waiting_caches(gen):
            waiting[:] = self.quantize_state(waiting)
