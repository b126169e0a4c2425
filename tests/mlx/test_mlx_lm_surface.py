"""The names of mlx-lm beyond its documented API that the MLX backend relies
on (``gezel_trio.mlx.mlx_lm_surface``, the seam): the installed mlx-lm has
each of them, the seam uses no other, and no other module of the backend
uses any.

The scan reads the backend's modules (sub-packages too) as syntax trees and
imports them to know which of their classes derive from mlx-lm's:
``self._x`` in such a class, ``anything._x`` elsewhere, and
``from mlx_lm... import _x`` count as a use when mlx-lm defines ``_x``, and
so does ``anything.x`` for a name ``x`` the seam lists. A use outside the
seam fails with its file and line; so does a use in the seam missing from
``RELIED_ON``, so the list stays the whole surface.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import mlx_lm.generate
import mlx_lm.models.base
import mlx_lm.models.cache
import mlx_lm.sample_utils
import mlx_lm.utils

import gezel_trio.mlx
from gezel_trio.mlx import mlx_lm_surface

_MLX_LM_MODULES = (
    "mlx_lm.generate",
    "mlx_lm.models.base",
    "mlx_lm.models.cache",
    "mlx_lm.models.gated_delta",
    "mlx_lm.sample_utils",
    "mlx_lm.tokenizer_utils",
    "mlx_lm.utils",
)


def test_the_installed_mlx_lm_has_every_name_relied_on() -> None:
    gone = mlx_lm_surface.missing()
    assert not gone, (
        f"mlx-lm {mlx_lm.__version__} lacks private names the backend relies on "
        f"(gezel_trio.mlx.mlx_lm_surface.RELIED_ON): {', '.join(gone)}"
    )
    mlx_lm_surface.check()


def test_a_missing_name_is_named() -> None:
    gone = mlx_lm_surface.missing(
        {
            "mlx_lm.generate.BatchGenerator": ("_generation_batch", "_renamed_batch"),
            "mlx_lm.models.cache.BatchKVCache": ("_idx",),
            "mlx_lm.not_a_module": ("_x",),
        }
    )
    assert gone == ["mlx_lm.generate.BatchGenerator._renamed_batch", "mlx_lm.not_a_module"]


def _universe() -> set[str]:
    """Every private name an mlx-lm class or module the backend imports
    from defines."""
    names: set[str] = set()
    for dotted in _MLX_LM_MODULES:
        module = importlib.import_module(dotted)
        names.update(n for n in vars(module) if n.startswith("_"))
        for value in vars(module).values():
            if inspect.isclass(value) and value.__module__ == dotted:
                names.update(mlx_lm_surface.private_names(value))
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _derives_from_mlx_lm(cls: object) -> bool:
    return isinstance(cls, type) and any(k.__module__.startswith("mlx_lm") for k in cls.__mro__)


def _uses(universe: set[str]) -> list[tuple[str, int, str]]:
    """``(file, line, name)`` for each use of an mlx-lm private name in the
    backend's modules."""
    root = Path(gezel_trio.mlx.__file__).parent
    found: list[tuple[str, int, str]] = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        module = importlib.import_module(".".join(("gezel_trio.mlx", *parts)))
        where = f"src/gezel_trio/mlx/{path.relative_to(root).as_posix()}"
        scan = _Scan(module, where, universe, found)
        scan.visit(ast.parse(path.read_text()), in_mlx_class=False, own=set())
    return found


_SEAM = "src/gezel_trio/mlx/mlx_lm_surface.py"
_LISTED = {name for names in mlx_lm_surface.RELIED_ON.values() for name in names}


class _Scan:
    def __init__(
        self, module: object, where: str, universe: set[str], found: list[tuple[str, int, str]]
    ) -> None:
        self.module, self.where, self.universe, self.found = module, where, universe, found

    def visit(self, node: ast.AST, *, in_mlx_class: bool, own: set[str]) -> None:
        """``in_mlx_class``: inside a class deriving from mlx-lm's, where
        ``self._x`` is mlx-lm's own; ``own``: the names a class of ours
        assigns itself, which another receiver's ``._x`` may be too."""
        if isinstance(node, ast.ClassDef):
            mlx_class = _derives_from_mlx_lm(getattr(self.module, node.name, None))
            mine = {
                n.attr
                for n in ast.walk(node)
                if isinstance(n, ast.Attribute)
                and isinstance(n.ctx, ast.Store)
                and isinstance(n.value, ast.Name)
                and n.value.id == "self"
            }
            for child in node.body:
                self.visit(child, in_mlx_class=mlx_class, own=set() if mlx_class else mine)
            return
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlx_lm"):
            self.found.extend(
                (self.where, node.lineno, a.name) for a in node.names if a.name in self.universe
            )
        if isinstance(node, ast.Attribute) and node.attr in self.universe:
            on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if (on_self and in_mlx_class) or (not on_self and node.attr not in own):
                self.found.append((self.where, node.lineno, node.attr))
        for child in ast.iter_child_nodes(node):
            self.visit(child, in_mlx_class=in_mlx_class, own=own)


def test_only_the_seam_uses_mlx_lm_private_names() -> None:
    uses = _uses(_universe() | _LISTED)
    elsewhere = [f"{f}:{line}: {name}" for f, line, name in uses if f != _SEAM]
    assert not elsewhere, (
        "modules other than gezel_trio.mlx.mlx_lm_surface use mlx-lm private names "
        "(add a public function to the seam and call it):\n" + "\n".join(elsewhere)
    )


def test_the_seam_uses_no_mlx_lm_private_name_left_off_the_list() -> None:
    uses = [(f, line, name) for f, line, name in _uses(_universe() | _LISTED) if f == _SEAM]
    # The scan finds the uses the list is made of (it is no scan of nothing).
    assert {name for _, _, name in uses} >= {
        "_generation_batch",
        "_next_tokens",
        "_idx",
        "gated_delta_ops",
    }
    unlisted = [f"{f}:{line}: {name}" for f, line, name in uses if name not in _LISTED]
    assert not unlisted, (
        "the seam uses mlx-lm private names missing from "
        "gezel_trio.mlx.mlx_lm_surface.RELIED_ON:\n" + "\n".join(unlisted)
    )
