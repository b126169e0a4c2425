"""OpenAI's reasoning effort, as chat completions (``reasoning_effort``)
and Responses (``reasoning.effort``) both take it: one fold into the chat
template's kwargs and one thinking budget."""

from __future__ import annotations

from typing import Any, Literal

__all__ = [
    "REASONING_EFFORT",
    "ReasoningEffort",
    "effort_template_kwargs",
    "effort_thinking_budget",
]

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
# reasoning_effort -> (thinking on, thinking budget in tokens; None: unbounded).
REASONING_EFFORT: dict[str, tuple[bool, int | None]] = {
    "none": (False, None),
    "minimal": (False, None),
    "low": (True, 512),
    "medium": (True, 2048),
    "high": (True, None),
    "xhigh": (True, None),
}


def effort_template_kwargs(
    chat_template_kwargs: dict[str, Any] | None, effort: str | None
) -> dict[str, Any]:
    """Template kwargs with a reasoning effort folded in: it switches
    thinking (unless the kwargs say otherwise) and is passed on for
    templates that read it (chat's ``reasoning_effort``, Responses'
    ``reasoning.effort``)."""
    kwargs = dict(chat_template_kwargs or {})
    if effort is not None:
        thinking, _ = REASONING_EFFORT[effort]
        kwargs.setdefault("enable_thinking", thinking)
        kwargs.setdefault("reasoning_effort", effort)
    return kwargs


def effort_thinking_budget(max_thinking_tokens: int | None, effort: str | None) -> int | None:
    """An explicit thinking budget, else what the effort implies."""
    if max_thinking_tokens is not None or effort is None:
        return max_thinking_tokens
    return REASONING_EFFORT[effort][1]
