"""The generic format, for chat templates without tool syntax (as llama.cpp's
generic handler does): the tools are described in the system turn
(``prompt.generic_tool_messages``) and a call is one JSON object,
``{"tool_call": {"name": ..., "arguments": ...}}``, constrained by a grammar
when the request forces one. Its body is the Hermes call object."""

from __future__ import annotations

import re

from ..call_syntax import JsonSyntax, Markup, SyntaxOptions, lit
from ._format import ToolFormat
from ._hermes import JSON_CALL

__all__ = ["GENERIC", "GenericSyntax", "teaches_no_tool_syntax"]

# A template that mentions the tool definitions teaches its own syntax.
_TEMPLATE_TOOLS = re.compile(r"\btools\b")


def teaches_no_tool_syntax(chat_template: str) -> bool:
    """Whether a chat template never mentions tools, so the generic format applies."""
    return _TEMPLATE_TOOLS.search(chat_template) is None


class GenericSyntax(JsonSyntax):
    """``{"tool_call": {"name": ..., "arguments": ...}}``, spelled with
    ordinary tokens (no special token opens or closes it)."""

    def __init__(self, markup: Markup, options: SyntaxOptions) -> None:
        super().__init__(markup, options)
        # Written as json.dumps writes it, a space after the colon.
        self.opener = '{"tool_call": '
        self.special_tokens = ()

    def wrapped(self, body: str) -> str:
        return f'{lit(self.opener)} {body} "}}"'


# '{"tool_call": ' + the Hermes-style call object + '}'. The body scanner
# reads the inner object; the trailer the "}". ``_families`` falls back to
# it when no family's markup is found in the template.
GENERIC = ToolFormat(
    "generic",
    '{"tool_call":',
    "}",
    JSON_CALL,
    teaches=teaches_no_tool_syntax,
    grammar=GenericSyntax,
)
