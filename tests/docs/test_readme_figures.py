"""The README's benchmark table and plot are the generated report's
(``bench/results/decode.md``, written by ``python -m bench decode``): the
same medians, the same date, the same plot file."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
REPORT = (ROOT / "bench" / "results" / "decode.md").read_text()


def _report_medians() -> dict[tuple[str, int], str]:
    """``(system, streams) -> tok/s median`` from the report's decode table."""
    section = REPORT.split("### Decode tok/s", 1)[1].split("###", 1)[0]
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[1].isdigit():
            out[cells[0], int(cells[1])] = cells[2]
    return out


def test_the_readme_table_is_the_reports() -> None:
    section = README.split("## Benchmark", 1)[1].split("\n## ", 1)[0]
    header = re.search(r"^\| streams \|(.*)\|$", section, re.M)
    assert header, "the README's benchmark table has a 'streams' column first"
    systems = [c.strip().strip("`") for c in header.group(1).split("|")]
    names = {"raw mlx-lm": "raw", "gezel-trio": "gezel", "mlx_lm.server": "mlx_lm.server"}
    medians = _report_medians()
    rows = re.findall(r"^\| (\d+) \|(.*)\|$", section, re.M)
    assert rows
    for streams, rest in rows:
        cells = [c.strip() for c in rest.split("|")]
        for system, cell in zip(systems, cells, strict=True):
            want = medians[names[system], int(streams)]
            assert cell == want, f"README: {system} at {streams} streams {cell}, report {want}"


def test_the_readme_dates_the_run_and_shows_the_reports_plot() -> None:
    ran = re.search(r"at (\d{4}-\d{2}-\d{2})T", REPORT)
    assert ran, "the report says when it ran"
    section = README.split("## Benchmark", 1)[1].split("\n## ", 1)[0]
    assert f"run {ran.group(1)} on" in section, "the README names the report's date"
    plots = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README)
    assert plots == ["bench/results/decode.png"], "one plot, the report's"
    assert (ROOT / plots[0]).is_file()
