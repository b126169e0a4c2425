"""The generic format, for chat templates without tool syntax (as llama.cpp's
generic handler does): the tools are described in the system turn
(``prompt.generic_tool_messages``) and a call is one JSON object,
``{"tool_call": {"name": ..., "arguments": ...}}``, constrained by a grammar
when the request forces one. Its body is the Hermes call object."""

from __future__ import annotations

import re

from ._format import ToolFormat

__all__ = ["GENERIC", "teaches_no_tool_syntax"]

# '{"tool_call": ' + the Hermes-style call object + '}'. The body scanner
# reads the inner object; the trailer the "}".
GENERIC = ToolFormat("generic", '{"tool_call":', "}", "json")

# A template that mentions the tool definitions teaches its own syntax.
_TEMPLATE_TOOLS = re.compile(r"\btools\b")


def teaches_no_tool_syntax(chat_template: str) -> bool:
    """Whether a chat template never mentions tools, so the generic format applies."""
    return _TEMPLATE_TOOLS.search(chat_template) is None
