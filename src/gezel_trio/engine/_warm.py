"""Cache warming: build a named prompt-cache entry before any turn needs it.

A history that ends awaiting the assistant (a user or tool turn) is the next
prompt itself and is warmed as it is. Otherwise the entry is cut where two
different synthetic user turns appended to the history render differently:
every real next turn shares the tokens before that cut, whatever the
template puts around a user message. The entry is built by one decode step
at background priority, so warming yields to a person who is waiting.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, Literal, Protocol

import attrs

from ..core.cache_plan import common_prefix
from ..core.config import EngineConfig
from ..core.errors import InvalidRequest
from ..core.events import Failed, Finished
from ..core.prepare import roster_fingerprint
from ..core.request import CacheRequest, GenerationRequest, RenderedPrompt, SamplingParams
from ..host.exchange import CacheInspect
from ._handle import RequestHandle
from ._link import CacheWarmed, HostLink

__all__ = ["Warmed", "Warming", "warm"]

# Two different synthetic user turns: where their renders diverge is a cut
# that any real next turn shares too.
_SYNTHETIC_USERS = ("Hello.", "What can you help me with today?")


@attrs.frozen
class Warmed:
    """How a warm ended. ``warmed``: the entry holds ``tokens`` tokens
    (``persisted``: written to disk at once). ``skipped``: nothing changed,
    ``tokens`` is what the entry held before, ``reason`` says why and
    ``code`` names it as the seed did (``in-flight``, ``roster-mismatch``)."""

    status: Literal["warmed", "skipped"]
    cache_id: str
    tokens: int
    persisted: bool = False
    reason: str | None = None
    code: str | None = None


class Warming(Protocol):
    """What warming uses of the engine (``Engine`` is one), so that this
    module, which the engine imports, imports nothing of it."""

    config: EngineConfig
    link: HostLink

    async def render_chat(
        self, messages: Sequence[dict[str, Any]], **options: Any
    ) -> RenderedPrompt: ...

    def submit_nowait(self, request: GenerationRequest, n: int = 1) -> RequestHandle: ...

    def cache_ids_in_use(self) -> set[str]: ...


async def warm(
    engine: Warming,
    messages: Sequence[Mapping[str, Any]],
    *,
    cache_id: str,
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    template_override: str | None = None,
    persist: bool = False,
    salt: str = "",
) -> Warmed:
    """Warm the entry ``cache_id`` with ``messages`` (text only), in the
    cache's ``salt`` partition (``CacheRequest.salt``). Raises
    ``InvalidRequest`` when nothing in them is shared by a next turn.
    Cancellation withdraws the warming request; the cache keeps what it
    computed."""
    if not messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    tool_list = [dict(t) for t in tools] if tools else None
    roster = roster_fingerprint(tool_list)
    found = await engine.link.call(CacheInspect(cache_id))
    prior = found.tokens or 0
    if found.pinned or cache_id in engine.cache_ids_in_use():
        return Warmed(
            "skipped", cache_id, prior, reason="in use by a live request", code="in-flight"
        )
    if found.tokens is not None and found.roster != roster:
        return Warmed(
            "skipped",
            cache_id,
            prior,
            reason="the saved entry was built with a different tool roster",
            code="roster-mismatch",
        )
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list) and any(
            isinstance(part, Mapping) and part.get("type") == "image" for part in content
        ):
            raise InvalidRequest(
                "cache warming takes text only; a request with images is cached as it runs",
                param=f"messages[{i}].content",
            )
    base = [dict(m) for m in messages]

    def render(extra: list[dict[str, Any]]) -> Awaitable[RenderedPrompt]:
        return engine.render_chat(
            [*base, *extra],
            tools=tool_list,
            template_kwargs=dict(template_kwargs or {}),
            template_override=template_override,
        )

    cut: int | None
    if base[-1].get("role") in ("user", "tool"):
        # Appending a synthetic user turn here would break alternation
        # (templates that enforce it refuse two user turns in a row).
        prompt, cut = (await render([])).tokens, None
    else:
        renders = [await render([{"role": "user", "content": text}]) for text in _SYNTHETIC_USERS]
        prompt = renders[0].tokens
        cut = common_prefix(prompt, renders[1].tokens)
        if cut < 1:
            raise InvalidRequest(
                "nothing in these messages is shared by a next turn", param="messages"
            )
    request = GenerationRequest(
        prompt=prompt,
        max_tokens=1,
        sampling=SamplingParams(temperature=0.0),
        priority="background",
        cache=CacheRequest(
            cache_id=cache_id, snapshot_at=cut, persist=persist, roster=roster, salt=salt
        ),
    )
    with engine.submit_nowait(request) as handle:
        async for _, event in handle:
            match event:
                case Finished():
                    tokens = len(prompt) if cut is None else cut
                    persisted = persist and engine.config.cache.persist_dir is not None
                    engine.link.note_nowait(
                        handle.rids[0], cache_id, CacheWarmed(tokens, prior, persisted)
                    )
                    return Warmed("warmed", cache_id, tokens, persisted=persisted)
                case Failed(error=error):
                    raise error
    raise InvalidRequest("the warm request ended without a result")  # pragma: no cover
