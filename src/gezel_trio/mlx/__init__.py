"""The MLX backend - the only package that imports ``mlx`` and ``mlx_lm``:
the backend over mlx-lm's ``BatchGenerator`` (``backend``), its grammar
processors (``constraints``), model loading and the default model
(``loading``, ``model_source``, ``gguf``), the demo models (``demo_model``),
and binding MLX to an optimized BLAS before anything imports it (``blas``).

This module imports nothing, so ``gezel_trio.mlx.blas`` can run before
``mlx`` is loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.backend import Backend
    from ..core.config import EngineConfig

__all__ = ["mlx_backend"]


def mlx_backend(config: EngineConfig) -> Backend:
    """The MLX backend for ``config`` (a ``BackendFactory``). Call it on the
    thread that will run it: MLX streams are thread-local, so the engine's
    host loop calls it there."""
    from .backend import MlxBackend

    return MlxBackend(config)
