"""One-token decode steps as one compiled graph (``--compiled-step``).

On the CPU the host thread builds each step's graph in Python while the
cores wait for it (docs/performance.md, "Why the host's Python between steps
costs its full time"), and MLX runs every elementwise op of the graph as a
kernel of its own. mlx-lm's ``BatchKVCache`` writes and reads its buffer at
Python integer offsets, so each step is a new graph, and ``mx.compile``
cannot be applied to the model as it is.

``CompiledDecode`` stands in for the model in ``BatchGenerator``. A call with
one token per sequence, on caches it can take (``_layout``), runs
``_traced`` compiled:

- the token's keys and values are written at an index held in an array
  (``mx.slice_update``);
- the attention reads the buffer up to the next multiple of 64 slots past
  that token (a wider step past 512 slots: ``window``), under a mask of the
  slots that hold the sequence's tokens (not its left padding, not the
  slots beyond). A window as wide as the buffer (256 slots at a time) made
  the attention read up to 255 empty slots per sequence, which cost more
  than the compiling saved at 8 streams;
- a hybrid model's linear-attention layers (Qwen 3.5's ``ArraysCache``: a
  convolution state, a recurrent one, the batch's left padding) are passed
  in and out with the attention layers' KV;
- speculation's caches with holes (``HoleyKVCache``: rejected slots beside
  accepted ones) add the holes to the mask and clear the written slot's, as
  their own ``update_and_fetch`` does.

So the function is traced once per layout, batch size and window (about
25 ms for SmolLM2), not once per token, and the caches then advance as
``update_and_fetch`` would have advanced them. Every other call (a prefill,
a quantized or rotating cache, a speculative verify, a buffer that must
grow first) goes to the model unchanged.

The masked slots get weights of exactly zero, but BLAS sums the weighted
values over the wider buffer in another order, so logits differ from the
model's own step in their last bits (up to 3e-6 on the test models; with
16-wide heads not at all). Greedy tokens were the same in every test
(``tests/mlx/test_compiled_step.py``); a comparison with mlx-lm to the bit
needs ``--compiled-step off``.

MLX fuses the traced elementwise ops into kernels it compiles with the
system's ``g++`` and keeps under ``$TMPDIR/mlx/<version>/cpu`` for later
processes (seconds of compiling, once per machine). Without ``g++`` MLX
runs them unfused, which measured no faster than the model's own step, so
the step is not compiled then. ``warm`` compiles them at load, so no request
waits for the compiler. Only the families whose attention reads
``cache.offset``, ``update_and_fetch`` and ``make_mask`` as llama's does are
compiled (``_FAMILIES``: llama, qwen2, qwen3, qwen3_5). The traced graph
holds the weights it was traced with: a model whose weights change after
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
from mlx_lm.models.cache import ArraysCache, BatchKVCache, make_prompt_cache

from ..core.shared_dir import DirLock
from .speculative import HoleyKVCache

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
# quarter more slots than it holds. Each trace holds the GIL 20-30 ms on
# SmolLM2 (docs/performance.md).
STEP: Final = 64


def window(slots: int) -> int:
    """How many slots the attention reads when ``slots`` hold tokens."""
    step = STEP
    while slots > step * 8:
        step *= 2
    return -(-slots // step) * step


# Past this many traces (about 25 ms each on SmolLM2's 30 layers) they are
# all dropped and made again as steps need them: a bound on what a
# long-running server keeps, where batch sizes and lengths keep changing.
MAX_TRACES: Final = 512
# How long a warm-up waits for another process's (``_kernels_lock``).
_LOCK_WAIT_S: Final = 120.0


# The attention caches a step is compiled on (``_layout``).
_KINDS: Final = (BatchKVCache, HoleyKVCache)
# In a layout, an attention layer (its keys and values); any other entry is
# a linear-attention layer's (how many state arrays, whether it has left
# padding).
_KV: Final = "kv"
Layout = tuple[str | tuple[int, bool], ...]


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


class _TracedCache:
    """What one attention layer sees while the step is traced."""

    def __init__(
        self,
        keys: mx.array,
        values: mx.array,
        index: mx.array,
        offset: mx.array,
        valid: mx.array,
        width: int,
    ) -> None:
        self.keys, self.values, self.offset = keys, values, offset
        self._index, self._valid, self._width = index, valid, width

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self._index, axes=(2,))
        self.values = mx.slice_update(self.values, values, self._index, axes=(2,))
        return self.keys[..., : self._width, :], self.values[..., : self._width, :]

    def make_mask(self, n: int, return_array: bool = False, window_size: Any = None) -> mx.array:
        if n != 1 or window_size is not None:
            raise _NotTraceable("a sliding window or more than one token")
        return self._valid

    def arrays(self) -> list[mx.array]:
        return [self.keys, self.values]


class _TracedArrays:
    """What one linear-attention layer sees while the step is traced: its
    state arrays and left padding (a decoding batch's ``ArraysCache``, which
    the model reads and replaces by index), as ``ArraysCache`` uses them."""

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

    def make_mask(self, n: int) -> mx.array | None:
        if self.left_padding is None:
            return None
        return mx.arange(n)[None] >= self.left_padding[:, None]

    def arrays(self) -> list[mx.array]:
        return self.cache if self.left_padding is None else [*self.cache, self.left_padding]


class _NotTraceable(Exception):
    """The model asked its cache for what the traced step does not hold."""


def _layout(cache: Sequence[Any]) -> Layout | None:
    """Each layer's entry (``_KV``, or a linear-attention layer's count of
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
        if type(c) not in _KINDS or c.keys is None or c._right_padding is not None:
            return None
        if first is None:
            first, holey = c, getattr(c, "holes", None) is not None
            if c._idx >= c.keys.shape[2]:
                return None
        elif (
            type(c) is not type(first)
            or c._idx != first._idx
            or c.keys.shape[2] != first.keys.shape[2]
            or (getattr(c, "holes", None) is not None) != holey
        ):
            return None
        layout.append(_KV)
    return tuple(layout) if first is not None else None


def _width(entry: str | tuple[int, bool]) -> int:
    """How many arrays a layer's entry passes in and out of the step."""
    if not isinstance(entry, tuple):
        return 2  # keys, values
    count, padded = entry
    return count + padded


class CompiledDecode:
    """``model`` for ``BatchGenerator``, its one-token steps compiled where
    the caches allow (the module docstring). Attributes it does not have are
    the model's."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._layers = len(model.layers)
        # One compiled function per layout (``_layout``: a join can add or
        # drop the linear-attention layers' padding).
        self._steps: dict[Layout, Any] = {}
        # The layouts steps were compiled for, the last one's last.
        self.layouts: list[Layout] = []
        # One marker array per window width: its shape is the width.
        self._windows: dict[int, mx.array] = {}
        self._off: str | None = None
        # Traces made (layout, batch, window), and the steps that ran
        # compiled: for tests and logs.
        self.traces: set[tuple[Layout, int, int]] = set()
        self.steps = 0
        self.retraced = 0  # times every trace was dropped (MAX_TRACES)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    @property
    def shapes(self) -> set[tuple[int, int]]:
        """The (batch, window) pairs traced, whatever the layout."""
        return {(b, w) for _, b, w in self.traces}

    def _compiled(self, layout: Layout) -> Any:
        step = self._steps.get(layout)
        if step is None:

            def traced(*arrays: mx.array) -> list[mx.array]:
                return self._traced(layout, arrays)

            step = self._steps[layout] = mx.compile(traced)
        return step

    def _traced(self, layout: Layout, arrays: Sequence[mx.array]) -> list[mx.array]:
        tokens, index, offset, left, marker = arrays[:5]
        # What the attention reads: the buffer's first slots, as many as
        # ``marker`` is long (its shape is part of the trace's key).
        width = marker.shape[0]
        slots = mx.arange(width)
        valid = (slots[None] <= index) & (slots[None] >= left[:, None])
        at = 5 + sum(_width(n) for n in layout)
        holes = arrays[at:]
        if holes:
            # Speculation's rejected slots (``HoleyKVCache``); the one about
            # to be written holds a real token, whatever it held before.
            written = mx.zeros((tokens.shape[0], 1), dtype=mx.bool_)
            holes = (mx.slice_update(holes[0], written, index, axes=(1,)),)
            valid = valid & ~holes[0][:, :width]
        mask = valid[:, None, None, :]
        caches: list[_TracedCache | _TracedArrays] = []
        at = 5
        for n in layout:
            part = arrays[at : at + _width(n)]
            at += len(part)
            if not isinstance(n, tuple):
                caches.append(_TracedCache(part[0], part[1], index, offset, mask, width))
            elif n[1]:  # padded: its left padding comes last
                caches.append(_TracedArrays(part[:-1], part[-1]))
            else:
                caches.append(_TracedArrays(part, None))
        logits = self._model(tokens, cache=caches)
        out = [logits, offset + 1, *holes]
        for c in caches:
            out += c.arrays()
        return out

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> Any:
        if (
            self._off is not None
            or kwargs
            or cache is None
            or len(cache) != self._layers
            or inputs.ndim != 2
            or inputs.shape[1] != 1
        ):
            return self._model(inputs, cache=cache, **kwargs)
        layout = _layout(cache)
        if layout is None:
            return self._model(inputs, cache=cache, **kwargs)
        first = cache[layout.index(_KV)]
        idx = first._idx
        width = min(first.keys.shape[2], window(idx + 1))
        marker = self._windows.get(width)
        if marker is None:
            marker = self._windows[width] = mx.zeros((width,), dtype=mx.bool_)
        shape = (inputs.shape[0], width)
        arrays = [inputs, mx.array(idx), first.offset, first.left_padding, marker]
        holey = getattr(first, "holes", None) is not None
        for c, n in zip(cache, layout, strict=True):
            if n != _KV:
                arrays += c.cache if c.left_padding is None else [*c.cache, c.left_padding]
                continue
            arrays += [c.keys, c.values]
            if holey:
                c._fit()  # holes as wide as the keys, as its own update would make them
        if holey:
            arrays.append(first.holes)
        key = (layout, *shape)
        new = key not in self.traces
        if new and len(self.traces) >= MAX_TRACES:
            self._steps.clear()  # the compiled functions go, and their traces
            self.traces.clear()
            self.retraced += 1
        t0 = time.perf_counter()
        try:
            out = self._compiled(layout)(*arrays)
        except Exception as e:  # nothing has changed yet: the model's step instead
            # _NotTraceable: what the model asked of its cache; anything else
            # raised while tracing is as much a reason to stop compiling.
            self._off = str(e) if isinstance(e, _NotTraceable) else f"{type(e).__name__}: {e}"
            log.warning("compiled step: off for this model (%s)", self._off)
            return self._model(inputs, cache=cache, **kwargs)
        if new:
            self.traces.add(key)
            if layout not in self.layouts:
                self.layouts.append(layout)
            log.debug(
                "compiled step: traced for %d sequences x %d slots in %.0f ms",
                *shape,
                (time.perf_counter() - t0) * 1000,
            )
        del arrays
        logits, offset = out[0], out[1]
        at = 3 if holey else 2
        for c, n in zip(cache, layout, strict=True):
            if isinstance(n, tuple):
                count, padded = n
                c.cache = list(out[at : at + count])
                if padded:
                    # Its own array: ArraysCache.advance updates it in place.
                    c.left_padding = out[at + count]
                at += _width(n)
                continue
            # The old buffers' last references go here, so MLX writes the
            # new slot in place instead of copying the buffer.
            c.keys, c.values = out[at], out[at + 1]
            at += 2
            # One offset and one holes array for every layer: the caches
            # rebind an offset, never update it in place, and update holes in
            # place only by writes that give the same array when repeated
            # for each layer (a rejection's OR, a written slot's False).
            c.offset = offset
            if holey:
                c.holes = out[2]
            c._idx = idx + 1
        self.steps += 1
        return logits

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
