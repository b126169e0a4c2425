"""How one tool call is spelled in a chat-template markup, as Lark rules
for llguidance (``shaping.grammar`` assembles them into whole grammars).

This module holds what the markups share; each markup's own spelling is a
subclass in its family's module (``shaping.toolcalls._hermes`` and the
others), named by its ``ToolFormat.grammar``.

Each markup is a ``CallSyntax``: the special tokens its calls use, the text
that opens a call (free text around calls must never spell it), how the
call is wrapped, and ``call_rules``: a ``call`` rule with one alternative per
tool whose name is a literal, so a call can only name a declared tool. The
arguments come in two strengths:

* ``free``: any arguments the markup can write (any JSON object; any
  ``<parameter=KEY>`` blocks; any Gemma 4 object), well formed, so the
  result always parses.
* by schema: what the tool's parameters schema allows. In the JSON markups
  the whole arguments object is the schema's JSON grammar. In the others the
  declared keys come in their order (the template's own order: declaration
  order, or sorted for Gemma 4, whose template sorts them), required ones
  present, each at most once, and each value by its schema: a string is
  free text (an ``enum`` or ``const`` of strings: one of its values), a
  typed value (number, boolean, object, array...) the JSON grammar of its
  schema (Gemma 4: its own number and literal syntax; nested values free),
  and a value whose schema has no type, or a ``$ref``, free. A tool whose
  schema declares no properties takes free arguments.

Every spelling is the one the chat template renders (the newlines of the
Qwen3-Coder layout, Gemma 4's comma without a space, GLM's optional
newlines), so generated ids match the rendered history and the prompt cache
is reused on the next turn, and a weak model is not given a way to loop on
whitespace.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs

__all__ = [
    "BareValueSyntax",
    "CallSyntax",
    "JsonSyntax",
    "KeyedSyntax",
    "Markup",
    "SyntaxOptions",
    "Tool",
    "json_scalar",
    "lit",
    "regex_escape",
    "value_kind",
]


class Tool(Protocol):
    """What a syntax needs of a tool: its name and prepared parameters schema."""

    @property
    def name(self) -> str: ...

    @property
    def parameters(self) -> Mapping[str, Any]: ...

    @property
    def grammar(self) -> str | None: ...


class Markup(Protocol):
    """What a syntax needs of its family (a ``shaping.toolcalls.ToolFormat``):
    its name and the markers that open and close a call."""

    @property
    def name(self) -> str: ...

    @property
    def start(self) -> str: ...

    @property
    def end(self) -> str: ...


@attrs.frozen
class SyntaxOptions:
    """What ``shaping.grammar`` decides for every markup: the JSON grammar's
    options (``x-guidance``), the schema of free JSON arguments, and the
    parameter a custom tool's input is written in."""

    json_options: Mapping[str, Any]
    free_args: str
    custom_input: str


def lit(text: str) -> str:
    """A Lark string literal (a JSON string literal is a valid one)."""
    return json.dumps(text, ensure_ascii=False)


def _without_opener(opener: str) -> str:
    return "/(?s:.*)/ & ~/(?s:.*)" + regex_escape(opener) + "(?s:.*)/"


def regex_escape(text: str) -> str:
    """``text`` as a literal inside a Lark regex."""
    return "".join(f"\\{c}" if c in "\\/.^$|?*+()[]{}-" else c for c in text)


class CallSyntax:
    """One markup's call spelling; see the module docstring. Its opener and
    closer are its family's markers, each one special token."""

    # Special tokens besides the opener and the closer (Gemma 4's string delimiter).
    extra_tokens: tuple[str, ...] = ()
    # Texts that end a value or the call, tried in order near the budget's
    # end (``mlx.constraints``); the JSON markups' JSON closers need none.
    closing_texts: tuple[str, ...] = ()

    def __init__(self, markup: Markup, options: SyntaxOptions) -> None:
        self.name = markup.name
        self.opener = markup.start
        self.closer = markup.end
        self.special_tokens: tuple[str, ...] = (self.opener, self.closer, *self.extra_tokens)
        self.options = options

    def wrapped(self, body: str) -> str:
        return f"{self.opener} {body} {self.closer}"

    def free_text(self) -> str:
        """A terminal definition: any text that does not spell the opener."""
        return _without_opener(self.opener)

    def call_rules(
        self, tools: Sequence[Tool], *, free: bool, dump: Callable[[Any], str]
    ) -> list[str]:
        raise NotImplementedError


class JsonSyntax(CallSyntax):
    """A markup whose call is one JSON object, ``{"name": ..., "arguments":
    ...}`` (Hermes, and inside ``{"tool_call": ...}`` the generic format)."""

    @staticmethod
    def _head(name: str) -> str:
        return lit(f'{{"name": "{name}", "arguments": ')

    def call_rules(
        self, tools: Sequence[Tool], *, free: bool, dump: Callable[[Any], str]
    ) -> list[str]:
        if free:
            heads = " | ".join(self._head(t.name) for t in tools)
            return [f'call: CALL_HEAD %json {self.options.free_args} "}}"', f"CALL_HEAD: {heads}"]
        alts = " | ".join(f"call_{i}" for i in range(len(tools)))
        rules = [f"call: {alts}"]
        for i, t in enumerate(tools):
            if t.grammar is not None:
                # A custom tool's input is its own grammar (@custom_<i>)
                # between the quotes of the input string.
                opener = lit(f'{{"{self.options.custom_input}": "')
                rules.append(f'call_{i}: {self._head(t.name)} {opener} @custom_{i} "\\"}}}}"')
            else:
                schema = _declared_keys_only(t.parameters)
                rules.append(f'call_{i}: {self._head(t.name)} %json {dump(schema)} "}}"')
        return rules


def _declared_keys_only(parameters: Mapping[str, Any]) -> Mapping[str, Any]:
    """The arguments' schema with only its declared keys allowed, where it
    declares some and says nothing of others: JSON Schema admits any other
    key then, and an unguided model writes one (an MCP tool's schema rarely
    says ``additionalProperties``), which no tool takes. The keyed markups
    below pin their keys the same way."""
    props = parameters.get("properties")
    if isinstance(props, Mapping) and props and "additionalProperties" not in parameters:
        return {**parameters, "additionalProperties": False}
    return parameters


# --- the markups whose arguments are not one JSON value -----------------------


def value_kind(schema: Any) -> tuple[str, tuple[str, ...]]:
    """How a property's value is constrained: ``("enum", values)``,
    ``("string", ())``, ``("json", ())`` (a typed value), or ``("free", ())``."""
    if not isinstance(schema, Mapping) or "$ref" in json.dumps(schema, default=str):
        return "free", ()
    enum = schema.get("enum")
    if "const" in schema:
        enum = [schema["const"]]
    if isinstance(enum, list) and enum:
        if all(isinstance(v, str) for v in enum):
            return "enum", tuple(dict.fromkeys(enum))
        return "json", ()
    kind = schema.get("type")
    if kind == "string":
        return "string", ()
    if kind in ("integer", "number", "boolean", "null", "object", "array"):
        return "json", ()
    return "free", ()


def json_scalar(schema: Mapping[str, Any]) -> bool:
    """A number, boolean or null (or an enum of them): spelled alike in JSON
    and in Gemma 4's syntax."""
    enum = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(enum, list):
        return not any(isinstance(v, str | list | dict) for v in enum)
    return schema.get("type") in ("integer", "number", "boolean", "null")


def _properties(tool: Tool) -> tuple[list[tuple[str, Any]], set[str]] | None:
    """The declared properties in order and the required names; ``None``
    when the schema declares none (free arguments)."""
    props = tool.parameters.get("properties")
    if not isinstance(props, Mapping) or not props:
        if tool.parameters.get("additionalProperties") is False:
            return [], set()  # no parameters at all
        return None
    required = tool.parameters.get("required")
    names = set(required) if isinstance(required, list) else set()
    return [(str(k), v) for k, v in props.items()], names


class KeyedSyntax(CallSyntax):
    """A markup whose arguments are key/value entries written one by one."""

    # Whether entries are separated by commas (Gemma 4) or just follow each other.
    separated = False
    sorted_keys = False

    def call_rules(
        self, tools: Sequence[Tool], *, free: bool, dump: Callable[[Any], str]
    ) -> list[str]:
        alts = " | ".join(f"call_{i}" for i in range(len(tools)))
        rules = [f"call: {alts}", *self.shared_rules()]
        for i, t in enumerate(tools):
            props = None if free else _properties(t)
            if props is None:
                args = self.free_args()
            else:
                entries, required = props
                if self.sorted_keys:
                    entries = sorted(entries)
                options = t.parameters.get("x-guidance", self.options.json_options)
                values = [(k, self.entry(k, schema, options, dump)) for k, schema in entries]
                args = self._sequence(rules, i, values, required)
            rules.append(f"call_{i}: {self.call(t.name, args)}")
        return rules

    def _sequence(
        self, rules: list[str], i: int, values: list[tuple[str, str]], required: set[str]
    ) -> str:
        """The entries in order, optional unless required."""
        if not values:
            return '""'
        if not self.separated:
            return " ".join(e if k in required else f"({e})?" for k, e in values)
        # With separators: first_j (nothing written yet) and after_j (a
        # comma comes before the next entry), so optional entries stay
        # linear in size.
        n = len(values)
        for j, (k, e) in enumerate(values):
            last = j + 1 == n
            next_after = '""' if last else f"args_{i}_after_{j + 1}"
            next_first = '""' if last else f"args_{i}_first_{j + 1}"
            first = f"{e} {next_after}"
            after = f'"," {e} {next_after}'
            if k not in required:
                first += f" | {next_first}"
                after += f" | {next_after}"
            rules.append(f"args_{i}_first_{j}: {first}")
            rules.append(f"args_{i}_after_{j}: {after}")
        return f"args_{i}_first_0"

    @staticmethod
    def json_value(schema: Any, options: Any, dump: Callable[[Any], str]) -> str:
        prepared = dict(schema)
        prepared["x-guidance"] = options
        return f"%json {dump(prepared)}"

    # Per markup:
    def shared_rules(self) -> list[str]:
        raise NotImplementedError

    def free_args(self) -> str:
        raise NotImplementedError

    def entry(self, key: str, schema: Any, options: Any, dump: Callable[[Any], str]) -> str:
        raise NotImplementedError

    def call(self, name: str, args: str) -> str:
        raise NotImplementedError


class BareValueSyntax(KeyedSyntax):
    """A keyed markup that writes each value bare and closes it with a tag
    (Qwen3-Coder, GLM): an enum or a typed value is closed by that tag right
    after it; any other value is free text, which the markup's lazy rule
    ends at the same tag."""

    # Per markup: the grammar after a constrained value, and a free value.
    value_end = ""
    free_value = ""

    def entry(self, key: str, schema: Any, options: Any, dump: Callable[[Any], str]) -> str:
        head = self.entry_head(key)
        kind, values = value_kind(schema)
        if kind == "enum":
            alts = " | ".join(lit(v) for v in values)
            return f"{head} ({alts}) {self.value_end}"
        if kind == "json":
            return f"{head} {self.json_value(schema, options, dump)} {self.value_end}"
        return f"{head} {self.free_value}"

    def entry_head(self, key: str) -> str:
        """The grammar of an entry up to its value."""
        raise NotImplementedError
