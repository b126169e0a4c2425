"""The documentation's fenced blocks, and the command lines in its shell blocks.

``doc_blocks`` finds every fenced block (``` or ~~~, indented ones in lists
too) of README.md and docs/**/*.md. ``commands`` reads a shell block as a
shell would: continuation lines joined, comments dropped, ``|``, ``&&``,
``||``, ``;`` and ``&`` separating commands, each ``$(...)`` a command of
its own; a ``console`` block's commands are its ``$ `` lines.

``check_command`` checks one command against what it names, offline: the
real argument parsers of ``gezel-trio``, ``./dev``, ``python -m bench``,
``mlx.launch`` and ``vllm-router`` (unknown flags and bad values fail), the
extras of ``pip install 'gezel-trio[...]'``, the variables ``export`` names,
and the coding agents' command lines against the ones the bench drives
(``bench/scenarios/_real_clients.py``). ``curl`` needs a server: the test
runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import re
import shlex
import sys
import tomllib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import attrs
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
SHELLS = ("sh", "bash", "shell", "zsh", "console")


@attrs.frozen
class Block:
    path: str  # relative to the repository root
    line: int  # the opening fence's, 1-based
    info: str  # the info string: the language, then any words
    text: str

    @property
    def lang(self) -> str:
        return self.info.split()[0].lower() if self.info else ""

    @property
    def head(self) -> str:
        """The first non-blank line: with the path, what names the block in
        the test's lists (it survives edits above the block)."""
        return next((line.strip() for line in self.text.splitlines() if line.strip()), "")

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}:{self.lang or 'none'}"


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def doc_blocks(root: Path = ROOT) -> list[Block]:
    return [
        b for f in doc_files(root) for b in parse_blocks(str(f.relative_to(root)), f.read_text())
    ]


def parse_blocks(path: str, text: str) -> list[Block]:
    """The fenced blocks of one markdown file; an unclosed fence runs to
    the end, as CommonMark reads it."""
    found: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        closing = re.compile(rf"^[ \t]*{fence[0]}{{{len(fence)},}}[ \t]*$")
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not closing.match(lines[j]):
            # The fence's indentation is the block's margin (a list item's).
            line = lines[j]
            body.append(line[min(indent, len(line) - len(line.lstrip())) :])
            j += 1
        found.append(Block(path, i + 1, m["info"].strip(), "\n".join(body) + "\n"))
        i = j + 1
    return found


# --- shell


def _strip_comment(line: str) -> str:
    """``line`` without its comment: a ``#`` that starts a word, outside
    quotes (``http://host/#x`` keeps its ``#``, as a shell keeps it)."""
    quote = ""
    for i, c in enumerate(line):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _logical_lines(block: Block) -> Iterator[str]:
    pending = ""
    for raw in block.text.splitlines():
        if block.lang == "console" and not pending:
            if not raw.startswith("$ "):
                continue  # output
            raw = raw[2:]
        line = _strip_comment(raw).rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        yield pending + line
        pending = ""
    if pending:
        yield pending


def split_line(line: str) -> list[list[str]]:
    """A command line's simple commands, ``$(...)`` substitutions first."""
    inner: list[str] = []

    def substitute(m: re.Match[str]) -> str:
        inner.append(m[1])
        return "SUBSTITUTED"

    line = re.sub(r"\$\(([^()]*)\)", substitute, line)
    lex = shlex.shlex(line, posix=True, punctuation_chars="|&;")
    lex.whitespace_split = True
    lex.commenters = ""
    out: list[list[str]] = [c for text in inner for c in split_line(text)]
    current: list[str] = []
    for token in lex:
        if token and set(token) <= set("|&;"):
            out.append(current)
            current = []
        else:
            current.append(token)
    out.append(current)
    return [c for c in out if c]


def commands(block: Block) -> list[list[str]]:
    """The block's simple commands, variable assignments before a command
    (``NAME=value cmd``) dropped; a bare assignment is no command."""
    found = []
    for line in _logical_lines(block):
        for words in split_line(line):
            while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
                words = words[1:]
            if words:
                found.append(words)
    return found


# --- the checks; each raises CommandError with what is wrong


class CommandError(AssertionError):
    pass


@contextlib.contextmanager
def _argparse_exit(what: str) -> Iterator[None]:
    """argparse's exit (status 2, the reason on stderr) as a CommandError."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            yield
    except SystemExit as exc:
        if exc.code not in (0, None):
            reason = err.getvalue().strip().splitlines()[-1:] or [f"{what}: exit {exc.code}"]
            raise CommandError(reason[0]) from None  # "PROG: error: ..."


def check_gezel_trio(args: Sequence[str]) -> None:
    from gezel_trio import cli

    argv, profile = cli._command_line(list(args), seed_launch=False)
    parsed = None
    with _argparse_exit("gezel-trio"):
        parsed = cli._parser(profile).parse_args(argv)
    if parsed is None:
        return  # --help: printed, exit status 0
    if parsed.command == "serve":
        try:  # the values' ranges, as `serve` checks them before loading
            cli.server_config(parsed, Path(parsed.model or "MODEL"))
        except ValueError as exc:
            raise CommandError(f"gezel-trio serve: {exc}") from None


def check_bench(args: Sequence[str]) -> None:
    from bench import _cli, scenarios

    with _argparse_exit("python -m bench"):
        _cli.plan(scenarios.load(), list(args))


def check_dev(args: Sequence[str]) -> None:
    """``./dev``'s subcommands are its ``case`` arms; ``serve`` passes the
    rest to ``gezel-trio serve``, ``test`` to pytest."""
    arms = re.findall(r"^ {4}(\w+)\)$", (ROOT / "dev").read_text(), re.M)
    if not args or args[0] not in arms:
        raise CommandError(f"./dev: {args[:1]} is none of {arms}")
    if args[0] == "serve":
        check_gezel_trio(["serve", *args[1:]])


class _Parsed(Exception):
    def __init__(self, known: argparse.Namespace, rest: list[str]) -> None:
        self.known, self.rest = known, rest


def _parse_as_installed(script: str, args: Sequence[str]) -> list[str]:
    """Run console script ``script``'s entry point until its argparse
    parser has read ``args``: what it left unparsed. A bad value exits
    there, as the command would."""
    (entry,) = importlib.metadata.entry_points(group="console_scripts", name=script)
    main: Callable[[], Any] = entry.load()
    original = argparse.ArgumentParser.parse_known_args

    def parse_known_args(self: argparse.ArgumentParser, *a: Any, **kw: Any) -> Any:
        known, rest = original(self, *a, **kw)
        raise _Parsed(known, rest)

    with (
        mock.patch.object(argparse.ArgumentParser, "parse_known_args", parse_known_args),
        mock.patch.object(sys, "argv", [script, *args]),
        _argparse_exit(script),
    ):
        try:
            main()
        except _Parsed as parsed:
            return parsed.rest
    raise CommandError(f"{script}: its entry point parsed no command line")


def check_mlx_launch(args: Sequence[str], check: Callable[[list[str]], None]) -> None:
    rest = _parse_as_installed("mlx.launch", args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if not rest or rest[0].startswith("-"):
        raise CommandError(f"mlx.launch: {rest[:1]} is not a program (an unknown flag?)")
    check(rest)  # the program each rank runs


def check_vllm_router(args: Sequence[str]) -> None:
    rest = _parse_as_installed("vllm-router", args)
    if rest:
        raise CommandError(f"vllm-router: unrecognized arguments: {' '.join(rest)}")


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def check_pip(args: Sequence[str]) -> None:
    """``pip install``: gezel-trio with extras it declares, or a package
    the project depends on."""
    words = [a for a in args if not a.startswith("-")]
    if words[:1] != ["install"] or len(words) < 2:
        raise CommandError(f"pip: only `pip install PACKAGE` is checked, not {list(args)}")
    project = _pyproject()
    extras = project["optional-dependencies"]
    known = {
        canonicalize_name(Requirement(r).name)
        for r in [*project["dependencies"], *(r for rs in extras.values() for r in rs)]
    }
    for spec in words[1:]:
        req = Requirement(spec)
        if canonicalize_name(req.name) == canonicalize_name(project["name"]):
            if unknown := req.extras - set(extras):
                raise CommandError(f"pip: gezel-trio has no extra {sorted(unknown)}")
        elif canonicalize_name(req.name) not in known:
            raise CommandError(f"pip: {req.name} is no dependency of gezel-trio")


def product_env_names() -> set[str]:
    """The environment variables the package names (quoted in src/)."""
    text = "\n".join(p.read_text() for p in (ROOT / "src").rglob("*.py"))
    return set(re.findall(r"[\"']([A-Z][A-Z0-9]*_[A-Z0-9_]+)[\"']", text))


def exports(block: Block) -> dict[str, str]:
    """What a shell block's ``export`` lines set."""
    out: dict[str, str] = {}
    for words in commands(block):
        if words[0] == "export":
            for w in words[1:]:
                name, _, value = w.partition("=")
                out[name] = value
    return out


def check_export(args: Sequence[str], known: set[str]) -> None:
    for w in args:
        name = w.partition("=")[0]
        if name not in known:
            raise CommandError(f"export: neither gezel-trio nor a driven client reads {name}")


AGENTS = {"claude": "claude-code", "codex": "codex", "opencode": "opencode"}
_PROMPT = "\0prompt"


def check_agent(program: str, args: Sequence[str]) -> None:
    """A coding agent's command line: its words in the order of the one
    the bench drives (``client_command``) for turn 1 or a later turn, some
    left out, the prompt given."""
    from bench.scenarios._real_clients import client_command

    for turn in (1, 2):
        driven = client_command(AGENTS[program], Path("bin"), turn, _PROMPT)[1:]
        if _in_order(args, driven):
            return
    raise CommandError(f"{program}: {list(args)} is not how the bench drives it")


def _in_order(args: Sequence[str], driven: Sequence[str]) -> bool:
    """``args`` a subsequence of ``driven``, the prompt among them."""
    i, prompt = 0, False
    for a in args:
        while i < len(driven) and driven[i] != a and (driven[i] != _PROMPT or a.startswith("-")):
            i += 1
        if i == len(driven):
            return False
        prompt |= driven[i] == _PROMPT
        i += 1
    return prompt


def program_of(word: str) -> str:
    """``.venv/bin/gezel-trio`` is ``gezel-trio``; ``./dev`` stays itself."""
    return word if word.startswith("./") else word.rsplit("/", 1)[-1]


def check_command(words: list[str], env_names: set[str]) -> bool:
    """Check ``words`` offline; False for ``curl``, which needs a server."""
    program, args = program_of(words[0]), words[1:]
    if program in ("python", "python3") and args[:2] == ["-m", "bench"]:
        check_bench(args[2:])
    elif program in ("python", "python3") and args[:2] == ["-m", "gezel_trio"]:
        check_gezel_trio(args[2:])
    elif program in ("python", "python3") and args[:2] == ["-m", "pip"]:
        check_pip(args[2:])
    elif program == "gezel-trio":
        check_gezel_trio(args)
    elif program == "./dev":
        check_dev(args)
    elif program == "mlx.launch":
        check_mlx_launch(args, lambda rest: _checked_offline(rest, env_names))
    elif program == "vllm-router":
        check_vllm_router(args)
    elif program == "pip":
        check_pip(args)
    elif program == "export":
        check_export(args, env_names)
    elif program in AGENTS:
        check_agent(program, args)
    elif program == "curl":
        return False
    else:
        raise CommandError(f"no check for `{program}`: teach tests/support/doc_blocks.py one")
    return True


def _checked_offline(words: list[str], env_names: set[str]) -> None:
    if not check_command(words, env_names):
        raise CommandError(f"{words[0]} under mlx.launch: not checked offline")
