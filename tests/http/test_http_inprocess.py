"""The HTTP app on a real hypercorn socket, in this Trio run, so a test can
watch the engine's state while a client misbehaves."""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from pathlib import Path

import httpx2 as httpx
import trio

from gezel_trio.http.app import HttpSettings
from tests.support.inprocess import raw_stream, read_content_frames, served, served_scripted

HANG = 60


BODY = {
    "messages": [{"role": "user", "content": "Tell me everything."}],
    "stream": True,
    "max_tokens": 20_000,
    "ignore_eos": True,
    "temperature": 0,
    "chat_template_kwargs": {"enable_thinking": False},
}


async def test_client_disconnect_mid_stream_frees_the_slot_within_one_step(
    any_model: Path,
) -> None:
    with trio.fail_after(HANG):
        async with served(any_model) as (engine, url), httpx.AsyncClient(base_url=url) as client:
            async with raw_stream(url, BODY) as stream:
                await read_content_frames(stream, 3)
                rid = engine.state().running[0]
            # Leaving the block closed the connection mid-stream.
            state = await engine.wait_until(lambda s: any(r.rid == rid for r in s.recent_removals))
            removal = next(r for r in state.recent_removals if r.rid == rid)
            assert removal.removed_at_step - removal.withdrawn_at_step <= 1
            await engine.wait_until(lambda s: s.running == () and s.live == 0)
            # The server keeps serving.
            r = await client.post(
                "/v1/chat/completions", json={**BODY, "stream": False, "max_tokens": 3}
            )
            assert r.status_code == 200
            assert r.json()["usage"]["completion_tokens"] == 3


async def test_health_answers_while_a_stream_runs(dense_model: Path) -> None:
    with trio.fail_after(HANG):
        async with served(dense_model) as (_engine, url), httpx.AsyncClient(base_url=url) as client:
            async with raw_stream(url, BODY) as stream:
                await read_content_frames(stream, 1)
                health = (await client.get("/health")).json()
                assert health["status"] == "ok"
                assert health["running"] == 1


async def test_queue_overflow_is_429_with_retry_after(dense_model: Path) -> None:
    with trio.fail_after(HANG):
        async with (
            served(dense_model, max_concurrency=1, max_queue=0) as (_engine, url),
            httpx.AsyncClient(base_url=url) as client,
        ):
            async with raw_stream(url, BODY) as stream:
                await read_content_frames(stream, 1)
                r = await client.post("/v1/chat/completions", json=BODY)
                assert r.status_code == 429
                assert r.headers["Retry-After"] == "1"
                assert r.json()["error"]["code"] == "queue_full"


async def test_api_key_guards_every_route_but_health() -> None:
    with trio.fail_after(HANG):
        settings = HttpSettings(api_key="s3cret")
        async with (
            served_scripted(settings) as (_engine, url),
            httpx.AsyncClient(base_url=url) as client,
        ):
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/v1/models")).status_code == 401
            wrong = {"Authorization": "Bearer nope"}
            assert (await client.get("/v1/cache/stats", headers=wrong)).status_code == 401
            right = {"Authorization": "Bearer s3cret"}
            assert (await client.get("/v1/models", headers=right)).status_code == 200


async def test_foreign_host_header_is_refused_on_loopback() -> None:
    # Refused before any model runs: on the scripted engine.
    with trio.fail_after(HANG):
        async with served_scripted() as (_engine, url), httpx.AsyncClient(base_url=url) as c:
            r = await c.get("/v1/models", headers={"Host": "evil.example:8080"})
            assert r.status_code == 403
            assert (await c.get("/v1/models", headers={"Host": "localhost:1"})).status_code == 200


async def test_a_queued_messages_stream_shows_its_place_then_starts_at_admission(
    dense_model: Path,
) -> None:
    ask = {
        "model": "demo",
        "max_tokens": 2,
        "stream": True,
        "messages": [{"role": "user", "content": "Which ferry leaves first?"}],
        "thinking": {"type": "disabled"},
    }
    with trio.fail_after(HANG):
        async with (
            served(dense_model, max_concurrency=1) as (_engine, url),
            httpx.AsyncClient(base_url=url, timeout=HANG) as client,
            AsyncExitStack() as stack,
        ):
            running = await stack.enter_async_context(raw_stream(url, BODY))
            await read_content_frames(running, 1)
            r = await stack.enter_async_context(client.stream("POST", "/v1/messages", json=ask))
            lines = r.aiter_lines()
            waiting = []
            async for line in lines:
                if line:
                    waiting.append(line)
                if line.startswith(": queued"):
                    break
            # While it waits, only the SSE comment: no event before message_start.
            assert waiting == [": queued 0"]
            await running.aclose()  # the running client leaves: this one is admitted
            rest = [line async for line in lines if line]
    names = [line[7:] for line in rest if line.startswith("event: ")]
    assert names[0] == "message_start"
    data = [json.loads(line[6:]) for line in rest if line.startswith("data: ")]
    start = data[0]["message"]["usage"]
    (end,) = [d["usage"] for d in data if d["type"] == "message_delta"]
    for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
        assert start[key] == end[key]
    assert start["output_tokens"] == 0
