"""The HTTP app on a real hypercorn socket, in the test's own Trio run, so a
test can watch the engine's state while a client misbehaves."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import trio

from gezel_trio import Engine, EngineConfig
from gezel_trio.http.app import HttpSettings
from gezel_trio.server import ServerConfig, serve
from gezel_trio.testing import ScriptedBackend


@asynccontextmanager
async def served(
    model: Path, settings: HttpSettings | None = None, **engine_kw: Any
) -> AsyncIterator[tuple[Engine, str]]:
    """``server.serve`` on a free loopback port: the engine and the URL.
    Leaving the block cancels the server (and closes the engine)."""
    config = ServerConfig(
        engine=EngineConfig.from_flags(model=model, **engine_kw),
        http=settings or HttpSettings(),
        port=0,
    )
    engines: list[Engine] = []
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, config, on_engine=engines.append))
        try:
            yield engines[0], binds[0]
        finally:
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def served_scripted(
    settings: HttpSettings | None = None,
    backend: ScriptedBackend | None = None,
    **engine_kw: Any,
) -> AsyncIterator[tuple[Engine, str]]:
    """``served`` over the scripted engine (``gezel_trio.testing``), for a
    test where the model does not matter: no MLX is loaded."""
    scripted = backend or ScriptedBackend()
    config = ServerConfig(
        engine=EngineConfig.from_flags(**engine_kw),
        http=settings or HttpSettings(),
        port=0,
    )
    engines: list[Engine] = []
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(serve, config, backend_factory=lambda _: scripted, on_engine=engines.append)
        )
        try:
            yield engines[0], binds[0]
        finally:
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def raw_stream(url: str, body: dict[str, object]) -> AsyncIterator[trio.SocketStream]:
    """POST ``body`` on a bare TCP stream: leaving the block is an abrupt
    client disconnect, with no client library in between."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        yield stream


async def read_content_frames(stream: trio.SocketStream, count: int) -> int:
    """Read until ``count`` SSE frames with content have arrived."""
    seen, buf = 0, b""
    while seen < count:
        data = await stream.receive_some()
        assert data, "the server closed the stream early"
        buf += data
        seen = buf.count(b'"content":"') - buf.count(b'"content":""')
    return seen


@asynccontextmanager
async def served_config(config: ServerConfig) -> AsyncIterator[tuple[Engine, str]]:
    """``server.serve`` with a whole ``ServerConfig``, as a command line
    builds it (``cli.server_config``); bind it to port 0. Leaving the block
    cancels the server (and closes the engine)."""
    engines: list[Engine] = []
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, config, on_engine=engines.append))
        try:
            yield engines[0], binds[0]
        finally:
            nursery.cancel_scope.cancel()
