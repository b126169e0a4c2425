"""A background request that waited too long in the queue, as a client
sees it: a 503 with ``Retry-After`` before anything was sent, the
protocol's error frame on a stream already opened. In-process over the
scripted backend under ``MockClock``: an interactive request holds the
only slot at a breakpoint while the clock jumps past the bound."""

from __future__ import annotations

import json
from typing import Any

import trio
import trio.testing

from gezel_trio.http.app import HttpSettings, create_app
from gezel_trio.testing import open_test_engine
from tests.support.scenarios import req, spawn

BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "priority": "background",
    "max_tokens": 4,
}


async def _post(app: Any, stream: bool) -> tuple[int, dict[str, str], Any]:
    client = app.test_client()
    if not stream:
        r = await client.post("/v1/chat/completions", json=BODY)
        return r.status_code, dict(r.headers), await r.get_json()
    async with client.request(
        "/v1/chat/completions", method="POST", headers={"Content-Type": "application/json"}
    ) as conn:
        await conn.send(json.dumps({**BODY, "stream": True}).encode())
        await conn.send_complete()
        data = b""
        while b'"error"' not in data:
            chunk = await conn.receive()
            assert chunk, "the stream ended without an error frame"
            data += chunk
        # The error frame and [DONE] may come in one write (a stream writes
        # what waits together): the JSON frames, as a client reads them.
        frames = [
            json.loads(line[6:])
            for line in data.decode().splitlines()
            if line[:6] == "data: " and line != "data: [DONE]"
        ]
        return conn.status_code or 0, dict(conn.headers or {}), frames


def _scenario(stream: bool) -> tuple[int, dict[str, str], Any]:
    async def scenario() -> tuple[int, dict[str, str], Any]:
        async with (
            open_test_engine(max_concurrency=1) as t,
            create_app(t.engine, HttpSettings()).test_app() as app,
        ):
            token3 = t.breakpoints.add("decode", rid=0, index=3)
            out: list[tuple[int, dict[str, str], Any]] = []
            async with trio.open_nursery() as nursery:
                spawn(nursery, t, req("chat", max_tokens=20, ignore_eos=True), [])
                await token3.reached()

                async def call() -> None:
                    out.append(await _post(app, stream))

                nursery.start_soon(call)
                await t.engine.wait_until(lambda s: len(s.queued) == 1)
                trio.lowlevel.current_clock().jump(601)  # type: ignore[attr-defined]
                token3.release()
            return out[0]

    result: tuple[int, dict[str, str], Any] = trio.run(
        scenario, clock=trio.testing.MockClock(autojump_threshold=0)
    )
    return result


def test_before_anything_was_sent_it_is_a_503_with_retry_after() -> None:
    status, headers, body = _scenario(stream=False)
    assert status == 503
    assert {k.lower(): v for k, v in headers.items()}["retry-after"] == "30"
    assert body["error"]["code"] == "queue_timeout"
    assert "600 s" in body["error"]["message"]


def test_an_opened_stream_gets_the_error_frame() -> None:
    status, _, frames = _scenario(stream=True)
    assert status == 200
    assert frames[-1]["error"]["code"] == "queue_timeout"
