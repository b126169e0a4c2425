"""Claude Code's billing line, dropped before a prompt is rendered.

Claude Code starts its system prompt with a line such as
``x-anthropic-billing-header: cc_version=2.1.37.abc; cc_entrypoint=cli;
cch=1f2e3;`` (newer versions add ``cc_prev_req=req_...``, and the line is not
always the first). ``cch`` changes on every request, so a prompt that keeps
it diverges from the previous turn's within its first few dozen tokens and
the whole conversation is prefilled again: turn 2 of a 1,748-token
conversation read 21 tokens from the cache. The line is billing metadata
for Anthropic's servers, never an instruction to the model, so it is taken
out of every system and developer message, whichever protocol carried it
(proxies forward Claude Code's prompt over chat completions too).

Pure functions over chat messages (``ChatRequest.messages`` shapes).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["BILLING_PREFIX", "drop_billing_header"]

BILLING_PREFIX = "x-anthropic-billing-header:"
_LINE = re.compile(r"[ \t]*x-anthropic-billing-header:", re.IGNORECASE)
# The header's attributes continued on a line of their own (the newer
# variant's ``cc_prev_req=req_...; cc_prompt_id=...;``): only ``cc_`` pairs,
# which no instruction line is.
_CONTINUATION = re.compile(r"[ \t]*(?:cc_[a-z_]+=[^;\r\n]*;[ \t]*)+[\r\n]*\Z", re.IGNORECASE)
_ROLES = ("system", "developer")


def _drop_lines(text: str) -> tuple[str, list[str]]:
    """``text`` without its billing lines, and the lines dropped. A line that
    was a paragraph of its own takes one separating blank line with it, so
    ``header\\n\\nrest`` becomes ``rest``, not ``\\nrest``."""
    if BILLING_PREFIX not in text.lower():
        return text, []
    lines = text.splitlines(keepends=True)
    kept: list[str] = []
    dropped: list[str] = []
    skip_blank = False
    in_header = False
    for line in lines:
        if _LINE.match(line) or (in_header and _CONTINUATION.match(line)):
            dropped.append(line.rstrip("\r\n"))
            # A paragraph of its own: at the start, or after a blank line.
            if not in_header:
                skip_blank = not kept or not kept[-1].strip()
            in_header = True
            continue
        in_header = False
        if skip_blank and not line.strip():
            skip_blank = False
            continue
        skip_blank = False
        kept.append(line)
    out = "".join(kept)
    if dropped and not out.strip():
        out = ""
    return out, dropped


def _drop_in_content(content: Any) -> tuple[Any, list[str]]:
    """Content (a string or a list of parts) without billing lines; a text
    part left empty is dropped, other parts are kept as they are."""
    if isinstance(content, str):
        return _drop_lines(content)
    if not isinstance(content, list):
        return content, []
    parts: list[Any] = []
    dropped: list[str] = []
    for part in content:
        text = part.get("text") if isinstance(part, Mapping) else None
        if not isinstance(text, str):
            parts.append(part)
            continue
        new, lines = _drop_lines(text)
        dropped += lines
        if not lines:
            parts.append(part)
        elif new:
            parts.append({**part, "text": new})
    return parts, dropped


def drop_billing_header(
    messages: Sequence[Mapping[str, Any]],
) -> tuple[list[dict[str, Any]], list[str]]:
    """``messages`` without billing lines in their system and developer
    content, and the lines dropped (in order). A message left with no
    content at all is dropped; user and assistant text is never touched
    (a user may quote the line)."""
    out: list[dict[str, Any]] = []
    dropped: list[str] = []
    for message in messages:
        if message.get("role") not in _ROLES:
            out.append(dict(message))
            continue
        content, lines = _drop_in_content(message.get("content"))
        if not lines:
            out.append(dict(message))
            continue
        dropped += lines
        if content == "" or content == []:
            continue
        out.append({**message, "content": content})
    return out, dropped
