"""What a request costs the server before it is known to be wanted: with
``--api-key`` a request without the key gets its 401 before its body is
read (nor received: the app is handed an empty one), and at most
``--max-connections`` requests are served at once.

Over a real hypercorn socket on the scripted backend, the request written by
hand: a client announcing a 500 MB body and sending a few bytes of it must
get its answer without the server waiting for the rest (before, the server
read the whole body first, and waited for it until its 60 s body timeout)."""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx2 as httpx
import pytest
import trio
import trio.testing

from gezel_trio import cli
from gezel_trio.http.app import HttpSettings, create_app, served
from gezel_trio.http.connections import bound_requests
from gezel_trio.server import ServerConfig, serve
from gezel_trio.testing import ScriptedBackend, open_test_engine

# A hang bound, far below the server's 60 s body timeout.
HANG = 20
KEY = "sk-right"


@asynccontextmanager
async def _served(settings: HttpSettings) -> AsyncIterator[tuple[str, int]]:
    config = ServerConfig(http=settings, port=0)
    async with trio.open_nursery() as nursery:
        scripted = partial(serve, config, backend_factory=lambda _: ScriptedBackend())
        binds = await nursery.start(scripted)
        host, port = binds[0].removeprefix("http://").rsplit(":", 1)
        yield host, int(port)
        nursery.cancel_scope.cancel()


async def _head_of_response(stream: trio.SocketStream) -> tuple[int, dict[str, str], bytes]:
    """The status line, headers and whatever body came, read until the
    server closes the connection."""
    data = b""
    while chunk := await stream.receive_some(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


# Past --max-body-mb (once a 413, the key never looked at) and within it
# (once waited for until the body timeout).
@pytest.mark.parametrize("announced", [500_000_000, 5_000_000])
async def test_a_wrong_key_is_refused_before_the_body_is_read(announced: int) -> None:
    with trio.fail_after(HANG):
        async with _served(HttpSettings(api_key=KEY)) as (host, port):
            async with await trio.open_tcp_stream(host, port) as stream:
                await stream.send_all(
                    b"POST /v1/chat/completions HTTP/1.1\r\n"
                    b"Host: 127.0.0.1\r\n"
                    b"Content-Type: application/json\r\n"
                    b"Authorization: Bearer sk-wrong\r\n"
                    b"Content-Length: %d\r\n\r\n"
                    b'{"messages": [' % announced
                )
                status, headers, body = await _head_of_response(stream)
                assert status == 401
                assert headers["connection"] == "close"
                assert json.loads(body)["error"]["code"] == "invalid_api_key"


def _scope(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1"), *headers],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8080),
        "extensions": {},
    }


# Without the key, and a probe's body whatever the key: neither is ever
# received from the server (Quart once read bodies beside its key check:
# 40 unauthenticated 7 MB uploads took 280 MB).
@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("POST", "/v1/chat/completions", 401), ("POST", "/v1/messages", 401), ("GET", "/health", 200)],
)
async def test_a_body_that_may_not_be_sent_is_never_received(
    method: str, path: str, status: int
) -> None:
    received = 0

    async def receive() -> dict[str, Any]:
        nonlocal received
        await trio.lowlevel.checkpoint()
        received += 1
        return {"type": "http.request", "body": b"x" * 65536, "more_body": True}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(b"content-type", b"application/json"), (b"content-length", b"8388608")]
    with trio.fail_after(HANG):
        async with open_test_engine() as t:
            app = create_app(t.engine, HttpSettings(api_key=KEY))
            async with app.test_app():
                await served(app)(_scope(method, path, headers), receive, send)
    assert received == 0
    assert sent[0]["status"] == status
    assert (b"connection", b"close") in sent[0]["headers"]


async def test_the_right_key_still_reads_the_body() -> None:
    with trio.fail_after(HANG):
        async with (
            _served(HttpSettings(api_key=KEY)) as (host, port),
            httpx.AsyncClient(base_url=f"http://{host}:{port}") as client,
        ):
            auth = {"Authorization": f"Bearer {KEY}"}
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            ok = await client.post("/v1/chat/completions", json=body, headers=auth)
            assert ok.status_code == 200
            # Keep-alive holds after a refusal without a body.
            assert (await client.get("/v1/models")).status_code == 401
            assert (await client.get("/v1/models", headers=auth)).status_code == 200


async def test_requests_past_the_bound_get_a_503_at_once() -> None:
    release = trio.Event()
    entered: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        entered.append(scope["path"])
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    bounded = bound_requests(app, 2)
    sent: list[dict[str, Any]] = []

    async def record(message: dict[str, Any]) -> None:
        sent.append(message)

    async def nothing() -> dict[str, Any]:
        raise AssertionError("a refused request's body is never read")

    def scope(path: str) -> dict[str, Any]:
        return {"type": "http", "path": path, "method": "POST"}

    with trio.fail_after(HANG):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(bounded, scope("/v1/chat/completions"), nothing, record)
            nursery.start_soon(bounded, scope("/v1/messages"), nothing, record)
            await trio.testing.wait_all_tasks_blocked()
            assert len(entered) == 2
            # The third, on Anthropic's path: refused in its envelope, at once.
            await bounded(scope("/v1/messages"), nothing, record)
            start, end = sent
            assert start["status"] == 503
            headers = dict(start["headers"])
            assert headers[b"connection"] == b"close"
            assert headers[b"retry-after"] == b"1"
            error = json.loads(end["body"])
            assert error["type"] == "error"
            assert "--max-connections" in error["error"]["message"]
            # A probe is answered whatever the load; on OpenAI's paths, its envelope.
            sent.clear()
            nursery.start_soon(bounded, scope("/health"), nothing, record)
            await bounded(scope("/v1/completions"), nothing, record)
            assert json.loads(sent[1]["body"])["error"]["code"] == "too_many_connections"
            await trio.testing.wait_all_tasks_blocked()
            assert entered[-1] == "/health"
            release.set()
        # Slots come back as requests end.
        sent.clear()
        await bounded(scope("/v1/completions"), nothing, record)
        assert sent[0]["status"] == 200


async def test_with_every_connection_busy_a_new_one_is_refused_and_a_probe_answered() -> None:
    with trio.fail_after(HANG):
        async with _served(HttpSettings(max_connections=2)) as (host, port):
            busy = [await trio.open_tcp_stream(host, port) for _ in range(2)]
            for stream in busy:
                # A request in progress: its headers whole, its body not yet sent.
                await stream.send_all(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 10\r\n\r\n"
                )
            # The cushion lets the server read what was sent before it settles.
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            async with await trio.open_tcp_stream(host, port) as third:
                await third.send_all(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                status, headers, body = await _head_of_response(third)
            assert status == 503
            assert headers["connection"] == "close"
            assert headers["retry-after"] == "1"
            assert "limit of 2 connections" in json.loads(body)["error"]["message"]
            async with await trio.open_tcp_stream(host, port) as probe:
                await probe.send_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                status, headers, _ = await _head_of_response(probe)
            assert status == 200
            assert headers["connection"] == "close"
            for stream in busy:
                await stream.aclose()


def test_the_flag_sets_the_bound() -> None:
    args = cli._parser().parse_args(["serve", "--model", "m", "--max-connections", "12"])
    assert cli._from_flags(HttpSettings, args).max_connections == 12
    assert HttpSettings().max_connections == 256


# Holds N idle connections, then asks for /health on one more: its status.
_IDLE_CLIENT = """
import resource, socket, sys
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # not the server's lowered one
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
held = [socket.create_connection((host, port), timeout=10) for _ in range(n)]
probe = socket.create_connection((host, port), timeout=10)
probe.sendall(b"GET /health HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\nConnection: close\\r\\n\\r\\n")
data = b""
while chunk := probe.recv(65536):
    data += chunk
# The held connections the server closed: one for each accept that found
# no descriptor, never all of them (those it kept stay silent).
ended = 0
for sock in held:
    sock.setblocking(False)
    try:
        ended += sock.recv(1) == b""
    except BlockingIOError:
        pass
    except ConnectionResetError:
        ended += 1
print(data.split(b" ", 2)[1].decode(), ended)
"""


async def test_out_of_descriptors_closes_the_longest_idle_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server's process out of descriptors, 100 idle connections held
    by another process: each accept that fails closes the longest idle
    connection, so the probe is answered, and one log line (no traceback)
    says so. Hypercorn's accept loop logged a traceback every 0.1 s and
    answered nobody until its keep-alive timers gave descriptors back."""
    caplog.set_level(logging.WARNING)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with trio.fail_after(HANG):
        async with _served(HttpSettings()) as (host, port):
            # Room for about 40 connections beside what the process holds.
            resource.setrlimit(
                resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 40, hard)
            )
            try:
                done = await trio.run_process(
                    [sys.executable, "-c", _IDLE_CLIENT, host, str(port), "100"],
                    capture_stdout=True,
                )
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    status, ended = done.stdout.decode().split()
    assert status == "200"
    # Room for about 40: at most the other 60 and the probe's closed idle ones.
    assert int(ended) <= 100 - 20
    out_of_files = [r for r in caplog.records if "accept failed" in r.getMessage()]
    assert len(out_of_files) == 1
    assert "EMFILE" in out_of_files[0].getMessage()
    assert all(r.exc_info is None for r in caplog.records)
