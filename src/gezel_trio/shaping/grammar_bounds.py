"""Bounds on a grammar's shape, checked before llguidance sees it.

llguidance compiles grammars recursively on the calling thread's native
stack, and a stack overflow there is a SIGSEGV that ends the process, not an
error. Byte limits do not bound depth: a 40 kB Lark grammar of 2,800
chained rules (``r0: r1 "a"``, ``r1: r2 "a"`` ...) overflows an 8 MiB stack
in llguidance 1.9.1, and a 44 kB JSON schema of 920 ``$defs`` each
referring to the next does too. The engine thread (which builds each
sequence's matcher) and the worker threads run on the platform's default
stack (8 MiB on Linux, 16 MiB for CPython's threads on macOS), so each
limit keeps about ten times below the measured crash on an 8 MiB stack: a
grammar at the rule and $ref limits still compiles on a 1 MiB stack, where
twice the limit overflows it. The figures behind each are by its constant.

Both walks are iterative and linear in the input: a hostile grammar or
schema cannot exhaust Python's recursion either.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, Final

__all__ = [
    "MAX_LARK_ALTERNATIVES",
    "MAX_LARK_DEPTH",
    "MAX_LARK_NESTING",
    "MAX_LARK_RULES",
    "MAX_REGEX_NESTING",
    "MAX_SCHEMA_REF_DEPTH",
    "lark_problem",
    "regex_problem",
    "schema_problem",
]

# Rules and terminals defined. Real tool grammars have tens (Codex's
# apply_patch: 15); 1,000 flat rules compile in ~20 ms.
MAX_LARK_RULES: Final = 1_000
# The longest chain of rule or terminal references. A chain of 2,700 rules
# (3,500 terminals) overflows an 8 MiB stack; 200 compile in ~5 ms.
MAX_LARK_DEPTH: Final = 200
# Parentheses and brackets inside one rule. llguidance 1.9.1's own parser
# refuses more than 29 as a plain error; this holds should that change.
MAX_LARK_NESTING: Final = 32
# Groups nested in one regex. llguidance's regex parser refuses over 250;
# Python's, which rewrites custom tools' regexes, spends about three frames
# a level of its 1,000 (900 levels raised RecursionError).
MAX_REGEX_NESTING: Final = 100
# "|" alternatives in the whole grammar: 20,000 took 0.84 s to compile
# (2.8 s with a tokenizer, on the engine thread for every sequence);
# 2,000 take ~0.07 s.
MAX_LARK_ALTERNATIVES: Final = 2_000
# JSON levels along the deepest path through a schema, following "$ref"s:
# 2,400 levels (a chain of bare "$ref"s; 920 object definitions of three
# levels each) overflow an 8 MiB stack.
MAX_SCHEMA_REF_DEPTH: Final = 256

_LARK_TOKEN = re.compile(
    r"""
      (?P<comment>//[^\n]*|\#[^\n]*)
    | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
    | (?P<regex>/(?![/*])(?:[^/\\\n]|\\.)+/[imslux]*)
    | (?P<json>%json\b)
    | (?P<directive>%[A-Za-z_]+)
    | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
    | (?P<newline>\n)
    | (?P<open>[(\[])
    | (?P<close>[)\]])
    | (?P<bar>\|)
    | (?P<other>.)
    """,
    re.VERBOSE | re.DOTALL,
)
# A character class: "]" first (after an optional "^") is a member.
_CLASS = re.compile(r"\[\^?\]?(?:[^\]\\]|\\.)*\]", re.DOTALL)
_BLANKS = re.compile(r"\s*")
# What follows a rule's name where it is defined: an optional priority, ":".
_DEFINES = re.compile(r"(?:\.-?[0-9]+)?[ \t]*:")


def lark_problem(definition: str) -> str | None:
    """Why a Lark grammar is too large or too deep to compile safely
    (``None``: it is within every bound). A ``%json`` schema inside it is
    held to ``schema_problem``. Syntax errors are left to llguidance."""
    rules: dict[str, set[str]] = {}
    current: set[str] | None = None
    alternatives = 0
    nesting = 0
    line_start = True
    pos = 0
    while pos < len(definition):
        m = _LARK_TOKEN.match(definition, pos)
        assert m is not None  # "other" matches any character
        kind, pos = m.lastgroup, m.end()
        if kind == "other" and m.group(0) in "?! \t\r":
            continue  # rule modifiers and blanks keep the line's start
        starts_line, line_start = line_start, kind == "newline"
        if kind == "name":
            name = m.group(0)
            if starts_line and (d := _DEFINES.match(definition, pos)) is not None:
                pos = d.end()
                current = rules.setdefault(name, set())
                nesting = 0
                if len(rules) > MAX_LARK_RULES:
                    return f"it defines over {MAX_LARK_RULES} rules and terminals, the most allowed"
            elif current is not None:
                current.add(name)
        elif kind == "regex" and (problem := regex_problem(m.group(0))) is not None:
            return problem
        elif kind == "json":
            schema, pos = _json_after(definition, pos)
            if schema is None:
                return "a %json directive is not followed by a JSON schema"
            problem = schema_problem(schema)
            if problem is not None:
                return f"its %json schema: {problem}"
        elif kind == "open":
            nesting += 1
            if nesting > MAX_LARK_NESTING:
                return f"its parentheses nest over {MAX_LARK_NESTING} deep, the most allowed"
        elif kind == "close":
            nesting = max(0, nesting - 1)
        elif kind == "bar":
            alternatives += 1
            if alternatives > MAX_LARK_ALTERNATIVES:
                return f"it has over {MAX_LARK_ALTERNATIVES} alternatives (|), the most allowed"
    no_refs: set[str] = set()
    depth = _longest_path(rules, lambda name: rules.get(str(name), no_refs), MAX_LARK_DEPTH)
    if depth > MAX_LARK_DEPTH:
        return f"its rules refer to rules over {MAX_LARK_DEPTH} deep, the most allowed"
    return None


def regex_problem(pattern: str) -> str | None:
    """Why a regex nests its groups too deep (``None``: it does not).
    Escapes and character classes are skipped; syntax is llguidance's to judge."""
    depth = 0
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 1
        elif c == "[":
            m = _CLASS.match(pattern, i)
            i = m.end() - 1 if m is not None else len(pattern)
        elif c == "(":
            depth += 1
            if depth > MAX_REGEX_NESTING:
                return f"a regex nests groups over {MAX_REGEX_NESTING} deep, the most allowed"
        elif c == ")":
            depth = max(0, depth - 1)
        i += 1
    return None


def _json_after(text: str, pos: int) -> tuple[Any, int]:
    start = _BLANKS.match(text, pos).end()  # type: ignore[union-attr]  # \s* always matches
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except (ValueError, RecursionError):
        return None, pos


def schema_problem(schema: Any) -> str | None:
    """Why a JSON schema is too deep to compile safely once its ``$ref``s
    are followed (``None``: it is not). Each JSON object or array is a
    level; a ``$ref`` (a JSON pointer into the schema) adds the levels of
    its target. A reference back into its own path (a recursive schema)
    adds nothing: llguidance compiles it lazily."""
    depth = _longest_path(
        [_Node(schema)], lambda n: _Node.children(n, schema), MAX_SCHEMA_REF_DEPTH
    )
    if depth > MAX_SCHEMA_REF_DEPTH:
        return (
            f"it is over {MAX_SCHEMA_REF_DEPTH} levels deep with its $refs followed, "
            "the most allowed"
        )
    return None


class _Node:
    """A JSON value compared by identity (values are not hashable)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Node) and other.value is self.value

    @staticmethod
    def children(node: Hashable, root: Any) -> list[_Node]:
        assert isinstance(node, _Node)
        value = node.value
        if isinstance(value, Mapping):
            items = list(value.values())
            ref = value.get("$ref")
            if isinstance(ref, str):
                items.append(_pointer(root, ref))
        elif isinstance(value, list | tuple):
            items = list(value)
        else:
            return []
        return [_Node(v) for v in items if isinstance(v, Mapping | list | tuple)]


def _pointer(root: Any, ref: str) -> Any:
    """The value a local JSON pointer (``#/$defs/a``) names; ``None`` for
    anything else (llguidance refuses what it cannot resolve)."""
    if not ref.startswith("#"):
        return None
    value = root
    for raw in ref[1:].split("/")[1:]:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(value, Mapping):
            value = value.get(part)
        elif isinstance(value, list | tuple) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


def _longest_path(
    roots: Iterable[Hashable], edges: Callable[[Hashable], Iterable[Hashable]], bound: int
) -> int:
    """The number of nodes on the longest path from ``roots`` (each path
    cut where it meets a node already on it), or a number over ``bound`` as
    soon as one is found. Iterative; each node is expanded once."""
    longest: dict[Hashable, int] = {}
    deepest = 0
    for root in roots:
        if root in longest:
            continue
        on_path = {root}
        stack: list[tuple[Hashable, Any, int]] = [(root, iter(edges(root)), 0)]
        while stack:
            node, todo, best = stack[-1]
            child = next(todo, None)
            if child is None:
                stack.pop()
                on_path.discard(node)
                longest[node] = best + 1
                deepest = max(deepest, best + 1)
                if stack:
                    parent, ptodo, pbest = stack[-1]
                    stack[-1] = (parent, ptodo, max(pbest, best + 1))
                continue
            if child in longest:
                below = longest[child]
            elif child in on_path:
                below = 0
            else:
                if len(stack) >= bound:
                    return len(stack) + 1
                on_path.add(child)
                stack.append((child, iter(edges(child)), 0))
                continue
            stack[-1] = (node, todo, max(best, below))
            if len(stack) + below > bound:
                return len(stack) + below
    return deepest
