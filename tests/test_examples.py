"""The documented examples run as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_embedding_example_runs(dense_model: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "embed_engine.py"), str(dense_model)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "[length: 24 tokens]" in out
    assert "[cancelled after 5 tokens" in out
