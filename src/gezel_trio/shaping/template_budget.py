"""Rendering a request's own chat template under a time and output budget.

A chat template a request brings (``chat_template_override``) is code from
the client. Jinja's sandbox stops it reaching Python's internals, not
spending: a 116-byte ``{{ 'x' * 20000000 }}`` rendered for 33 s and took
3.1 GB (the tokenizer's share of 20 M characters), a bigger number got the
process killed for memory, and nested loops kept a worker thread busy long
after the client left. Rendering runs in ``trio.to_thread``, which cannot
kill a thread, so the render must stop by itself.

``BoundedTemplates`` compiles a template in a sandbox that checks, before
it computes, that no string or list it builds (``*``, ``+``, ``~``, ``%``,
a filter, a call) grows past ``max_chars``, and checks the deadline at every
loop step, call and filter; the output is streamed and counted as it comes.
Breaking either bound raises ``TemplateBudgetExceeded``. The model's own
template is the operator's and renders as transformers renders it.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar

import attrs
import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["BoundedTemplates", "TemplateBudget", "TemplateBudgetExceeded", "compile_problem"]


@attrs.frozen
class TemplateBudget:
    """How long one render of a request's template may take, and how many
    characters any value it builds (its output included) may have."""

    seconds: float = 2.0
    max_chars: int = 4_000_000


class TemplateBudgetExceeded(Exception):
    """A template spent more than its budget; ``why`` says which bound."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


@attrs.define
class _Spend:
    deadline: float
    max_chars: int

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBudgetExceeded("it ran past its time budget")

    def size(self, n: int) -> None:
        if n > self.max_chars:
            raise TemplateBudgetExceeded(
                f"it built a value of more than {self.max_chars} characters"
            )


# The render in progress on this thread (renders run on worker threads, many
# at once; each thread runs its render in its own context).
_SPEND: contextvars.ContextVar[_Spend | None] = contextvars.ContextVar("gezel_spend", default=None)
# A format spec or printf width of seven digits or more builds millions of
# characters in one C call ('{:>999999999}'), before any result is seen.
_WIDE_FORMAT = re.compile(r"\{[^{}]*:[^{}]*\d{7,}|%[-+ #0*]*\.?\d{7,}")


def _spend() -> _Spend:
    spend = _SPEND.get()
    if spend is None:  # compiled here, rendered elsewhere: never through render()
        raise TemplateBudgetExceeded("it was rendered without a budget")
    return spend


def _length(value: Any) -> int:
    return len(value) if isinstance(value, str | bytes | list | tuple | dict) else 0


def _check_widths(spend: _Spend, args: Iterable[Any]) -> None:
    """A width or count past the cap (center, indent, ljust, zfill, a
    printf width) is refused before it is built."""
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > spend.max_chars:
            raise TemplateBudgetExceeded(f"it asked for a size of more than {spend.max_chars}")


def _check_format(fmt: Any) -> None:
    if isinstance(fmt, str) and _WIDE_FORMAT.search(fmt):
        raise TemplateBudgetExceeded("it formats with a width of millions")


def _joined(spend: _Spend, sep: str, items: Iterable[Any]) -> list[Any]:
    """``items`` as a list, once what joining them with ``sep`` makes is
    known to fit (a long separator over many items is the bomb)."""
    out: list[Any] = []
    total = 0
    for item in items:
        spend.tick()
        total += len(str(item)) + (len(sep) if out else 0)
        spend.size(total)
        out.append(item)
    return out


def _check_replace(spend: _Spend, text: Any, old: Any, new: Any) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        spend.size(len(text) + (len(text) // max(len(old), 1) + 1) * len(new))


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    passes = hasattr(func, "jinja_pass_arg")

    def bounded(*args: Any, **kwargs: Any) -> Any:
        spend = _spend()
        spend.tick()
        _check_widths(spend, (*args, *kwargs.values()))
        values = list(args[1:] if passes else args)
        if name == "format" and values:
            _check_format(values[0])
        elif name == "replace" and len(values) >= 3:
            _check_replace(spend, values[0], values[1], values[2])
        elif name == "join" and values:
            sep = values[1] if len(values) > 1 else kwargs.get("d", "")
            joined = _joined(spend, str(sep), values[0])
            args = (*args[: len(args) - len(values)], joined, *values[1:])
        result = func(*args, **kwargs)
        spend.size(_length(result))
        return result

    if passes:  # Jinja passes the context or environment by this marker
        bounded.jinja_pass_arg = func.jinja_pass_arg  # type: ignore[attr-defined]
    return bounded


def _paced(iterable: Any) -> Iterator[Any]:
    """Every loop's iterable: the deadline is checked at each step."""
    spend = _spend()
    for item in iterable:
        spend.tick()
        yield item


class _Generation(Extension):  # type: ignore[misc]  # jinja2 is not type-followed (pyproject)
    """``{% generation %}`` (transformers' assistant-mask tag) renders its body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):  # type: ignore[misc]  # jinja2 is not type-followed (pyproject)
    """transformers' namespace rules (no underscore names), and a size check
    on what is stored, since a namespace is how a value survives a loop."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        values = dict(*rest, **kwargs)
        for name in values:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, values)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        _spend().size(_length(value))
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed names on a namespace: {name!r}"
            )


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: no HTML escaping, its options exposed.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _seq_size(value: Any) -> int | None:
    return len(value) if isinstance(value, str | list | tuple) else None


class _BoundedEnvironment(ImmutableSandboxedEnvironment):  # type: ignore[misc]  # jinja2 is not type-followed (pyproject)
    """transformers' chat-template sandbox (its globals, filters and tags),
    with every operator that can build a large value checked first."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})
    filters: dict[str, Callable[..., Any]]

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
        )
        filters: dict[str, Callable[..., Any]] = dict(self.filters)
        filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, f) for name, f in filters.items()}
        self.filters["gezel_paced"] = _paced
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["dict"] = _TemplateDict()
        self.globals["namespace"] = _Namespace

    def call_binop(
        self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any
    ) -> Any:
        spend = _spend()
        spend.tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                size = _seq_size(seq)
                if size is not None and isinstance(n, int):
                    spend.size(size * max(n, 0))
        elif operator == "+":
            a, b = _seq_size(left), _seq_size(right)
            if a is not None and b is not None:
                spend.size(a + b)
        elif operator == "%":
            _check_format(left)
            _check_widths(spend, right if isinstance(right, tuple) else (right,))
        elif operator == "**" and isinstance(right, int) and abs(right) > 1024:
            raise TemplateBudgetExceeded("it raised a number to a power past 1024")
        return super().call_binop(context, operator, left, right)

    def call(
        __self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any
    ) -> Any:
        spend = _spend()
        spend.tick()
        _check_widths(spend, (*args, *kwargs.values()))
        # The sandbox hands out str.format wrapped; the string is the bound self.
        method_of = getattr(__obj, "__wrapped__", __obj)
        owner = getattr(method_of, "__self__", None)
        if isinstance(owner, str):
            method = getattr(method_of, "__name__", "")
            if method in ("format", "format_map"):
                _check_format(owner)
            elif method == "replace" and len(args) >= 2:
                _check_replace(spend, owner, args[0], args[1])
            elif method == "join" and args:
                args = (_joined(spend, owner, args[0]), *args[1:])
        result = super().call(__context, __obj, *args, **kwargs)
        spend.size(_length(result))
        return result


def _paced_loops(tree: nodes.Template) -> nodes.Template:
    """Every ``for`` iterates its iterable through ``gezel_paced`` and every
    ``~`` is checked, so loops and concatenations meet the budget."""
    for loop in tree.find_all(nodes.For):
        loop.iter = nodes.Filter(loop.iter, "gezel_paced", [], [], None, None, lineno=loop.lineno)
    for concat in list(tree.find_all(nodes.Concat)):
        # A '~' joins parts already bounded; the sum is checked by the
        # 'join' filter (bounded like every filter) before it is built.
        parts = nodes.List([nodes.Filter(p, "string", [], [], None, None) for p in concat.nodes])
        concat.nodes = [nodes.Filter(parts, "join", [], [], None, None, lineno=concat.lineno)]
    return tree


class BoundedTemplates:
    """Compiles and renders request templates under a ``TemplateBudget``;
    compiled templates are kept in a small LRU bounded by source bytes."""

    def __init__(self, budget: TemplateBudget, *, max_bytes: int = 4 * 1024 * 1024) -> None:
        self.budget = budget
        self._env = _BoundedEnvironment()
        self._compiled: OrderedDict[str, jinja2.Template] = OrderedDict()
        self._bytes = 0
        self._max_bytes = max_bytes
        self._lock = threading.Lock()  # renders run on several worker threads

    def compile(self, source: str) -> jinja2.Template:
        """``source`` compiled (``jinja2.TemplateError`` when it does not)."""
        with self._lock:
            template = self._compiled.get(source)
            if template is not None:
                self._compiled.move_to_end(source)
                return template
        template = self._env.from_string(_paced_loops(self._env.parse(source)))
        with self._lock:
            if source not in self._compiled:
                self._compiled[source] = template
                self._bytes += len(source)
            while self._bytes > self._max_bytes and len(self._compiled) > 1:
                old, _ = self._compiled.popitem(last=False)
                self._bytes -= len(old)
        return template

    def held_bytes(self) -> int:
        """The characters of template source the compiled LRU holds."""
        return self._bytes

    def render(
        self,
        source: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Any] | None,
        add_generation_prompt: bool,
        variables: Mapping[str, Any],
    ) -> str:
        """The template's text for ``messages`` as transformers would render
        it (messages without their ``None`` fields, reasoning also under its
        older names), or ``TemplateBudgetExceeded``."""
        template = self.compile(source)
        with self.spending() as spend:
            out: list[str] = []
            total = 0
            for chunk in template.generate(
                **variables,
                messages=[_as_transformers_sees(m) for m in messages],
                tools=list(tools) if tools else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            ):
                total += len(chunk)
                spend.size(total)
                spend.tick()
                out.append(chunk)
            return "".join(out)

    @contextlib.contextmanager
    def spending(self) -> Iterator[_Spend]:
        """One budget for every render inside (a request's probes, fallbacks
        and boundary renders share its deadline); the outermost sets it."""
        spend = _SPEND.get()
        if spend is not None:
            yield spend
            return
        spend = _Spend(time.monotonic() + self.budget.seconds, self.budget.max_chars)
        token = _SPEND.set(spend)
        try:
            yield spend
        finally:
            _SPEND.reset(token)


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _as_transformers_sees(message: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


# Compiling changes nothing in an environment (from_string keeps no cache),
# so one serves every request's compile check.
_CHECKER = _BoundedEnvironment()


def compile_problem(source: str) -> str | None:
    """Why ``source`` does not compile as a bounded chat template (``None``:
    it does), in the sandbox the renders use."""
    try:
        _CHECKER.from_string(_paced_loops(_CHECKER.parse(source)))
    except jinja2.TemplateError as exc:
        return f"{type(exc).__name__}: {exc}"[:300]
    except (RecursionError, MemoryError, ValueError) as exc:
        return f"{type(exc).__name__}"
    return None
