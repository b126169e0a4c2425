"""docs/configuration.md, rendered from the settings' declarations.

Every flag of ``gezel-trio serve``, under the heading ``serve --help``
shows it under and in the same order: the parser is the one the CLI
builds (``cli.serve_parser``), and a flag that is a setting is described
by its declaration (``core.settings``): its help, and its default as a
user types it (MB where the field holds bytes, 0 where 0 means unset,
``on``/``off``). Each section names the modules that read it: those its
settings class's docstring names in its first paragraph.

``python -m gezel_trio.config_reference > docs/configuration.md``
regenerates the page; tests/docs/test_configuration.py fails while it is
stale. Importing this imports the CLI, never MLX.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import re
import sys
from typing import Any

import attrs

from .cli import serve_parser, setting_groups
from .core.settings import Setting, flag_default, flags_of
from .profiles import PROFILES, SEED

__all__ = ["REGENERATE", "render_reference"]

REGENERATE = ".venv/bin/python -m gezel_trio.config_reference > docs/configuration.md"

# The modules that read the groups of serve's parser that no settings class declares.
_OWNERS = {"options": ["cli", "profiles"], "the seed sidecar's flags": ["cli"]}

_HEAD = f"""\
# Configuration

Generated from the settings' declarations; regenerate it with
`{REGENERATE}`
(tests/docs/test_configuration.py fails while this page is stale).

Every flag of `gezel-trio serve`, under its `serve --help` heading and the modules
(`src/gezel_trio/`) that read it. In parentheses, the default as typed (MB for `-mb`, `0`
where 0 means unset, `on`/`off`) and the seed profile's where it differs
([migrating-from-the-seed.md](migrating-from-the-seed.md)). `EngineConfig.from_flags` takes
these names without dashes ([embedding.md](embedding.md)).
"""

# A module a docstring names: ``core.scheduler``, ``gezel_trio.tuning``,
# ``mlx.backend``'s.
_NAMED = re.compile(r"``(?:gezel_trio\.)?([a-z_]+(?:\.[a-z_]+)*)``")
# Written as code in help text: a flag, a markup tag, a snake_case or
# UPPER_CASE name (generation_config.json too).
_CODE = re.compile(
    r"--[a-z][a-z0-9-]*|</?[A-Za-z_]+>|\b[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+(?:\.json)?\b"
)


def render_reference() -> str:
    """The text of docs/configuration.md."""
    parser = serve_parser()
    classes = {title: cls for cls, title in setting_groups()}
    declared = {
        meta.flag: (field, meta)
        for cls, _ in setting_groups()
        for _, field, meta in flags_of(cls)
        if meta.flag is not None
    }
    out = [_HEAD]
    # argparse has no public list of a parser's groups: these two attributes
    # are what its own format_help walks (since Python 2.7), and the tests
    # compare this page with that help.
    for group in parser._action_groups:
        items = [
            _item(action, declared.get(action.option_strings[0]))
            for action in group._group_actions
            if _listed(action, group._group_actions)
        ]
        if not items:
            continue
        title = group.title or ""
        cls = classes.get(title)
        owners = _owners(cls) if cls is not None else _OWNERS[title]
        read_by = ", ".join(f"`{name}`" for name in owners)
        out += [f"## {title}\n", f"Read by {read_by}.\n", *items, ""]
    return "\n".join(out)


def _owners(cls: type) -> list[str]:
    """The package's modules that the first paragraph of ``cls``'s
    docstring names; a section whose docstring names none is an error."""
    paragraph = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0]
    found = [name for name in _NAMED.findall(paragraph) if _is_module(name)]
    if not found:
        raise ValueError(f"{cls.__name__}'s docstring names no module that reads it")
    return list(dict.fromkeys(found))


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(f"gezel_trio.{name}") is not None
    except ModuleNotFoundError:  # a name inside a module (``server.serve``)
        return False


def _listed(action: argparse.Action, siblings: list[argparse.Action]) -> bool:
    """Whether ``action`` has an entry of its own: not ``--help``, and not
    the ``--no-x`` of an ``--x`` beside it (that one's entry names both)."""
    flag = action.option_strings[0]
    if action.default is argparse.SUPPRESS:
        return False
    positive = "--" + flag.removeprefix("--no-")
    return not (flag.startswith("--no-") and any(positive in a.option_strings for a in siblings))


def _item(action: argparse.Action, declared: tuple[attrs.Attribute[Any], Setting] | None) -> str:
    flag = action.option_strings[0]
    if declared is not None:
        field, meta = declared
        text, default = meta.help, flag_default(field, meta)
    else:
        text, default = action.help or "", action.default
    choices = "|".join(map(str, action.choices or ()))
    if action.nargs == "?" and choices:  # on_off: a bare flag means on
        shown = f"`{flag} [{choices}]`, `--no-{flag[2:]}`"
    elif choices:
        shown = f"`{flag} {choices}`"
    else:
        shown = f"`{flag}`"
    typed = "off" if action.nargs == 0 else _typed(default)
    seed = PROFILES[SEED].get(action.dest)
    if seed is not None:
        typed += f"; seed {_typed(seed)}"
    return f"- {shown} ({typed}): {_inline(text)}"


def _typed(value: object) -> str:
    """``value`` as a user types it on the command line."""
    if value is None:
        return "unset"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`" if value != "" else '`""`'


def _inline(text: str) -> str:
    """Help text as Markdown: names and flags as code, the characters
    Markdown would read escaped."""
    parts = []
    last = 0
    for m in _CODE.finditer(text):
        parts += [_escape(text[last : m.start()]), f"`{m.group()}`"]
        last = m.end()
    parts.append(_escape(text[last:]))
    return "".join(parts)


def _escape(text: str) -> str:
    return re.sub(r"([\\`*_<>\[\]])", r"\\\1", text)


if __name__ == "__main__":
    sys.stdout.write(render_reference())
