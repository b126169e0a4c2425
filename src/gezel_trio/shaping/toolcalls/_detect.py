"""Which markup a chat template teaches: read from the template, never guessed
from what the model writes."""

from __future__ import annotations

from ._format import ToolFormat
from ._gemma import GEMMA4
from ._generic import GENERIC, teaches_no_tool_syntax
from ._glm import GLM
from ._hermes import HERMES
from ._mistral import MISTRAL
from ._qwen_xml import QWEN3_CODER

__all__ = ["detect_format", "resolve_format"]


def detect_format(chat_template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template teaches its model, or None.

    Checked most specific first: GLM's and Qwen3-Coder's templates also
    contain ``<tool_call>``. Mistral's older JSON-list form is not
    supported, so it gives None rather than a wrong guess.
    """
    if not chat_template:
        return None
    t = chat_template
    if "<|tool_call>" in t and "<tool_call|>" in t:
        return GEMMA4
    if "<tool_call>" in t and "<arg_key>" in t:
        return GLM
    if "<tool_call>" in t and "<function=" in t and "<parameter=" in t:
        return QWEN3_CODER
    if "<tool_call>" in t and "<arg_key>" not in t:
        return HERMES
    if "[TOOL_CALLS]" in t and "[ARGS]" in t:
        return MISTRAL
    return None


def resolve_format(chat_template: str | None) -> ToolFormat | None:
    """:func:`detect_format`, or :data:`GENERIC` for a template that has no
    tool syntax at all; None for no template, or an unsupported family."""
    found = detect_format(chat_template)
    if found is None and chat_template and teaches_no_tool_syntax(chat_template):
        return GENERIC
    return found
