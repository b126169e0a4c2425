"""Tool-call JSON parsing: lexer vs scanner vs partial-JSON libraries, per streamed byte.

The hand-written lexer vs a scanner + ``json.loads`` vs partial-JSON
libraries, per byte of streamed output, and what each gets right.

Usage (from the repository root, no model or server needed; ``--size`` does
not apply)::

    python -m bench toolcall_parsing [--repeats 5] [--mutations 5000]
                                     [--sections cost growth dense tests mutations]

It runs in a child process (``bench._worker``): it swaps the splitter's JSON
body and runs pytest, which the runner's own process should not do.

Systems, all fed the same model outputs in the same random chunks of 1-8
characters (about one token each, seeded):

``splitter only``
    the splitter around a body that takes every piece whole and does nothing:
    what feeding pieces, finding markers and building events cost around any
    JSON parsing; the other systems' own share is what they add to it.
``lexer``
    ``ToolCallSplitter(HERMES)`` as shipped: ``shaping.toolcalls._json_lexer``,
    an incremental JSON lexer with C-speed fast paths.
``scanner``
    the same splitter with ``_json_scan.JsonBody`` in its place: the call
    object's own syntax checked as it comes, inside a value only strings and
    brackets tracked, ``json.loads`` on each value once it ends. It was
    removed after this measurement; the script loads it from the last commit
    that had it.
``jiter``, ``partial-json-parser``
    neither can resume a parse, report where a value ends in longer text, or
    give back the raw text of a member, so streaming with them means parsing
    the call's JSON text so far again after every chunk (what partial-JSON
    tool parsers do): ``jiter.from_json(bytes, partial_mode="trailing-strings")``
    and ``partial_json_parser.loads``. Only that re-parse is timed (no marker
    search, no argument deltas), so their figures are lower bounds, to be
    added to ``splitter only``. partial-json-parser is pure Python and skips
    outputs over 12 KB (one run of 32 KiB takes over a minute). jiter comes
    with the test extra (openai needs it); partial-json-parser is no
    dependency of the project (``pip install partial-json-parser``), and a
    library that is not installed is left out.

Sections:

``cost``
    ns per byte of each output, best of ``--repeats``.
``growth``
    the same for one arguments object of 2, 8 and 32 KiB: a re-parse per
    chunk costs O(n) per chunk, so its cost per byte grows with the call.
``dense``
    token-dense markup (the timing figure that used to be a test): the lexer's
    ns per byte at 1/8 and 1/2 MiB in one piece. The tests check the same
    property by counting work, not time.
``tests``
    ``tests/shaping/test_toolcalls.py`` run in this process with the scanner swapped
    in for the lexer.
``mutations``
    ``--mutations`` valid calls (followed by prose and a second, valid call),
    each with one character deleted, inserted or replaced inside the first
    call's JSON, split by lexer and scanner: how often their events differ,
    and how often the second call is lost.
"""

from __future__ import annotations

from typing import Any

from bench import _worker
from bench._scenario import Cell, Context, Option, Plot, Result, Scenario, Series, Table

SECTIONS = ("cost", "growth", "dense", "tests", "mutations")


def _ns_table(title: str, rows: dict[str, dict[str, float]], systems: list[str]) -> Table:
    cols = [s for s in systems if any(s in r for r in rows.values())]
    cells: list[list[Cell]] = [
        [name, int(r["bytes"]), *(r.get(s) for s in cols)] for name, r in rows.items()
    ]
    return Table(title, ("output", "bytes", *cols), cells, ("", "d", *(".0f" for _ in cols)))


def _bar_series(rows: dict[str, dict[str, float]], keys: list[str]) -> tuple[Series, ...]:
    names = list(rows)
    return tuple(
        Series(k, names, [rows[n].get(k) for n in names])
        for k in keys
        if any(k in r for r in rows.values())
    )


def run(ctx: Context) -> Result:
    a = ctx.args
    if a.repeats < 1 or a.mutations < 1:
        raise ValueError("--repeats >= 1 and --mutations >= 1 required")
    sections = [s for s in SECTIONS if s in a.sections]
    with ctx.phase("measure"):
        got = _worker.run(
            "bench.scenarios._toolcall_parsing:measure",
            sections=sections,
            repeats=a.repeats,
            mutation_count=a.mutations,
        )
    by = {d["section"]: d for d in got}
    systems: list[str] = by["systems"]["systems"]
    data: dict[str, Any] = {
        "systems": systems,
        "chunk_seed": 20261201,
        "scanner_missing": by["systems"]["scanner_missing"],
    }
    tables: list[Table] = []
    plots: list[Plot] = []
    notes = [f"Systems: {', '.join(systems)} (chunks of 1-8 characters, seed 20261201)."]
    for lib in ("jiter", "partial-json-parser"):
        if lib not in systems:
            notes.append(f"{lib} is not installed: left out.")
    if by["systems"]["scanner_missing"]:
        notes.append(
            f"The scanner could not be loaded ({by['systems']['scanner_missing']}): "
            "no scanner column, no tests or mutations section."
        )
    best = f"ns per byte, best of {a.repeats}"
    if "cost" in by:
        rows = by["cost"]["rows"]
        data["cost"] = rows
        tables.append(_ns_table(f"Cost per byte of streamed output ({best})", rows, systems))
        plots.append(
            Plot(
                "Cost per byte, by output",
                "",
                "ns/byte",
                _bar_series(rows, systems),
                kind="bar",
                logy=True,
            )
        )
    if "growth" in by:
        rows = by["growth"]["rows"]
        data["growth"] = rows
        tables.append(_ns_table(f"One call, growing arguments ({best})", rows, systems))
        kib = [int(r["bytes"]) / 1024 for r in rows.values()]
        plots.append(
            Plot(
                "One call, growing arguments",
                "arguments KiB",
                "ns/byte",
                tuple(
                    Series(s, kib, [r.get(s) for r in rows.values()])
                    for s in systems
                    if any(s in r for r in rows.values())
                ),
                logx=True,
                logy=True,
            )
        )
    if "dense" in by:
        rows = by["dense"]["rows"]
        data["dense"] = rows
        cells: list[list[Cell]] = [
            [name, r["1/8 MiB"], r["1/2 MiB"], r["ratio x100"]] for name, r in rows.items()
        ]
        tables.append(
            Table(
                f"Token-dense markup in one piece, lexer ({best})",
                ("markup", "1/8 MiB", "1/2 MiB", "ratio x100"),
                cells,
                ("", ".0f", ".0f", ".0f"),
                (
                    "ratio x100: 100 x (ns/byte at 1/2 MiB) / (ns/byte at 1/8 MiB); "
                    "100 means linear time.",
                ),
            )
        )
        plots.append(
            Plot(
                "Token-dense markup in one piece (lexer)",
                "",
                "ns/byte",
                _bar_series(rows, ["1/8 MiB", "1/2 MiB"]),
                kind="bar",
            )
        )
    if "tests" in by:
        out = by["tests"]["outcomes"]
        data["tests"] = out
        tables.append(
            Table(
                "tests/shaping/test_toolcalls.py with the scanner in place of the lexer",
                ("passed", "failed", "which failed"),
                [
                    [
                        out.get("passed", 0),
                        out.get("failed", 0),
                        ", ".join(out.get("which failed", [])) or "-",
                    ]
                ],
                ("d", "d", ""),
            )
        )
    if "mutations" in by:
        counts = by["mutations"]["counts"]
        data["mutations"] = counts
        tables.append(
            Table(
                "One character broken in a call's JSON (then prose and a second call)",
                ("what", "count"),
                [[k, v] for k, v in counts.items()],
                ("", "d"),
            )
        )
        shown = {k: v for k, v in counts.items() if k != "outputs"}
        plots.append(
            Plot(
                f"One character broken, {counts['outputs']} outputs",
                "",
                "% of outputs",
                (
                    Series(
                        "broken", list(shown), [100 * v / counts["outputs"] for v in shown.values()]
                    ),
                ),
                kind="bar",
            )
        )
    return Result(data, tables, plots, notes, title="no model: pure text processing")


SCENARIO = Scenario(
    name="toolcall_parsing",
    doc=__doc__ or "",
    run=run,
    options=(
        Option("repeats", 5, "timed runs per output (the best is reported)", int, quick=1),
        Option("mutations", 5000, "broken calls in the mutations section", int, quick=200),
        Option("sections", list(SECTIONS), "sections to run", str, "+", SECTIONS),
    ),
)
