"""A compiled structure constraint: the value a request carries to the
backend, which turns it into a logits processor (``mlx.constraints``).
``shaping.grammar`` builds and validates it."""

from __future__ import annotations

from typing import Literal

import attrs

__all__ = ["Constraint", "ConstraintKind"]

ConstraintKind = Literal[
    "json_object", "json_schema", "tool_call", "tool_name", "json_or_tool_call"
]


@attrs.frozen
class Constraint:
    """A compiled, validated structure constraint for one request.

    ``grammar`` is a serialized llguidance grammar (``LLMatcher`` input).
    ``tool_names`` lists the functions a call may name (empty for plain
    JSON). ``special_tokens`` are the tokenizer tokens the grammar refers to;
    a model whose tokenizer lacks them cannot serve it. ``closing_texts``
    are the markup's own ways to end a value or a call (``</parameter>``,
    ``<tool_call|>``...), which the engine steers to near the end of the
    budget where the grammar allows one whole.
    """

    kind: ConstraintKind
    grammar: str = attrs.field(repr=False)
    tool_names: tuple[str, ...] = ()
    special_tokens: tuple[str, ...] = ()
    closing_texts: tuple[str, ...] = ()
