"""The cache-state codec: a sequence's KV state cut into blocks, joined
back, written to a file and read back (``core.backend.StateCodec``).

A state is the list of one sequence's cache layers, in this model's layout
(``CacheLayout``: the KV format of ``mlx.kv_quant`` and which layers grow by
appending). Its plain attention layers are *blockable*: the prompt cache
cuts them into shared token blocks and any prefix is a valid state; a
sliding window or linear attention is kept whole (its "rest").
"""

from __future__ import annotations

import copy
import io
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.models.cache import (
    ArraysCache,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    save_prompt_cache,
)

from ..core.config import EngineConfig
from ..core.model import KvFootprint
from .kv_quant import KvPlan, KvStart, QuantizedKV, kv_format
from .kv_quant import layout as kv_layout
from .kv_quant import plan as kv_plan
from .memory import kv_footprint, kv_room

__all__ = ["CacheLayout", "MlxStates"]

log = logging.getLogger("gezel_trio.mlx")

_ALWAYS_TRIMMABLE = (KVCache, QuantizedKVCache, QuantizedKV, ConcatenateKVCache)
# Layers the prompt cache cuts into token blocks (plain and quantized KV).
_BLOCKABLE = (KVCache, QuantizedKV)
_CACHE_CLASSES: dict[str, Any] = {
    c.__name__: c
    for c in (
        KVCache,
        QuantizedKVCache,
        QuantizedKV,
        ConcatenateKVCache,
        ArraysCache,
        RotatingKVCache,
        ChunkedKVCache,
    )
}


def _copy_layer(layer: Any) -> Any:
    """An independent copy of one cache layer (extracted layers may be views
    of the batch's arrays)."""
    out = copy.copy(layer)
    out.state = tree_map(lambda a: mx.array(a) if isinstance(a, mx.array) else a, layer.state)
    return out


def _joined(parts: list[Any], length: int) -> Any:
    """Blocks of one layer's keys (or values) as one, ``length`` tokens
    long: arrays, or a quantized layer's (packed, scales, biases) triples."""
    if isinstance(parts[0], tuple):
        return tuple(_joined([p[e] for p in parts], length) for e in range(len(parts[0])))
    joined = mx.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]
    return joined[..., :length, :]


def _layer_signature(layer: Any) -> tuple[Any, ...]:
    """The shapes and dtypes of one cache layer's arrays, the sequence axis
    of a KV layer's ``(batch, heads, tokens, head dim)`` arrays left out:
    what a stored state must share with this model's to seed it."""
    grows = not isinstance(layer, ArraysCache)
    out: list[Any] = []
    for _, a in tree_flatten(layer.state):
        if not isinstance(a, mx.array):
            out.append(None)
            continue
        shape: list[int | None] = list(a.shape)
        if grows and a.ndim == 4:
            shape[2] = None
        out.append((tuple(shape), str(a.dtype).removeprefix("mlx.core.")))
    return tuple(out)


class CacheLayout:
    """One sequence's cache on this model: the KV format (``mlx.kv_quant``:
    with ``--kv-bits`` every plain attention layer's cache is quantized, in
    the batch, the blocks and on disk) and which layers are blockable."""

    def __init__(self, model: Any, config: EngineConfig, vision: bool, stream: Any) -> None:
        self._model = model
        self.group_size = config.kv_quant.group_size
        self.bits = config.kv_quant.bits
        self.plan = KvPlan(frozenset(), {})
        if self.bits and vision:
            log.warning("kv-bits: off for this model (an image model's KV stays unquantized)")
            self.bits = 0
        if self.bits:
            self.plan = kv_plan(model, self.bits, config.kv_quant.group_size, stream)
            kept = self.plan.describe(config.kv_quant.group_size)
            if kept is not None:
                log.warning("kv-bits %d: %s", self.bits, kept)
            if not self.plan.layers:
                self.bits = 0
        # --quantized-kv-start: unquantized until a lane's sequence is long.
        self.start: KvStart | None = None
        if self.bits and config.kv_quant.start > 0:
            self.start = KvStart(
                config.kv_quant.start,
                self.bits,
                config.kv_quant.group_size,
                self.plan.layers,
            )
            log.info(
                "kv-bits %d: a lane's KV is quantized once one of its sequences holds %d tokens",
                self.bits,
                config.kv_quant.start,
            )
        # A stored state is only ever read back in the KV format it was written in.
        self.format = kv_format(
            self.bits,
            config.kv_quant.group_size,
            config.kv_quant.start if self.start is not None else 0,
        )
        layout = self.new()
        self.count = len(layout)
        self.blockable = [i for i, c in enumerate(layout) if type(c) in _BLOCKABLE]
        self.rest = [i for i, c in enumerate(layout) if type(c) not in _BLOCKABLE]
        self.recurrent = any(type(c) is ArraysCache for c in layout)

    @property
    def trimmable(self) -> bool:
        """Every layer grows by appending: any prefix of a state is one."""
        return not self.rest

    def new(self) -> list[Any]:
        """A fresh cache for one sequence, in the configured KV format
        (unquantized until a start, ``--quantized-kv-start``)."""
        bits = 0 if self.start is not None else self.bits
        return kv_layout(self._model, bits, self.group_size, self.plan.layers)

    def budget(
        self, config: EngineConfig, weights: int, stream: Any
    ) -> tuple[KvFootprint | None, int]:
        """KV-aware admission: each sequence's KV, and the room the memory
        limit (or the machine) leaves for it beside ``weights`` bytes."""
        footprint = kv_footprint(self._model, stream, self.new())
        room = kv_room(config.memory, weights)
        if footprint is not None:
            log.info(
                "KV%s: %d bytes per token (+%s windowed, %d fixed); %.0f MB of weights leave "
                "%.0f MB for running sequences",
                (
                    f" (unquantized until {config.kv_quant.start} tokens: admission plans "
                    "with this size)"
                    if self.start is not None
                    else f" ({self.bits}-bit)"
                    if self.bits
                    else ""
                ),
                footprint.per_token,
                list(footprint.windowed),
                footprint.fixed,
                weights / 2**20,
                room / 2**20,
            )
        return footprint, room


class MlxStates:
    """``core.backend.StateCodec`` over mlx-lm cache layers, on the
    backend's stream."""

    def __init__(self, model: Any, layout: CacheLayout, stream: Any) -> None:
        self._model = model
        self._layout = layout
        self._stream = stream
        # What a stored state's layers must look like (``_signature``):
        # False until first asked for.
        self._layer_signatures: list[tuple[Any, ...]] | Literal[False] | None = False
        self._quantized_signatures: list[tuple[Any, ...]] | None = None

    def state_offsets(self, state: Any) -> list[int | None]:
        return [getattr(c, "offset", None) if type(c) in _ALWAYS_TRIMMABLE else None for c in state]

    def state_blocks(self, state: Any, ranges: Sequence[tuple[int, int]]) -> list[tuple[Any, int]]:
        out: list[tuple[Any, int]] = []
        arrays: list[Any] = []
        with mx.stream(self._stream):
            for start, end in ranges:
                layers = []
                nbytes = 0
                for i in self._layout.blockable:
                    c = state[i]
                    # mx.array() copies: a slice would keep the whole source
                    # buffer alive. A quantized layer's keys and values are
                    # (packed, scales, biases): each is sliced alike.
                    k, v = tree_map(
                        lambda a, start=start, end=end: mx.array(a[..., start:end, :]),
                        (c.keys, c.values),
                    )
                    layers.append((k, v))
                    flat = [a for _, a in tree_flatten((k, v))]
                    arrays += flat
                    nbytes += sum(a.nbytes for a in flat)
                out.append((tuple(layers), nbytes))
            mx.eval(arrays)
        return out

    def state_rest(self, state: Any) -> tuple[Any, int]:
        if not self._layout.rest:
            return None, 0
        with mx.stream(self._stream):
            rest = {i: _copy_layer(state[i]) for i in self._layout.rest}
            mx.eval([c.state for c in rest.values()])
        return rest, int(sum(c.nbytes for c in rest.values()))

    def join_state(self, blocks: Sequence[Any], length: int, rest: Any) -> Any:
        layers: list[Any] = [None] * self._layout.count
        with mx.stream(self._stream):
            for j, i in enumerate(self._layout.blockable):
                k = _joined(self._one_format([b[j][0] for b in blocks]), length)
                v = _joined(self._one_format([b[j][1] for b in blocks]), length)
                c = (
                    QuantizedKV(self._layout.group_size, self._layout.bits)
                    if isinstance(k, tuple)
                    else KVCache()
                )
                c.keys, c.values = k, v
                c.offset = length
                layers[i] = c
        for i, layer in (rest or {}).items():
            # A shallow copy: BatchGenerator merges seeds into fresh batch
            # arrays, so the stored arrays are never written.
            layers[i] = copy.copy(layer)
        if any(c is None for c in layers):
            raise ValueError("the rest state does not cover this model's unblockable layers")
        return layers

    def _one_format(self, parts: list[Any]) -> list[Any]:
        """One layer's blocks in one format: under ``--quantized-kv-start``
        a conversation's early blocks may be stored unquantized and its
        later ones quantized; the unquantized are quantized to join them
        (a group runs along one token, so this is what the lane's switch
        would have made of them)."""
        if all(isinstance(p, tuple) for p in parts) or not any(isinstance(p, tuple) for p in parts):
            return parts
        group, bits = self._layout.group_size, self._layout.bits
        return [
            p if isinstance(p, tuple) else tuple(mx.quantize(p, group_size=group, bits=bits))
            for p in parts
        ]

    def dump_state(self, state: Any, metadata: dict[str, str], path: Path) -> None:
        with mx.stream(self._stream):
            save_prompt_cache(str(path), state, metadata)

    def forget_state(self, path: Path) -> None:
        pass  # the payload is the whole state

    def load_state(self, payload: bytes, path: Path) -> tuple[Any, dict[str, str]]:
        with mx.stream(self._stream):
            loaded: Any = mx.load(io.BytesIO(payload), format="safetensors", return_metadata=True)
        arrays: dict[str, Any] = loaded[0]
        flat_meta: dict[str, str] = loaded[1]
        meta_tree = tree_unflatten(list(flat_meta.items()))
        metadata, classes, scalars = meta_tree
        unknown = set(classes) - set(_CACHE_CLASSES)
        if unknown:
            # Never instantiate a class named by a file beyond the known ones.
            raise ValueError(f"unknown cache classes {sorted(unknown)}")
        for pos, kind in scalars[1:]:
            array = arrays[pos]
            if kind == "scalar":
                arrays[pos] = array.item()
            elif kind == "string":
                arrays[pos] = "".join(chr(i) for i in array.tolist())
            elif kind == "none":
                arrays[pos] = None
            else:
                raise ValueError(f"unknown scalar kind {kind!r}")
        states = tree_unflatten(list(arrays.items()))
        layers = [_CACHE_CLASSES[c].from_state(st) for c, st in zip(classes, states, strict=True)]
        ref = self._layout.new()
        if [self._kind(c) for c in layers] != [self._kind(c) for c in ref]:
            raise ValueError("cache layers do not match this model's layout")
        self._check_shapes(layers)
        return layers, dict(metadata)

    def ready_state_checks(self) -> None:
        """Make what ``load_state`` checks states against now (a one-token
        pass of the model, the first time): a group's ranks run it at the
        same order, for its collectives."""
        self._signature()
        self._quantized_signature()

    def _kind(self, layer: Any) -> type[Any]:
        """A stored layer's class as the layout sees it: under
        ``--quantized-kv-start`` a planned layer is plain or quantized."""
        kind: type[Any] = type(layer)
        if self._layout.start is not None and kind is QuantizedKV:
            kind = KVCache
        return kind

    def _check_shapes(self, layers: list[Any]) -> None:
        """Raise ``ValueError`` naming the first layer whose arrays' shapes or
        dtypes are not the ones this model's cache holds: a stored state of
        another model (or one held in another dtype) would fail its lane, or
        worse, seed it with nonsense."""
        expected = self._signature()
        if expected is None:
            return
        quantized = self._quantized_signature()
        for i, (layer, want) in enumerate(zip(layers, expected, strict=True)):
            got = _layer_signature(layer)
            if type(layer) is QuantizedKV and quantized is not None:
                want = quantized[i]
            if got != want:
                raise ValueError(f"layer {i} holds {got}, this model's cache {want}")

    def _quantized_signature(self) -> list[tuple[Any, ...]] | None:
        """Under ``--quantized-kv-start``, the signature of every layer once
        quantized (from a one-token pass, made once); else ``None``."""
        start = self._layout.start
        if start is None:
            return None
        if self._quantized_signatures is None:
            with mx.stream(self._stream):
                ref = start.quantize_state(self._layout.new())
                self._model(mx.array([[0]]), cache=ref)
                mx.eval([c.state for c in ref])
            self._quantized_signatures = [_layer_signature(c) for c in ref]
        return self._quantized_signatures

    def _signature(self) -> list[tuple[Any, ...]] | None:
        """The signature of every layer of this model's cache, from a
        one-token forward pass made the first time it is asked for (a few
        milliseconds on the tiny models, one decode step on any); ``None``
        (warned once) where that pass fails: states are then checked by
        layer type only."""
        if self._layer_signatures is False:
            try:
                with mx.stream(self._stream):
                    ref = self._layout.new()
                    self._model(mx.array([[0]]), cache=ref)
                    mx.eval([c.state for c in ref])
                self._layer_signatures = [_layer_signature(c) for c in ref]
            except Exception as exc:  # a model whose bare forward pass fails
                log.warning("stored cache states are checked by layer type only: %s", exc)
                self._layer_signatures = None
        return self._layer_signatures
