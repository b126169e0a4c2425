"""Preparation on worker threads: a chat into a checked ``PreparedChat``.

Rendering with the chat template, tokenizing, decoding images and
compiling grammars are CPU work in plain Python (tokenizers, Pillow,
llguidance), never MLX: each runs in ``trio.to_thread.run_sync``, never on
the Trio thread nor on the MLX host thread. The checks against the model
are the pure ``core.prepare``. Cancelling any of these discards the work
(it finishes in its thread) and queues nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import attrs
import trio

from ..core.config import EngineConfig
from ..core.constraint import Constraint
from ..core.errors import InvalidRequest
from ..core.images import VisionPrompt
from ..core.prepare import (
    ChatRequest,
    PreparedChat,
    bound_max_tokens,
    check_n,
    prepare,
    wants_constraint,
)
from ..core.request import RenderedPrompt
from ..shaping.billing_header import drop_billing_header
from ..shaping.replies import ReplyLedger, ReplySeal
from ._images import prepare_vision
from ._link import Loaded
from ._metrics import EngineMetrics

log = logging.getLogger("gezel_trio.prepare")

__all__ = ["Preparer"]


@attrs.frozen
class Preparer:
    """The loaded model's renderer, compiler and image processor, used from
    worker threads."""

    loaded: Loaded
    config: EngineConfig
    metrics: EngineMetrics | None = None
    # The replies this engine generated, reused when a history carries them.
    replies: ReplyLedger | None = None
    # The key clients' sealed blobs are signed with (``shaping.replies``).
    seal: ReplySeal | None = None

    async def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        template_override: str | None = None,
        band_chars: int | None = None,
        pins: Sequence[int] = (),
    ) -> RenderedPrompt:
        renderer = self.loaded.renderer
        kwargs = dict(template_kwargs or {})
        if self.config.shaping.think_by_default:
            kwargs.setdefault("enable_thinking", True)
        messages, pins = self._without_billing_header(messages, pins)
        extra = {"pins": tuple(pins)} if pins else {}
        replies = self.replies
        return await trio.to_thread.run_sync(
            lambda: renderer.render(
                messages,
                tools=tools,
                template_kwargs=kwargs,
                template_override=template_override,
                band_chars=band_chars,
                **extra,
                replies=replies,
            )
        )

    def _without_billing_header(
        self, messages: Sequence[dict[str, Any]], pins: Sequence[int]
    ) -> tuple[Sequence[dict[str, Any]], Sequence[int]]:
        """Every rendered conversation (chat, count_tokens, tokenize, cache
        warming) loses Claude Code's per-request billing line, so what is
        counted or warmed is what runs. ``pins`` (message indices) follow
        their messages when a message that held only the line goes."""
        if self.config.shaping.keep_billing_header:
            return messages, pins
        kept, dropped = drop_billing_header(messages)
        if not dropped:
            return messages, pins
        log.debug("dropped %d billing-header line(s): %r", len(dropped), dropped)
        if self.metrics is not None:
            self.metrics.billing_lines.inc(len(dropped))
        if pins and len(kept) != len(messages):
            # Where each message now stands: a dropped one pins its predecessor.
            gone = [not drop_billing_header([m])[0] for m in messages]
            at = [i - sum(gone[: i + 1]) for i in range(len(messages))]
            # Out of range (-1) stays in its place: pins align with the request's.
            pins = [at[i] if 0 <= i < len(at) else -1 for i in pins]
        return kept, pins

    async def compile_constraint(
        self,
        *,
        response_format: Any = None,
        tools: Any = None,
        tool_choice: Any = None,
        tool_grammar: Any = None,
        custom_tools: Any = None,
    ) -> Constraint | None:
        if not wants_constraint(response_format, tool_choice, tool_grammar):
            return None
        compiler = self.loaded.compiler
        if compiler is None:
            raise InvalidRequest("this model cannot constrain decoding", param="response_format")
        # Only when there are custom tools, so compilers without the keyword still serve.
        extra = {"custom_tools": custom_tools} if custom_tools else {}
        result: Constraint | None = await trio.to_thread.run_sync(
            lambda: compiler.compile(
                response_format=response_format,
                tools=tools,
                tool_choice=tool_choice,
                tool_grammar=tool_grammar,
                **extra,
            )
        )
        return result

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> tuple[int, ...]:
        renderer = self.loaded.renderer
        return await trio.to_thread.run_sync(
            lambda: renderer.encode(text, add_special_tokens=add_special_tokens)
        )

    def _check_ids(self, tokens: Sequence[int]) -> list[int]:
        vocab = self.loaded.info.vocab_size
        if vocab and not all(0 <= t < vocab for t in tokens):
            raise InvalidRequest(f"token ids must be in [0, {vocab})", param="tokens")
        return list(tokens)

    async def detokenize(self, tokens: Sequence[int]) -> str:
        ids = self._check_ids(tokens)
        renderer = self.loaded.renderer
        return await trio.to_thread.run_sync(lambda: renderer.decode(ids))

    async def token_texts(self, tokens: Sequence[int]) -> tuple[str, ...]:
        ids = self._check_ids(tokens)
        renderer = self.loaded.renderer
        return await trio.to_thread.run_sync(lambda: tuple(renderer.decode([t]) for t in ids))

    async def render(self, chat: ChatRequest) -> tuple[RenderedPrompt, VisionPrompt | None]:
        """``chat``'s prompt: rendered with the template (or a raw prompt,
        tokenized as it is), its images decoded and placed."""
        if chat.prompt is not None:
            rendered = await self._raw_prompt(chat)
        else:
            rendered = await self.render_chat(
                [dict(m) for m in chat.messages],
                tools=[dict(t) for t in chat.tools] if chat.tools else None,
                template_kwargs=dict(chat.template_kwargs),
                template_override=chat.template_override,
                band_chars=chat.stable_prefix_chars,
                pins=[p.message for p in chat.pins],
            )
        if not chat.images:
            return rendered, None
        preparer = self.loaded.images
        if preparer is None:
            raise InvalidRequest(
                f"the model {self.loaded.info.model_id} takes no images (it is text-only)",
                param=chat.images[0].param,
            )
        limits = self.config.images
        parts = tuple(chat.images)
        return await trio.to_thread.run_sync(
            lambda: prepare_vision(rendered, parts, preparer, limits)
        )

    async def prepare(self, chat: ChatRequest) -> PreparedChat:
        """Render, bound by the context window, compile and check ``chat``;
        raises ``InvalidRequest`` naming the field."""
        check_n(self.config.scheduling, chat.n)
        rendered, vision = await self.render(chat)
        info = self.loaded.info
        max_tokens = bound_max_tokens(
            info, self.config.requests, len(rendered.tokens), chat.max_tokens
        )
        constraint = await self.compile_constraint(
            response_format=dict(chat.response_format) if chat.response_format else None,
            tools=[dict(t) for t in chat.tools] if chat.tools else None,
            tool_choice=chat.tool_choice,
            tool_grammar=dict(chat.tool_grammar) if chat.tool_grammar else None,
            custom_tools=dict(chat.custom_tools) or None,
        )
        return prepare(
            chat,
            rendered,
            max_tokens=max_tokens,
            vision=vision,
            constraint=constraint,
            info=info,
            config=self.config,
            image_token=self.image_token,
        )

    @property
    def image_token(self) -> int | None:
        images = self.loaded.images
        return images.image_token if images is not None else None

    async def _raw_prompt(self, chat: ChatRequest) -> RenderedPrompt:
        """A legacy completion's prompt: text tokenized without a chat
        template, or token ids as given (checked against the vocabulary)."""
        if chat.messages:
            raise InvalidRequest("send messages or a prompt, not both", param="prompt")
        if isinstance(chat.prompt, str):
            return RenderedPrompt(await self.tokenize(chat.prompt))
        assert chat.prompt is not None
        return RenderedPrompt(tuple(chat.prompt))
