"""The suite's shared fixtures, registered from ``tests/support``: demo models
built once per session in a private home (``tests.support.models``) and one
``gezel-trio serve`` process per model for the tests that share its flags
(``tests.support.process``)."""

from __future__ import annotations

# First, before any test module imports mlx: the package binds MLX to
# OpenBLAS at import time (gezel_trio.mlx.blas) and warns when it is too late.
import gezel_trio  # noqa: F401

pytest_plugins = ["tests.support.models", "tests.support.process"]
