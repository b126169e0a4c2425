"""The MLX backend - with the platform tuning (``gezel_trio.tuning``), the
only package that imports ``mlx`` and ``mlx_lm``: the backend over mlx-lm's
``BatchGenerator`` (``backend``), its grammar processors (``constraints``),
model loading and the default model (``loading``, ``model_source``,
``gguf``).

The backend factories: ``mlx_backend`` is one process's backend, with the
whole model. Under ``mlx.launch`` (``group_rank`` says so) rank 0 serves
with ``group_backend``, the same backend over rank 0's part of the model
inside the group's decorator (``mlx.group.GroupBackend``), and every other
rank runs ``follow_rank``; ``gezel-trio serve`` composes them so
(``server``, ``cli``), and a library user under ``mlx.launch`` does the
same.

This module imports nothing, so ``gezel_trio.tuning.blas`` can run before
``mlx`` is loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.backend import Backend
    from ..core.config import EngineConfig

__all__ = ["follow_rank", "group_backend", "group_rank", "mlx_backend", "open_file_limit"]


def mlx_backend(config: EngineConfig) -> Backend:
    """The MLX backend for ``config``, one process's, with the whole model
    (a ``BackendFactory``). Call it on the thread that will run it: MLX
    streams are thread-local, so the engine's host loop calls it there."""
    from ..tuning import applies, blas

    blas.preload(applies(config.tuning))  # before the backend's modules import mlx
    from .backend import MlxBackend

    return MlxBackend(config)


def group_backend(config: EngineConfig) -> Backend:
    """Rank 0's backend in an ``mlx.launch`` group (a ``BackendFactory``,
    called as ``mlx_backend`` is): the MLX backend over rank 0's part of
    the model, which sends each call that changes what the ranks hold to
    the other ranks first (``mlx.group.GroupBackend``). Outside a group it
    raises ``ModelLoadError``."""
    from ..core.errors import ModelLoadError
    from ..tuning import applies, blas

    blas.preload(applies(config.tuning))  # before the backend's modules import mlx
    from .backend import MlxBackend
    from .group import GroupBackend, Sharding, rank_group

    group = rank_group()
    if group is None:
        raise ModelLoadError("not started by mlx.launch in a group of two or more ranks")
    local = MlxBackend(config, split=Sharding(group, config.group.split))
    return GroupBackend(local, group, local.stream, config.group.timeout)


def open_file_limit() -> int:
    """The process's open-file limit (its soft ``RLIMIT_NOFILE``), raised to
    its hard limit. Importing mlx-lm sets both (``mlx_lm.utils``: 2048 and
    4096, whatever the supervisor gave; a hard limit once lowered stays
    lowered), so it is imported first: raised before, the limit would be
    lowered again as the model loads."""
    import contextlib
    import resource

    import mlx_lm.utils  # noqa: F401 - its import sets the limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard and hard != resource.RLIM_INFINITY:
        # A platform's own ceiling (macOS: OPEN_MAX) leaves the soft limit as it is.
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def group_rank() -> tuple[int, int] | None:
    """``(rank, world size)`` when this process was started by
    ``mlx.launch`` in a group of two or more; ``None`` alone."""
    from .group import rank_group

    group = rank_group()
    return None if group is None else (int(group.rank()), int(group.size()))


def follow_rank(config: EngineConfig) -> None:
    """A rank other than 0: load and shard the model, then run rank 0's
    orders until it closes (``mlx.group.follow``). Runs on the calling
    thread, which is then this rank's one MLX thread."""
    import signal

    from ..tuning import applies, blas

    blas.preload(applies(config.tuning))  # before the backend's modules import mlx
    from .backend import MlxBackend
    from .group import Sharding, follow, rank_group

    # A rank stops when rank 0 closes the group (after its drain): Ctrl-C
    # in the launcher's terminal, or a signal to its process group, is
    # rank 0's to act on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    group = rank_group()
    assert group is not None
    backend = MlxBackend(config, split=Sharding(group, config.group.split))
    follow(backend, group, backend.stream)
