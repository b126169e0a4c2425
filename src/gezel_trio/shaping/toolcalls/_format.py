"""One tool-call markup family: how a chat template teaches it, how its
calls are read from streamed text, and how a grammar writes one."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from ..call_syntax import CallSyntax, SyntaxOptions
    from ._body import Body, Owner

__all__ = ["BodyReader", "ToolFormat"]


@attrs.frozen
class BodyReader:
    """How a family reads the markup between a call's markers:
    ``first_chars``, what a call's body can begin with (any other character
    after the opening marker is content at once), and ``open``, a new body
    scanner for one call (``_body.Body``)."""

    first_chars: frozenset[str]
    open: Callable[[Owner, ToolFormat], Body]


@attrs.frozen
class ToolFormat:
    """One chat-template family's tool-call markup, declared in its own
    module and listed once in ``_families``; every other place that names
    a family reads it there.

    ``name`` is its one spelling: the model's ``tool_format``, the grammar's
    and the one ``tool_grammar.format`` takes. ``start`` opens a call and
    ``end`` closes it (empty when the call ends with its body); ``body``
    reads what is in between. ``teaches`` says whether a chat template
    teaches this markup (``None``: it is never read from a template).
    ``grammar`` writes a call as Lark rules
    (``None``: no grammar is built for it). ``client_names`` are the other
    names a client's ``tool_grammar.format`` may give the family: older
    spellings kept so no client breaks, or a wider family it belongs to.
    """

    name: str
    start: str = attrs.field(validator=attrs.validators.min_len(1))
    end: str
    body: BodyReader
    teaches: Callable[[str], bool] | None = None
    grammar: Callable[[ToolFormat, SyntaxOptions], CallSyntax] | None = None
    client_names: tuple[str, ...] = ()

    def call_syntax(self, options: SyntaxOptions) -> CallSyntax | None:
        """The family's call spelling under ``options``, or None."""
        return self.grammar(self, options) if self.grammar is not None else None
