"""Prompt-cache endpoints: stats, delete, warm, flush.

Cache state lives on the engine's host thread; these handlers read the view
the engine publishes after each step, or ask the engine for an operation
(``evict``, ``flush``, ``warm``) that runs there between two steps.

Each tenant (``http.tenancy``) sees and acts on its own entries only: its
names are namespaced on the way to the engine and stripped on the way back,
and stats list the entries of its names and salts. The entry counts in
``totals`` are the caller's; bytes, the budget, the disk and the hit
counters are the process's, as the budget is shared by every tenant.
"""

from __future__ import annotations

from typing import Any

import trio
from quart import Response, request

from ..core.errors import InvalidRequest
from ..engine import CacheView, Engine
from .checks import check_cache_id
from .edge import ProtocolBlueprint, error_response, json_body, refusal
from .openai_wire import WarmRequest, parse_warm_request, tool_dicts
from .strict import dump_json
from .tenancy import Tenant, current_tenant

__all__ = ["blueprint"]

MAX_SETTLE_MS = 60_000


def blueprint(engine: Engine, *, stats_format: str = "object") -> ProtocolBlueprint:
    """The prompt-cache routes over ``engine``; errors leave in the OpenAI
    envelope. ``stats_format``: ``/v1/cache/stats`` as our object, or as the
    seed sidecar's array of named entries."""
    bp = ProtocolBlueprint("cache_api", __name__, refusal(engine, error_response))

    @bp.route("/v1/cache/stats")
    async def cache_stats() -> Response:
        entries = _own(current_tenant(), engine.cache_view)
        if stats_format == "array":
            # The seed listed its named entries only: every one a session or
            # prefix its client had named, and the client's controller sums
            # their bytes against its budget and evicts by id. Anonymous
            # entries are bounded by the engine's own budget.
            named = [_entry(e, name) for e, name in entries if e.named]
            return Response(dump_json(named), mimetype="application/json")
        t = engine.cache_totals
        body = {
            "object": "list",
            "data": [_entry(e, name) for e, name in entries],
            # Bytes really held: blocks shared by several entries count once.
            "total_bytes": t.bytes,
            "totals": {
                "entries": len(entries),
                "named_entries": sum(1 for e, _ in entries if e.named),
                "blocks": t.blocks,
                "bytes": t.bytes,
                "logical_bytes": sum(e.bytes for e, _ in entries),
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
        return Response(dump_json(body), mimetype="application/json")

    @bp.route("/v1/cache/<path:cache_id>", methods=["DELETE"])
    async def cache_delete(cache_id: str) -> dict[str, Any]:
        check_cache_id(cache_id, "cache_id")
        tenant = current_tenant()
        name = tenant.name(cache_id)
        if tenant.id and cache_id.startswith("anon:"):
            # An anonymous entry's id is its content's: with keys, only the
            # tenant whose stats list it may drop it.
            listed = {n for _, n in _own(tenant, engine.cache_view)}
            name = cache_id if cache_id in listed else None
        memory = disk = False
        if name is not None:
            evicted = await engine.evict(name)
            memory, disk = evicted.memory, evicted.disk
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
        written = await engine.flush()
        return {"flushed": written, "settled": settled}

    @bp.route("/v1/cache/warm", methods=["POST"])
    async def cache_warm() -> dict[str, Any]:
        return await _warm(engine, await json_body(parse_warm_request))

    return bp


def _own(tenant: Tenant, view: tuple[CacheView, ...]) -> list[tuple[CacheView, str]]:
    """The entries of ``tenant``'s names and salts, each with its id as the
    tenant writes it."""
    out = []
    for e in view:
        if not e.named:
            if tenant.owns_salt(e.salt):
                out.append((e, e.cache_id))
        elif (name := tenant.own(e.cache_id)) is not None:
            out.append((e, name))
    return out


def _entry(e: CacheView, cache_id: str) -> dict[str, Any]:
    """One entry of ``/v1/cache/stats``, listed as ``cache_id``."""
    return {
        "cache_id": cache_id,
        "tokens": e.tokens,
        "bytes": e.bytes,
        "kind": e.kind,
        "last_used": e.last_used,
        "dirty": e.dirty,
        "pinned": e.pinned,
        "hits": e.hits,
        # Anthropic ``cache_control`` pins: kind "pin", and the seconds left
        # before eviction may take the entry again.
        "pin_expires_in": e.pin_expires_in,
        # The seed sidecar's names for the same values; its cache controller
        # reads these.
        "token_count": e.tokens,
        "est_bytes": e.bytes,
        "last_used_ts": e.last_used,
    }


async def _warm(engine: Engine, warm: WarmRequest) -> dict[str, Any]:
    """``Engine.warm``, in our shape and the seed's (``warmed``,
    ``token_count``, ``persisted``; a refusal's ``skipped`` reason), in the
    caller's namespace and salt."""
    tenant = current_tenant()
    done = await engine.warm(
        [m.to_template() for m in warm.messages],
        cache_id=tenant.name(warm.cache_id),
        tools=tool_dicts(warm.tools),
        template_kwargs=warm.chat_template_kwargs,
        template_override=warm.chat_template_override,
        persist=warm.persist,
        salt=tenant.salt(warm.cache_salt),
    )
    if done.status == "skipped":
        return {
            "status": "skipped",
            "cache_id": warm.cache_id,
            "reason": done.reason,
            "warmed": False,
            "token_count": done.tokens,
            "persisted": False,
            "skipped": done.code,
        }
    return {
        "status": "warmed",
        "cache_id": warm.cache_id,
        "tokens": done.tokens,
        "warmed": True,
        "token_count": done.tokens,
        "persisted": done.persisted,
    }
