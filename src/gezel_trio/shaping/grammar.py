"""Compile a request's structure constraints into one llguidance grammar.

This is the pure front half of constrained decoding: it turns
``response_format``, ``tools`` / ``tool_choice`` and the gezel ``tool_grammar``
extension into a frozen ``Constraint`` holding a serialized llguidance grammar,
and compiles that grammar once so a bad schema is a 400 before any stream
starts. It imports llguidance but never MLX; the engine side
(``mlx_constraints``) turns a ``Constraint`` into a per-sequence logits
processor.

How each kind is expressed, in the call markup of the model's chat
template (``tool_format``: Hermes JSON, Qwen3-Coder XML, GLM, Gemma 4 or the
generic format; ``shaping.call_syntax`` spells a call in each):

* ``json_object`` / ``json_schema``: llguidance's JSON-schema grammar
  (``{"type": "object"}`` for ``json_object``).
* ``tool_call`` (``tool_choice`` ``"required"`` or a named function): a Lark
  grammar forcing exactly one call, e.g. Hermes'
  ``<tool_call>\\n{"name": "f", "arguments": ARGS}\\n</tool_call>``, one
  alternative per allowed tool, its arguments by its parameters schema
  (``%json {...}`` in the JSON markups; key by key in the others). Parallel
  calls are not generated: one call, then EOS.
* ``tool_name`` (the gezel ``tool_grammar`` field the seed's client sends,
  ``{"format": ..., "mode": "name-only" | "name-and-params"}``): free text
  in which the markup's opening special token opens a call whose name must
  be one of the tools; ``name-only`` leaves the arguments free (any
  well-formed arguments the markup can write, so the call always parses),
  ``name-and-params`` (the seed's default) holds them to the tool's schema
  as a forced call does. After the closing token free text resumes, so
  several calls may appear, or none. The free text is a terminal that
  cannot contain the opener's characters, so a call spelled out in plain
  text (which the tool-call parser would also pick up) is impossible: every
  call goes through the constrained branch. Being text, it cannot hold
  other special tokens either (EOS still ends the turn anywhere).
  ``allowed_names`` (the gezel app's newer client) narrows the names a
  call may take, here and in a forced call, to the tools the turn may
  call; every tool stays in the prompt, so its cache is kept. An empty
  list, or a name that is empty or not among the tools, is a 400 naming
  it (``tool_grammar.allowed_names[i]``).
  ``format`` names the family the client expects (the seed's ``hermes`` is
  the ``<tool_call>`` family, which includes Qwen 3.5/3.6's Qwen3-Coder
  XML); where it disagrees with the template, the template's markup is
  used all the same: it is what the model learned, what the parser reads
  and what the history renders, and a grammar in another markup would only
  fight the model (the seed skipped its grammar then). An unknown
  ``format`` or ``mode`` is a 400 naming ``tool_grammar``.
* ``json_or_tool_call``: ``response_format`` JSON together with tools under
  ``tool_choice`` ``"auto"``: either the JSON answer or one constrained call,
  which is what the OpenAI API allows in that case.

With ``tool_format="generic"`` (models whose chat template has no tool
syntax; see ``shaping.toolcalls.GENERIC``) a call is the JSON object
``{"tool_call": {"name": "f", "arguments": ARGS}}`` instead, spelled with
ordinary tokens; ``json_or_tool_call`` is then one JSON grammar (``anyOf``
the answer and the call), and ``tool_name`` is refused (free text cannot be
stopped before a plain-text opener).

The tool tags are the tokenizer's special tokens (``<tool_call>`` /
``</tool_call>``; Gemma 4's ``<|tool_call>`` / ``<tool_call|>`` and its
string delimiter ``<|"|>``; ``Constraint.special_tokens`` lists them), not
the same characters spelled with ordinary tokens: that is what these models
emit, and it keeps generated ids identical to what the chat template renders
for the history, so the prompt cache can be reused on the next turn.

JSON is generated compactly in ``json.dumps`` style (``", "`` and ``": "``,
no other whitespace): flexible whitespace lets a weak model loop on newlines
forever, and the compact form is the one chat templates render.

Hostile input is bounded four ways: each schema is at most
``MAX_SCHEMA_BYTES`` serialized and ``MAX_SCHEMA_DEPTH`` deep (checked
before anything recurses), the whole grammar at most ``MAX_GRAMMAR_BYTES``,
a grammar's rules, reference depth, nesting and alternatives and a schema's
depth through its ``$ref``s by ``grammar_bounds`` (llguidance recurses on
the native stack, where an overflow ends the process), and
``parser_limits()`` caps llguidance's lexer fuel, Earley items and lexer
states, so a schema that would stall mask computation is refused here or, at
worst, ends its own sequence on the engine side. Compiling takes
milliseconds for ordinary schemas and under a second for the largest
allowed ones; the GIL is released meanwhile, but callers on an event loop
should still run ``build_constraint`` in a worker thread.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs
import llguidance

from ..core.constraint import Constraint, ConstraintKind
from ..core.errors import InvalidRequest, shown
from .call_syntax import CallSyntax, JsonSyntax, SyntaxOptions
from .custom_tools import INPUT_PARAMETER, escaped_grammar, grammar_of
from .grammar_bounds import lark_problem, regex_problem, schema_problem
from .toolcalls import GENERIC, GRAMMAR_FORMATS, HERMES, TOOL_GRAMMAR_FORMATS, family

__all__ = [
    "GRAMMAR_FORMATS",
    "MAX_GRAMMAR_BYTES",
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMA_DEPTH",
    "TOOL_GRAMMAR_FORMATS",
    "TOOL_GRAMMAR_MODES",
    "Constraint",
    "ConstraintKind",
    "ToolFormatName",
    "ToolGrammarHint",
    "build_constraint",
    "parser_limits",
    "tool_grammar_hint",
]


# 64 KiB is far above real tool or response schemas (a few KiB) and keeps a
# worst-case compile near 20 ms; a 1.4 MB, 100k-entry enum takes 0.5 s.
MAX_SCHEMA_BYTES: Final = 64 * 1024
# Many tools may each be near the per-schema bound; the grammar as a whole is
# what the engine compiles per sequence.
MAX_GRAMMAR_BYTES: Final = 256 * 1024
# JSON nesting levels (each schema level is two: "properties" then the name).
# Checked before json.dumps, which would hit Python's recursion limit near 1000.
MAX_SCHEMA_DEPTH: Final = 64

log = logging.getLogger(__name__)

# A tool format's name (``shaping.toolcalls``; ``GRAMMAR_FORMATS`` are those a
# grammar can be built for). ``TOOL_GRAMMAR_FORMATS``: each name
# tool_grammar.format takes -> the families it names.
ToolFormatName = str
TOOL_GRAMMAR_MODES: Final = ("name-only", "name-and-params")

# A special token's name as llguidance's Lark reads one.
_SPECIAL_TOKEN = re.compile(r"<[^<>\s]+>")

# OpenAI's own rule for function names; it also keeps names safe to splice
# into Lark string literals.
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

# Compact json.dumps-style output (see the module docstring). coerce_one_of:
# pydantic emits oneOf for unions; treat it as anyOf rather than refuse it.
_JSON_OPTIONS: Final[Mapping[str, Any]] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "coerce_one_of": True,
}

# name-only arguments in the JSON markups: any object.
_ANY_OBJECT: Final = json.dumps(
    {"type": "object", "x-guidance": {**_JSON_OPTIONS, "lenient": True}}
)

_SYNTAX_OPTIONS: Final = SyntaxOptions(
    json_options=_JSON_OPTIONS, free_args=_ANY_OBJECT, custom_input=INPUT_PARAMETER
)

# A function with no "parameters" takes none (OpenAI semantics): only {}.
_NO_PARAMETERS: Final[Mapping[str, Any]] = {"type": "object", "additionalProperties": False}


def parser_limits() -> Any:
    """The ``llguidance.LLParserLimits`` used for validation and matching.

    A fresh object per call (no shared mutable state). Figures from the
    llguidance docs: lexer fuel runs at about 14k units/ms per step and 50k/ms
    at build time, Earley items at about 20k/ms; a lexer state costs 1-2 kB.
    """
    return llguidance.LLParserLimits(
        # ~20 ms to build a grammar's regexes; more is refused with a 400.
        initial_lexer_fuel=1_000_000,
        # ~15 ms and ~2.5 ms of mask work per step at most: the engine thread
        # computes masks for every constrained sequence in the batch.
        step_lexer_fuel=200_000,
        step_max_items=50_000,
        # At most ~100 MB of lexer states per sequence (default 250k, ~500 MB).
        max_lexer_states=50_000,
        max_grammar_size=200_000,
        max_items_in_row=2_000,
        # Errors go back to the client; the full grammar dump is noise there.
        verbose_errors=False,
    )


@attrs.frozen
class _Tool:
    name: str
    parameters: Mapping[str, Any]
    # A custom tool's grammar over the JSON-escaped input (``custom_tools``).
    grammar: str | None = None


def build_constraint(
    *,
    response_format: Mapping[str, Any] | None,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None,
    tool_grammar: Mapping[str, Any] | None,
    tool_format: ToolFormatName = HERMES.name,
    llg_tokenizer: Any = None,
    custom_tools: Mapping[str, Mapping[str, Any] | None] | None = None,
    text_tokens: Sequence[str] = (),
) -> Constraint | None:
    """The constraint a chat request asks for, compiled, or ``None``.

    Raises ``InvalidRequest`` (``param`` names the field) for an invalid or
    too large schema, an unknown or missing tool, or requests that cannot be
    combined (JSON output and a forced tool call). ``llg_tokenizer`` (an
    ``llguidance.LLTokenizer``), when given, makes the check complete:
    special tokens and lexer limits are then checked against the real
    vocabulary; without it the engine repeats that check when it builds the
    matcher. ``custom_tools`` maps the names of custom (freeform) tools,
    rendered as functions taking one ``input`` string, to their Responses
    format: a forced call's input then matches its grammar
    (``shaping.custom_tools``). ``text_tokens`` are special tokens the free
    text of a ``tool_grammar`` turn may hold: the model's own thinking
    markers (``<think>`` / ``</think>``, Gemma 4's ``<|channel>`` /
    ``<channel|>``), which the text terminal could not otherwise produce.
    CPU-bound, no I/O; see the module docstring for timings.
    """
    markup = family(tool_format)
    fmt = markup.call_syntax(_SYNTAX_OPTIONS) if markup is not None else None
    if fmt is None:
        raise InvalidRequest(f"unsupported tool format {shown(tool_format)}", param="tool_format")
    response = _response_schema(response_format)
    choice = _tool_choice(tool_choice)
    hint = tool_grammar_hint(tool_grammar)
    allowed = _allowed(hint, tools)
    if hint is not None and hint.format is not None and not hint.agrees_with(fmt.name):
        # The template's markup is what the model was taught, what the parser
        # reads and what the history renders: it wins (see the module docstring).
        log.info(
            "tool_grammar.format %r names another family than this template's %s markup; "
            "constraining in the template's markup",
            hint.format,
            fmt.name,
        )
    # Custom tools' grammars apply inside a JSON string (the JSON markups).
    custom = custom_tools if isinstance(fmt, JsonSyntax) else None

    if isinstance(choice, _Forced) or choice == "required":
        if response is not None:
            raise InvalidRequest(
                "response_format JSON cannot be combined with a forced tool call; "
                "the tool's parameters schema already constrains the output",
                param="response_format",
            )
        all_tools = _tools(tools, param="tools", custom=custom)
        if isinstance(choice, _Forced):
            chosen = [t for t in all_tools if t.name in choice.names]
            missing = set(choice.names) - {t.name for t in chosen}
            if missing:
                listed = ", ".join(repr(n) for n in sorted(missing))
                raise InvalidRequest(
                    f"tool_choice names {listed}, which is not in tools", param="tool_choice"
                )
        else:
            chosen = all_tools
        if allowed is not None:
            chosen = [t for t in chosen if t.name in allowed]
            if not chosen:
                raise InvalidRequest(
                    "tool_choice names only tools that tool_grammar.allowed_names leaves out",
                    param="tool_choice",
                )
        lark = _forced_call_lark(chosen, fmt)
        return _compile_lark("tool_call", lark, chosen, fmt, param="tool_choice", tok=llg_tokenizer)

    tools_active = bool(tools) and choice != "none"
    if response is not None:
        kind, schema = response
        if tools_active:
            all_tools = _narrowed(_tools(tools, param="tools"), allowed)
            lark = _json_or_call_lark(schema, all_tools, fmt)
            return _compile_lark(
                "json_or_tool_call",
                lark,
                all_tools,
                fmt,
                param="response_format",
                tok=llg_tokenizer,
            )
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            _dump(schema, param="response_format")
        )
        _validate(grammar, param="response_format", tok=llg_tokenizer)
        return Constraint(kind, grammar)

    if hint is not None:
        if not tools:
            raise InvalidRequest(
                f'tool_grammar {{"mode": "{hint.mode}"}} needs tools to constrain names to',
                param="tool_grammar",
            )
        if not tools_active:
            return None  # tool_choice "none": the model is not to call tools at all
        if fmt.name == GENERIC.name:
            # Free text must end where a call begins; with a special token as
            # the opener that is decided per token, but llguidance's greedy
            # lexer cannot stop free text before a plain-text opener.
            raise InvalidRequest(
                f'tool_grammar {{"mode": "{hint.mode}"}} needs a model whose chat template '
                "has tool-call markup (this one uses the generic JSON format)",
                param="tool_grammar",
            )
        all_tools = _narrowed(_tools(tools, param="tools"), allowed)
        return _compile_lark(
            "tool_name",
            _calls_in_text_lark(
                all_tools,
                fmt,
                free=hint.mode == "name-only",
                text_tokens=[t for t in text_tokens if _SPECIAL_TOKEN.fullmatch(t)],
            ),
            all_tools,
            fmt,
            param="tool_grammar",
            tok=llg_tokenizer,
        )
    return None


# --- request fields -------------------------------------------------------


@attrs.frozen
class _Forced:
    """One call of one of ``names`` (a named function, or ``allowed_tools``
    in ``required`` mode)."""

    names: tuple[str, ...]


def _response_schema(
    response_format: Mapping[str, Any] | None,
) -> tuple[ConstraintKind, dict[str, Any]] | None:
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise InvalidRequest("response_format must be an object", param="response_format")
    rtype = response_format.get("type")
    if rtype in (None, "text"):
        return None
    if rtype == "json_object":
        return "json_object", _prepared_schema(
            {"type": "object"}, where="response_format", param="response_format", lenient=True
        )
    if rtype != "json_schema":
        raise InvalidRequest(
            f"response_format.type must be text, json_object or json_schema, not {shown(rtype)}",
            param="response_format",
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise InvalidRequest(
            "response_format.json_schema must be an object with a schema",
            param="response_format",
        )
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise InvalidRequest(
            "response_format.json_schema.schema must be a JSON schema object",
            param="response_format",
        )
    # OpenAI's strict mode refuses keywords it cannot enforce; otherwise an
    # unsupported keyword (say "format") is skipped rather than a 400.
    lenient = spec.get("strict") is not True
    return "json_schema", _prepared_schema(
        schema,
        where="response_format.json_schema.schema",
        param="response_format",
        lenient=lenient,
    )


def _tool_choice(tool_choice: str | Mapping[str, Any] | None) -> str | _Forced | None:
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return tool_choice
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if tool_choice.get("type") == "function" and isinstance(name, str):
            return _Forced((name,))
        names = tool_choice.get("names")
        if (
            tool_choice.get("type") == "allowed_tools"
            and isinstance(names, Sequence)
            and names
            and all(isinstance(n, str) for n in names)
        ):
            return _Forced(tuple(names))
    raise InvalidRequest(
        'tool_choice must be "auto", "none", "required", '
        '{"type": "function", "function": {"name": ...}} or '
        '{"type": "allowed_tools", "names": [...]}',
        param="tool_choice",
    )


@attrs.frozen
class ToolGrammarHint:
    """The gezel ``tool_grammar`` field, checked.

    ``format`` is the markup family the client expects (``None``: the
    template's); ``mode`` is ``name-only`` (names pinned, arguments free but
    well formed) or ``name-and-params`` (the whole call by the tool's
    schema, the seed's default).
    """

    format: str | None
    mode: str
    # The tools a call may name (``None``: any of the request's).
    allowed_names: tuple[str, ...] | None = None

    def agrees_with(self, tool_format: str) -> bool:
        """Whether ``format`` names the family of a template's markup."""
        return self.format is None or tool_format in TOOL_GRAMMAR_FORMATS[self.format]


def tool_grammar_hint(tool_grammar: Mapping[str, Any] | None) -> ToolGrammarHint | None:
    """``tool_grammar`` checked; raises ``InvalidRequest`` naming it."""
    if tool_grammar is None:
        return None
    if not isinstance(tool_grammar, Mapping):
        raise InvalidRequest("tool_grammar must be an object", param="tool_grammar")
    unknown = sorted(set(tool_grammar) - {"format", "mode", "allowed_names"})
    if unknown:
        raise InvalidRequest(
            f"tool_grammar takes format, mode and allowed_names, not {', '.join(unknown)}",
            param="tool_grammar",
        )
    mode = tool_grammar.get("mode", "name-and-params")
    if mode not in TOOL_GRAMMAR_MODES:
        raise InvalidRequest(
            f'tool_grammar.mode must be "name-only" or "name-and-params", not {shown(mode)}',
            param="tool_grammar",
        )
    fmt = tool_grammar.get("format")
    if fmt is not None and fmt not in TOOL_GRAMMAR_FORMATS:
        listed = ", ".join(f'"{f}"' for f in TOOL_GRAMMAR_FORMATS)
        raise InvalidRequest(
            f"tool_grammar.format must be one of {listed}, not {shown(fmt)}", param="tool_grammar"
        )
    return ToolGrammarHint(fmt, mode, _allowed_names(tool_grammar.get("allowed_names")))


def _allowed_names(names: Any) -> tuple[str, ...] | None:
    """``tool_grammar.allowed_names`` checked on its own (against the tools
    in ``_allowed``)."""
    if names is None:
        return None
    where = "tool_grammar.allowed_names"
    if not isinstance(names, Sequence) or isinstance(names, str) or not names:
        raise InvalidRequest(f"{where} must be a non-empty list of tool names", param=where)
    for i, name in enumerate(names):
        if not isinstance(name, str) or not name:
            raise InvalidRequest(
                f"{where}[{i}] must be a tool's name, not {shown(name)}", param=f"{where}[{i}]"
            )
    return tuple(names)


def _allowed(
    hint: ToolGrammarHint | None, tools: Sequence[Mapping[str, Any]] | None
) -> frozenset[str] | None:
    """The names calls may take under ``allowed_names``, each one checked
    to be among ``tools`` (``None``: no narrowing)."""
    if hint is None or hint.allowed_names is None:
        return None
    declared = {
        fn.get("name")
        for t in tools or ()
        if isinstance(t, Mapping) and isinstance(fn := t.get("function"), Mapping)
    }
    for i, name in enumerate(hint.allowed_names):
        if name not in declared:
            where = f"tool_grammar.allowed_names[{i}]"
            raise InvalidRequest(f"{where} {shown(name)} is not in tools", param=where)
    return frozenset(hint.allowed_names)


def _narrowed(tools: list[_Tool], allowed: frozenset[str] | None) -> list[_Tool]:
    return tools if allowed is None else [t for t in tools if t.name in allowed]


def _tools(
    tools: Sequence[Mapping[str, Any]] | None,
    *,
    param: str,
    custom: Mapping[str, Mapping[str, Any] | None] | None = None,
) -> list[_Tool]:
    if not tools:
        raise InvalidRequest("this tool_choice needs a non-empty tools list", param=param)
    out: list[_Tool] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if (
            not isinstance(tool, Mapping)
            or tool.get("type", "function") != "function"
            or (not isinstance(fn, Mapping))
        ):
            raise InvalidRequest(
                f'{where} must be {{"type": "function", "function": {{...}}}}', param="tools"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise InvalidRequest(
                f"{where}.function.name must match [A-Za-z0-9_-]{{1,64}}", param="tools"
            )
        if name in seen:
            raise InvalidRequest(f"{where}.function.name {shown(name)} is repeated", param="tools")
        seen.add(name)
        params = fn.get("parameters")
        if params is None:
            params = _NO_PARAMETERS
        if not isinstance(params, Mapping):
            raise InvalidRequest(
                f"{where}.function.parameters must be a JSON schema object", param="tools"
            )
        schema = _prepared_schema(
            params,
            where=f"{where}.function.parameters",
            param="tools",
            lenient=fn.get("strict") is not True,
        )
        # Compile each schema on its own first so an error names its tool.
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_dump(schema, param="tools"))
        _validate(grammar, param="tools", where=f"{where}.function.parameters")
        out.append(_Tool(name, schema, _custom_grammar(custom, name, where)))
    return out


def _custom_grammar(
    custom: Mapping[str, Mapping[str, Any] | None] | None, name: str, where: str
) -> str | None:
    """A custom tool's grammar over its escaped input, checked; ``None`` for
    a function or a text-format custom tool (its schema says it all)."""
    if custom is None or name not in custom:
        return None
    syntax, definition = grammar_of(custom[name])
    if definition is None:
        return None
    problem = _shape_problem(syntax, definition)
    if problem is not None:
        raise InvalidRequest(f"{where}.format.definition: {problem}", param="tools")
    escaped = escaped_grammar(syntax, definition, where=f"{where}.format")
    _validate(escaped, param="tools", where=f"{where}.format.definition")
    return escaped


# --- schemas --------------------------------------------------------------


def _prepared_schema(
    schema: Mapping[str, Any], *, where: str, param: str, lenient: bool
) -> dict[str, Any]:
    depth = _json_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidRequest(
            f"{where} is nested {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are allowed",
            param=param,
        )
    problem = schema_problem(schema)
    if problem is not None:
        raise InvalidRequest(f"{where}: {problem}", param=param)
    # The client's own "x-guidance" options (whitespace patterns and the like)
    # are replaced: output shape and compile cost are the server's to decide.
    prepared = {k: v for k, v in schema.items() if k != "x-guidance"}
    prepared["x-guidance"] = {**_JSON_OPTIONS, "lenient": lenient}
    size = len(_dump(prepared, param=param).encode())
    if size > MAX_SCHEMA_BYTES:
        raise InvalidRequest(
            f"{where} is {size} bytes serialized; at most {MAX_SCHEMA_BYTES} are allowed",
            param=param,
        )
    return prepared


def _json_depth(value: Any) -> int:
    """Nesting depth of a JSON value, without recursion (hostile input)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Mapping):
            children: Any = node.values()
        elif isinstance(node, list | tuple):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_SCHEMA_DEPTH:
            return depth  # enough to refuse; do not walk the rest
        stack.extend((c, depth + 1) for c in children)
    return deepest


def _dump(value: Any, *, param: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:  # NaN or a non-JSON value from a Python caller
        raise InvalidRequest(f"schema is not valid JSON: {exc}", param=param) from exc


# --- Lark grammars --------------------------------------------------------


def _forced_call_lark(tools: Sequence[_Tool], fmt: CallSyntax) -> str:
    rules = fmt.call_rules(tools, free=False, dump=_dump_tools)
    return "\n".join([f"start: {fmt.wrapped('call')}", *rules])


def _dump_tools(value: Any) -> str:
    return _dump(value, param="tools")


def _json_or_call_lark(schema: Mapping[str, Any], tools: Sequence[_Tool], fmt: CallSyntax) -> str:
    if fmt.name == GENERIC.name:
        # Both alternatives are JSON objects: one JSON grammar with anyOf, as
        # an answer and a call that both open with "{" cannot be told apart
        # by llguidance's lexer when they are separate lexemes.
        call = {
            "type": "object",
            "properties": {
                "tool_call": {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {
                                "name": {"const": t.name},
                                "arguments": _without_options(t.parameters),
                            },
                            "required": ["name", "arguments"],
                            "additionalProperties": False,
                        }
                        for t in tools
                    ]
                }
            },
            "required": ["tool_call"],
            "additionalProperties": False,
        }
        combined = {
            "anyOf": [_without_options(schema), call],
            "x-guidance": schema.get("x-guidance", _JSON_OPTIONS),
        }
        return f"start: %json {_dump(combined, param='response_format')}"
    return "\n".join(
        [
            f"start: answer | {fmt.wrapped('call')}",
            f"answer: %json {_dump(schema, param='response_format')}",
            *fmt.call_rules(tools, free=False, dump=_dump_tools),
        ]
    )


def _without_options(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in schema.items() if k != "x-guidance"}


def _calls_in_text_lark(
    tools: Sequence[_Tool], fmt: CallSyntax, *, free: bool, text_tokens: Sequence[str]
) -> str:
    """Free text with any number of calls, each naming one of ``tools``;
    ``text_tokens`` (the model's thinking tokens) may appear in the text."""
    # TEXT is any text that does not spell the opener (the and/not regex
    # operators are llguidance extensions); the grammar's call is the only way in.
    breaks = " | ".join([fmt.wrapped("call"), *text_tokens])
    return "\n".join(
        [
            "start: segment* TEXT",
            f"segment: TEXT ({breaks})",
            *fmt.call_rules(tools, free=free, dump=_dump_tools),
            f"TEXT: {fmt.free_text()}",
        ]
    )


def _compile_lark(
    kind: ConstraintKind,
    lark: str,
    tools: Sequence[_Tool],
    fmt: CallSyntax,
    *,
    param: str,
    tok: Any,
) -> Constraint:
    if len(lark) > MAX_GRAMMAR_BYTES:
        raise InvalidRequest(
            f"the tool grammar is {len(lark)} bytes; at most {MAX_GRAMMAR_BYTES} are allowed "
            "(fewer or smaller tools)",
            param="tools",
        )
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    subs = [(i, t.grammar) for i, t in enumerate(tools) if t.grammar is not None]
    if subs:
        # Each custom tool's grammar is a grammar of its own (own rule names,
        # own lexer), referenced from its call as @custom_<i>.
        grammars = [{"lark_grammar": lark}]
        grammars += [{"name": f"custom_{i}", "lark_grammar": g} for i, g in subs]
        grammar = json.dumps({"grammars": grammars})
        if len(grammar) > MAX_GRAMMAR_BYTES:
            raise InvalidRequest(
                f"the tool grammar is {len(grammar)} bytes; at most {MAX_GRAMMAR_BYTES} "
                "are allowed",
                param="tools",
            )
    _validate(grammar, param=param, tok=tok)
    return Constraint(
        kind,
        grammar,
        tool_names=tuple(t.name for t in tools),
        special_tokens=fmt.special_tokens,
        closing_texts=fmt.closing_texts,
    )


def _validate(grammar: str, *, param: str, where: str | None = None, tok: Any = None) -> None:
    """Compile ``grammar`` under ``parser_limits()``; a failure is a 400."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, tok, limits=parser_limits()
    )
    if is_error:
        detail = messages[0] if messages else "invalid grammar"
        raise InvalidRequest(f"{where or param}: {detail}", param=param)


def custom_grammar_problem(syntax: str, definition: str) -> str | None:
    """Why a custom tool's grammar does not compile (``None``: it does), under
    ``parser_limits()``: llguidance reads Lark natively, regexes as one lexeme."""
    if len(definition) > MAX_GRAMMAR_BYTES:
        return f"it is {len(definition)} bytes; at most {MAX_GRAMMAR_BYTES} are allowed"
    problem = _shape_problem(syntax, definition)
    if problem is not None:
        return problem
    try:
        if syntax == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(definition)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(definition)
    except (ValueError, TypeError) as exc:
        return str(exc)[:300]
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, None, limits=parser_limits()
    )
    return (messages[0] if messages else "invalid grammar")[:300] if is_error else None


def _shape_problem(syntax: str, definition: str) -> str | None:
    """Why a custom grammar is too large or deep for llguidance to compile
    safely (``grammar_bounds``), checked before it sees the grammar."""
    return regex_problem(definition) if syntax == "regex" else lark_problem(definition)
