"""The documented examples run as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.mark.slow
def test_agent_loop_example_runs_on_the_default_model(smollm2_model: Path) -> None:
    """No arguments: the default model, already fetched and converted into
    this session's home by the fixture, as a first ``serve`` would."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "agent_loop.py")],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    assert "[tool call: get_weather(" in out
    assert "[tool result: It is 18 degrees Celsius and sunny in" in out
    assert "[summary: " in out
