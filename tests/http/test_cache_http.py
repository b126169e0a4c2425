"""Cache endpoints on a real hypercorn socket in this Trio run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx2 as httpx
import trio

from tests.support.inprocess import raw_stream, read_content_frames, served, served_scripted

HANG = 120
SYSTEM = "You are the archivist. You answer from the archive and cite shelf numbers. " * 4
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "shelf", "parameters": {"type": "object"}}}
]


def gzc_files(root: Path) -> list[Path]:
    return list(root.rglob("*.gzc"))


def chat(cache_id: str, user: str, **extra: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": 3,
        "temperature": 0,
        "cache_id": cache_id,
        "chat_template_kwargs": {"enable_thinking": False},
        **extra,
    }


async def test_warm_then_a_real_turn_reuses_the_warmed_head(any_model: Path) -> None:
    with trio.fail_after(HANG):
        async with served(any_model) as (_engine, url), httpx.AsyncClient(base_url=url) as c:
            warm = await c.post(
                "/v1/cache/warm",
                json={"cache_id": "w", "messages": [{"role": "system", "content": SYSTEM}]},
            )
            assert warm.status_code == 200, warm.text
            body = warm.json()
            assert body["status"] == "warmed"
            head = body["tokens"]
            assert head > 50
            r = await c.post("/v1/chat/completions", json=chat("w", "Where is the map of Oslo?"))
            assert r.json()["usage"]["cached_tokens"] == head
            stats = (await c.get("/v1/cache/stats")).json()
            named = [e for e in stats["data"] if e["kind"] != "anonymous"]
            assert [e["cache_id"] for e in named] == ["w"]
            assert named[0]["bytes"] > 0
            assert stats["totals"]["hits"] == 1


async def test_warm_is_skipped_for_another_tool_roster(dense_model: Path) -> None:
    with trio.fail_after(HANG):
        async with served(dense_model) as (_engine, url), httpx.AsyncClient(base_url=url) as c:
            base = {"cache_id": "r", "messages": [{"role": "system", "content": SYSTEM}]}
            first = (await c.post("/v1/cache/warm", json=base)).json()
            assert first["status"] == "warmed"
            assert (first["warmed"], first["persisted"]) == (True, False)
            again = await c.post("/v1/cache/warm", json={**base, "tools": TOOLS})
            assert again.json() == {
                "status": "skipped",
                "cache_id": "r",
                "reason": "the saved entry was built with a different tool roster",
                # The seed's fields: the entry left as it was.
                "warmed": False,
                "token_count": first["token_count"],
                "persisted": False,
                "skipped": "roster-mismatch",
            }


async def test_warm_is_skipped_while_a_live_request_holds_the_id(dense_model: Path) -> None:
    with trio.fail_after(HANG):
        async with served(dense_model) as (_engine, url), httpx.AsyncClient(base_url=url) as c:
            body = {**chat("busy", "Talk."), "stream": True, "max_tokens": 5000, "ignore_eos": True}
            async with raw_stream(url, body) as stream:
                await read_content_frames(stream, 1)
                r = await c.post(
                    "/v1/cache/warm",
                    json={"cache_id": "busy", "messages": [{"role": "system", "content": SYSTEM}]},
                )
                assert r.json()["status"] == "skipped"
                assert r.json()["skipped"] == "in-flight"


async def test_delete_removes_memory_and_disk(dense_model: Path, tmp_path: Path) -> None:
    with trio.fail_after(HANG):
        async with (
            served(dense_model, persist_dir=tmp_path) as (_engine, url),
            httpx.AsyncClient(base_url=url) as c,
        ):
            await c.post("/v1/chat/completions", json=chat("gone/with_../slashes", "Hello."))
            flushed = (await c.post("/admin/flush?settle_ms=100")).json()
            assert flushed == {"flushed": 1, "settled": True}
            assert len(gzc_files(tmp_path)) == 1
            d = await c.delete("/v1/cache/gone/with_../slashes")
            assert d.json() == {
                "cache_id": "gone/with_../slashes",
                "evicted": True,
                "deleted": True,
                "memory": True,
                "disk": True,
            }
            assert gzc_files(tmp_path) == []
            # Absent: the seed's answer, not an error (DELETE is idempotent).
            again = await c.delete("/v1/cache/gone/with_../slashes")
            assert again.status_code == 200
            assert again.json() == {
                "cache_id": "gone/with_../slashes",
                "evicted": False,
                "deleted": False,
                "memory": False,
                "disk": False,
            }
            r = await c.post("/v1/chat/completions", json=chat("gone/with_../slashes", "Hello."))
            assert r.json()["usage"]["cached_tokens"] == 0


async def test_flush_waits_for_a_cancelled_turn_to_file_its_snapshot(
    dense_model: Path, tmp_path: Path
) -> None:
    with trio.fail_after(HANG):
        async with (
            served(dense_model, persist_dir=tmp_path) as (_engine, url),
            httpx.AsyncClient(base_url=url) as c,
        ):
            body = {**chat("cut", "Talk."), "stream": True, "max_tokens": 5000, "ignore_eos": True}
            async with raw_stream(url, body) as stream:
                await read_content_frames(stream, 2)
            flushed = (await c.post("/admin/flush?settle_ms=5000")).json()
            assert flushed == {"flushed": 1, "settled": True}
            stats = (await c.get("/v1/cache/stats")).json()["data"]
            assert [(e["cache_id"], e["dirty"]) for e in stats] == [("cut", False)]


async def test_cache_request_fields_are_validated() -> None:
    # Refused before any model runs: on the scripted engine.
    with trio.fail_after(HANG):
        async with served_scripted() as (_engine, url), httpx.AsyncClient(base_url=url) as c:
            for bad, param in [
                ({"cache_id": ""}, "cache_id"),
                ({"cache_id": "x" * 5000}, "cache_id"),
                ({"prefix_cache_ids": ["a", 3]}, "prefix_cache_ids[1]"),
                ({"stable_prefix_chars": -1}, "stable_prefix_chars"),
            ]:
                r = await c.post("/v1/chat/completions", json={**chat("ok", "hi"), **bad})
                assert r.status_code == 400
                assert r.json()["error"]["param"] == param
            r = await c.post("/admin/flush?settle_ms=abc")
            assert r.status_code == 400
            r = await c.post("/v1/cache/warm", json={"cache_id": "x", "messages": []})
            assert r.json()["error"]["param"] == "messages"


async def test_stable_prefix_band_is_shared_by_a_sibling_session(any_model: Path) -> None:
    band = SYSTEM
    with trio.fail_after(HANG):
        async with served(any_model) as (_engine, url), httpx.AsyncClient(base_url=url) as c:

            def sibling(cache_id: str, volatile: str) -> dict[str, Any]:
                return {
                    "messages": [
                        {"role": "system", "content": band + volatile},
                        {"role": "user", "content": "Begin."},
                    ],
                    "max_tokens": 2,
                    "temperature": 0,
                    "cache_id": cache_id,
                    "prefix_cache_ids": ["band-1"],
                    "stable_prefix_chars": len(band),
                }

            first = await c.post("/v1/chat/completions", json=sibling("a", "Today is Monday."))
            assert first.json()["usage"]["cached_tokens"] == 0
            second = await c.post("/v1/chat/completions", json=sibling("b", "It rains in Bergen."))
            shared = second.json()["usage"]["cached_tokens"]
            stats = {e["cache_id"]: e for e in (await c.get("/v1/cache/stats")).json()["data"]}
            assert stats["band-1"]["kind"] == "prefix"
            # At least the band (a dense model reuses every shared token).
            assert shared >= stats["band-1"]["tokens"] > 40


async def test_warm_with_persist_writes_to_disk_at_once(dense_model: Path, tmp_path: Path) -> None:
    with trio.fail_after(HANG):
        async with (
            served(dense_model, persist_dir=tmp_path) as (_engine, url),
            httpx.AsyncClient(base_url=url) as c,
        ):
            body = {
                "cache_id": "kept",
                "messages": [{"role": "system", "content": SYSTEM}],
                "persist": True,
            }
            assert (await c.post("/v1/cache/warm", json=body)).json()["status"] == "warmed"
            assert len(gzc_files(tmp_path)) == 1  # no flush needed
