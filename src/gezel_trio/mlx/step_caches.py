"""What a compiled decode step (``mlx.compiled_step``) reads of the batch's
caches: whether it can take them (``layout_of``), the stand-ins its layers
see while they are traced, and the attention's masks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache

from .mlx_lm_surface import HoleyKVCache, cache_index, right_padding

__all__ = [
    "KV",
    "Layout",
    "NotTraceable",
    "StepCache",
    "TracedArrays",
    "TracedCache",
    "entry_width",
    "holey_step_mask",
    "layout_of",
    "step_mask",
]

# The attention caches a step is compiled on (``layout_of``).
_KINDS: Final = (BatchKVCache, HoleyKVCache)
# In a layout, an attention layer (its keys and values); any other entry is
# a linear-attention layer's (how many state arrays, whether it has left
# padding).
KV: Final = "kv"
Layout = tuple[str | tuple[int, bool], ...]


class TracedCache:
    """What one attention layer's step sees while it is traced."""

    def __init__(
        self, keys: mx.array, values: mx.array, index: mx.array, offset: mx.array, width: int
    ) -> None:
        self.keys, self.values, self.offset = keys, values, offset
        self._index, self._width = index, width

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self._index, axes=(2,))
        self.values = mx.slice_update(self.values, values, self._index, axes=(2,))
        return self.keys[..., : self._width, :], self.values[..., : self._width, :]

    def arrays(self) -> list[mx.array]:
        return [self.keys, self.values]


class TracedArrays:
    """What one linear-attention layer's step sees while it is traced: its
    state arrays and left padding (a decoding batch's ``ArraysCache``, which
    the layer reads and replaces by index), as ``ArraysCache`` uses them."""

    lengths = None

    def __init__(self, arrays: Sequence[mx.array], left_padding: mx.array | None) -> None:
        self.cache = list(arrays)
        self.left_padding = left_padding

    def __getitem__(self, i: int) -> mx.array:
        return self.cache[i]

    def __setitem__(self, i: int, value: mx.array) -> None:
        self.cache[i] = value

    def advance(self, n: int) -> None:
        if self.left_padding is not None:
            self.left_padding = self.left_padding - n

    def arrays(self) -> list[mx.array]:
        return self.cache if self.left_padding is None else [*self.cache, self.left_padding]


class StepCache:
    """What the model's own code (embedding, masks, the loop over layers)
    sees of a layer's cache during a compiled step: the masks, made once for
    the step. The layer's state is its compiled step's (``compiled_step``)."""

    def __init__(
        self, offset: mx.array | None, mask: mx.array | None, left_padding: mx.array | None = None
    ) -> None:
        self.offset, self._mask, self._left = offset, mask, left_padding

    def make_mask(self, n: int, return_array: bool = False, window_size: Any = None) -> Any:
        if n != 1 or window_size is not None:
            raise NotTraceable("a sliding window or more than one token")
        if self._mask is None and self._left is not None:
            # A linear-attention layer's, as ArraysCache.make_mask makes it:
            # only for the one layer the model asks.
            self._mask = (self._left <= 0)[:, None]
        return self._mask


class NotTraceable(Exception):
    """The model asked its cache for what the compiled step does not hold."""


def layout_of(cache: Sequence[Any]) -> Layout | None:
    """Each layer's entry (``KV``, or a linear-attention layer's count of
    state arrays and whether it is padded) when the step can be compiled on
    ``cache``: every attention layer a plain batch KV cache with a free
    slot, or speculation's holey one (holes or none in every layer), at one
    index and width; every other layer a decoding batch's ``ArraysCache``.
    ``None``: it cannot."""
    layout: list[str | tuple[int, bool]] = []
    first: Any = None
    holey = False
    for c in cache:
        if type(c) is ArraysCache:
            if c.lengths is not None or any(a is None for a in c.cache):
                return None
            layout.append((len(c.cache), c.left_padding is not None))
            continue
        if type(c) not in _KINDS or c.keys is None or right_padding(c) is not None:
            return None
        if first is None:
            first, holey = c, getattr(c, "holes", None) is not None
            if cache_index(c) >= c.keys.shape[2]:
                return None
        elif (
            type(c) is not type(first)
            or cache_index(c) != cache_index(first)
            or c.keys.shape[2] != first.keys.shape[2]
            or (getattr(c, "holes", None) is not None) != holey
        ):
            return None
        layout.append(KV)
    return tuple(layout) if first is not None else None


def entry_width(entry: str | tuple[int, bool]) -> int:
    """How many state arrays a layer's entry passes in and out of its step."""
    if not isinstance(entry, tuple):
        return 2  # keys, values
    count, padded = entry
    return count + padded


def step_mask(index: mx.array, left: mx.array, marker: mx.array) -> mx.array:
    """The attention's mask: the slots up to ``index`` that hold each
    sequence's tokens (not its left padding), over a window as wide as
    ``marker``."""
    slots = mx.arange(marker.shape[0])
    valid = (slots[None] <= index) & (slots[None] >= left[:, None])
    return valid[:, None, None, :]


def holey_step_mask(
    index: mx.array, left: mx.array, marker: mx.array, holes: mx.array
) -> tuple[mx.array, mx.array]:
    """``step_mask`` less speculation's rejected slots (``HoleyKVCache``); the
    one about to be written holds a real token, whatever it held before."""
    written = mx.zeros((holes.shape[0], 1), dtype=mx.bool_)
    holes = mx.slice_update(holes, written, index, axes=(1,))
    mask = step_mask(index, left, marker) & ~holes[:, None, None, : marker.shape[0]]
    return mask, holes
