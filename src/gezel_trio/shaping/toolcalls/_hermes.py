"""Hermes markup (Qwen 2.5 and 3, and many others): ``<tool_call>`` + one JSON
object ``{"name": ..., "arguments": ...}`` + ``</tool_call>``."""

from __future__ import annotations

from ..call_syntax import JsonSyntax
from ._body import WS, Body, Owner
from ._format import BodyReader, ToolFormat
from ._json_lexer import JsonBody

__all__ = ["HERMES", "JSON_CALL", "HermesSyntax"]

_JSON_STRUCTURE = frozenset('{}[],:"')


def _open_body(owner: Owner, fmt: ToolFormat) -> Body:
    """The body of a call in any format whose body is a JSON call object."""
    # The body watches for a closing marker written before the JSON is
    # complete, unless the marker is JSON itself (GENERIC's "}"): then only
    # the trailer after the complete body reads it.
    early_end = "" if fmt.end[:1] in _JSON_STRUCTURE else fmt.end
    return JsonBody(owner, early_end, root_args=False)


# What a call object can begin with.
JSON_CALL = BodyReader(frozenset("{" + WS), _open_body)


class HermesSyntax(JsonSyntax):
    """``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``."""

    def wrapped(self, body: str) -> str:
        return f'{self.opener} "\\n" {body} "\\n" {self.closer}'


def _teaches(chat_template: str) -> bool:
    # GLM's and Qwen3-Coder's templates also contain <tool_call>: they are
    # listed before this family in ``_families``.
    return "<tool_call>" in chat_template and "<arg_key>" not in chat_template


HERMES = ToolFormat(
    "hermes", "<tool_call>", "</tool_call>", JSON_CALL, teaches=_teaches, grammar=HermesSyntax
)
