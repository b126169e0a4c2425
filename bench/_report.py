"""Writing a run down: ``<scenario>.json``, ``<scenario>.md`` and ``<scenario>.png``.

The JSON file holds the run's settings (options, model size, command line,
code version, load average, phase times) and the scenario's raw data; the markdown
file its tables, notes and the scenario's documentation; the PNG its curves
(matplotlib's Agg backend, one panel per ``Plot``). matplotlib comes with
the ``bench`` extra; without it the PNG is skipped with a warning.

Also the small statistics the scenarios share (``median``, ``percentile``).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import textwrap
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

from bench._scenario import Cell, Plot, Result, Scenario, Table


def median(values: Iterable[float | None]) -> float:
    """The median of the values that are numbers; NaN for none."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(vals) if vals else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, None when either side is missing (or ``b`` is 0)."""
    if a is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def _jsonable(obj: Any) -> Any:
    if attrs.has(type(obj)):
        return attrs.asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, set | frozenset | tuple):
        return list(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def _nan_to_none(obj: Any) -> Any:
    """JSON has no NaN: write null instead."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_nan_to_none(v) for v in obj]
    return obj


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    plain = json.loads(json.dumps(payload, default=_jsonable))
    path.write_text(json.dumps(_nan_to_none(plain), indent=2, allow_nan=False) + "\n")


# --- markdown ----------------------------------------------------------------


def cell(value: Cell, fmt: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and not fmt:
        fmt = ".3g"
    return format(value, fmt) if fmt and not isinstance(value, str) else str(value)


def table_markdown(table: Table) -> str:
    formats = table.formats or ("",) * len(table.columns)
    head = "| " + " | ".join(table.columns) + " |"
    rule = "|" + "|".join("---" if f == "" else "--:" for f in formats) + "|"
    rows = [
        "| " + " | ".join(cell(v, f) for v, f in zip(row, formats, strict=True)) + " |"
        for row in table.rows
    ]
    out = [f"### {table.title}", "", head, rule, *rows]
    if table.notes:
        out += ["", *table.notes]
    return "\n".join(out)


def _settings(meta: dict[str, Any]) -> list[str]:
    load = meta["loadavg"]
    opts = ", ".join(f"`{k}={v}`" for k, v in meta["options"].items())
    return [
        f"`{meta['command']}` at {meta['started']} on gezel-trio `{meta['version']}`, "
        f"{meta['cpus']} CPUs; wall {meta['wall_s']:.0f} s; 1-minute load average "
        f"{load['before'][0]:.2f} before, {load['after'][0]:.2f} after (a run keeps "
        "about one core busy: much more means something else shared the CPUs).",
        "",
        f"Options: {opts or '-'}.",
    ]


def markdown(scenario: Scenario, result: Result, meta: dict[str, Any], png: str | None) -> str:
    title = f"# {scenario.name}: {scenario.summary}"
    out = [title, ""]
    if result.title:
        out += [result.title, ""]
    out += [*_settings(meta), ""]
    if png:
        out += [f"![{scenario.name}]({png})", ""]
    for table in result.tables:
        out += [table_markdown(table), ""]
    if result.notes:
        out += [*(f"- {n}" for n in result.notes), ""]
    out += ["## What it measures", "", scenario.doc.strip(), ""]
    return "\n".join(out)


def terminal_text(result: Result) -> str:
    """The tables and notes, for stdout."""
    parts = [table_markdown(t) for t in result.tables]
    parts += [f"- {n}" for n in result.notes]
    return "\n\n".join(parts)


# --- plot --------------------------------------------------------------------


def write_png(path: Path, title: str, plots: Sequence[Plot]) -> bool:
    """One figure, one panel per plot; False (and a warning) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print(
            "matplotlib is missing: no PNG (pip install -e '.[bench]')",
            file=sys.stderr,
        )
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 1 if len(plots) == 1 else 2
    rows = math.ceil(len(plots) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(6.4 * cols, 4.2 * rows), squeeze=False, layout="constrained"
    )
    # One colour per system (or mode) across all panels of the figure.
    groups = dict.fromkeys(s.group or s.label for plot in plots for s in plot.series)
    colour = {g: f"C{i % 10}" for i, g in enumerate(groups)}
    for ax, plot in zip(axes.flat, plots, strict=False):
        _panel(ax, plot, colour)
    for ax in list(axes.flat)[len(plots) :]:
        ax.set_visible(False)
    fig.suptitle(textwrap.fill(title, 60 * cols), fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _panel(ax: Any, plot: Plot, colour: dict[str, str]) -> None:
    if plot.kind == "bar":
        cats = list(dict.fromkeys(x for s in plot.series for x in s.x))
        width = 0.8 / max(1, len(plot.series))
        for i, s in enumerate(plot.series):
            ys = dict(zip(s.x, s.y, strict=True))
            pos = [k + (i - (len(plot.series) - 1) / 2) * width for k in range(len(cats))]
            vals = [ys.get(c) for c in cats]
            ys_bar = [math.nan if v is None else v for v in vals]
            ax.bar(pos, ys_bar, width, label=s.label, color=colour[s.group or s.label])
        labels = [str(c) for c in cats]
        if sum(map(len, labels)) > 40:  # long names: slanted, so they do not overlap
            ax.set_xticks(range(len(cats)), labels, rotation=25, ha="right", fontsize=8)
        else:
            ax.set_xticks(range(len(cats)), labels)
    else:
        for s in plot.series:
            pts = [(x, y) for x, y in zip(s.x, s.y, strict=True) if y is not None]
            if pts:
                xs, ys = zip(*pts, strict=True)
                c = colour[s.group or s.label]
                ax.plot(xs, ys, s.style, marker="o", label=s.label, color=c)
        ticks = sorted({x for s in plot.series for x in s.x})
        if len(ticks) <= 12 and all(isinstance(x, int) for x in ticks):
            ax.set_xticks(ticks)  # stream counts, turns: no fractional ticks
    if plot.logx:
        ax.set_xscale("log", base=2)
    if plot.logy:
        ax.set_yscale("log")
    ax.set_title(plot.title, fontsize=10)
    ax.set_xlabel(plot.xlabel)
    ax.set_ylabel(plot.ylabel)
    ax.grid(True, alpha=0.3)
    if len(plot.series) > 1:
        ax.legend(fontsize=8)
