"""The measuring side of the ``toolcall_parsing`` scenario (its documentation
is there): run in a child process by ``bench._worker``, since it imports
gezel-trio's tool-call splitter, swaps its JSON body and runs pytest.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# The package's private modules too: the bench swaps the JSON body.
from gezel_trio.shaping.toolcalls import (
    HERMES,
    QWEN3_CODER,
    ToolCallSplitter,
    ToolEvent,
    ToolFormat,
    _hermes,
    _mistral,
    collect,
)
from gezel_trio.shaping.toolcalls._body import RUNNING

ROOT = Path(__file__).resolve().parents[2]

SCANNER = "src/gezel_trio/shaping/toolcalls/_json_scan.py"
CHUNK_SEED = 20261201
MiB = 1 << 20


def load_scanner() -> Any:
    """The scanner candidate's JsonBody, from the last commit that had it.
    ``--full-history``: without it git's history simplification follows the
    side of a merge where the file never existed, and finds no commit."""
    last = subprocess.run(
        ["git", "rev-list", "-n", "1", "--full-history", "HEAD", "--", SCANNER],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    # The commit that deleted it, or (before that) the one that last changed it.
    for rev in (f"{last}^", last):
        shown = subprocess.run(
            ["git", "show", f"{rev}:{SCANNER}"], cwd=ROOT, capture_output=True, text=True
        )
        if shown.returncode == 0:
            break
    else:
        raise RuntimeError(f"{SCANNER} is not in this repository's history")
    name = "gezel_trio.shaping.toolcalls._json_scan"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "gezel_trio.shaping.toolcalls"
    exec(compile(shown.stdout, SCANNER, "exec"), module.__dict__)
    sys.modules[name] = module
    return module.JsonBody


@contextlib.contextmanager
def body(cls: Any) -> Iterator[None]:
    """Every JSON-bodied format (Hermes, generic, Mistral) uses ``cls``."""
    saved = _hermes.JsonBody, _mistral.JsonBody
    _hermes.JsonBody = _mistral.JsonBody = cls
    try:
        yield
    finally:
        _hermes.JsonBody, _mistral.JsonBody = saved


class NoParse:
    """A body that takes every piece whole and never ends."""

    status = RUNNING
    back = ""
    complete = False

    def __init__(self, owner: Any, end: str, *, root_args: bool) -> None:
        pass

    def step(self, text: str, i: int) -> int:
        return len(text)

    def closable_at_end(self) -> bool:
        return False


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


def split(text: str, pieces: list[str], fmt: ToolFormat = HERMES) -> list[ToolEvent]:
    s = ToolCallSplitter(fmt, id_factory=lambda: "id")
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


def with_body(cls: Any) -> Run:
    def run(text: str, pieces: list[str]) -> Any:
        with body(cls):
            return split(text, pieces)

    return run


def partial_parsers() -> dict[str, Callable[[str], Any]]:
    found: dict[str, Callable[[str], Any]] = {}
    with contextlib.suppress(ImportError):
        import jiter

        found["jiter"] = lambda s: jiter.from_json(s.encode(), partial_mode="trailing-strings")
    with contextlib.suppress(ImportError):
        import partial_json_parser

        found["partial-json-parser"] = partial_json_parser.loads
    return found


def valid(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def systems(scanner: Any) -> dict[str, Run]:
    found: dict[str, Run] = {"splitter only": with_body(NoParse), "lexer": split}
    if scanner is not None:
        found["scanner"] = with_body(scanner)
    parsers = partial_parsers()
    if "jiter" in parsers:
        found["jiter"] = reparser(parsers["jiter"])
    if "partial-json-parser" in parsers:
        found["partial-json-parser"] = reparser(parsers["partial-json-parser"], limit=12_000)
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


def tests(scanner: Any) -> dict[str, Any]:
    import pytest

    class Count:
        def __init__(self) -> None:
            self.outcomes: dict[str, Any] = {"passed": 0, "failed": 0, "which failed": []}

        def pytest_runtest_logreport(self, report: Any) -> None:
            if report.when == "call" or report.outcome != "passed":
                self.outcomes[report.outcome] = self.outcomes.get(report.outcome, 0) + 1
            if report.outcome == "failed":
                self.outcomes["which failed"].append(report.nodeid.split("::")[-1])

    counts = Count()
    with body(scanner), contextlib.redirect_stdout(io.StringIO()):
        pytest.main(
            [str(ROOT / "tests/shaping/test_toolcalls.py"), "-q", "-p", "no:cacheprovider"],
            plugins=[counts],
        )
    return counts.outcomes


def mutations(scanner: Any, n: int) -> dict[str, int]:
    rnd = random.Random(2)
    samples = [
        {"city": "Paris", "days": 3},
        {"code": 'if (a) { return "}"; }\n', "n": [1, 2.5, -3e2, None, True]},
        {"a": {"b": {"c": [[], {}]}}},
        {"text": 'é😀 \\ " \u2028'},
    ]
    second = '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    found = {"outputs": n, "events differ": 0, "second call lost by lexer": 0}
    found["second call lost by scanner"] = 0
    found["first call's JSON invalid"] = 0
    partial = partial_parsers()
    for name in partial:
        found[f"invalid JSON accepted by {name}"] = 0
    for _ in range(n):
        args = rnd.choice(samples)
        first = hermes(rnd.choice([args, json.dumps(args)]))
        k = rnd.randrange(len("<tool_call>\n"), len(first) - len("\n</tool_call>"))
        op = rnd.choice(["delete", "insert", "replace"])
        c = rnd.choice('{}[]",:\\ ax1-.tn<')
        broken = first[:k] + ("" if op == "delete" else c) + first[k + (op != "insert") :]
        (json_text,) = call_json(broken)
        if not valid(json_text):
            found["first call's JSON invalid"] += 1
            for name, parse in partial.items():
                with contextlib.suppress(Exception):
                    parse(json_text)
                    found[f"invalid JSON accepted by {name}"] += 1
        text = broken + " Then: " + second
        pieces = chunks(text, rnd.randrange(1 << 30))
        lexed = split(text, pieces)
        with body(scanner):
            scanned = split(text, pieces)
        if collect(lexed) != collect(scanned):
            found["events differ"] += 1
        for system, events in (("lexer", lexed), ("scanner", scanned)):
            if "g" not in [c["function"]["name"] for c in collect(events)[1]]:
                found[f"second call lost by {system}"] += 1
    return found


def growth_cases() -> dict[str, str]:
    return {f"{k} KiB code string": hermes(code_args(k * 1024)) for k in (2, 8, 32)}


def measure(sections: list[str], repeats: int, mutation_count: int) -> Iterator[dict[str, Any]]:
    """One dict per section (``bench._worker`` sends each as a line); the
    first names the systems and whether the scanner could be loaded."""
    try:
        scanner = load_scanner()
        missing = None
    except (RuntimeError, subprocess.CalledProcessError, SyntaxError, ImportError) as e:
        scanner, missing = None, f"{type(e).__name__}: {e}"
    found = systems(scanner)
    yield {"section": "systems", "systems": list(found), "scanner_missing": missing}
    if "cost" in sections:
        yield {"section": "cost", "rows": cost(found, outputs(), repeats)}
    if "growth" in sections:
        yield {"section": "growth", "rows": cost(found, growth_cases(), repeats)}
    if "dense" in sections:
        yield {"section": "dense", "rows": dense(repeats)}
    if "tests" in sections and scanner is not None:
        yield {"section": "tests", "outcomes": tests(scanner)}
    if "mutations" in sections and scanner is not None:
        yield {"section": "mutations", "counts": mutations(scanner, mutation_count)}
