"""What a field's type cannot say, checked the same way by every protocol.

The bounds on one request (stop strings, messages, tools, cache ids,
template kwargs, metadata, seeds) keep a hostile body from costing the
engine anything; the rest are values that must be valid as something else
(a tool's parameters as a JSON schema, a chat template override as a Jinja
template that compiles). Each raises ``InvalidRequest`` naming the field.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import attrs
import jsonschema

from ..core.errors import InvalidRequest
from ..shaping.grammar import custom_grammar_problem
from ..shaping.template_budget import compile_problem
from .strict import FieldInvalid

__all__ = [
    "CACHE_ID_REFUSED",
    "MAX_CACHE_ID_CHARS",
    "MAX_CACHE_SALT_CHARS",
    "MAX_MESSAGES",
    "MAX_METADATA",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_TEMPLATE_CHARS",
    "MAX_TEMPLATE_KWARGS_CHARS",
    "MAX_TOOLS",
    "SEED_MAX",
    "SEED_MIN",
    "TOOL_NAME",
    "check_cache_id",
    "check_cache_salt",
    "check_custom_grammar",
    "check_messages",
    "check_metadata",
    "check_parameters",
    "check_stops",
    "check_template",
    "check_template_kwargs",
]

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 4096
MAX_CACHE_ID_CHARS = 4096
# A request's ``cache_salt`` (vLLM's): any text, 1 to this many characters.
MAX_CACHE_SALT_CHARS = 1024
MAX_TOOLS = 128
MAX_TEMPLATE_CHARS = 65_536
MAX_TEMPLATE_KWARGS_CHARS = 16_384
MAX_METADATA = 16
# OpenAI's seed is an int64; the engine keys its random stream by 64 bits.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# OpenAI's function names (chat tools and Responses tools).
TOOL_NAME = r"[A-Za-z0-9_-]{1,64}"


def check_messages(_: Any, attr: attrs.Attribute[Any], value: list[Any]) -> None:
    """A field validator for a conversation: 1 to ``MAX_MESSAGES`` turns."""
    if not value:
        raise FieldInvalid(attr.name, f"{attr.name} must not be empty")
    if len(value) > MAX_MESSAGES:
        raise FieldInvalid(attr.name, f"at most {MAX_MESSAGES} {attr.name}")


def check_stops(stops: tuple[str, ...], param: str) -> None:
    """At most ``MAX_STOP_STRINGS`` stop strings of 1 to ``MAX_STOP_CHARS``
    characters each."""
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings", param=param)
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise InvalidRequest(
            f"each stop string must have 1 to {MAX_STOP_CHARS} characters", param=param
        )


# What a cache id must not hold: control characters (Unicode Cc; NUL
# separates internal keys) and whitespace (Zs, Zl, Zp). An id is printed in
# the supervisor's stdout lines (``Prefill: ... cache=<id>``), whose reader
# splits on whitespace: "a cache=b" would draw its bar in session b's row.
# One class for this check and the OpenAPI pattern (``\uXXXX`` reads the same
# in Python's and ECMAScript's regexes).
CACHE_ID_REFUSED = r"\u0000-\u0020\u007f-\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_REFUSED_IN_ID = re.compile(f"[{CACHE_ID_REFUSED}]")


def check_cache_salt(_: Any, attr: attrs.Attribute[Any], value: str | None) -> None:
    """A field validator: ``cache_salt`` is a non-empty string, bounded."""
    if value is not None and not 1 <= len(value) <= MAX_CACHE_SALT_CHARS:
        raise FieldInvalid(attr.name, f"{attr.name} must be 1 to {MAX_CACHE_SALT_CHARS} characters")


def check_cache_id(value: str | None, param: str) -> None:
    """Any text without whitespace is a valid id (ids are hashed, never used
    as paths), but an empty or unbounded one, or one with whitespace or
    control characters, is a client bug worth naming."""
    if value is None:
        return
    if not value:
        raise InvalidRequest(f"{param} must not be empty", param=param)
    if len(value) > MAX_CACHE_ID_CHARS:
        raise InvalidRequest(f"{param} is longer than {MAX_CACHE_ID_CHARS} characters", param=param)
    if _REFUSED_IN_ID.search(value):
        raise InvalidRequest(
            f"{param} must not contain whitespace or control characters", param=param
        )


# What the renderer itself passes to the template, or transformers'
# ``apply_chat_template`` takes as its own arguments: sent as template
# kwargs, ``chat_template`` replaced the template unchecked, and the others
# made the render fail, so the fallback without kwargs dropped every other key.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "add_generation_prompt",
        "chat_template",
        "continue_final_message",
        "conversation",
        "conversations",
        "documents",
        "max_length",
        "messages",
        "padding",
        "return_assistant_tokens_mask",
        "return_dict",
        "return_tensors",
        "sanitize_control_tokens",
        "tokenize",
        "tokenizer_kwargs",
        "tools",
        "truncation",
    }
)


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """``chat_template_kwargs`` must be JSON of at most
    ``MAX_TEMPLATE_KWARGS_CHARS`` characters and name none of
    ``RESERVED_TEMPLATE_KWARGS`` (a chat template is sent as
    ``chat_template_override``, tools as ``tools``)."""
    if kwargs is None:
        return
    try:
        size = len(json.dumps(kwargs))
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(str(exc), param="chat_template_kwargs") from exc
    if size > MAX_TEMPLATE_KWARGS_CHARS:
        raise InvalidRequest("chat_template_kwargs is too large", param="chat_template_kwargs")
    for key in sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs)):
        hint = " (send chat_template_override)" if key == "chat_template" else ""
        raise InvalidRequest(
            f"chat_template_kwargs.{key} is set by the server, not by template kwargs{hint}",
            param=f"chat_template_kwargs.{key}",
        )


def check_metadata(metadata: dict[str, Any] | None) -> None:
    """OpenAI's ``metadata``: at most ``MAX_METADATA`` pairs of a key of at
    most 64 characters and a string of at most 512."""
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA:
        raise InvalidRequest(f"at most {MAX_METADATA} metadata pairs", param="metadata")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise InvalidRequest(
                "metadata maps keys of at most 64 characters to strings of at most 512",
                param=f"metadata.{key[:64]}",
            )


def check_parameters(params: dict[str, Any] | None, where: str) -> None:
    """A tool's parameters must be an object JSON schema; ``where`` names it."""
    if params is None:
        return
    try:
        problem = _SCHEMA_PROBLEMS.get(json.dumps(params, sort_keys=True))
    except (TypeError, ValueError, RecursionError) as exc:
        problem = str(exc)
    if problem is not None:
        raise InvalidRequest(f"{where} is not a JSON schema: {problem}", param=where)


def check_custom_grammar(syntax: str, definition: str, where: str) -> None:
    """A custom tool's grammar must compile (llguidance); ``where`` names its format."""
    problem = _grammar_problem(syntax, definition)
    if problem is not None:
        param = f"{where}.definition"
        raise InvalidRequest(f"{param} is not a valid {syntax} grammar: {problem}", param=param)


def _grammar_problem(syntax: str, definition: str) -> str | None:
    return _GRAMMAR_PROBLEMS.get(f"{syntax}\0{definition}")


def _keyed_grammar_problem(key: str) -> str | None:
    syntax, _, definition = key.partition("\0")
    return custom_grammar_problem(syntax, definition)


class _ProblemMemo:
    """A check's answer once per distinct text (an agent sends the same
    tools and grammars each turn), in an LRU bounded by the texts' size: a
    count alone (256 schemas) let 256 schemas of 8 MB each stay. A text
    larger than the whole bound is checked and not kept."""

    def __init__(self, check: Callable[[str], str | None], max_chars: int) -> None:
        self._check = check
        self._max_chars = max_chars
        self._chars = 0
        self._problems: OrderedDict[str, str | None] = OrderedDict()
        self._lock = threading.Lock()  # parsing may run on worker threads

    @property
    def chars(self) -> int:
        return self._chars

    def get(self, canonical: str) -> str | None:
        with self._lock:
            if canonical in self._problems:
                self._problems.move_to_end(canonical)
                return self._problems[canonical]
        problem = self._check(canonical)
        if len(canonical) <= self._max_chars:
            with self._lock:
                if canonical not in self._problems:
                    self._problems[canonical] = problem
                    self._chars += len(canonical)
                while self._chars > self._max_chars:
                    old, _ = self._problems.popitem(last=False)
                    self._chars -= len(old)
        return problem

    def held_chars(self) -> int:
        return self._chars


def _schema_problem(canonical: str) -> str | None:
    """Why a tool's ``parameters`` is not a JSON schema (``None``: it is)."""
    schema = json.loads(canonical)
    if not isinstance(schema, dict):
        return "it must be an object"
    if schema.get("type", "object") != "object":
        return 'its "type" must be "object"'
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        return f"{exc.message[:200]}" + (f" (at {where})" if where else "")
    except RecursionError:
        return "it is nested too deeply"
    return None


# 4 M characters each: the tool sets of many agents at once, where one
# 8 MB body used to stay whole.
_SCHEMA_PROBLEMS = _ProblemMemo(_schema_problem, 4_000_000)
_GRAMMAR_PROBLEMS = _ProblemMemo(_keyed_grammar_problem, 4_000_000)


def check_template(template: str | None) -> None:
    """``chat_template_override`` must be a Jinja template that compiles in
    the sandbox the renderer uses, within ``MAX_TEMPLATE_CHARS``."""
    if template is None:
        return
    if len(template) > MAX_TEMPLATE_CHARS:
        raise InvalidRequest(
            f"chat_template_override is longer than {MAX_TEMPLATE_CHARS} characters",
            param="chat_template_override",
        )
    problem = _template_problem(template)
    if problem is not None:
        raise InvalidRequest(
            f"chat_template_override does not compile: {problem}", param="chat_template_override"
        )


def bookkeeping() -> dict[str, int]:
    """The sizes of the request checks' per-process caches, for ``/metrics``."""
    return {
        "schema_check_chars": _SCHEMA_PROBLEMS.chars,
        "grammar_check_chars": _GRAMMAR_PROBLEMS.chars,
        "template_check_entries": _template_problem.cache_info().currsize,
    }


@lru_cache(maxsize=32)
def _template_problem(template: str) -> str | None:
    """Compile once per distinct override (a bounded LRU: a client sending
    new templates each time costs one compile each, never unbounded memory)."""
    return compile_problem(template)
