"""What the MLX backend relies on in mlx-lm beyond its documented API.

mlx-lm's ``BatchGenerator`` and cache classes are the engine's core, but
speculation (``mlx.speculative``), KV quantization (``mlx.kv_quant``), the
compiled step (``mlx.compiled_step``), the backend's thread tuning and vision
loading read or set private names of theirs. mlx-lm may rename any of them in a
patch release, and the break would show as an ``AttributeError`` far from its
cause. So the names are listed here, once, and checked against the installed
mlx-lm: by ``tests/mlx/test_mlx_lm_surface.py`` (which also scans the backend's
source, so a new use cannot be left off this list) and by :func:`check` when
the backend loads, which names every missing one.

Checked with mlx-lm 0.32.2 (the version ``pyproject.toml`` allows is
``>=0.32.2,<0.33``). Per name, who relies on it:

* ``BatchGenerator._generation_batch``: speculation installs its batch there;
  KV quantization and the thread tuning read it.
* ``BatchGenerator._prompt_batch``, ``_unprocessed_sequences``: KV quantization
  quantizes what they hold; ``_currently_processing``: the thread tuning.
* ``GenerationBatch._next_tokens``, ``_next_logprobs``, ``_current_tokens``,
  ``_current_logprobs``, ``_num_tokens``, ``_matchers``, ``_token_context``:
  speculation's verify step, which replaces ``GenerationBatch``'s own step;
  ``_step``: that own step, which speculation calls when it proposes nothing.
* ``BatchKVCache._idx``, ``_right_padding``: speculation's and KV
  quantization's caches (subclasses), and the compiled step's fast path.
* ``mlx_lm.models.gated_delta.gated_delta_ops``: the CPU chunked gated-delta
  kernel (``tuning.gated_delta``) stands in for it while a backend's step
  runs (``gated_delta_ops_as``).
* ``mlx_lm.utils._get_classes``: vision builds a text model's classes from
  its config.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import textwrap
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final

__all__ = [
    "RELIED_ON",
    "check",
    "gated_delta_ops",
    "gated_delta_ops_as",
    "missing",
    "private_names",
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


def check() -> None:
    """Raise ``RuntimeError`` naming every relied-on name the installed
    mlx-lm lacks (a version outside the tested range), before anything runs
    into one of them."""
    gone = missing()
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


def gated_delta_ops() -> Callable[..., Any]:
    """The function mlx-lm's linear-attention layers call for the gated
    delta rule on the CPU now: its own token loop, outside
    ``gated_delta_ops_as``."""
    module: Any = importlib.import_module("mlx_lm.models.gated_delta")
    ops: Callable[..., Any] = module.gated_delta_ops
    return ops


@contextlib.contextmanager
def gated_delta_ops_as(ops: Callable[..., Any]) -> Iterator[None]:
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
