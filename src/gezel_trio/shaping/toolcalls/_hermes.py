"""Hermes markup (Qwen 2.5 and 3, and many others): ``<tool_call>`` + one JSON
object ``{"name": ..., "arguments": ...}`` + ``</tool_call>``."""

from __future__ import annotations

from ._body import WS, Body, Owner
from ._format import ToolFormat
from ._json_lexer import JsonBody

__all__ = ["FIRST_CHARS", "HERMES", "open_body"]

HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "json")

# What a call object can begin with.
FIRST_CHARS = frozenset("{" + WS)

_JSON_STRUCTURE = frozenset('{}[],:"')


def open_body(owner: Owner, fmt: ToolFormat) -> Body:
    """The body of a call in any format whose body is a JSON call object."""
    # The body watches for a closing marker written before the JSON is
    # complete, unless the marker is JSON itself (GENERIC's "}"): then only
    # the trailer after the complete body reads it.
    early_end = "" if fmt.end[:1] in _JSON_STRUCTURE else fmt.end
    return JsonBody(owner, early_end, root_args=False)
