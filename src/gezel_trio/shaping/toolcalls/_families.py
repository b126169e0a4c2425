"""The tool-call markup families, listed once.

Each family is declared in its own module (a ``ToolFormat``: how a template
teaches it, how its calls are read, how a grammar writes one, the names
clients give it); ``FAMILIES`` lists them, and everything else that names a
family reads it here: which markup a template teaches, the model's
``tool_format``, the shaper's splitter, the grammars and the names
``tool_grammar.format`` takes. A new family is its module and its entry in
``FAMILIES``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from ._format import ToolFormat
from ._gemma import GEMMA4
from ._generic import GENERIC
from ._glm import GLM
from ._hermes import HERMES
from ._mistral import MISTRAL
from ._qwen_xml import QWEN3_CODER

__all__ = [
    "FAMILIES",
    "GRAMMAR_FORMATS",
    "TOOL_GRAMMAR_FORMATS",
    "TOOL_GRAMMAR_NAMES",
    "detect_format",
    "family",
    "resolve_format",
]

# The families read from a chat template, most specific first: the first
# whose check passes is the template's (GLM's and Qwen3-Coder's templates
# also contain Hermes' <tool_call>).
FAMILIES: Final[tuple[ToolFormat, ...]] = (GEMMA4, GLM, QWEN3_CODER, HERMES, MISTRAL)

# For a template that teaches none of them; its own check says whether the
# template has no tool syntax at all (an unknown family gets no format).
_FALLBACK: Final = GENERIC

_BY_NAME: Final[Mapping[str, ToolFormat]] = {f.name: f for f in (*FAMILIES, _FALLBACK)}

# The families a grammar can be built for, by name.
GRAMMAR_FORMATS: Final[tuple[str, ...]] = tuple(
    f.name for f in (*FAMILIES, _FALLBACK) if f.grammar is not None
)

# tool_grammar.format -> the families it names: each family with a grammar
# and a markup of its own (the fallback has none to expect) under its name
# and its ``client_names``.
TOOL_GRAMMAR_FORMATS: Final[Mapping[str, tuple[str, ...]]] = {
    name: tuple(f.name for f in FAMILIES if name in (f.name, *f.client_names))
    for f in FAMILIES
    if f.grammar is not None
    for name in (f.name, *f.client_names)
}
TOOL_GRAMMAR_NAMES: Final[tuple[str, ...]] = tuple(TOOL_GRAMMAR_FORMATS)


def family(name: str | None) -> ToolFormat | None:
    """The family of a ``tool_format`` name, or None."""
    return _BY_NAME.get(name) if name else None


def detect_format(chat_template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template teaches its model, or None."""
    if not chat_template:
        return None
    return next((f for f in FAMILIES if f.teaches is not None and f.teaches(chat_template)), None)


def resolve_format(chat_template: str | None) -> ToolFormat | None:
    """:func:`detect_format`, or :data:`GENERIC` for a template that has no
    tool syntax at all; None for no template, or an unsupported family."""
    found = detect_format(chat_template)
    if found is None and chat_template and _FALLBACK.teaches is not None:
        return _FALLBACK if _FALLBACK.teaches(chat_template) else None
    return found
