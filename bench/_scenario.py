"""What a scenario is: a name, its documentation, its options, one ``run``.

A scenario module under ``bench/scenarios/`` defines ``SCENARIO =
Scenario(...)``; the runner discovers it there (``bench.scenarios.load``).
``run`` gets a ``Context`` (the resolved options, the model size, a working
directory, phase timing) and returns a ``Result``: the raw data for the JSON
file, the tables for the markdown file, and the curves for the PNG. Writing
them is the harness's job (``bench._report``), so a scenario never formats a
file or draws a figure itself.

Options are declared once per scenario with a default and, optionally, a
smaller value for ``--quick``. The CLI has one flag per option name across
all scenarios: two scenarios that declare ``tokens`` share ``--tokens`` (each
keeps its own default and its own choices), so ``python -m bench decode
grammar --streams 1 2`` sets both.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import attrs

Cell = str | int | float | None


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


@attrs.frozen
class Option:
    """One ``--name`` flag of a scenario (``name`` with ``_``; the flag uses ``-``).

    ``kind``: ``value`` (``type`` applied, ``nargs`` as argparse's) or
    ``flag`` (``store_true``). ``quick`` is the value under ``--quick``.
    """

    name: str
    default: Any
    help: str
    type: Callable[[str], Any] = str
    nargs: Literal["+"] | None = None
    choices: tuple[Any, ...] | None = None
    quick: Any = UNSET
    kind: Literal["value", "flag"] = "value"

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def value(self, given: Any, quick: bool) -> Any:
        """What the scenario sees: the CLI value, else its quick or default value."""
        if given is not None:
            return given
        if quick and self.quick is not UNSET:
            return self.quick
        return self.default


@attrs.frozen
class Table:
    """A markdown table; ``formats`` are format specs per column (``""``: str())."""

    title: str
    columns: tuple[str, ...]
    rows: Sequence[Sequence[Cell]]
    formats: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def table(title: str, header: str, rows: Sequence[Sequence[Cell]], *notes: str) -> Table:
    """A table declared like its markdown header: ``"system | streams:d | tok/s:.1f"``,
    each column a name and, after ``:``, the format spec of its numbers."""
    cols = [c.strip().partition(":") for c in header.split("|")]
    return Table(title, tuple(c[0] for c in cols), rows, tuple(c[2] for c in cols), notes)


@attrs.frozen
class Series:
    label: str
    x: Sequence[Any]  # numbers (line plot) or category names (bar plot)
    y: Sequence[float | None]
    style: str = "-"  # a matplotlib line style for line plots ("--": a secondary curve)
    group: str = ""  # series of one group share a colour (a system's cold and warm TTFT)


@attrs.frozen
class Plot:
    """One panel of the scenario's PNG."""

    title: str
    xlabel: str
    ylabel: str
    series: tuple[Series, ...]
    kind: Literal["line", "bar"] = "line"
    logx: bool = False
    logy: bool = False


@attrs.define
class Result:
    """What a run returns: ``data`` goes to the JSON file as is (keep every
    raw measurement there), ``tables`` and ``notes`` to the markdown,
    ``plots`` to the PNG; ``title`` names the run (the model, say)."""

    data: dict[str, Any]
    tables: list[Table] = attrs.Factory(list)
    plots: list[Plot] = attrs.Factory(list)
    notes: list[str] = attrs.Factory(list)
    title: str = ""


@attrs.define
class Context:
    """What a scenario's ``run`` gets from the harness."""

    scenario: str
    options: Mapping[str, Any]
    size: Literal["tiny", "bench"]
    quick: bool
    workdir: Path  # server logs and scratch files; kept only with --log-dir
    phases: list[dict[str, Any]] = attrs.Factory(list)

    @property
    def args(self) -> argparse.Namespace:
        """The options as attributes (``ctx.args.tokens``), as argparse gives them."""
        return argparse.Namespace(**self.options)

    def progress(self, msg: str) -> None:
        print(f"  [{self.scenario}] {msg}", file=sys.stderr, flush=True)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time one phase (one system, one section); recorded with the load
        average after it, so a run that shared its CPUs shows where."""
        t0 = time.monotonic()
        yield
        seconds = time.monotonic() - t0
        load = os.getloadavg()
        self.phases.append({"phase": name, "seconds": round(seconds, 2), "loadavg": load})
        self.progress(f"{name}: {seconds:.0f}s, load {load[0]:.2f}")

    def demo_model(self, kind: str = "dense") -> Path:
        """The demo model of this run's ``--size`` (built on first use)."""
        from bench import _servers

        return _servers.demo_model(kind, self.size)


@attrs.frozen
class Scenario:
    """A declared measurement: ``doc`` is its module docstring, whose first
    line is the one-line summary ``--list`` shows. ``in_default_run``: run by
    a bare ``python -m bench`` (a long soak would say False)."""

    name: str
    doc: str
    run: Callable[[Context], Result]
    options: tuple[Option, ...] = ()
    in_default_run: bool = True

    @property
    def summary(self) -> str:
        return self.doc.strip().splitlines()[0].rstrip(".")

    def option(self, name: str) -> Option:
        for o in self.options:
            if o.name == name:
                return o
        raise KeyError(name)

    def resolve(self, given: Mapping[str, Any], quick: bool) -> dict[str, Any]:
        """The option values for one run; ValueError names a value this
        scenario does not accept."""
        out: dict[str, Any] = {}
        for o in self.options:
            value = o.value(given.get(o.name), quick)
            if o.choices is not None and value is not None:
                bad = [v for v in (value if o.nargs else [value]) if v not in o.choices]
                if bad:
                    raise ValueError(
                        f"{self.name}: {o.flag} {bad[0]!r} is not one of {list(o.choices)}"
                    )
            out[o.name] = value
        return out
