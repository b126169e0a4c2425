"""Tool-call JSON parsing: the lexer vs partial-JSON libraries, per streamed byte.

The shipped splitter (``ToolCallSplitter(HERMES)``, whose JSON bodies run
``shaping.toolcalls._json_lexer``, an incremental lexer) against what could
replace it, per byte of streamed output.

Usage (from the repository root, no model or server needed; ``--size`` does
not apply)::

    python -m bench toolcall_parsing [--repeats 5] [--sections cost growth dense]

Systems, all fed the same model outputs in the same random chunks of 1-8
characters (about one token each, seeded):

``lexer``
    the splitter as shipped, whole: marker search, the lexer, the events.
``jiter``, ``partial-json-parser``
    neither can resume a parse, report where a value ends in longer text, or
    give back the raw text of a member, so streaming with them means parsing
    the call's JSON text so far again after every chunk (what partial-JSON
    tool parsers do): ``jiter.from_json(bytes, partial_mode="trailing-strings")``
    and ``partial_json_parser.loads``. Only that re-parse is timed (no marker
    search, no argument deltas), so their figures are lower bounds.
    partial-json-parser is pure Python and skips outputs over 12 KB (one run
    of 32 KiB takes over a minute). jiter comes with the test extra (openai
    needs it); partial-json-parser is no dependency of the project (``pip
    install partial-json-parser``), and a library that is not installed is
    left out.

Sections:

``cost``
    ns per byte of each output, best of ``--repeats``.
``growth``
    the same for one arguments object of 2, 8 and 32 KiB: a re-parse per
    chunk costs O(n) per chunk, so its cost per byte grows with the call.
``dense``
    token-dense markup: the lexer's ns per byte at 1/8 and 1/2 MiB in one
    piece. The tests check the same property by counting work, not time.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bench._scenario import Cell, Context, Option, Plot, Result, Scenario, Series, Table

if TYPE_CHECKING:
    from gezel_trio.shaping.toolcalls import ToolEvent, ToolFormat

SECTIONS = ("cost", "growth", "dense")
CHUNK_SEED = 20261201
MiB = 1 << 20

# --- outputs -------------------------------------------------------------------

CODE = (
    'def greet(name: str) -> str:\n\t"""Say hello."""\n'
    '\treturn f"Hello, {name}!\\n" + "\\\\" * 2  # {"not": "json"}\n\n'
)


def hermes(args: Any, **dumps: Any) -> str:
    return (
        "<tool_call>\n" + json.dumps({"name": "f", "arguments": args}, **dumps) + "\n</tool_call>"
    )


def code_args(size: int) -> dict[str, str]:
    return {"path": "src/app.py", "content": (CODE * (size // len(CODE) + 1))[:size]}


def nested(depth: int) -> Any:
    value: Any = {"leaf": [1, "x"]}
    for k in range(depth):
        value = {"k": value} if k % 2 else [value, k]
    return value


def outputs() -> dict[str, str]:
    rnd = random.Random(1)
    weather = {"city": "Paris", "unit": "celsius"}
    return {
        "small object": "Let me check.\n" + hermes(weather),
        "4 small calls": "".join(hermes({"q": f"item {k}", "limit": k}) for k in range(4)),
        "8 KiB code string": hermes(code_args(8192)),
        "indented object": hermes(
            {"rows": [{"id": k, "ok": k % 2 == 0} for k in range(60)]}, indent=2
        ),
        "2k numbers": hermes({"values": [round(rnd.uniform(-1e3, 1e3), 4) for _ in range(2000)]}),
        "deep nesting (100)": hermes(nested(100)),
        "\\u escapes": hermes({"text": "é😀 “quoted” \\ \t" * 200}),
        "double-encoded": hermes(json.dumps(code_args(2048))),
    }


def growth_cases() -> dict[str, str]:
    return {f"{k} KiB code string": hermes(code_args(k * 1024)) for k in (2, 8, 32)}


def chunks(text: str, seed: int = CHUNK_SEED) -> list[str]:
    rnd = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rnd.randint(1, 8)
        out.append(text[i : i + n])
        i += n
    return out


def call_json(text: str) -> list[str]:
    """The JSON text of each call in a Hermes output."""
    return [p.split("</tool_call>")[0].strip() for p in text.split("<tool_call>")[1:]]


# --- systems -------------------------------------------------------------------

Run = Callable[[str, list[str]], Any]


class TooLong(Exception):
    pass


def split(text: str, pieces: list[str], fmt: ToolFormat | None = None) -> list[ToolEvent]:
    """The splitter as shipped over ``pieces`` (Hermes unless ``fmt``)."""
    # Imported here: importing a scenario module stays cheap (bench.scenarios).
    from gezel_trio.shaping.toolcalls import HERMES, ToolCallSplitter

    s = ToolCallSplitter(fmt or HERMES, id_factory=lambda: "id")
    events: list[ToolEvent] = []
    for piece in pieces:
        events += s.feed(piece)
    return events + s.finish()


def reparser(parse: Callable[[str], Any], limit: int = 0) -> Run:
    calls: dict[str, list[list[str]]] = {}  # chunked outside the timed runs

    def run(text: str, pieces: list[str]) -> Any:
        if limit and len(text) > limit:
            raise TooLong
        if text not in calls:
            calls[text] = [chunks(call) for call in call_json(text)]
            return None
        value = None
        for call in calls[text]:
            sofar = ""
            for piece in call:
                sofar += piece
                value = parse(sofar)
        return value

    return run


def systems() -> dict[str, Run]:
    found: dict[str, Run] = {"lexer": split}
    with contextlib.suppress(ImportError):
        import jiter

        found["jiter"] = reparser(
            lambda s: jiter.from_json(s.encode(), partial_mode="trailing-strings")
        )
    with contextlib.suppress(ImportError):
        import partial_json_parser

        found["partial-json-parser"] = reparser(partial_json_parser.loads, limit=12_000)
    return found


def best(found: dict[str, Run], text: str, repeats: int) -> dict[str, float]:
    """Each system's best of ``repeats`` runs, in ns per byte. The systems take
    turns within each repeat, so a busy moment on the machine hits all alike."""
    pieces = chunks(text)
    times: dict[str, float] = {}
    for system, run in found.items():
        with contextlib.suppress(TooLong):
            run(text, pieces)  # a warm-up
            times[system] = float("inf")
    for _ in range(repeats):
        for system in times:
            began = time.perf_counter()
            found[system](text, pieces)
            times[system] = min(times[system], time.perf_counter() - began)
    return {system: t / len(text.encode()) * 1e9 for system, t in times.items()}


# --- sections ------------------------------------------------------------------


def cost(found: dict[str, Run], cases: dict[str, str], repeats: int) -> dict[str, Any]:
    return {
        name: {"bytes": len(text.encode()), **best(found, text, repeats)}
        for name, text in cases.items()
    }


def dense(repeats: int) -> dict[str, Any]:
    from gezel_trio.shaping.toolcalls import HERMES, QWEN3_CODER

    units = {
        "late failures": (
            HERMES,
            '<tool_call>{"name": "f", "arguments": {"a": 1\n]}</tool_call>\n',
        ),
        "unclosed late failures": (HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1]'),
        "raw control characters": (HERMES, '"k\n":"v\t",\n'),
        "xml calls": (QWEN3_CODER, "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n"),
    }
    rows = {}
    for name, (fmt, unit) in units.items():
        prefix = '<tool_call>{"name": "f", "arguments": {' if unit.startswith('"k') else ""
        row: dict[str, float] = {}

        def one_piece(t: str, _: list[str], f: ToolFormat = fmt) -> Any:
            return split(t, [t], f)

        for label, size in (("1/8 MiB", MiB // 8), ("1/2 MiB", MiB // 2)):
            text = prefix + unit * (size // len(unit))
            row[label] = best({label: one_piece}, text, repeats)[label]
        row["ratio x100"] = 100 * row["1/2 MiB"] / row["1/8 MiB"]
        rows[name] = row
    return rows


# --- the report ----------------------------------------------------------------


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
    if a.repeats < 1:
        raise ValueError("--repeats >= 1 required")
    found = systems()
    by: dict[str, dict[str, Any]] = {}
    with ctx.phase("measure"):
        if "cost" in a.sections:
            by["cost"] = {"rows": cost(found, outputs(), a.repeats)}
        if "growth" in a.sections:
            by["growth"] = {"rows": cost(found, growth_cases(), a.repeats)}
        if "dense" in a.sections:
            by["dense"] = {"rows": dense(a.repeats)}
    names = list(found)
    data: dict[str, Any] = {"systems": names, "chunk_seed": CHUNK_SEED}
    tables: list[Table] = []
    plots: list[Plot] = []
    notes = [f"Systems: {', '.join(names)} (chunks of 1-8 characters, seed 20261201)."]
    for lib in ("jiter", "partial-json-parser"):
        if lib not in names:
            notes.append(f"{lib} is not installed: left out.")
    of_best = f"ns per byte, best of {a.repeats}"
    if "cost" in by:
        rows = by["cost"]["rows"]
        data["cost"] = rows
        tables.append(_ns_table(f"Cost per byte of streamed output ({of_best})", rows, names))
        plots.append(
            Plot(
                "Cost per byte, by output",
                "",
                "ns/byte",
                _bar_series(rows, names),
                kind="bar",
                logy=True,
            )
        )
    if "growth" in by:
        rows = by["growth"]["rows"]
        data["growth"] = rows
        tables.append(_ns_table(f"One call, growing arguments ({of_best})", rows, names))
        kib = [int(r["bytes"]) / 1024 for r in rows.values()]
        plots.append(
            Plot(
                "One call, growing arguments",
                "arguments KiB",
                "ns/byte",
                tuple(
                    Series(s, kib, [r.get(s) for r in rows.values()])
                    for s in names
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
                f"Token-dense markup in one piece, lexer ({of_best})",
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
    return Result(data, tables, plots, notes, title="no model: pure text processing")


SCENARIO = Scenario(
    name="toolcall_parsing",
    doc=__doc__ or "",
    run=run,
    options=(
        Option("repeats", 5, "timed runs per output (the best is reported)", int, quick=1),
        Option("sections", list(SECTIONS), "sections to run", str, "+", SECTIONS),
    ),
)
