"""Prompt-cache endpoints: stats, delete, warm, flush.

Cache state lives on the engine's host thread; these handlers read the view
the engine publishes after each step, or run a command there between two
steps with ``Engine.host_call``.
"""

from __future__ import annotations

from typing import Any

import trio
from quart import request

from ..core.cache_plan import common_prefix
from ..core.errors import InvalidRequest
from ..core.events import Failed, Finished
from ..core.request import CacheRequest, GenerationRequest, SamplingParams
from ..engine import Engine, roster_fingerprint
from ..host.loop import CacheEvict, CacheFlush, CacheInspect
from .checks import check_cache_id
from .edge import ProtocolBlueprint, error_response, json_body, refusal
from .openai_wire import WarmRequest, parse_warm_request, tool_dicts

__all__ = ["blueprint"]

# Two different synthetic user turns: where their renders diverge is a cut
# that any real next turn shares too, so the warmed entry serves it.
_SYNTHETIC_USERS = ("Hello.", "What can you help me with today?")
MAX_SETTLE_MS = 60_000


def blueprint(engine: Engine) -> ProtocolBlueprint:
    """The prompt-cache routes over ``engine``; errors leave in the OpenAI
    envelope."""
    bp = ProtocolBlueprint("cache_api", __name__, refusal(engine, error_response))

    @bp.route("/v1/cache/stats")
    async def cache_stats() -> dict[str, Any]:
        entries = engine.cache_view
        t = engine.cache_totals
        return {
            "object": "list",
            "data": [
                {
                    "cache_id": e.cache_id,
                    "tokens": e.tokens,
                    "bytes": e.bytes,
                    "kind": e.kind,
                    "last_used": e.last_used,
                    "dirty": e.dirty,
                    "pinned": e.pinned,
                    "hits": e.hits,
                    # The seed sidecar's names for the same values; its
                    # cache controller reads these.
                    "token_count": e.tokens,
                    "est_bytes": e.bytes,
                    "last_used_ts": e.last_used,
                }
                for e in entries
            ],
            # Bytes really held: blocks shared by several entries count once.
            "total_bytes": t.bytes,
            "totals": {
                "entries": t.entries,
                "named_entries": t.named,
                "blocks": t.blocks,
                "bytes": t.bytes,
                "logical_bytes": t.logical_bytes,
                "budget_bytes": t.budget_bytes,
                "disk_entries": t.disk_entries,
                "disk_bytes": t.disk_bytes,
                "lookups": t.lookups,
                "hits": t.hits,
                "hit_rate": round(t.hits / t.lookups, 4) if t.lookups else 0.0,
                "prompt_tokens": t.prompt_tokens,
                "cached_tokens": t.cached_tokens,
                "token_hit_rate": (
                    round(t.cached_tokens / t.prompt_tokens, 4) if t.prompt_tokens else 0.0
                ),
                "evictions": t.evictions,
            },
        }

    @bp.route("/v1/cache/<path:cache_id>", methods=["DELETE"])
    async def cache_delete(cache_id: str) -> dict[str, Any]:
        check_cache_id(cache_id, "cache_id")
        memory, disk = await engine.host_call(CacheEvict(cache_id))
        # An absent id is not an error (the seed's answer, and DELETE is
        # idempotent): a controller evicting an entry our own LRU already
        # dropped gets "evicted": false, not a 404 to handle.
        deleted = memory or disk
        return {
            "cache_id": cache_id,
            "evicted": deleted,
            "deleted": deleted,
            "memory": memory,
            "disk": disk,
        }

    @bp.route("/admin/flush", methods=["POST"])
    async def admin_flush() -> dict[str, Any]:
        raw = request.args.get("settle_ms", "0")
        try:
            settle_ms = int(raw)
        except ValueError:
            raise InvalidRequest("settle_ms must be an integer", param="settle_ms") from None
        if not 0 <= settle_ms <= MAX_SETTLE_MS:
            raise InvalidRequest(f"settle_ms must be in [0, {MAX_SETTLE_MS}]", param="settle_ms")
        settled = True
        if settle_ms:
            settled = False
            with trio.move_on_after(settle_ms / 1000):
                await engine.settle()
                settled = True
        written = await engine.host_call(CacheFlush())
        return {"flushed": written, "settled": settled}

    @bp.route("/v1/cache/warm", methods=["POST"])
    async def cache_warm() -> dict[str, Any]:
        return await _warm(engine, parse_warm_request(await json_body()))

    return bp


def _skipped(cache_id: str, prior: int, seed_reason: str, reason: str) -> dict[str, Any]:
    """A refused warm, in our shape and the seed's (``warmed``,
    ``token_count`` of the entry left as it was, ``skipped``)."""
    return {
        "status": "skipped",
        "cache_id": cache_id,
        "reason": reason,
        "warmed": False,
        "token_count": prior,
        "persisted": False,
        "skipped": seed_reason,
    }


async def _warm(engine: Engine, warm: WarmRequest) -> dict[str, Any]:
    """Build a cache entry through the engine: one decode step at background
    priority. A history that ends awaiting the assistant (a user or tool turn)
    is the next prompt itself and is warmed as it is; otherwise the entry is
    snapshotted where two different synthetic user turns diverge."""
    tools = tool_dicts(warm.tools)
    roster = roster_fingerprint(tools)
    found, pinned = await engine.host_call(CacheInspect(warm.cache_id))
    prior = found[0] if found is not None else 0
    if pinned or warm.cache_id in engine.cache_ids_in_use():
        return _skipped(warm.cache_id, prior, "in-flight", "in use by a live request")
    if found is not None and found[1] != roster:
        return _skipped(
            warm.cache_id,
            prior,
            "roster-mismatch",
            "the saved entry was built with a different tool roster",
        )
    for i, m in enumerate(warm.messages):
        if m.has_images():
            raise InvalidRequest(
                "cache warming takes text only; a request with images is cached as it runs",
                param=f"messages[{i}].content",
            )
    base = [m.to_template() for m in warm.messages]
    cut: int | None
    if warm.messages[-1].role in ("user", "tool"):
        # Appending a synthetic user turn here would break alternation
        # (templates that enforce it refuse two user turns in a row).
        rendered = await engine.render_chat(
            base,
            tools=tools,
            template_kwargs=warm.chat_template_kwargs,
            template_override=warm.chat_template_override,
        )
        prompt, cut = rendered.tokens, None
    else:
        renders = [
            await engine.render_chat(
                [*base, {"role": "user", "content": text}],
                tools=tools,
                template_kwargs=warm.chat_template_kwargs,
                template_override=warm.chat_template_override,
            )
            for text in _SYNTHETIC_USERS
        ]
        prompt = renders[0].tokens
        cut = common_prefix(prompt, renders[1].tokens)
        if cut < 1:
            raise InvalidRequest(
                "nothing in these messages is shared by a next turn", param="messages"
            )
    gen = GenerationRequest(
        prompt=prompt,
        max_tokens=1,
        sampling=SamplingParams(temperature=0.0),
        priority="background",
        cache=CacheRequest(
            cache_id=warm.cache_id, snapshot_at=cut, persist=warm.persist, roster=roster
        ),
    )
    with engine.submit_nowait(gen) as handle:
        async for event in handle:
            match event:
                case Finished():
                    tokens = len(prompt) if cut is None else cut
                    return {
                        "status": "warmed",
                        "cache_id": warm.cache_id,
                        "tokens": tokens,
                        # The seed's fields. persisted: written to disk at
                        # once (asked for, and a --persist-dir is set).
                        "warmed": True,
                        "token_count": tokens,
                        "persisted": warm.persist and engine.config.persist_dir is not None,
                    }
                case Failed(error=error):
                    raise error
    raise InvalidRequest("the warm request ended without a result")  # pragma: no cover
