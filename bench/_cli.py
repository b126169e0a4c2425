"""``python -m bench [SCENARIO ...]``: run scenarios, write their results.

Without a scenario it runs every scenario of the default run. Each run writes
``<out>/<scenario>.json``, ``.md`` and ``.png`` (``--out``, default
``bench/results``) and prints its tables. ``--list`` names the scenarios;
``--list SCENARIO`` prints what one measures.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import _report, scenarios
from bench._scenario import UNSET, Context, Option, Scenario

RESULTS = Path(__file__).resolve().parent / "results"
_ROOT = Path(__file__).resolve().parent.parent


def _dest(name: str) -> str:
    return f"opt_{name}"


def shared_options(registry: Mapping[str, Scenario]) -> dict[str, list[tuple[str, Option]]]:
    """Each option name with the scenarios that declare it; ValueError when
    two declarations of one name disagree on how the flag parses."""
    by_name: dict[str, list[tuple[str, Option]]] = {}
    for scenario in registry.values():
        for o in scenario.options:
            by_name.setdefault(o.name, []).append((scenario.name, o))
    for name, decls in by_name.items():
        shapes = {(o.kind, o.type, o.nargs) for _, o in decls}
        if len(shapes) > 1:
            raise ValueError(f"--{name}: scenarios declare it differently: {shapes}")
    return by_name


def parser(registry: Mapping[str, Scenario]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run bench scenarios; write <out>/<scenario>.json, .md and .png.",
        epilog="Scenario options are shared by name: each scenario keeps its own default.",
    )
    p.add_argument("scenarios", nargs="*", metavar="SCENARIO", help="default: the default run")
    p.add_argument("--list", action="store_true", help="name the scenarios (with names: docs)")
    p.add_argument("--size", choices=("tiny", "bench"), default="bench", help="demo models")
    p.add_argument("--quick", action="store_true", help="short settings: a smoke run")
    p.add_argument("--out", type=Path, default=RESULTS, help=f"default: {RESULTS}")
    p.add_argument("--log-dir", type=Path, default=None, help="keep server logs here")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    group = p.add_argument_group("scenario options")
    for name, decls in shared_options(registry).items():
        o = decls[0][1]
        defaults = "; ".join(
            f"{s}: {d.default}" + ("" if d.quick is UNSET else f", quick {d.quick}")
            for s, d in decls
        )
        help_text = f"{o.help} ({defaults})".replace("%", "%%")
        if o.kind == "flag":
            group.add_argument(o.flag, dest=_dest(name), action="store_true", default=None,
                               help=help_text)  # fmt: skip
            continue
        choices = {c for _, d in decls for c in (d.choices or ())}
        group.add_argument(
            o.flag,
            dest=_dest(name),
            type=o.type,
            nargs=o.nargs,
            default=None,
            choices=sorted(choices, key=str) if choices else None,
            metavar=None if choices else {int: "N", float: "X", Path: "DIR"}.get(o.type, "VALUE"),
            help=help_text,
        )
    return p


def _version() -> str:
    """The code measured, as ``git describe`` names it (``-dirty`` when edited)."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
            cwd=_ROOT,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def run_one(
    scenario: Scenario, options: dict[str, Any], args: argparse.Namespace, command: str
) -> None:
    print(f"== {scenario.name}: {scenario.summary}", file=sys.stderr, flush=True)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    t0 = time.monotonic()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix=f"gezel-bench-{scenario.name}-") as tmp:
        workdir = Path(tmp) if args.log_dir is None else args.log_dir / scenario.name
        workdir.mkdir(parents=True, exist_ok=True)
        ctx = Context(scenario.name, options, args.size, args.quick, workdir)
        result = scenario.run(ctx)
    meta = {
        "scenario": scenario.name,
        "summary": scenario.summary,
        "command": command,
        "started": started,
        "version": _version(),
        "cpus": os.cpu_count(),
        "wall_s": time.monotonic() - t0,
        "size": args.size,
        "quick": args.quick,
        "options": options,
        "loadavg": {"before": load_before, "after": os.getloadavg()},
        "phases": ctx.phases,
    }
    out: Path = args.out
    _report.write_json(out / f"{scenario.name}.json", {**meta, "data": result.data})
    png = None
    if not args.no_plot and result.plots:
        title = f"{scenario.name}: {result.title or scenario.summary} ({started[:10]})"
        if _report.write_png(out / f"{scenario.name}.png", title, result.plots):
            png = f"{scenario.name}.png"
    md = _report.markdown(scenario, result, meta, png)
    (out / f"{scenario.name}.md").write_text(md)
    print(_report.terminal_text(result))
    written = ", ".join(
        f"{scenario.name}{x}" for x in (".json", ".md", ".png") if x != ".png" or png
    )
    print(f"[{scenario.name}: {meta['wall_s']:.0f}s; wrote {written} in {out}]", file=sys.stderr)


def plan(
    registry: Mapping[str, Scenario], argv: Sequence[str] | None
) -> tuple[argparse.Namespace, dict[str, dict[str, Any]]]:
    """What ``argv`` asks for: the parsed flags and each chosen scenario's
    resolved options, in run order (none with ``--list``). A bad command
    line exits as argparse does, with status 2 and the reason on stderr."""
    p = parser(registry)
    args = p.parse_args(argv)
    unknown = [s for s in args.scenarios if s not in registry]
    if unknown:
        p.error(f"unknown scenario {unknown[0]!r}; --list names them")
    if args.list:
        return args, {}
    chosen = args.scenarios or [n for n, s in registry.items() if s.in_default_run]
    given = {name: getattr(args, _dest(name)) for name in shared_options(registry)}
    resolved: dict[str, dict[str, Any]] = {}
    for name in chosen:
        try:
            resolved[name] = registry[name].resolve(given, args.quick)
        except ValueError as exc:
            p.error(str(exc))
    stray = [
        n
        for n, v in given.items()
        if v is not None and not any(o.name == n for s in chosen for o in registry[s].options)
    ]
    if stray:
        p.error(f"--{stray[0].replace('_', '-')} applies to none of {', '.join(chosen)}")
    return args, resolved


def main(argv: Sequence[str] | None = None) -> int:
    registry = scenarios.load()
    args, resolved = plan(registry, argv)
    if args.list:
        if args.scenarios:
            for name in args.scenarios:
                s = registry[name]
                print(f"{name}: {s.doc.strip()}\n")
        else:
            width = max(map(len, registry)) + 2
            for s in registry.values():
                extra = "" if s.in_default_run else "  (not in the default run)"
                print(f"{s.name:<{width}}{s.summary}{extra}")
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched from a hub
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    argv_list = sys.argv[1:] if argv is None else list(argv)
    command = shlex.join(["python", "-m", "bench", *argv_list])
    for name, options in resolved.items():
        run_one(registry[name], options, args, command)
    return 0
