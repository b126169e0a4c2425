"""One-token decode steps, each layer's a compiled graph (``--compiled-step``).

On the CPU the host thread builds each step's graph in Python while the
cores wait for it (docs/performance.md, "Why the host's Python between steps
costs its full time"), and MLX runs every elementwise op of the graph as a
kernel of its own. mlx-lm's ``BatchKVCache`` writes and reads its buffer at
Python integer offsets, so each step is a new graph, and ``mx.compile``
cannot be applied to the model as it is.

``CompiledDecode`` stands in for the model in ``BatchGenerator``. A call with
one token per sequence, on caches it can take (``step_caches.layout_of``), runs the
model's own code (embedding, the loop over layers, the norm and head) with
each layer replaced for that call by its compiled step (``_LayerStep``):

- the token's keys and values are written at an index held in an array
  (``mx.slice_update``);
- the attention reads the buffer up to the next multiple of 64 slots past
  that token (a wider step past 512 slots: ``window``), under a mask of the
  slots that hold the sequence's tokens (not its left padding, not the
  slots beyond), made once per step. A window as wide as the buffer (256
  slots at a time) made the attention read up to 255 empty slots per
  sequence, which cost more than the compiling saved at 8 streams;
- a hybrid model's linear-attention layers (Qwen 3.5's ``ArraysCache``: a
  convolution state, a recurrent one, the batch's left padding) pass their
  state in and out as the attention layers pass their KV;
- speculation's caches with holes (``HoleyKVCache``: rejected slots beside
  accepted ones) add the holes to the mask and clear the written slot's, as
  their own ``update_and_fetch`` does.

Layers of one kind (class, weights' names and shapes, cache entry) share
one compiled function, their weights passed in as arguments: it is traced
once per batch size and window for all of them, 3-5 ms for SmolLM2's 30
layers. Compiling the whole model as one function cost 20-45 ms per trace,
every millisecond of it with the GIL held (MLX's graph passes), so each new
shape stalled the Trio thread that long (docs/performance.md). A layer's
arrays that are not weights (a RoPE's frequencies) are the first traced
layer's: in these families every layer's are the same. The caches then
advance as ``update_and_fetch`` would have advanced them. Every other call
(a prefill, a quantized or rotating cache, a speculative verify, a buffer
that must grow first) goes to the model unchanged.

The masked slots get weights of exactly zero, but BLAS sums the weighted
values over the wider buffer in another order, so logits differ from the
model's own step in their last bits (up to 3e-6 on the test models; with
16-wide heads not at all). Greedy tokens were the same in every test
(``tests/mlx/test_compiled_step.py``); a comparison with mlx-lm to the bit
needs ``--compiled-step off``.

A step of two sequences or more computes each ``nn.Linear`` as ``W @ xᵀ``
while its layer is traced, and a call of several tokens a sequence and
``VERIFY_ROWS`` rows or fewer (a speculative verify, a short prompt) is the
model's own, eager, with its layers' linears computed so (not the head):
the same values to the bit, a few percent faster on OpenBLAS
(``tuning.rows_last``, which says by how much). ``rows_last=False`` (the
platform tuning off) keeps ``nn.Linear``'s own product.

MLX fuses the traced elementwise ops into kernels it compiles with the
system's ``g++`` and keeps under ``$TMPDIR/mlx/<version>/cpu`` for later
processes (seconds of compiling, once per machine). Without ``g++`` MLX
runs them unfused, which measured no faster than the model's own step, so
the step is not compiled then. ``warm`` compiles them at load, so no request
waits for the compiler. Only the families whose attention reads
``cache.offset``, ``update_and_fetch`` and ``make_mask`` as llama's does are
compiled (``_FAMILIES``: llama, qwen2, qwen3, qwen3_5). Each layer's weights
are read at its first compiled step: a model whose weights change after
load would need a new ``CompiledDecode``.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from ..core.shared_dir import DirLock
from ..tuning.rows_last import linears_rows_last
from .mlx_lm_surface import cache_index, set_cache_index
from .step_caches import (
    KV,
    Layout,
    NotTraceable,
    StepCache,
    TracedArrays,
    TracedCache,
    entry_width,
    holey_step_mask,
    layout_of,
    step_mask,
)

__all__ = ["CompiledDecode", "compiled_blocker"]

log = logging.getLogger(__name__)

# mlx-lm modules whose attention uses the cache as llama's does: RoPE at
# ``cache.offset``, then ``update_and_fetch``, then the mask from
# ``create_attention_mask(h, cache[0])``.
# Qwen 3.5's linear-attention layers keep their state in an ArraysCache.
_FAMILIES: Final = frozenset(
    {"mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3", "mlx_lm.models.qwen3_5"}
)


# The attention reads the buffer up to the next multiple of a step of 64
# slots past the newest token; past 512 slots the step doubles with the
# width (128 up to 1,024, 256 up to 2,048, ...), so a long sequence makes a
# new trace at most every quarter of its length, and reads at most a
# quarter more slots than it holds. A step's traces hold the GIL 3-5 ms on
# SmolLM2, one layer's trace at a time (docs/performance.md).
STEP: Final = 64


def window(slots: int) -> int:
    """How many slots the attention reads when ``slots`` hold tokens."""
    step = STEP
    while slots > step * 8:
        step *= 2
    return -(-slots // step) * step


# Past this many shapes of step (each a trace of every kind of layer) they are
# all dropped and made again as steps need them: a bound on what a
# long-running server keeps, where batch sizes and lengths keep changing.
MAX_TRACES: Final = 512
# The most rows (sequences x tokens) of a call of several tokens a sequence
# whose layers compute as ``W @ xᵀ`` (``CompiledDecode._few_rows``): the
# identity to the bit is tested up to 16.
VERIFY_ROWS: Final = 16
# How long a warm-up waits for another process's (``_kernels_lock``).
_LOCK_WAIT_S: Final = 120.0


def compiled_blocker(model: Any) -> str | None:
    """Why ``model``'s decode step is not compiled; ``None``: it can be."""
    family = type(model).__module__
    if family not in _FAMILIES:
        return f"{family.rsplit('.', 1)[-1]} is not among the families it is built for"
    on_cpu = mx.default_device() == mx.cpu
    if on_cpu and sys.platform.startswith("linux") and shutil.which("g++") is None:
        # MLX's CPU backend builds its fused kernels with g++; unfused, the
        # compiled step was no faster than the model's (docs/performance.md).
        return "no g++ on PATH for MLX's fused CPU kernels"
    return None


class _LayerStep:
    """Stands in for one layer in the model's loop during a compiled step:
    runs the layer's compiled step on the state it holds (``state``: the
    cache's arrays in, the new ones out). Attributes it does not have are
    the layer's (the loop reads ``is_linear``, ``use_sliding``)."""

    def __init__(self, owner: CompiledDecode, i: int, entry: str | tuple[int, bool]) -> None:
        self._owner, self._i, self._entry = owner, i, entry
        self.layer = owner._originals[i]
        self.state: list[mx.array] = []
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.layer, name)

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        owner = self._owner
        extras = owner._extras if self._entry == KV else []
        fn, params = owner._layer_fn(self._i, self._entry, mask is None)
        masks = [] if mask is None else [mask]
        out = fn(x, *masks, *self.state, *extras, *params)
        self.state = out[1:]
        self.calls += 1
        h: mx.array = out[0]
        return h


def _layer_list(model: Any) -> list[Any]:
    """The list the model's loop runs its layers from (``model.layers`` may
    be a fresh slice of it, as in mlx-lm's pipelined models)."""
    layers = model.layers
    todo = [model] if isinstance(model, dict) else []
    while todo:  # nn.Module is a dict of its children
        module = todo.pop(0)
        found = module.get("layers")
        if (
            isinstance(found, list)
            and len(found) == len(layers)
            and all(a is b for a, b in zip(found, layers, strict=True))
        ):
            return found
        todo += [v for v in module.values() if isinstance(v, dict)]
    if not isinstance(layers, list):
        raise TypeError("the model's layers are not a list")
    return layers


class CompiledDecode:
    """``model`` for ``BatchGenerator``, its one-token steps compiled where
    the caches allow (the module docstring). Attributes it does not have are
    the model's."""

    def __init__(self, model: Any, *, rows_last: bool = True) -> None:
        self._model = model
        # Linears as ``W @ xᵀ`` for a few rows (``tuning.rows_last``).
        self._rows_last = rows_last
        self._layers = len(model.layers)
        # The list the model's loop reads its layers from, and its layers.
        self._layer_list: list[Any] = []
        self._originals: list[Any] = []
        # One compiled function per kind of layer (``_layer_fn``), and the
        # masks': each traced once per batch size and window.
        self._fns: dict[tuple[int, str | tuple[int, bool], bool], Any] = {}
        # Each layer's kind: its class, its weights' names and their shapes,
        # numbered; the weights, read at its first compiled step (a model
        # whose weights change after load needs a new CompiledDecode).
        self._kind_ids: dict[tuple[Any, ...], int] = {}
        self._names: dict[int, tuple[str, ...]] = {}
        self._kinds: list[int | None] = [None] * self._layers
        self._params: list[list[mx.array]] = [[] for _ in range(self._layers)]
        self._masks: Any = None
        self._holey_masks: Any = None
        self._tracing: Any = None  # the layer a step is traced with
        self._extras: list[mx.array] = []  # an attention layer's index, offset, window
        # The layouts steps were compiled for, the last one's last.
        self.layouts: list[Layout] = []
        # One marker array per window width: its shape is the width.
        self._windows: dict[int, mx.array] = {}
        self._off: str | None = None
        # The layers' own linears: a call of a few tokens a sequence (a
        # verify) computes them as ``W @ xᵀ``, and not the head.
        self._layer_linears = frozenset(
            id(m)
            for layer in model.layers
            for _, m in layer.named_modules()
            if isinstance(m, nn.Linear)
        )
        self.few_row_calls = 0  # such calls, verifies and short prompts (for tests)
        # Steps of new shapes (layout, batch, window), and the steps that ran
        # compiled: for tests and logs.
        self.traces: set[tuple[Layout, int, int]] = set()
        self.steps = 0
        self.layer_traces = 0  # layer steps traced, shared by layers of a kind
        self.retraced = 0  # times every trace was dropped (MAX_TRACES)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    @property
    def shapes(self) -> set[tuple[int, int]]:
        """The (batch, window) pairs traced, whatever the layout."""
        return {(b, w) for _, b, w in self.traces}

    def _layer_fn(self, i: int, entry: str | tuple[int, bool], no_mask: bool) -> Any:
        """Layer ``i``'s compiled step and the weights to pass it. Layers of
        one kind (class, weights' names and shapes, cache entry) share one
        function, its weights passed in: one trace serves them all."""
        layer = self._originals[i]
        base = self._kinds[i]
        if base is None:
            flat = tree_flatten(layer.parameters())
            self._params[i] = [v for _, v in flat]
            names = tuple(k for k, _ in flat)
            shapes = tuple((v.shape, v.dtype) for _, v in flat)
            base = self._kind_ids.setdefault((type(layer), names, shapes), len(self._kind_ids))
            self._kinds[i] = base
            self._names.setdefault(base, names)
        kind = (base, entry, no_mask)
        fn = self._fns.get(kind)
        if fn is None:
            fn = self._fns[kind] = mx.compile(self._traced_layer(self._names[base], entry, no_mask))
        self._tracing = layer
        return fn, self._params[i]

    def _traced_layer(
        self, names: Sequence[str], entry: str | tuple[int, bool], no_mask: bool
    ) -> Any:
        def traced(*arrays: mx.array) -> list[mx.array]:
            x, at = arrays[0], 1
            mask = None if no_mask else arrays[1]
            at += not no_mask
            state = arrays[at : at + entry_width(entry)]
            at += len(state)
            cache: TracedCache | TracedArrays
            if not isinstance(entry, tuple):
                index, offset, marker = arrays[at : at + 3]
                at += 3
                cache = TracedCache(state[0], state[1], index, offset, marker.shape[0])
            elif entry[1]:  # padded: its left padding comes last
                cache = TracedArrays(state[:-1], state[-1])
            else:
                cache = TracedArrays(state, None)
            self.layer_traces += 1
            # The layer, its weights the traced inputs for the trace's length.
            layer = self._tracing
            weights = layer.parameters()
            layer.update(tree_unflatten(list(zip(names, arrays[at:], strict=True))))
            try:
                with linears_rows_last(x.shape[0]) if self._rows_last else contextlib.nullcontext():
                    h = layer(x, mask, cache=cache)
            finally:
                layer.update(weights)
            return [h, *cache.arrays()]

        return traced

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> Any:
        if (
            self._off is not None
            or kwargs
            or cache is None
            or len(cache) != self._layers
            or inputs.ndim != 2
        ):
            return self._model(inputs, cache=cache, **kwargs)
        if inputs.shape[1] != 1:
            return self._few_rows(inputs, cache)
        layout = layout_of(cache)
        if layout is None:
            return self._model(inputs, cache=cache, **kwargs)
        first = cache[layout.index(KV)]
        idx = cache_index(first)
        width = min(first.keys.shape[2], window(idx + 1))
        holey = getattr(first, "holes", None) is not None
        key = (layout, inputs.shape[0], width)
        new = key not in self.traces
        if new and len(self.traces) >= MAX_TRACES:
            self._fns.clear()  # the compiled functions go, and their traces
            self._masks = self._holey_masks = None
            self.traces.clear()
            self.retraced += 1
        t0 = time.perf_counter()
        try:
            logits, steps, holes = self._step(inputs, cache, layout, idx, width, holey)
        except Exception as e:  # nothing has changed yet: the model's step instead
            # NotTraceable: what the model asked of its cache; anything else
            # raised while tracing is as much a reason to stop compiling.
            self._off = str(e) if isinstance(e, NotTraceable) else f"{type(e).__name__}: {e}"
            log.warning("compiled step: off for this model (%s)", self._off)
            return self._model(inputs, cache=cache, **kwargs)
        finally:
            self._extras = []
            self._tracing = None
        if new:
            self.traces.add(key)
            if layout not in self.layouts:
                self.layouts.append(layout)
            log.debug(
                "compiled step: traced for %d sequences x %d slots in %.1f ms",
                *key[1:],
                (time.perf_counter() - t0) * 1000,
            )
        offset = first.offset + 1
        for c, n, step in zip(cache, layout, steps, strict=True):
            state = step.state
            if isinstance(n, tuple):
                count, padded = n
                c.cache = list(state[:count])
                if padded:
                    # Its own array: ArraysCache.advance updates it in place.
                    c.left_padding = state[count]
                continue
            # The old buffers' last references go with the steps, so MLX
            # writes the new slot in place instead of copying the buffer.
            c.keys, c.values = state
            # One offset and one holes array for every layer: the caches
            # rebind an offset, never update it in place, and update holes in
            # place only by writes that give the same array when repeated
            # for each layer (a rejection's OR, a written slot's False).
            c.offset = offset
            if holes is not None:
                c.holes = holes
            set_cache_index(c, idx + 1)
        self.steps += 1
        return logits

    def _few_rows(self, inputs: mx.array, cache: Any) -> Any:
        """A call of several tokens a sequence: the model's own, eager (a
        prefill, or a speculative verify's k+1 tokens). Of ``VERIFY_ROWS``
        rows or fewer, its layers' linears compute as ``W @ xᵀ``: the same
        to the bit, and a verify of several sequences a few percent faster
        (``tuning.rows_last``); the head stays ``x @ Wᵀ`` (a large
        one was slower)."""
        rows = inputs.size
        if rows > VERIFY_ROWS or not self._rows_last:
            return self._model(inputs, cache=cache)
        self.few_row_calls += 1
        with linears_rows_last(rows, only=self._layer_linears):
            return self._model(inputs, cache=cache)

    def _step(
        self, inputs: mx.array, cache: Any, layout: Layout, idx: int, width: int, holey: bool
    ) -> tuple[mx.array, list[_LayerStep], mx.array | None]:
        """The model's own code over the layers' compiled steps: its logits,
        each layer's new state (not yet the caches'), and the new holes."""
        if not self._layer_list:
            self._layer_list = _layer_list(self._model)
            self._originals = list(self._layer_list)
        first = cache[layout.index(KV)]
        marker = self._windows.get(width)
        if marker is None:
            marker = self._windows[width] = mx.zeros((width,), dtype=mx.bool_)
        index = mx.array(idx)
        holes = None
        if holey:
            if self._holey_masks is None:
                self._holey_masks = mx.compile(holey_step_mask)
            for c in cache:
                if not isinstance(c, ArraysCache):
                    c.fit_holes()  # holes as wide as the keys, as its own update makes them
            mask, holes = self._holey_masks(index, first.left_padding, marker, first.holes)
        else:
            if self._masks is None:
                self._masks = mx.compile(step_mask)
            mask = self._masks(index, first.left_padding, marker)
        self._extras = [index, first.offset, marker]
        steps: list[_LayerStep] = []
        seen: list[StepCache] = []
        for i, (c, n) in enumerate(zip(cache, layout, strict=True)):
            step = _LayerStep(self, i, n)
            if isinstance(n, tuple):
                step.state = c.cache if c.left_padding is None else [*c.cache, c.left_padding]
                seen.append(StepCache(None, None, c.left_padding))
            else:
                step.state = [c.keys, c.values]
                seen.append(StepCache(first.offset, mask))
            steps.append(step)
        layers = self._layer_list
        layers[:] = steps
        try:
            logits = self._model(inputs, cache=seen)
        finally:
            layers[:] = self._originals
        if any(step.calls != 1 for step in steps):
            # The model's loop ran its layers from elsewhere: their caches
            # would advance over slots never written.
            raise NotTraceable("the model's loop did not run each layer's step once")
        return logits, steps, holes

    @property
    def off(self) -> str | None:
        """Why no step is compiled any more; ``None``: they are."""
        return self._off

    def warm(self, batches: Sequence[int] = (1, 2)) -> None:
        """Trace and evaluate a step for each batch size on a scratch cache,
        so MLX compiles its kernels now (once per machine) and not while a
        request waits; a step MLX cannot compile or run turns it off. Call it
        on the host thread, in the model's stream."""
        t0 = time.perf_counter()
        try:
            with _kernels_lock():
                self._warm(batches)
        except Exception as e:  # any failure leaves the model's own step
            self._off = f"{type(e).__name__}: {e}"
            log.warning("compiled step: off (%s)", self._off)
            return
        if self._off is not None:
            return
        log.info(
            "compiled step: on (%s); its kernels ready in %.1f s",
            ", ".join(f"{b} x {w}" for b, w in sorted(self.shapes)) or "nothing traced",
            time.perf_counter() - t0,
        )

    def _warm(self, batches: Sequence[int]) -> None:
        one = make_prompt_cache(self._model)
        mx.eval(self._model(mx.zeros((1, 2), dtype=mx.int32), cache=one))
        for b in batches:
            # A batch as BatchGenerator merges one (each buffer exactly full);
            # the model's step grows it, then one is compiled.
            cache = [c.merge([c] * b) for c in one]
            # A decode step's tokens are sampled: uint32.
            tokens = mx.zeros((b, 1), dtype=mx.uint32)
            self._model(tokens, cache=cache)
            logits = self(tokens, cache=cache)
            state = [c.keys if type(c) is not ArraysCache else c.cache for c in cache]
            mx.eval(logits, state, [c.values for c in cache if type(c) is not ArraysCache])


@contextlib.contextmanager
def _kernels_lock() -> Iterator[None]:
    """Held while warming: MLX writes each new kernel's source and library
    straight into the directory every process shares, so two servers
    starting together on a machine that has not compiled them yet could
    load each other's half-written files. The second waits for the first,
    then finds them built; past ``_LOCK_WAIT_S`` (a process stuck in its
    warm-up) it warms without the lock."""
    folder = Path(tempfile.gettempdir()) / "mlx"
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / "gezel-trio-warm.lock"
    marker.touch()
    lock = DirLock(marker)  # flock, on this file as on a directory
    deadline = time.monotonic() + _LOCK_WAIT_S
    # flock has no timeout of its own: try again every 0.1 s until then.
    while not lock.acquire():
        if time.monotonic() > deadline:
            log.warning("compiled step: warming without the kernels' lock")
            break
        time.sleep(0.1)
    try:
        yield
    finally:
        lock.release()
