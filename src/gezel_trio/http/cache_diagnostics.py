"""Anthropic's cache diagnostics on ``/v1/messages``.

A request that sends ``diagnostics`` (``{"previous_message_id": "msg_..."}``,
or ``null`` on a conversation's first turn to opt in; the beta header
``anthropic-beta: cache-diagnosis-2026-04-07`` is accepted and not needed)
leaves a fingerprint under its response id, and gets back
``diagnostics.cache_miss_reason`` when its prompt does not extend the one of
the request it names: the first place, in the order the prompt is built
(model, tools, system, messages), where the two differ.

A fingerprint holds digests and token estimates only, never text, as
Anthropic's does: the model name, the tools, the system prompt, each
message, and the other fields that change the rendered prompt (thinking,
tool choice). The comparison is of the conversation as this server renders
it (after the Messages shapes are mapped onto the chat template's roles),
so what it says is what changed the prompt the cache saw: what the engine
takes out of every prompt before rendering (Claude Code's billing line,
``shaping.billing_header``, new on every request) is taken out here too,
unless the server keeps it (``--keep-billing-header``). The store is
bounded (``FingerprintStore.limit``, oldest first out) and lives with the
app; a fingerprint that was dropped, or one from before a restart, is
``previous_message_not_found``.

``cache_missed_input_tokens`` is the previous prompt's length less the
tokens before the first difference: what that prompt would have let this
one read from the cache. Per-part token counts are the rendered prompt's
length shared out by each part's characters (an estimate, as Anthropic's).
``usage.cache_miss`` (docs/protocols.md) says where the prompt left the
cache at the token; this says which part of the request moved it.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import attrs

from ..core.events import CacheMiss
from ..core.prepare import ChatRequest
from ..shaping.billing_header import drop_billing_header

__all__ = ["Fingerprint", "FingerprintStore", "fingerprint", "system_block"]


@attrs.frozen
class Fingerprint:
    """Digests of one request's parts and the tokens each part ends at
    (cumulative estimates, in prompt order: tools, system, each message)."""

    model: str
    tools: str
    system: str
    messages: tuple[str, ...]
    other: str
    ends: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return self.ends[-1] if self.ends else 0


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _chars(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, default=str)) if value else 0


def fingerprint(
    model: str, chat: ChatRequest, prompt_tokens: int, *, keep_billing_header: bool = False
) -> Fingerprint:
    """The fingerprint of ``chat`` as rendered for ``model`` into
    ``prompt_tokens`` tokens."""
    messages = [dict(m) for m in chat.messages]
    if not keep_billing_header:
        messages, _ = drop_billing_header(messages)
    n_system = 0
    while n_system < len(messages) and messages[n_system].get("role") in ("system", "developer"):
        n_system += 1
    system, rest = messages[:n_system], messages[n_system:]
    tools = [dict(t) for t in chat.tools] if chat.tools else None
    sizes = [_chars(tools), _chars(system), *(_chars(m) for m in rest)]
    total = sum(sizes) or 1
    ends, seen = [], 0
    for size in sizes:
        seen += size
        ends.append(round(prompt_tokens * seen / total))
    other = _digest(
        {
            "tool_choice": chat.tool_choice,
            "template_kwargs": dict(chat.template_kwargs),
            "response_format": chat.response_format,
        }
    )
    return Fingerprint(
        model=model,
        tools=_digest(tools),
        system=_digest(system),
        messages=tuple(_digest(m) for m in rest),
        other=other,
        ends=tuple(ends),
    )


def _missed(previous: Fingerprint, part: int) -> int:
    """Tokens of ``previous`` from its part ``part`` on."""
    before = previous.ends[part - 1] if part > 0 else 0
    return max(0, previous.tokens - before)


def compare(previous: Fingerprint, current: Fingerprint) -> dict[str, Any] | None:
    """The ``cache_miss_reason`` of ``current`` against ``previous``, or
    ``None`` when ``current`` extends it (only appended messages)."""
    if previous.model != current.model:
        return {"type": "model_changed", "cache_missed_input_tokens": previous.tokens}
    if previous.tools != current.tools:
        return {"type": "tools_changed", "cache_missed_input_tokens": _missed(previous, 0)}
    if previous.system != current.system:
        return {"type": "system_changed", "cache_missed_input_tokens": _missed(previous, 1)}
    old, new = previous.messages, current.messages
    for i, digest in enumerate(old):
        if i >= len(new) or new[i] != digest:
            return {
                "type": "messages_changed",
                "cache_missed_input_tokens": _missed(previous, 2 + i),
            }
    if previous.other != current.other:
        return {"type": "unavailable"}
    return None


def system_block(blocks: Sequence[str], miss: CacheMiss | None) -> int | None:
    """Which of the request's ``system`` text blocks a cache miss in the
    system message falls in: the block that holds the text just before the
    divergence and as much as can be of what follows it, or the block that
    starts with what follows (a divergence at a block's first character).
    ``None`` when the miss is elsewhere or the text is not found (a
    template that rewrote it, a character split between tokens)."""
    if miss is None or miss.role != "system" or miss.message != 0 or not blocks:
        return None
    before, after = miss.common[-16:], miss.prompt[:16]
    for cut in range(len(after), -1, -1):
        needle = before + after[:cut]
        if not needle:
            break
        for i, text in enumerate(blocks):
            if needle in text:
                return i
    for cut in range(len(after), 3, -1):
        for i, text in enumerate(blocks):
            if text.startswith(after[:cut]):
                return i
    return None


class FingerprintStore:
    """Fingerprints by response id, the ``limit`` most recent."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._prints: OrderedDict[str, Fingerprint] = OrderedDict()

    def __len__(self) -> int:
        return len(self._prints)

    def remember(self, message_id: str, print_: Fingerprint) -> None:
        self._prints[message_id] = print_
        while len(self._prints) > self.limit:
            self._prints.popitem(last=False)

    def diagnose(
        self, message_id: str, previous_id: str | None, current: Fingerprint
    ) -> dict[str, Any] | None:
        """The response's ``diagnostics`` for a request that sent
        ``diagnostics.previous_message_id`` (``previous_id``) and will answer
        as ``message_id``: ``None`` when there is nothing to compare (the
        first turn) or nothing changed; the fingerprint is kept either way."""
        out: dict[str, Any] | None = None
        if previous_id is not None:
            previous = self._prints.get(previous_id)
            reason = (
                {"type": "previous_message_not_found"}
                if previous is None
                else compare(previous, current)
            )
            out = None if reason is None else {"cache_miss_reason": reason}
        self.remember(message_id, current)
        return out
