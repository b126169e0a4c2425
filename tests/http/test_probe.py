"""``/health`` answered at the ASGI edge (``http.probe``): a plain probe
never reaches Quart, and gets what Quart would have answered; every other
``/health`` request (a browser's, one with a body, a refused host) goes
through the app and its checks.

Over a real hypercorn socket on the scripted backend, and at the ASGI
level where the app underneath must not run."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx2 as httpx
import trio

from gezel_trio.http.app import HttpSettings, create_app
from gezel_trio.http.probe import health_first
from gezel_trio.server import ServerConfig, serve
from gezel_trio.testing import ScriptedBackend, open_test_engine

HANG = 20
ORIGIN = "http://127.0.0.1:3000"


@asynccontextmanager
async def _server() -> AsyncIterator[str]:
    config = ServerConfig(http=HttpSettings(allowed_origins=(ORIGIN,)), port=0)
    async with trio.open_nursery() as nursery:
        scripted = partial(serve, config, backend_factory=lambda _: ScriptedBackend())
        binds = await nursery.start(scripted)
        yield binds[0]
        nursery.cancel_scope.cancel()


async def test_a_plain_probe_is_answered_before_quart_runs() -> None:
    reached: list[tuple[str, str]] = []

    async def underneath(scope: Any, receive: Any, send: Any) -> None:
        reached.append((scope["method"], scope["path"]))

    sent: list[dict[str, Any]] = []

    async def record(message: dict[str, Any]) -> None:
        sent.append(message)

    received: list[str] = []

    async def receive() -> dict[str, Any]:
        received.append("request")
        return {"type": "http.request", "body": b"", "more_body": False}

    def scope(*headers: tuple[bytes, bytes]) -> dict[str, Any]:
        return {"type": "http", "path": "/health", "method": "GET", "headers": list(headers)}

    async with open_test_engine(ScriptedBackend()) as t:
        app = create_app(t.engine, HttpSettings())
        # The app's own probe, over the real engine, before an app that must
        # not run (``served`` puts it before the Quart app).
        guarded = health_first(underneath, app.extensions["gezel_trio.health_probe"])
        with trio.fail_after(HANG):
            await guarded(scope((b"host", b"127.0.0.1:8080")), receive, record)
        start, end = sent
        assert start["status"] == 200
        assert dict(start["headers"])[b"content-type"] == b"application/json"
        body = json.loads(end["body"])
        assert body["status"] == "ok"
        assert body["model"] == t.engine.info.model_id
        assert received == ["request"]  # the (empty) body was read
        assert reached == []
        # Not plain: each goes to the app underneath.
        for headers in (
            [(b"host", b"127.0.0.1"), (b"origin", b"http://127.0.0.1")],
            [(b"host", b"127.0.0.1"), (b"content-length", b"3")],
            [(b"host", b"127.0.0.1"), (b"transfer-encoding", b"chunked")],
            [(b"host", b"evil.example")],  # refused by the origin policy: Quart's 403
            [],  # no Host
        ):
            await guarded(scope(*headers), receive, record)
        await guarded({**scope((b"host", b"127.0.0.1")), "method": "HEAD"}, receive, record)
        assert reached == [("GET", "/health")] * 5 + [("HEAD", "/health")]
        assert len(sent) == 2  # nothing more was answered here


async def test_over_hypercorn_the_fast_answer_is_quarts_answer() -> None:
    with trio.fail_after(HANG):
        async with _server() as base, httpx.AsyncClient(base_url=base) as client:
            # One keep-alive connection: the fast answers do not stall it.
            plain = [await client.get("/health") for _ in range(5)]
            assert {r.status_code for r in plain} == {200}
            assert plain[0].headers["content-type"] == "application/json"
            # A browser's probe goes through Quart (its CORS header says so).
            browser = await client.get("/health", headers={"Origin": ORIGIN})
            assert browser.headers["access-control-allow-origin"] == ORIGIN
            assert "access-control-allow-origin" not in plain[0].headers
            # Same body either way (the step may have moved: compare the rest).
            fast, slow = plain[-1].json(), browser.json()
            for body in (fast, slow):
                body.pop("step")
            assert fast == slow
            # A refused host is refused, in the OpenAI envelope.
            refused = await client.get("/health", headers={"Host": "evil.example"})
            assert refused.status_code == 403
            assert "evil.example" in refused.json()["error"]["message"]
            # A probe with a body is read and answered by the app.
            with_body = await client.request("GET", "/health", content=b"abc")
            assert with_body.status_code == 200
            assert with_body.json()["status"] == "ok"
