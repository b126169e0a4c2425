"""Rendering a conversation into prompt tokens with the model's chat template.

Plain Python over the Hugging Face tokenizer (no MLX), so it runs on a worker
thread beside the event loop, never on the engine's host thread.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

import attrs

from .errors import InvalidRequest

__all__ = ["ChatTemplateRenderer", "RenderedPrompt"]


@attrs.frozen
class RenderedPrompt:
    """Prompt tokens, and where the shared band ends in them (the first
    ``band_chars`` characters of the system message), when asked for."""

    tokens: tuple[int, ...]
    band_end: int | None = None


def _prepare_message(message: dict[str, Any]) -> dict[str, Any]:
    """Templates index into ``arguments``; OpenAI clients send it as a JSON
    string, so parse it to a mapping (left as-is when it is not JSON)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    prepared = []
    for call in calls:
        fn = dict(call.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            with contextlib.suppress(json.JSONDecodeError):
                fn["arguments"] = json.loads(args) if args.strip() else {}
        prepared.append({**call, "function": fn})
    return {**message, "tool_calls": prepared}


class ChatTemplateRenderer:
    """Implements ``backend.PromptRenderer`` over a tokenizer with a chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None,
        template_kwargs: dict[str, Any],
        template_override: str | None,
        band_chars: int | None = None,
    ) -> RenderedPrompt:
        kwargs: dict[str, Any] = {"enable_thinking": True, **template_kwargs}
        if template_override is not None:
            kwargs["chat_template"] = template_override
        elif not getattr(self._tokenizer, "chat_template", None):
            raise InvalidRequest(
                "this model has no chat template; send chat_template_override",
                param="chat_template_override",
            )
        try:
            text = self._tokenizer.apply_chat_template(
                [_prepare_message(m) for m in messages],
                tools=list(tools) if tools else None,
                add_generation_prompt=True,
                tokenize=False,
                **kwargs,
            )
        except Exception as exc:  # jinja2 and transformers raise assorted types
            raise InvalidRequest(
                f"the chat template could not render these messages: {type(exc).__name__}: {exc}",
                param="messages",
            ) from exc
        if not isinstance(text, str):
            raise InvalidRequest("the chat template did not produce text", param="messages")
        if not band_chars:
            ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False)
            return RenderedPrompt(tuple(ids))
        return self._with_band(text, messages, band_chars)

    def _with_band(
        self, text: str, messages: Sequence[dict[str, Any]], band_chars: int
    ) -> RenderedPrompt:
        """Locate the band's end as a token index: the number of tokens that
        end at or before the band's last character in the rendered text."""
        hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
        enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = tuple(enc["input_ids"])
        system = next((m for m in messages if m.get("role") in ("system", "developer")), None)
        content = system.get("content") if system else None
        if not isinstance(content, str) or not content:
            return RenderedPrompt(ids)
        band = content[:band_chars]
        start = text.find(band)
        if start < 0:
            return RenderedPrompt(ids)
        end_char = start + len(band)
        band_end = sum(1 for _, stop in enc["offset_mapping"] if stop <= end_char)
        return RenderedPrompt(ids, band_end)
