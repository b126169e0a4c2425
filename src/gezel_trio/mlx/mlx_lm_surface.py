"""The one module that touches mlx-lm beyond its documented API.

mlx-lm's ``BatchGenerator``, ``GenerationBatch`` and batch cache classes are
the engine's core, and speculation, KV quantization, the compiled step, the
thread tuning, vision loading and the CPU gated-delta kernel need more of
them than mlx-lm makes public. They get it here, through small public
functions and classes; no other module of ``gezel_trio.mlx`` names an
mlx-lm private (``tests/mlx/test_mlx_lm_surface.py`` scans them and fails
naming the file and line of one that does):

* the generator: ``generation_batch``, ``install_generation_batch``,
  ``prompt_batch``, ``waiting_caches``, ``prefilling``;
* the generation batch: ``GenerationBatchBase``, a ``GenerationBatch``
  whose step state a subclass (speculation's batch) reads and sets by
  public names;
* batch caches: ``cache_index``, ``set_cache_index``, ``right_padding``;
  ``BatchCache``, a ``BatchKVCache`` with those as properties (the quantized
  batch cache builds on it); ``HoleyKVCache`` and ``with_holes`` (a batch
  cache whose rows may mask slots: speculation's rejected proposals);
  ``taken_over``, a cache of another class holding a cache's state (no
  class is swapped on a live object);
* ``gated_delta_kernel``, ``gated_delta_kernel_as``: mlx-lm's gated-delta
  kernel, which the CPU chunked one (``tuning.gated_delta``) stands in for
  while a backend's step runs; ``model_classes``: a text model's classes
  from its config (vision).

mlx-lm may rename any of these names in a patch release, and the break would
show as an ``AttributeError`` far from its cause. So they are listed here,
once (``RELIED_ON``), and checked against the installed mlx-lm: by
``tests/mlx/test_mlx_lm_surface.py`` and by :func:`check` when the backend
loads, which names every missing one.

Checked with mlx-lm 0.32.2 (the version ``pyproject.toml`` allows is
``>=0.32.2,<0.33``). Per name, who relies on it:

* ``BatchGenerator._generation_batch``: speculation installs its batch there;
  KV quantization and the thread tuning read it.
* ``BatchGenerator._prompt_batch``, ``_unprocessed_sequences`` (a waiting
  sequence's cache is its tuple's fourth item): KV quantization quantizes
  what they hold; ``_currently_processing``: the thread tuning.
* ``GenerationBatch._next_tokens``, ``_next_logprobs``, ``_current_tokens``,
  ``_current_logprobs``, ``_num_tokens``, ``_matchers``, ``_token_context``:
  speculation's verify step, which replaces ``GenerationBatch``'s own step;
  ``_step``: that own step, which speculation calls when it proposes nothing.
* ``BatchKVCache._idx``, ``_right_padding``: the holey and quantized batch
  caches, and the compiled step's fast path.
* ``mlx_lm.models.gated_delta.gated_delta_ops``: the CPU chunked gated-delta
  kernel (``tuning.gated_delta``) stands in for it while a backend's step
  runs (``gated_delta_kernel_as``).
* ``mlx_lm.utils._get_classes``: vision builds a text model's classes from
  its config.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import inspect
import textwrap
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models.cache import BatchKVCache

__all__ = [
    "RELIED_ON",
    "BatchCache",
    "GenerationBatchBase",
    "HoleyKVCache",
    "cache_index",
    "check",
    "gated_delta_kernel",
    "gated_delta_kernel_as",
    "generation_batch",
    "hf_tokenizer",
    "holey_class",
    "install_generation_batch",
    "keep_leading_space",
    "missing",
    "model_classes",
    "prefilling",
    "private_names",
    "prompt_batch",
    "right_padding",
    "set_cache_index",
    "taken_over",
    "waiting_caches",
    "with_holes",
]

#: Each mlx-lm class or module, by dotted name, and the names of it relied on.
RELIED_ON: Final[Mapping[str, tuple[str, ...]]] = {
    "mlx_lm.generate.BatchGenerator": (
        "_generation_batch",
        "_prompt_batch",
        "_unprocessed_sequences",
        "_currently_processing",
    ),
    "mlx_lm.generate.GenerationBatch": (
        "_next_tokens",
        "_next_logprobs",
        "_current_tokens",
        "_current_logprobs",
        "_num_tokens",
        "_matchers",
        "_token_context",
        "_step",
    ),
    "mlx_lm.models.cache.BatchKVCache": ("_idx", "_right_padding"),
    "mlx_lm.models.gated_delta": ("gated_delta_ops",),
    "mlx_lm.utils": ("_get_classes",),
    "mlx_lm.tokenizer_utils.TokenizerWrapper": ("_tokenizer",),
    "mlx_lm.tokenizer_utils.BPEStreamingDetokenizer": ("_maybe_trim_space",),
}


def _resolve(dotted: str) -> object:
    """The module or class named ``dotted`` (``mlx_lm.generate`` is also a
    function's name in ``mlx_lm``'s namespace, so modules are imported by
    their full name)."""
    try:
        return importlib.import_module(dotted)
    except ImportError:
        module, _, name = dotted.rpartition(".")
        return getattr(importlib.import_module(module), name)


def private_names(cls: type) -> set[str]:
    """The names an mlx-lm class defines, itself or by its mlx-lm bases: its
    attributes and methods, its annotated fields, and every ``self.NAME``
    its methods assign (instance attributes exist only once ``__init__`` ran,
    so they are read from the source rather than from an instance)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("mlx_lm"):
            continue
        names.update(vars(klass))
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
    return names


def missing(relied_on: Mapping[str, Iterable[str]] = RELIED_ON) -> list[str]:
    """Every relied-on name the installed mlx-lm lacks, as ``owner.name``
    (an owner that cannot be imported is listed as itself)."""
    gone: list[str] = []
    for owner, wanted in relied_on.items():
        try:
            target = _resolve(owner)
        except (ImportError, AttributeError):
            gone.append(owner)
            continue
        have = private_names(target) if isinstance(target, type) else set(vars(target))
        gone.extend(f"{owner}.{name}" for name in wanted if name not in have)
    return gone


@functools.cache
def _missing_here() -> tuple[str, ...]:
    # Read once a process: the installed mlx-lm does not change under it,
    # and reading the classes' source costs 0.3 s a time.
    return tuple(missing())


def check() -> None:
    """Raise ``RuntimeError`` naming every relied-on name the installed
    mlx-lm lacks (a version outside the tested range), before anything runs
    into one of them."""
    gone = _missing_here()
    if gone:
        from mlx_lm import __version__

        raise RuntimeError(
            f"mlx-lm {__version__} lacks names gezel-trio relies on: {', '.join(gone)}; "
            f"install the version gezel-trio allows ({_allowed()})"
        )


def _allowed() -> str:
    """gezel-trio's own requirement on mlx-lm, as installed."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        wanted = requires("gezel-trio") or []
    except PackageNotFoundError:
        wanted = []
    return next((r for r in wanted if r.startswith("mlx-lm")), "mlx-lm")


# --- the generator ---------------------------------------------------------------------


def generation_batch(gen: BatchGenerator) -> Any:
    """``gen``'s decoding batch (a ``GenerationBatch``)."""
    return gen._generation_batch


def install_generation_batch(gen: BatchGenerator, batch: Any) -> None:
    """Make ``batch`` ``gen``'s decoding batch (before anything was inserted)."""
    gen._generation_batch = batch


def prompt_batch(gen: BatchGenerator) -> Any:
    """``gen``'s prefilling batch (a ``PromptProcessingBatch``)."""
    return gen._prompt_batch


def waiting_caches(gen: BatchGenerator) -> list[list[Any]]:
    """The per-layer caches of the sequences ``gen`` has not begun to
    prefill: each one's own list, which may be refilled in place."""
    return [sequence[3] for sequence in gen._unprocessed_sequences]


def prefilling(gen: BatchGenerator) -> bool:
    """Whether ``gen`` has a prompt waiting or being prefilled."""
    return bool(gen._unprocessed_sequences or gen._currently_processing)


def model_classes(config: dict[str, Any]) -> tuple[type[Any], type[Any]]:
    """mlx-lm's model and arguments classes for a text model's ``config``."""
    from mlx_lm.utils import _get_classes

    classes: tuple[type[Any], type[Any]] = _get_classes(config)
    return classes


def hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer inside mlx-lm's ``TokenizerWrapper``."""
    return tokenizer._tokenizer


def keep_leading_space(detok: Any) -> None:
    """Make ``detok`` (a fresh streaming detokenizer) keep the first space
    of its text: mlx-lm's SPM detokenizer trims it unless told not to, its
    BPE one always does (``_maybe_trim_space``)."""
    if hasattr(detok, "trim_space"):
        detok.trim_space = False
    if hasattr(detok, "_maybe_trim_space"):
        detok._maybe_trim_space = _untrimmed


def _untrimmed(text: str) -> str:
    return text


# --- the generation batch ----------------------------------------------------------------


class GenerationBatchBase(GenerationBatch):  # type: ignore[misc]  # mlx-lm is untyped
    """mlx-lm's ``GenerationBatch`` with its step state by public names, for
    a subclass that takes steps of its own (speculation's verify)."""

    @property
    def next_tokens(self) -> Any:
        """The pending next token of each sequence (an array, maybe still
        computing)."""
        return self._next_tokens

    @property
    def next_logprobs(self) -> list[Any]:
        """The log-probabilities each pending token was drawn from."""
        out: list[Any] = self._next_logprobs
        return out

    def set_pending(
        self, current: Any, current_logprobs: list[Any], tokens: Any, logprobs: list[Any]
    ) -> None:
        """After a step of its own: the tokens it fed (``current``) and the
        pending next ones, as mlx-lm's own step leaves them."""
        self._current_tokens = current
        self._current_logprobs = current_logprobs
        self._next_tokens = tokens
        self._next_logprobs = logprobs

    @property
    def num_tokens(self) -> list[int]:
        """Tokens emitted per sequence (counted against ``max_tokens``; a
        step of its own adds to them in place)."""
        out: list[int] = self._num_tokens
        return out

    @property
    def matchers(self) -> list[Any]:
        """Each sequence's stop-sequence matcher (``advance(token)``)."""
        out: list[Any] = self._matchers
        return out

    @property
    def token_context(self) -> list[Any]:
        """Each sequence's token buffer, which its logits processors read."""
        out: list[Any] = self._token_context
        return out

    def plain_step(self) -> tuple[list[int], list[Any]]:
        """mlx-lm's own pipelined step: the tokens it emits and their logprobs."""
        out: tuple[list[int], list[Any]] = self._step()
        return out


# --- batch caches ------------------------------------------------------------------------


def cache_index(cache: Any) -> int:
    """The slot a batch cache writes its next token at."""
    idx: int = cache._idx
    return idx


def set_cache_index(cache: Any, idx: int) -> None:
    cache._idx = idx


def right_padding(cache: Any) -> Any:
    """A batch cache's right padding while a prompt of unequal rows
    prefills (``None`` otherwise)."""
    return cache._right_padding


class BatchCache(BatchKVCache):  # type: ignore[misc]  # mlx-lm is untyped
    """mlx-lm's ``BatchKVCache`` with its index and right padding as
    properties, for a subclass that keeps its slots itself."""

    @property
    def idx(self) -> int:
        return cache_index(self)

    @idx.setter
    def idx(self, value: int) -> None:
        self._idx = value

    @property
    def right_padding(self) -> Any:
        return self._right_padding

    @right_padding.setter
    def right_padding(self, value: Any) -> None:
        self._right_padding = value


def taken_over(cache: Any, cls: type[Any], **fields: Any) -> Any:
    """A new ``cls`` cache holding ``cache``'s state (its keys, values,
    offsets, padding, index and anything else it set), and ``fields``;
    ``cache`` is not to be used after. A cache with holes gives one with
    holes (``holey_class``)."""
    if isinstance(cache, HoleyKVCache):
        cls = holey_class(cls)
    new: Any = object.__new__(cls)
    vars(new).update(vars(cache))
    vars(new).update(fields)
    return new


def _slots(keys: Any) -> int:
    """The slots a layer's keys hold: an array, or a quantized triple."""
    first = keys[0] if isinstance(keys, tuple) else keys
    return int(first.shape[2])


class HoleyKVCache(BatchCache):
    """A batch cache whose sequences may have masked slots (holes):
    speculation's rejected proposals that other sequences' accepted tokens
    sit beside (``reject``). Attention masks them, and the sequence's RoPE
    offset goes back by as many, so positions stay contiguous; ``extract``
    gathers the valid slots, so a sequence's own cache is dense. Another
    batch cache class gets holes as ``holey_class(cls)``; a cache of one
    gets them as ``with_holes(cache)``."""

    holes: mx.array | None = None  # (batch, slots) bool, as wide as ``keys``

    def fit_holes(self) -> None:
        """Holes as wide as the keys' slots (new slots are not holes)."""
        if self.holes is None or self.keys is None:
            return
        width, slots = self.holes.shape[1], _slots(self.keys)
        if width < slots:
            pad = mx.zeros((self.holes.shape[0], slots - width), dtype=mx.bool_)
            self.holes = mx.concatenate([self.holes, pad], axis=1)
        elif width > slots:
            self.holes = self.holes[:, :slots]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        prev = self._idx
        out = super().update_and_fetch(keys, values)
        if self.holes is not None:
            self.fit_holes()
            assert self.holes is not None
            # The slots just written hold real tokens, whatever they held before.
            self.holes[:, prev : self._idx] = False
        return out

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        mask = super().make_mask(N, return_array=return_array, **kwargs)
        if self.holes is None or self._idx == 0:
            return mask
        B = self.holes.shape[0]
        # Slots at and past the end are about to be written: never holes.
        holes = mx.concatenate(
            [self.holes[:, : self._idx], mx.zeros((B, N), dtype=mx.bool_)], axis=1
        )
        return mask & ~holes[:, None, None, :]

    def reject(self, extra: Sequence[int]) -> None:
        """Sequence ``i``'s last ``extra[i]`` slots are holes now; its RoPE
        offset goes back by as many."""
        width = max(extra)
        if width == 0:
            return
        B = len(extra)
        if self.holes is None:
            slots = _slots(self.keys) if self.keys is not None else self._idx
            self.holes = mx.zeros((B, slots), dtype=mx.bool_)
        self.fit_holes()
        assert self.holes is not None
        cols = mx.arange(width)[None, :]
        starts = mx.array([width - e for e in extra])[:, None]
        seg = cols >= starts
        lo = self._idx - width
        self.holes[:, lo : self._idx] = self.holes[:, lo : self._idx] | seg
        back: mx.array = mx.array(list(extra))
        self.offset: mx.array = self.offset - back

    def filter(self, batch_indices: Any) -> None:
        if self.holes is not None:
            holes = self.holes[batch_indices]
            shift = min(self.left_padding[batch_indices].tolist())
            super().filter(batch_indices)
            self.holes = holes[:, shift:] if shift > 0 else holes
        else:
            super().filter(batch_indices)

    def extend(self, other: Any) -> None:
        mine, theirs = self.holes, getattr(other, "holes", None)
        if mine is None and theirs is None:
            super().extend(other)
            return
        # The same right-justification BatchKVCache.extend gives the keys.
        max_idx = max(self._idx, other._idx)
        sizes = [_slots(c.keys) for c in (self, other) if c.keys is not None]
        max_size = max(sizes) if sizes else 0

        def padded(c: Any, holes: mx.array | None) -> mx.array:
            B = c.offset.shape[0]
            width = _slots(c.keys) if c.keys is not None else 0
            h = holes if holes is not None else mx.zeros((B, width), dtype=mx.bool_)
            h = h[:, :width]
            if h.shape[1] < width:
                h = mx.concatenate([h, mx.zeros((B, width - h.shape[1]), dtype=mx.bool_)], 1)
            left = max_idx - c._idx
            right = max_size - width - left
            if right < 0:
                h = h[:, :right]
                right = 0
            return mx.pad(h, [(0, 0), (left, right)]) if left or right else h

        joined = mx.concatenate([padded(self, mine), padded(other, theirs)], axis=0)
        super().extend(other)
        self.holes = joined

    def extract(self, idx: int) -> Any:
        if self.holes is None:
            return super().extract(idx)
        padding = self.left_padding.tolist()[idx]
        row: list[bool] = self.holes[idx, padding : self._idx].tolist()  # type: ignore[assignment]
        # The batch class's own extract gives the slots from the padding
        # on, in its format (an array, or a quantized triple); the valid
        # ones are gathered from them.
        cache = super().extract(idx)
        valid = mx.array([s for s, hole in enumerate(row) if not hole])

        def gather(a: mx.array) -> mx.array:
            return mx.contiguous(mx.take(a, valid, axis=2))

        cache.keys, cache.values = tree_map(gather, (cache.keys, cache.values))
        cache.offset = len(row) - sum(row)
        return cache


# Each batch cache class's holey one, made once (``holey_class``).
_HOLEY: dict[type[Any], type[Any]] = {}


def holey_class(cls: type[Any]) -> type[Any]:
    """``cls`` (a ``BatchKVCache``) with holes (``HoleyKVCache``'s)."""
    if issubclass(cls, HoleyKVCache):
        return cls
    if cls is BatchKVCache or cls is BatchCache:
        return HoleyKVCache
    holey = _HOLEY.get(cls)
    if holey is None:
        holey = _HOLEY[cls] = type(f"Holey{cls.__name__}", (HoleyKVCache, cls), {})
    return holey


def with_holes(cache: Any) -> HoleyKVCache:
    """``cache`` as a batch cache that can take holes: itself if it can, or
    a new one holding its state (to put in its place)."""
    if isinstance(cache, HoleyKVCache):
        return cache
    holey: HoleyKVCache = taken_over(cache, holey_class(type(cache)))
    return holey


def gated_delta_kernel() -> Callable[..., Any]:
    """The function mlx-lm's linear-attention layers call for the gated
    delta rule on the CPU now: its own token loop, outside
    ``gated_delta_kernel_as``."""
    module: Any = importlib.import_module("mlx_lm.models.gated_delta")
    ops: Callable[..., Any] = module.gated_delta_ops
    return ops


@contextlib.contextmanager
def gated_delta_kernel_as(ops: Callable[..., Any]) -> Iterator[None]:
    """mlx-lm's layers call ``ops`` in place of ``gated_delta_ops`` inside
    the block (mlx-lm looks the name up at each call); the function before
    it is back when the block ends, whatever happens in it. Host thread
    only: the name is the process's."""
    module: Any = importlib.import_module("mlx_lm.models.gated_delta")
    before = module.gated_delta_ops
    module.gated_delta_ops = ops
    try:
        yield
    finally:
        module.gated_delta_ops = before
