"""The suite's shared fixtures and hooks, registered from ``tests/support``:
demo models built once per session in a private home (``models``), one
``gezel-trio serve`` process per model for the tests that share its flags
(``process``), and how a test past its timeout ends the run (``timeouts``)."""

from __future__ import annotations

import os

import pytest

# The suite runs several servers at once on the same cores; OpenBLAS's
# workers spin while they wait, so each process (and every server it
# starts, which inherits this) computes on one BLAS thread. Set before the
# first import of mlx, which loads OpenBLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# First, before any test module imports mlx: the package has MLX bound to
# OpenBLAS when mlx is first imported (gezel_trio.tuning.blas) and warns
# when it is too late.
import gezel_trio  # noqa: F401

pytest_plugins = [
    "tests.support.models",
    "tests.support.process",
    "tests.support.timeouts",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules marked ``slow`` (a server process, real MLX) run first.
    ``./dev test``'s workers take a module each at a time in this order, so
    the run ends on short in-process modules that fill whichever worker
    frees first, not with one worker idle while the other runs a module of
    a minute or more."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
