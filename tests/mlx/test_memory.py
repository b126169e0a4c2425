"""The MLX memory policies (``mlx.memory``): the limits each computes from
the ceiling, the wired plan and Metal's recommended working set, the seed
profile's choice of the seed's policy, and MLX's buffer-cache limit read
back after it was set (which works without Metal too; the wired limit needs
Metal and is only logged as having no effect here)."""

from __future__ import annotations

import ctypes
import logging
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from gezel_trio import cli
from gezel_trio.core.config import EngineConfig, MemorySettings
from gezel_trio.core.settings import MIB
from gezel_trio.mlx import memory
from gezel_trio.mlx.memory import (
    MemoryLimits,
    apply_buffer_cache_limit,
    log_limits,
    memory_limits,
)

GB = 1024 * MIB


def _limits(
    policy: str,
    ceiling_mb: float | None = None,
    wired_mb: float | None = None,
    recommended: int = 0,
) -> MemoryLimits:
    memory = MemorySettings(limit_mb=ceiling_mb, wired_limit_mb=wired_mb, policy=policy)
    return memory_limits(memory, recommended)


def test_quarter_caps_the_buffer_cache_at_a_quarter_of_the_ceiling_and_wires_the_plan() -> None:
    # Without a ceiling the buffer cache is never unbounded: the seed's cap
    # (1 GB; a sixteenth of Metal's working set within 256 MB-4 GB).
    assert _limits("quarter") == MemoryLimits(None, None, 1 * GB)
    assert _limits("quarter", 8192) == MemoryLimits(8192 * MIB, None, 2048 * MIB)
    assert _limits("quarter", 8192, 4096) == MemoryLimits(8192 * MIB, 4096 * MIB, 2048 * MIB)
    # Metal's recommended working set sets no ceiling and wires nothing here.
    assert _limits("quarter", recommended=96 * GB) == MemoryLimits(None, None, 4 * GB)
    assert _limits("quarter", recommended=24 * GB) == MemoryLimits(None, None, 1536 * MIB)


@pytest.mark.parametrize(
    ("ceiling_mb", "wired_mb", "recommended", "want"),
    [
        # No ceiling at all (no flag, no Metal): MLX's own wiring, a 1 GB cache.
        (None, None, 0, MemoryLimits(None, None, 1 * GB)),
        # The seed's client launch: 8 GB ceiling, 4 GB planned: 4096 / 16.
        (8192, 4096, 0, MemoryLimits(8 * GB, 4 * GB, 256 * MIB)),
        # No plan: the ceiling is wired, and scales the cache (clamped at 4 GB).
        (131072, None, 0, MemoryLimits(128 * GB, 128 * GB, 4 * GB)),
        (32768, None, 0, MemoryLimits(32 * GB, 32 * GB, 2 * GB)),
        # A small ceiling: the cache keeps its 256 MB floor.
        (2048, None, 0, MemoryLimits(2 * GB, 2 * GB, 256 * MIB)),
        # A plan above the ceiling is capped at it.
        (8192, 16384, 0, MemoryLimits(8 * GB, 8 * GB, 512 * MIB)),
        # Metal's recommended working set bounds the ceiling, and stands in
        # for it when none is given.
        (131072, None, 96 * GB, MemoryLimits(96 * GB, 96 * GB, 4 * GB)),
        (None, None, 24 * GB, MemoryLimits(24 * GB, 24 * GB, 1536 * MIB)),
        # A plan without a ceiling is wired as it is.
        (None, 4096, 0, MemoryLimits(None, 4 * GB, 256 * MIB)),
    ],
)
def test_bounded_is_the_seeds_policy(
    ceiling_mb: float | None, wired_mb: float | None, recommended: int, want: MemoryLimits
) -> None:
    assert _limits("bounded", ceiling_mb, wired_mb, recommended) == want


def test_the_seed_profile_selects_the_seeds_policy_and_a_flag_wins(tmp_path: Path) -> None:
    def policy(profile: str, *argv: str) -> str:
        args = cli._parser(profile).parse_args(["serve", "--model", str(tmp_path), *argv])
        return cli.server_config(args, tmp_path).engine.memory.policy

    assert policy("standard") == "quarter"
    assert policy("seed") == "bounded"
    assert policy("seed", "--mlx-memory-policy", "quarter") == "quarter"
    with pytest.raises(ValueError, match="mlx_memory_policy must be one of quarter, bounded"):
        policy("standard", "--mlx-memory-policy", "huge")


def test_the_buffer_cache_limit_reads_back_and_the_wired_limit_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    limits = _limits("bounded", 8192, 4096)
    before = mx.set_cache_limit(0)
    try:
        apply_buffer_cache_limit(limits)
        assert mx.set_cache_limit(before) == 256 * MIB  # the previous limit: ours
    finally:
        mx.set_cache_limit(before)
    with caplog.at_level(logging.INFO, logger="gezel_trio.mlx"):
        log_limits(MemorySettings(policy="bounded"), limits)
    text = caplog.text
    policy = "MLX memory (bounded policy): ceiling 8192 MB, wired 4096 MB, buffer cache 256 MB"
    assert policy in text
    if not mx.metal.is_available():
        assert "no Metal device: the wired limit (4096 MB) has no effect" in text


def test_the_buffer_cache_is_given_back_through_ctypes_without_the_gil() -> None:
    """``clear_buffer_cache`` calls MLX's own ``clear_cache`` through
    ``ctypes`` (the GIL released: a plain ``CDLL`` function, not a
    ``PyDLL`` one) in the ``libmlx`` already loaded, and empties the cache."""
    native = memory._native_clear_cache()
    if sys.platform.startswith("linux"):
        assert native is not None, "the Linux wheel's libmlx exports clear_cache"
    if native is None:
        pytest.skip("no libmlx with clear_cache beside mlx.core here")
    assert isinstance(native, ctypes._CFuncPtr)  # type: ignore[attr-defined]
    assert not native._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # type: ignore[attr-defined]
    parts = [mx.ones((1 << 18,)) + i for i in range(8)]
    mx.eval(parts)
    del parts
    assert mx.get_cache_memory() > 0
    memory.clear_buffer_cache()
    assert mx.get_cache_memory() == 0


def test_the_backend_reclaims_through_the_gil_free_call(
    dense_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gezel_trio.mlx import generators
    from gezel_trio.mlx.backend import MlxBackend

    calls: list[str] = []
    monkeypatch.setattr(generators, "clear_buffer_cache", lambda: calls.append("clear"))
    monkeypatch.setattr(mx, "clear_cache", lambda: calls.append("mx"))
    backend = MlxBackend(EngineConfig.from_flags(model=dense_model, decode_threads="all"))
    try:
        calls.clear()
        backend.reclaim()
        assert calls == ["clear"]
    finally:
        backend.close()
    assert "mx" not in calls
