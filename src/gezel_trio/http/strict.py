"""Strict request bodies: the JSON parser, the cattrs converter factory and
the field validators every protocol's wire module builds on.

Validation is strict: a wrong type is an error, never coerced ("5" is not an
int, ``true`` is not a number), and every error names the field path. Every
number must be finite, every string valid text (no lone UTF-16 surrogates)
and no value nested deeper than ``MAX_DEPTH``.

A field no class declares, at any depth, is the one thing not refused by
default: peer servers ignore fields they do not implement, and clients and
routers send new ones without asking (a gateway that refused them broke
Claude Code the day it began sending ``context_management``). The object
hook of every converter drops it and notes it in the ``FieldReport`` that
``collecting_fields`` opened around the parse; ``structure`` then finds
where in the body each noted object sits (by identity, one walk, only when
something was noted) and, for a strict report, refuses the first one by
path. Without an open report an unknown field is refused, as before.

Each wire module builds its own converter with ``strict_converter`` and adds
the hooks for its own unions to it (``register_union``); no module changes a
converter it did not build. ``Range`` and ``Pattern`` are also read by
``http.openapi`` into the schema.

The same strictness holds on the way out: ``dump_json`` is the one writer of
every JSON body, SSE event and stored record, and it refuses ``NaN`` and
``Infinity`` (which Python's writer emits and JavaScript's and Go's parsers
reject): a non-finite number that reaches it is a server bug, raised, never
sent.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from decimal import Decimal
from typing import Any, Literal, TypeVar, get_args, get_origin

import attrs
import cattrs
import ijson
from cattrs.cols import list_structure_factory
from cattrs.errors import (
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
)
from cattrs.gen import make_dict_structure_fn
from quart.json.provider import DefaultJSONProvider

from ..core.errors import InvalidRequest, clipped, shown

__all__ = [
    "MAX_DEPTH",
    "MAX_HEADER_CHARS",
    "FieldInvalid",
    "FieldReport",
    "IgnoredFields",
    "Pattern",
    "Range",
    "StrictJSONProvider",
    "check_text",
    "collecting_fields",
    "dump_json",
    "header_path",
    "object_hook",
    "parse_json",
    "parse_json_yielding",
    "register_union",
    "strict_converter",
    "structure",
]

T = TypeVar("T")

MAX_DEPTH = 64


class FieldInvalid(ValueError):
    """A validator's or a hook's verdict on one field; carries the field
    name for the error's path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@attrs.frozen
class Range:
    """A field validator: ``lo <= value <= hi`` (``None``: unbounded);
    ``http.openapi`` reads the bounds into the schema."""

    lo: float | None = None
    hi: float | None = None

    def __call__(self, _: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is None:
            return
        if self.lo is not None and value < self.lo:
            raise FieldInvalid(attr.name, f"{attr.name} must be >= {self.lo}, got {shown(value)}")
        if self.hi is not None and value > self.hi:
            raise FieldInvalid(attr.name, f"{attr.name} must be <= {self.hi}, got {shown(value)}")


@attrs.frozen
class Is:
    """A field validator: the value is ``value`` (a field other servers
    honour and this one accepts only at the setting it behaves as);
    ``why`` says what this server does instead."""

    value: Any
    why: str

    def __call__(self, _: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value != self.value:
            raise FieldInvalid(
                attr.name,
                f"{attr.name}: only {shown(self.value)} is supported, got {shown(value)} "
                f"({self.why})",
            )


@attrs.frozen
class Pattern:
    """A field validator: the whole string matches ``regex``."""

    regex: str

    def __call__(self, _: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not re.fullmatch(self.regex, value):
            got = shown(value)
            raise FieldInvalid(attr.name, f"{attr.name} must match {self.regex}, got {got}")


# --- JSON -----------------------------------------------------------------------

# What a JSON value can be besides text and containers: nothing to check in it.
_SCALARS = frozenset({int, float, bool, type(None)})
_TEXT = frozenset({str})


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def parse_json(raw: str | bytes) -> Any:
    """Strict JSON: ``NaN`` and ``Infinity`` (which Python's parser accepts)
    are refused, as are integers too long to parse; ``InvalidRequest`` on
    any of it."""
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        # JSONDecodeError is a ValueError; so are int-length limits.
        raise InvalidRequest(f"the body is not valid JSON: {str(exc)[:200]}") from None


# A large body is parsed this much at a time: each piece holds the GIL well
# under a millisecond, and between pieces (a Python-level read) the Trio
# thread can run. ``json.loads`` is one C call: 8 MB held the GIL ~150 ms.
_PIECE = 64 * 1024
# The C backend only: its reading is what the guards below were written
# against (and the pure-Python one is slower than json.loads by far).
try:
    _YAJL: Any = ijson.get_backend("yajl2_c")
except ImportError:  # no compiled backend on this platform: json.loads
    _YAJL = None
# What yajl (ijson's parser) reads otherwise than Python's json: \f and \v
# as whitespace, a NUL after the value, a lone UTF-16 surrogate escape (made
# "?"; any surrogate escape is looked for, pairs too), a surrogate written in
# UTF-8 bytes, an integer longer than Python converts (ijson 3.6 crashes the
# process on one). A body with any of them, or not in UTF-8, takes
# ``parse_json`` itself, in one call.
_DIGITS = sys.get_int_max_str_digits()
# ``json.loads`` costs per value (~0.1-0.3 us), and a long string is one
# fast copy: a body of fewer values than this (commas counted) is parsed in
# one call within a few ms; yajl would take longer over an 8 MB string.
_FEW_VALUES = 10_000
# The bytes yajl may read otherwise, each found by a fast search; only a
# body holding one is searched for the whole sequence.
_ODD_BYTES = (b"\x00", b"\x0b", b"\x0c")
_UTF8_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# Every digit as 0, every other byte as a space: a digit run is a run of 0s.
_DIGIT_RUNS = bytes.maketrans(
    bytes(range(256)), bytes(48 if 48 <= b <= 57 else 32 for b in range(256))
)
# ``json.loads`` fails a body nested deeper than its recursion budget (~1000
# on a worker thread); yajl has no such limit. Deeper than this, the body
# takes ``parse_json``, so the error is the same.
_DEEPEST_YIELDING = 900


class _Pieces:
    """A body as a file that yajl reads ``_PIECE`` bytes at a time."""

    def __init__(self, raw: bytes) -> None:
        self._raw = memoryview(raw)
        self._at = 0

    def read(self, size: int) -> bytes:
        piece = self._raw[self._at : self._at + size]
        self._at += len(piece)
        return bytes(piece)


def parse_json_yielding(raw: str | bytes) -> Any:
    """``parse_json(raw)``, the same value or the same ``InvalidRequest``,
    built ``_PIECE`` bytes at a time so that other threads run in between
    (for a worker thread: the Trio thread never waits long for the GIL).

    The checks for what yajl reads differently scan the body in pieces too;
    a body with any of them is parsed by ``parse_json`` in one call."""
    if _YAJL is None or isinstance(raw, str) or raw.count(b",") < _FEW_VALUES:
        return parse_json(raw)
    if json.detect_encoding(raw) != "utf-8" or _differs(raw):
        return parse_json(raw)
    try:
        # To the end: what follows the value is a fault too.
        values = list(_YAJL.items(_Pieces(raw), "", buf_size=_PIECE))
    except (ijson.JSONError, ValueError, UnicodeDecodeError):
        values = []
    if len(values) != 1:
        # Invalid JSON; ``parse_json`` names what, as it always has.
        return parse_json(raw)
    value = values[0]
    if type(value) is Decimal:
        return float(value)
    if not _as_python_json(value):
        return parse_json(raw)
    return value


def _differs(raw: bytes) -> bool:
    """Whether ``raw`` holds something yajl reads otherwise than Python,
    looked for ``_PIECE`` bytes at a time."""
    if any(odd in raw for odd in _ODD_BYTES):
        return True
    if b"\xed" in raw and _search(_UTF8_SURROGATE, raw, 2):
        return True
    if b"\\u" in raw and _search(_SURROGATE_ESCAPE, raw, 4):
        return True
    if _DIGITS:
        run = b"0" * (_DIGITS + 1)
        for start in range(0, len(raw), _PIECE):
            piece = raw[max(0, start - _DIGITS) : start + _PIECE]
            if run in piece.translate(_DIGIT_RUNS):
                return True
    return False


def _search(pattern: re.Pattern[bytes], raw: bytes, width: int) -> bool:
    return any(
        pattern.search(raw, max(0, start - width), start + _PIECE)
        for start in range(0, len(raw), _PIECE)
    )


def _as_python_json(value: Any) -> bool:
    """Makes ``value`` (yajl's) what ``json.loads`` returns: numbers with a
    fraction or an exponent ijson gives as ``Decimal`` become floats (both
    round correctly: the same float, ``1e400`` infinite as in Python).
    False when it is nested deeper than ``_DEEPEST_YIELDING``."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > _DEEPEST_YIELDING:
            return False
        if isinstance(node, dict):
            for k, v in node.items():
                kind = type(v)
                if kind is Decimal:
                    node[k] = float(v)
                elif kind is dict or kind is list:
                    stack.append((v, depth + 1))
        elif isinstance(node, list):
            for start in range(0, len(node), _PIECE):
                part = node[start : start + _PIECE]
                if only(_SCALARS, part) or only(_TEXT, part):
                    continue
                for i, v in enumerate(part, start):
                    kind = type(v)
                    if kind is Decimal:
                        node[i] = float(v)
                    elif kind is dict or kind is list:
                        stack.append((v, depth + 1))
    return True


def dump_json(value: Any, *, compact: bool = False) -> str:
    """``value`` as JSON text; ``ValueError`` on a ``NaN`` or an infinity
    anywhere in it. ``compact``: no spaces after separators (SSE events,
    stored records); otherwise ``json.dumps``'s default layout."""
    if compact:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    return json.dumps(value, allow_nan=False)


class StrictJSONProvider(DefaultJSONProvider):
    """Quart's JSON for a view that returns a dict, refusing non-finite
    numbers as ``dump_json`` does."""

    def dumps(self, obj: Any, **kwargs: Any) -> str:
        kwargs.setdefault("allow_nan", False)
        return super().dumps(obj, **kwargs)


def check_text(body: Any) -> None:
    """Every string valid Unicode text (no lone UTF-16 surrogate, which JSON
    escapes can carry and no tokenizer takes) and nothing nested deeper than
    ``MAX_DEPTH``; ``InvalidRequest`` names the first offending field.

    Only containers and non-ASCII strings cost a step each: an 8 MB prompt
    of 4M token ids took 5 s when every element was a step, and is one C
    pass over its element types now."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(body, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_DEPTH:
            raise InvalidRequest(f"nested more than {MAX_DEPTH} levels deep", param=_path(path))
        # Below the depth limit a scalar or ASCII child is valid as it is.
        shallow = len(path) < MAX_DEPTH
        if isinstance(value, str):
            if not value.isascii() and _has_surrogate(value):
                raise InvalidRequest(
                    "the text holds a lone UTF-16 surrogate, which is not valid Unicode",
                    param=_path(path) or None,
                )
        elif isinstance(value, dict):
            for k, v in value.items():
                if not k.isascii() and _has_surrogate(k):
                    raise InvalidRequest(
                        "a key holds a lone UTF-16 surrogate", param=_path(path) or None
                    )
                if not (shallow and _plain(v)):
                    stack.append((v, (*path, k)))
        elif isinstance(value, list):
            if shallow and only(_SCALARS, value):
                continue
            stack.extend(
                (v, (*path, i)) for i, v in enumerate(value) if not (shallow and _plain(v))
            )


def only(kinds: frozenset[Any], values: list[Any]) -> bool:
    """Whether every element of ``values`` is of exactly one of ``kinds``:
    C passes of ``_PIECE`` elements, so that a 4M-element list does not
    hold the GIL through one."""
    return all(
        kinds.issuperset(map(type, values[i : i + _PIECE])) for i in range(0, len(values), _PIECE)
    )


def _copy(values: list[Any]) -> list[Any]:
    """``list(values)``, a piece at a time (``only``)."""
    out: list[Any] = []
    for i in range(0, len(values), _PIECE):
        out += values[i : i + _PIECE]
    return out


def _plain(value: Any) -> bool:
    """A scalar or an ASCII string: nothing in it to check."""
    kind = type(value)
    return kind in _SCALARS or (kind is str and value.isascii())


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _path(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{clipped(part)}" if out else clipped(part)
    return out


# --- the converter ------------------------------------------------------------------

_INTS = frozenset({int})


def _strict(kind: type[T], name: str) -> Callable[[Any, Any], T]:
    def hook(value: Any, _: Any) -> T:
        # bool is an int subclass; JSON true is not a number.
        if isinstance(value, bool) and kind is not bool:
            raise TypeError(f"expected {name}, got a boolean")
        if kind is float and isinstance(value, int):
            try:
                value = float(value)  # JSON 1 is a valid float
            except OverflowError:
                raise ValueError("expected a finite number") from None
        if not isinstance(value, kind):
            raise TypeError(f"expected {name}, got {type(value).__name__}")
        if kind is float and not math.isfinite(value):  # type: ignore[arg-type]
            raise ValueError("expected a finite number")
        return value

    return hook


def object_hook(cls: Any, conv: cattrs.Converter) -> Callable[[Any, Any], Any]:
    """The structure function of the attrs class ``cls`` on ``conv``: an
    object, its declared fields structured and checked; a field ``cls``
    does not declare is dropped and noted in the open ``FieldReport``
    (refused when none is open). Every converter's object hook, and the one
    a wire module calls itself where ``conv.structure`` would come back to
    its own union hook."""
    inner = make_dict_structure_fn(cls, conv, _cattrs_forbid_extra_keys=True)
    known = frozenset(a.name for a in attrs.fields(cls))

    def hook(value: Any, tt: Any) -> Any:
        if not isinstance(value, dict):
            raise TypeError(f"expected an object, got {type(value).__name__}")
        # One C pass over the keys: the common body has nothing unknown.
        if not known.issuperset(value):
            report = _REPORT.get()
            if report is not None:
                report.note(value, [k for k in value if k not in known])
                value = {k: v for k, v in value.items() if k in known}
        return inner(value, tt)

    return hook


def register_union(conv: cattrs.Converter, tp: Any, hook: Callable[[Any, Any], Any]) -> None:
    """``hook`` for ``tp`` and ``tp | None`` on ``conv``: cattrs cannot tell
    these unions apart by itself, and an absent optional field is ``None``,
    never a call to ``hook``."""

    def maybe(value: Any, t: Any) -> Any:
        return None if value is None and t != tp else hook(value, t)

    conv.register_structure_hook_func(lambda t: t in (tp, tp | None), maybe)


def strict_converter() -> cattrs.Converter:
    """A new strict converter: scalars of their exact JSON type, lists that
    are lists, objects that are objects without unknown keys, literals by
    value, and the unions every protocol uses (a string or a list of
    strings, a string or an object). A wire module adds its own unions."""
    conv = cattrs.Converter(forbid_extra_keys=True)
    conv.register_structure_hook(int, _strict(int, "an integer"))
    conv.register_structure_hook(float, _strict(float, "a number"))
    conv.register_structure_hook(str, _strict(str, "a string"))
    conv.register_structure_hook(bool, _strict(bool, "a boolean"))

    def any_hook(value: Any, _: Any) -> Any:
        return value

    conv.register_structure_hook(Any, any_hook)

    def strict_list(t: Any, c: cattrs.Converter) -> Callable[[Any, Any], Any]:
        inner = list_structure_factory(t, c)
        # Token ids: a list of exact ints is valid as it is, checked in one C
        # pass (4M ids through the per-element hook took seconds); anything
        # else takes the hook, which names the offending index.
        ints = get_args(t) == (int,)

        def hook(value: Any, tt: Any) -> Any:
            # A string is iterable; without this "abc" would become ["a", "b", "c"].
            if not isinstance(value, list):
                raise TypeError(f"expected a list, got {type(value).__name__}")
            if ints and only(_INTS, value):
                return _copy(value)
            return inner(value, tt)

        return hook

    def literal(t: Any) -> Callable[[Any, Any], Any]:
        allowed = get_args(t)

        def hook(value: Any, _: Any) -> Any:
            if isinstance(value, bool) or value not in allowed:
                choices = ", ".join(repr(a) for a in allowed)
                raise TypeError(f"must be one of {choices}; got {shown(value)}")
            return value

        return hook

    def origin_is(kind: Any) -> Callable[[Any], bool]:
        return lambda t: bool(get_origin(t) is kind)

    conv.register_structure_hook_factory(origin_is(Literal), literal)
    conv.register_structure_hook_factory(origin_is(list), strict_list)
    conv.register_structure_hook_factory(attrs.has, object_hook)

    def mapping_hook(value: Any, _: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise TypeError(f"expected an object, got {type(value).__name__}")
        return value

    register_union(conv, dict[str, Any], mapping_hook)

    def str_or_list(value: Any, _: Any) -> str | list[str]:
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        raise TypeError("expected a string or a list of strings")

    register_union(conv, str | list[str], str_or_list)

    def str_or_object(value: Any, _: Any) -> str | dict[str, Any]:
        if isinstance(value, str | dict):
            return value
        raise TypeError("expected a JSON string or an object")

    register_union(conv, str | dict[str, Any], str_or_object)
    return conv


# --- fields no class declares ------------------------------------------------------

# Objects whose unknown fields a body's report places (a path each); past
# this, only counted. A body is at most 8 MB, so the count is bounded too.
_PLACED = 64
# Distinct field names one report keeps; past this, only counted.
_NAMES = 64
# The ignored-fields header: at most this many characters, paths whole.
MAX_HEADER_CHARS = 1024
# A path's key without these characters is written bare (``a.b[2].c``);
# with any, as a JSON string (``a["x.y"]``), so the header stays ASCII and
# a comma always separates two paths.
_BARE_KEY = re.compile(r"[A-Za-z0-9_$@-]+", re.ASCII)

FieldPath = tuple[str | int, ...]


@attrs.frozen
class IgnoredFields:
    """What one body held that no class declares: the paths of those in
    the first ``_PLACED`` objects noted (body order), the distinct names (at
    most ``_NAMES``; ``more_names``: the fields of further names), and how
    many fields in all."""

    paths: tuple[FieldPath, ...] = ()
    names: tuple[str, ...] = ()
    more_names: int = 0
    count: int = 0

    def __bool__(self) -> bool:
        return self.count > 0

    def header(self) -> str:
        """The paths as the ``x-gezel-ignored-fields`` header: ``a.b[2].c``,
        comma-separated, at most ``MAX_HEADER_CHARS`` characters; when some
        are left out, a last ``+N`` says how many."""
        out: list[str] = []
        size = 0
        for path in self.paths:
            text = header_path(path)
            # Room is kept for the ", +N" that may follow.
            if size + len(text) + 2 > MAX_HEADER_CHARS - 12:
                break
            out.append(text)
            size += len(text) + 2
        if len(out) < self.count:
            out.append(f"+{self.count - len(out)}")
        return ", ".join(out)


def header_path(path: FieldPath) -> str:
    """``path`` in the header's form: ASCII, no comma outside a quoted key."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _BARE_KEY.fullmatch(part := clipped(part, 64)):
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part)}]"
    return out


class FieldReport:
    """The unknown fields met while one body is structured (``collecting_
    fields`` opens it). ``strict``: ``structure`` refuses the first one."""

    def __init__(self, *, strict: bool) -> None:
        self.strict = strict
        # Noted objects (held until placed) and their unknown keys.
        self._pending: list[tuple[dict[str, Any], list[str]]] = []
        self._paths: list[FieldPath] = []
        self._names: dict[str, None] = {}
        self._more_names = 0
        self._count = 0

    def note(self, obj: dict[str, Any], keys: list[str]) -> None:
        """``keys`` of ``obj`` are declared by no class: dropped, reported."""
        self._count += len(keys)
        for k in keys:
            if k in self._names:
                continue
            if len(self._names) < _NAMES:
                self._names[k] = None
            else:
                self._more_names += 1
        if len(self._pending) + len(self._paths) < _PLACED:
            self._pending.append((obj, keys))

    def place(self, body: Any) -> None:
        """Find where in ``body`` each noted object sits: one walk in body
        order, ended when all are found (costs nothing when none was
        noted). An object not in ``body`` (a hook's own) gives bare names."""
        if not self._pending:
            return
        wanted = {id(obj): set(keys) for obj, keys in self._pending}
        # A stack of nodes to visit and of paths found, in body order.
        stack: list[tuple[Any, FieldPath, bool]] = [(body, (), False)]
        while stack and wanted:
            node, path, found = stack.pop()
            if found:
                self._paths.append(path)
                continue
            if isinstance(node, dict):
                unknown = wanted.pop(id(node), ())
                later = [
                    (v, (*path, k), k in unknown)
                    for k, v in node.items()
                    if k in unknown or isinstance(v, dict | list)
                ]
                stack.extend(reversed(later))
            elif isinstance(node, list) and not only(_SCALARS, node):
                later = [
                    (v, (*path, i), False) for i, v in enumerate(node) if isinstance(v, dict | list)
                ]
                stack.extend(reversed(later))
        while stack:  # paths already found below the last object
            node, path, found = stack.pop()
            if found:
                self._paths.append(path)
        pending, self._pending = self._pending, []
        for obj, keys in pending:
            if id(obj) in wanted:
                self._paths.extend((k,) for k in keys)

    @property
    def ignored(self) -> IgnoredFields:
        """What was reported, paths as placed so far."""
        return IgnoredFields(tuple(self._paths), tuple(self._names), self._more_names, self._count)


_REPORT: ContextVar[FieldReport | None] = ContextVar("gezel_field_report", default=None)


@contextmanager
def collecting_fields(*, strict: bool) -> Iterator[FieldReport]:
    """A report of the unknown fields the bodies structured inside this
    block hold (on this thread: open it where the parse runs)."""
    report = FieldReport(strict=strict)
    token = _REPORT.set(report)
    try:
        yield report
    finally:
        _REPORT.reset(token)


# --- validating a body -----------------------------------------------------------------


def _describe(exc: BaseException, path: str = "") -> tuple[str, str | None]:
    """The first error in a cattrs exception tree, as (message, field path)."""
    if isinstance(exc, ForbiddenExtraKeysError):
        names = sorted(exc.extra_fields)
        first = clipped(names[0])
        field = f"{path}.{first}" if path else first
        return f"unknown field {', '.join(shown(n) for n in names[:8])}", field
    if isinstance(exc, ClassValidationError):
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            return _describe(sub, f"{path}.{note.name}" if path else note.name)
        for sub in without:
            return _describe(sub, path)
    if isinstance(exc, IterableValidationError):
        with_idx, without_idx = exc.group_exceptions()
        for sub, inote in with_idx:
            key = inote.index
            return _describe(sub, f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]")
        for sub in without_idx:
            return _describe(sub, path)
    if isinstance(exc, FieldInvalid):
        return str(exc), f"{path}.{exc.field}" if path else exc.field
    if isinstance(exc, KeyError):
        return "required field missing", path or None
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        return _describe(exc.exceptions[0], path)
    return str(exc) or type(exc).__name__, path or None


def structure(body: Any, cls: type[T], conv: cattrs.Converter) -> T:
    """Validate a decoded JSON body into ``cls`` with ``conv``;
    ``InvalidRequest`` names the field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    check_text(body)
    report = _REPORT.get()
    try:
        value = conv.structure(body, cls)
    except (ClassValidationError, ForbiddenExtraKeysError, IterableValidationError) as exc:
        msg, path = _describe(exc)
        where = f" at {path}" if path else ""
        raise InvalidRequest(f"invalid request{where}: {msg}", param=path) from None
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"invalid request: {exc}") from None
    if report is not None:
        report.place(body)
        ignored = report.ignored
        if report.strict and ignored:
            first = ignored.paths[0]
            where = _path(first)
            more = ignored.count - 1
            also = f" (and {more} more unknown field{'s' if more > 1 else ''})" if more else ""
            raise InvalidRequest(
                f"invalid request at {where}: unknown field {shown(first[-1])}{also}",
                param=where,
            )
    return value
