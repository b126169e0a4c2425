"""docs/configuration.md is the settings' declarations rendered
(``gezel_trio.config_reference``): it fails here the moment a flag, a
default or a help text changes without the page being regenerated, and
it lists every flag of the real ``gezel-trio serve --help`` under that
help's heading."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from gezel_trio.config_reference import REGENERATE, render_reference

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"COLUMNS": "100"}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, check=True, timeout=60
    )


def _help_flags(text: str) -> list[tuple[str, str]]:
    """``serve --help`` as (heading, flag) pairs in its order, ``--help`` left out."""
    pairs = []
    heading = ""
    for line in text.splitlines():
        if line and not line.startswith(" "):
            heading = line.removesuffix(":")
        elif line.startswith("  --"):
            pairs.append((heading, line.split()[0]))
    return pairs


def _page_flags(text: str) -> list[tuple[str, str]]:
    """The page's entries as (heading, flag) pairs in its order; an entry
    names its flags in code before its parenthesized default."""
    pairs = []
    heading = ""
    for line in text.splitlines():
        if line.startswith("## "):
            heading = line.removeprefix("## ")
        elif line.startswith("- `"):
            named = line.split(" (", 1)[0]
            pairs += [(heading, flag) for flag in re.findall(r"`(--[a-z0-9-]+)", named)]
    return pairs


def test_the_page_is_the_declarations_rendered() -> None:
    rendered = render_reference().encode()
    assert rendered == PAGE.read_bytes(), f"docs/configuration.md is stale: run {REGENERATE}"


def test_every_flag_of_serve_help_is_on_the_page_under_its_heading() -> None:
    shown = _help_flags(_run("-m", "gezel_trio", "serve", "--help").stdout)
    assert ("the prompt cache and its persistence", "--cache-budget-mb") in shown
    assert ("the seed sidecar's flags", "--vision") in shown
    assert ("the server", "--no-exit-with-parent") in shown
    assert len(shown) > 70
    assert _page_flags(PAGE.read_text()) == shown


def test_the_regenerate_command_writes_the_page_and_loads_no_mlx() -> None:
    # -X importtime lists on stderr every module the process imported.
    done = _run("-X", "importtime", "-m", "gezel_trio.config_reference")
    assert done.stdout == PAGE.read_text()
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}
    assert "gezel_trio.cli" in imported
    heavy = sorted(m for m in imported if m.split(".")[0] in {"mlx", "mlx_lm", "mlx_vlm"})
    assert not heavy, heavy
