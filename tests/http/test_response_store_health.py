"""A stored response whose file cannot be written (a full disk, a writer
that raises) is still served, and ``/health`` says it is not persisted.

In-process over the scripted backend: the store runs in the test's
nursery; cancelling it flushes every write still queued (its shutdown
flush), so once the nursery is left every write was tried.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from gezel_trio.http.app import HttpSettings, create_app
from gezel_trio.http.response_store import ResponseStore
from gezel_trio.testing import ScriptedBackend, open_test_engine

Writer = Callable[[Path, bytes], None]


def failing(exc: Exception, times: int, real: Writer) -> tuple[Writer, list[Path]]:
    """A writer that raises ``exc`` on its first ``times`` calls, then writes."""
    calls: list[Path] = []

    def write(path: Path, raw: bytes) -> None:
        calls.append(path)
        if len(calls) <= times:
            raise exc
        real(path, raw)

    return write, calls


async def scenario(
    tmp_path: Path, exc: Exception, times: int, posts: int
) -> tuple[list[int], int, dict[str, Any], ResponseStore]:
    """``posts`` stored responses through a store whose writer fails
    ``times`` times: their statuses, a GET of the first, and /health."""
    store = ResponseStore(directory=tmp_path / "responses")
    write, _calls = failing(exc, times, store._write)
    store._write = write  # type: ignore[method-assign]
    async with open_test_engine(ScriptedBackend()) as t:
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            async with create_app(t.engine, HttpSettings(), store).test_app() as app:
                client = app.test_client()
                statuses, ids = [], []
                for i in range(posts):
                    r = await client.post(
                        "/v1/responses", json={"model": "m", "input": f"hi {i}", "store": True}
                    )
                    statuses.append(r.status_code)
                    ids.append((await r.get_json())["id"])
            nursery.cancel_scope.cancel()  # the store's flush: every write tried
        async with create_app(t.engine, HttpSettings(), store).test_app() as app:
            client = app.test_client()
            got = (await client.get(f"/v1/responses/{ids[0]}")).status_code
            health = await (await client.get("/health")).get_json()
    return statuses, got, health, store


async def test_a_failed_write_keeps_serving_and_shows_in_health(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gezel_trio.responses")
    full = OSError(errno.ENOSPC, "No space left on device")
    statuses, got, health, store = await scenario(tmp_path, full, times=99, posts=3)
    assert statuses == [200, 200, 200]
    assert got == 200  # still served, from memory
    assert health["status"] == "degraded"
    [reason] = health["reasons"]
    assert "No space left on device" in reason
    assert "3 failed writes" in reason
    assert store.failed_writes == 3
    warned = [r for r in caplog.records if "not persisted" in r.message]
    assert len(warned) == 1, "one warning per kind of failure"


async def test_a_writer_that_raises_anything_never_stops_the_store(tmp_path: Path) -> None:
    statuses, got, health, _ = await scenario(
        tmp_path, RuntimeError("a writer bug"), times=99, posts=2
    )
    assert statuses == [200, 200]
    assert got == 200
    assert health["status"] == "degraded"
    assert "RuntimeError: a writer bug" in health["reasons"][0]


async def test_a_write_that_works_again_clears_it(tmp_path: Path) -> None:
    denied = PermissionError(errno.EACCES, "Permission denied")
    _, _, health, store = await scenario(tmp_path, denied, times=1, posts=2)
    assert store.failed_writes == 1
    assert store.problem is None
    assert health["status"] == "ok"
    assert len(list((tmp_path / "responses").glob("*.json"))) == 1
