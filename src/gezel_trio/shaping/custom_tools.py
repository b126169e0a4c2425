"""Custom (freeform) tools: raw-text input, optionally constrained by a
Lark or regex grammar, shown to the model as a function and read back raw.

OpenAI's custom tools (``{"type": "custom", "name", "description",
"format"}``) take one free-form text, not JSON arguments. Chat templates
know only functions, so a custom tool is rendered as a function whose one
parameter, ``input``, is a string (``as_function``); its grammar, if any, is
quoted in the description so the model sees what the input must look like.
The model's call then carries ``{"input": "<text>"}`` and the protocols hand
back the decoded text (``RawInput`` streams it as it is generated).

Forced calls are constrained by the tool's grammar. In the JSON tool-call
syntaxes (Hermes, the generic format) the input sits inside a JSON string,
so the grammar must hold for the *decoded* string. JSON string escaping is a
homomorphism of characters and context-free languages are closed under it:
``escaped_grammar`` rewrites the grammar over escaped characters. String
literals are escaped; each regex terminal is parsed (Python's
``re._parser``) and every character class rewritten so that it matches the
escaped forms of its members (``\\"``, ``\\\\``, ``\\n``, ``\\u001f`` ...)
and nothing else. llguidance applies such a JSON-quote transform only to
whole lexemes (its JSON-schema strings), never to a context-free grammar,
hence this rewrite. The escapes are the ones ``json.dumps(...,
ensure_ascii=False)`` writes, which is also how a re-sent call renders.

What the rewrite refuses (a 400 naming the tool): anchors, lookarounds,
back-references, possessive repeats and case-insensitive flags in regexes,
``%json``/``%regex``/``%llguidance`` and special tokens in a Lark grammar,
and ``%import`` of a common terminal outside the table below.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from collections.abc import Mapping
from typing import Any, Final

from ..core.errors import InvalidRequest, shown

# The regex parser Python ships and its opcodes (private modules, untyped;
# the public sre_parse alias warns on import).
sre_parse: Any = importlib.import_module("re._parser")
sre: Any = importlib.import_module("re._constants")

__all__ = [
    "INPUT_PARAMETER",
    "RawInput",
    "as_function",
    "custom_input",
    "escaped_grammar",
    "input_arguments",
]

INPUT_PARAMETER: Final = "input"

# The characters JSON must escape inside a string, with the escape
# json.dumps writes for each.
_SPECIALS: Final = {chr(c): json.dumps(chr(c))[1:-1] for c in range(0x20)} | {
    '"': '\\"',
    "\\": "\\\\",
}

# Lark's common terminals a grammar may %import, as Python regexes.
_COMMON: Final = {
    "LF": r"\n",
    "CR": r"\r",
    "NEWLINE": r"(\r?\n)+",
    "WS": r"[ \t\f\r\n]+",
    "WS_INLINE": r"[ \t]+",
    "DIGIT": r"[0-9]",
    "HEXDIGIT": r"[a-fA-F0-9]",
    "INT": r"[0-9]+",
    "SIGNED_INT": r"[+-]?[0-9]+",
    "LETTER": r"[A-Za-z]",
    "LCASE_LETTER": r"[a-z]",
    "UCASE_LETTER": r"[A-Z]",
    "WORD": r"[A-Za-z]+",
    "CNAME": r"[_A-Za-z][_A-Za-z0-9]*",
}


def as_function(
    name: str, description: str | None, fmt: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The function a chat template renders for a custom tool (chat shape)."""
    text = description or ""
    syntax, definition = grammar_of(fmt)
    if definition is not None:
        note = (
            f"This tool takes raw text, not JSON: pass it whole as the `{INPUT_PARAMETER}` "
            f"string. The text must match this {syntax} grammar:\n{definition}"
        )
        text = f"{text}\n\n{note}" if text else note
    fn: dict[str, Any] = {
        "name": name,
        "description": text,
        "parameters": {
            "type": "object",
            "properties": {INPUT_PARAMETER: {"type": "string"}},
            "required": [INPUT_PARAMETER],
            "additionalProperties": False,
        },
    }
    return {"type": "function", "function": fn}


def grammar_of(fmt: Mapping[str, Any] | None) -> tuple[str, str | None]:
    """``(syntax, definition)`` of a Responses-shaped format; no grammar for text."""
    if fmt is None or fmt.get("type") != "grammar":
        return "text", None
    return str(fmt.get("syntax")), str(fmt.get("definition"))


def input_arguments(raw: str) -> str:
    """A custom call's raw input as the function arguments a template renders,
    spelled as a forced call is generated."""
    return json.dumps({INPUT_PARAMETER: raw}, ensure_ascii=False)


def custom_input(arguments: str) -> str | None:
    """The raw input of a call's arguments text, or ``None`` when they are not
    ``{"input": <string>}``."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return None
    if isinstance(value, dict) and isinstance(value.get(INPUT_PARAMETER), str):
        return str(value[INPUT_PARAMETER])
    return None


def partial_input(arguments: str) -> str | None:
    """The input decoded so far of a call cut short (``{"input": "...`` with
    no end), or ``None`` when the text does not open that object."""
    raw = RawInput()
    text = raw.feed(arguments)
    return text if raw.opened else None


class RawInput:
    """Arguments text fed in pieces, the decoded ``input`` string out in
    pieces: what streams as a custom call's input deltas. Linear in the text
    fed; an escape split across pieces is held back until it is whole."""

    _HEAD = re.compile(r'\s*\{\s*"input"\s*:\s*"')

    def __init__(self) -> None:
        self._buf = ""
        self._pos: int | None = None  # where the string's content resumes
        self._closed = False
        self.text: list[str] = []

    @property
    def opened(self) -> bool:
        """Whether the text fed so far opened the ``input`` string."""
        return self._pos is not None

    def feed(self, fragment: str) -> str:
        self._buf += fragment
        if self._closed:
            return ""
        if self._pos is None:
            head = self._HEAD.match(self._buf)
            if head is None:
                return ""
            self._pos = head.end()
        out: list[str] = []
        buf, i = self._buf, self._pos
        while i < len(buf):
            j = min((k for k in (buf.find("\\", i), buf.find('"', i)) if k >= 0), default=-1)
            if j < 0:
                out.append(buf[i:])
                i = len(buf)
                break
            out.append(buf[i:j])
            i = j
            if buf[j] == '"':
                self._closed = True
                break
            size = 6 if buf[j + 1 : j + 2] == "u" else 2
            if j + size > len(buf):
                break  # a partial escape: wait for the rest
            if size == 6 and 0xD800 <= _hex(buf[j + 2 : j + 6]) < 0xDC00:
                size = 12  # a surrogate pair is decoded whole
                if j + size > len(buf):
                    break
            try:
                out.append(json.loads(f'"{buf[j : j + size]}"'))
            except ValueError:
                self._closed = True  # not JSON: the call's final text decides
                break
            i = j + size
        self._pos = i
        text = "".join(out)
        if text:
            self.text.append(text)
        return text


def _hex(text: str) -> int:
    try:
        return int(text, 16)
    except ValueError:
        return -1


# --- the grammar rewrite ------------------------------------------------------


def escaped_grammar(syntax: str, definition: str, *, where: str) -> str:
    """A Lark grammar (llguidance's dialect) for the JSON-string-escaped text
    of what ``definition`` accepts. Raises ``InvalidRequest`` naming ``where``."""
    if syntax == "regex":
        return f"start: {_regex_terminal(definition, '', where)}"
    if syntax != "lark":
        raise InvalidRequest(
            f"{where}.syntax must be lark or regex, not {shown(syntax)}", param=where
        )
    return _escaped_lark(definition, where)


_LARK_TOKEN = re.compile(
    r"""
      (?P<comment>//[^\n]*|\#[^\n]*)
    | (?P<string>"(?:[^"\\\n]|\\.)*"(?P<sflags>i?))
    | (?P<regex>/(?!/)(?:[^/\\\n]|\\.)+/(?P<rflags>[imslux]*))
    | (?P<import>%import[ \t]+common(?:\.(?P<one>[A-Z_]+)|[ \t]*\((?P<many>[^)]*)\)))
    | (?P<directive>%[a-z_]+)
    | (?P<special><[^<>\s]+>|@[A-Za-z0-9_]+)
    | (?P<range>\.\.)
    | (?P<other>[^"/%<@.\#]+|[.<@])
    """,
    re.VERBOSE,
)


def _escaped_lark(definition: str, where: str) -> str:
    out: list[str] = []
    pos = 0
    pending_range: str | None = None  # the string before a ``..``
    tokens: list[tuple[str, re.Match[str]]] = []
    while pos < len(definition):
        m = _LARK_TOKEN.match(definition, pos)
        if m is None or m.end() == pos:
            raise InvalidRequest(
                f"{where}.definition: cannot read the grammar at {definition[pos : pos + 20]!r}",
                param=where,
            )
        assert m.lastgroup is not None
        kind = m.lastgroup if m.lastgroup not in ("sflags", "rflags", "one", "many") else None
        kind = kind or next(k for k in ("string", "regex", "import") if m.group(k))
        tokens.append((kind, m))
        pos = m.end()
    for k, (kind, m) in enumerate(tokens):
        text = m.group(0)
        match kind:
            case "comment":
                out.append("")
            case "string":
                if m.group("sflags"):
                    raise InvalidRequest(
                        f"{where}.definition: case-insensitive strings are not supported "
                        "inside a JSON tool call",
                        param=where,
                    )
                value = _string_value(text[1 : -1 - len(m.group("sflags"))], where)
                if k + 1 < len(tokens) and tokens[k + 1][0] == "range":
                    pending_range = value
                    continue
                if pending_range is not None:
                    lo, pending_range = pending_range, None
                    if len(lo) != 1 or len(value) != 1:
                        raise InvalidRequest(
                            f"{where}.definition: a range needs one character each side",
                            param=where,
                        )
                    rx = f"[{_py_char(lo)}-{_py_char(value)}]"
                    out.append(_regex_terminal(rx, "", where))
                    continue
                out.append(_lark_literal(value))
            case "range":
                if pending_range is None:
                    raise InvalidRequest(f"{where}.definition: a stray '..'", param=where)
            case "regex":
                flags = m.group("rflags")
                body = text[1 : -1 - len(flags)]
                out.append(_regex_terminal(_unslash(body), flags, where))
            case "import":
                names = [m.group("one")] if m.group("one") else m.group("many").split(",")
                defs = []
                for raw in names:
                    name = raw.strip()
                    if name not in _COMMON:
                        raise InvalidRequest(
                            f"{where}.definition: %import common.{name} is not supported "
                            f"inside a JSON tool call (supported: {', '.join(_COMMON)})",
                            param=where,
                        )
                    rule = _rule_names(name)
                    defs.append(f"{rule}: {_regex_terminal(_COMMON[name], '', where)}")
                out.append("\n".join(defs))
            case "directive":
                # %ignore too: it would skip text inside the call's JSON.
                raise InvalidRequest(
                    f"{where}.definition: {text} is not supported in a custom tool grammar",
                    param=where,
                )
            case "special":
                raise InvalidRequest(
                    f"{where}.definition: special tokens and grammar references ({text}) "
                    "are not supported in a custom tool grammar",
                    param=where,
                )
            case _:
                out.append(_rule_names(text))
    return "".join(out)


def _string_value(body: str, where: str) -> str:
    try:
        value = json.loads(f'"{body}"')
    except ValueError:
        try:
            value = ast.literal_eval(f'"{body}"')
        except (ValueError, SyntaxError) as exc:
            raise InvalidRequest(
                f"{where}.definition: bad string literal {body[:40]!r}", param=where
            ) from exc
    return str(value)


def _unslash(body: str) -> str:
    """A Lark ``/.../`` body as a plain regex: ``\\/`` is ``/``."""
    return re.sub(r"\\(.)", lambda m: "/" if m.group(1) == "/" else m.group(0), body)


def _py_char(c: str) -> str:
    return f"\\U{ord(c):08x}"


def _rust_char(c: str) -> str:
    return c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}"


def _lark_literal(text: str) -> str:
    """A Lark string literal for the escaped form of ``text``."""
    return json.dumps("".join(_SPECIALS.get(c, c) for c in text), ensure_ascii=False)


_TERMINAL_NAME = re.compile(r"(?<![A-Za-z0-9_])_?[A-Z][A-Z0-9_]*(?![A-Za-z0-9_])")


def _rule_names(code: str) -> str:
    """Terminal names as rule names (see ``_regex_terminal``)."""
    return _TERMINAL_NAME.sub(lambda m: "term_" + m.group(0).lower(), code)


def _regex_terminal(pattern: str, flags: str, where: str) -> str:
    """A Lark expression matching the escaped forms of what ``pattern`` matches.

    Not one regex lexeme: llguidance's lexer is greedy and never gives a byte
    back, so a lexeme that may go on with an escape (``\\\\``) would swallow
    the backslash of a following ``\\n`` lexeme and fail. Here every escape
    is a lexeme of its own and plain text comes in runs without backslashes,
    so lexemes always end where an escape begins; terminal definitions become
    rules for the same reason (``_rule_names``).
    """
    if "i" in flags:
        raise InvalidRequest(
            f"{where}.definition: case-insensitive regexes are not supported inside a JSON "
            "tool call",
            param=where,
        )
    py_flags = (re.DOTALL if "s" in flags else 0) | (re.VERBOSE if "x" in flags else 0)
    try:
        parsed = sre_parse.parse(pattern, py_flags)
    except re.error as exc:
        raise InvalidRequest(
            f"{where}.definition: bad regex {shown(pattern)}: {exc}", param=where
        ) from exc
    if parsed.state.flags & re.IGNORECASE:
        raise InvalidRequest(
            f"{where}.definition: case-insensitive regexes are not supported inside a JSON "
            "tool call",
            param=where,
        )
    dotall = bool(parsed.state.flags & re.DOTALL)
    return f"({_Rewriter(where).seq(list(parsed), dotall)})"


_CATEGORIES: Final = {
    sre.CATEGORY_DIGIT: r"\d",
    sre.CATEGORY_NOT_DIGIT: r"\D",
    sre.CATEGORY_SPACE: r"\s",
    sre.CATEGORY_NOT_SPACE: r"\S",
    sre.CATEGORY_WORD: r"\w",
    sre.CATEGORY_NOT_WORD: r"\W",
}

_EVERYTHING: Final = r"[\x{0}-\x{10ffff}]"
_PLAIN_ONLY: Final = r"--[\x{0}-\x{1f}\x{22}\x{5c}]"


class _Rewriter:
    """A parsed regex as a Lark expression over escaped text."""

    def __init__(self, where: str) -> None:
        self._where = where

    def _refuse(self, what: str) -> InvalidRequest:
        return InvalidRequest(
            f"{self._where}.definition: {what} in a regex are not supported inside a JSON "
            "tool call",
            param=self._where,
        )

    def seq(self, nodes: list[Any], dotall: bool) -> str:
        out: list[str] = []
        text: list[str] = []  # consecutive literal characters, one literal
        for op, av in nodes:
            if op is sre.LITERAL:
                text.append(chr(av))
                continue
            if text:
                out.append(_lark_literal("".join(text)))
                text = []
            out.append(self.node(op, av, dotall))
        if text:
            out.append(_lark_literal("".join(text)))
        return " ".join(out) if out else '""'

    def node(self, op: Any, av: Any, dotall: bool) -> str:
        atom = self._atom(op, av, dotall)
        if atom is not None:
            return self._set(*atom, run=False)
        if op is sre.BRANCH:
            return "(" + " | ".join(self.seq(list(alt), dotall) for alt in av[1]) + ")"
        if op is sre.SUBPATTERN:
            _, add, remove, body = av
            if add & re.IGNORECASE:
                raise self._refuse("case-insensitive groups")
            dots = (dotall or bool(add & re.DOTALL)) and not remove & re.DOTALL
            return "(" + self.seq(list(body), dots) + ")"
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
            # Lazy and greedy repeats match the same language.
            lo, hi, body = av
            body = list(body)
            single = self._atom(body[0][0], body[0][1], dotall) if len(body) == 1 else None
            if single is not None and lo <= 1 and hi == sre.MAXREPEAT:
                # Plain text in runs (one lexeme), escapes one by one.
                return f"({self._set(*single, run=True)}){'*' if lo == 0 else '+'}"
            inner = self.seq(body, dotall)
            top = "" if hi == sre.MAXREPEAT else str(hi)
            return f"({inner}){{{lo},{top}}}"
        if op is sre.AT:
            raise self._refuse("anchors")
        if op in (sre.ASSERT, sre.ASSERT_NOT):
            raise self._refuse("lookarounds")
        if op is sre.GROUPREF or op is sre.GROUPREF_EXISTS:
            raise self._refuse("back-references")
        raise self._refuse(f"{str(op).lower()} constructs")

    def _atom(self, op: Any, av: Any, dotall: bool) -> tuple[str, list[str]] | None:
        """A one-character node as ``(class of its plain members, its special
        members)``, or ``None`` for anything longer."""
        if op is sre.LITERAL:
            items: list[tuple[Any, Any]] = [(sre.LITERAL, av)]
        elif op is sre.NOT_LITERAL:
            items = [(sre.NEGATE, None), (sre.LITERAL, av)]
        elif op is sre.ANY:
            if dotall:
                return _EVERYTHING, list(_SPECIALS)
            items = [(sre.NEGATE, None), (sre.LITERAL, 10)]
        elif op is sre.IN:
            items = list(av)
        elif op is sre.CATEGORY:
            items = [(sre.CATEGORY, av)]
        else:
            return None
        rust: list[str] = []
        py: list[str] = []
        negate = False
        for kind, value in items:
            if kind is sre.NEGATE:
                negate = True
            elif kind is sre.LITERAL:
                rust.append(_rust_char(chr(value)))
                py.append(_py_char(chr(value)))
            elif kind is sre.RANGE:
                lo, hi = value
                rust.append(f"{_rust_char(chr(lo))}-{_rust_char(chr(hi))}")
                py.append(f"{_py_char(chr(lo))}-{_py_char(chr(hi))}")
            elif kind is sre.CATEGORY and value in _CATEGORIES:
                rust.append(_CATEGORIES[value])
                py.append(_CATEGORIES[value])
            else:
                raise self._refuse(f"{str(kind).lower()} classes")
        hat = "^" if negate else ""
        if not rust:
            return (_EVERYTHING, list(_SPECIALS)) if negate else ("", [])
        test = re.compile(f"[{hat}{''.join(py)}]")
        members = [c for c in _SPECIALS if test.fullmatch(c) is not None]
        return f"[{hat}{''.join(rust)}]", members

    @staticmethod
    def _set(plain: str, specials: list[str], *, run: bool) -> str:
        alts = []
        if plain:
            alts.append(f"/[{plain}{_PLAIN_ONLY}]{'+' if run else ''}/")
        alts += [json.dumps(_SPECIALS[c]) for c in specials]
        if not alts:
            return "/[^\\x{0}-\\x{10ffff}]/"  # the empty class: nothing matches
        return "(" + " | ".join(alts) + ")"
