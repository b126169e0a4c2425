"""The code in docs/testing.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_testing_guide_example_runs() -> None:
    text = (DOCS / "testing.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, "docs/testing.md", "exec"), {"__name__": "docs_example"})
