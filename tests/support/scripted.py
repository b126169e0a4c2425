"""The HTTP app over the scripted engine (``gezel_trio.testing``), served by
hypercorn on a loopback port from a thread of its own: the same ``Server``
(a URL, an ``openai`` client, ``post``) that ``tests.support.process``
gives for a real ``gezel-trio serve``, for the tests where the model does
not matter - a request's validation, its refusals and the fields it
ignores. It starts in a fraction of a second and loads no MLX.

The composition is ``server.serve``'s (``create_app`` with a running
``ResponseStore``, ``served``, ``bound_requests``, ``serve_http``) minus
what only a process has: the stdout protocol and the signal handlers.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig

from gezel_trio.http.app import HttpSettings, create_app, served
from gezel_trio.http.connections import ConnectionCap, bound_requests, serve_http
from gezel_trio.http.response_store import ResponseStore
from gezel_trio.testing import ScriptedBackend, open_test_engine
from tests.support.process import Server

# Seconds to wait for the server thread to bind, or to drain and stop.
START_S = 60


@contextmanager
def scripted_server(
    backend: ScriptedBackend | None = None,
    http: HttpSettings | None = None,
    **engine_kw: Any,
) -> Iterator[Server]:
    """A server over ``backend`` (a default ``ScriptedBackend``) with
    ``http`` settings and ``engine_kw`` as ``open_test_engine`` takes them,
    for the block; leaving it drains the server and joins its thread."""
    settings = http or HttpSettings()
    ready: queue.Queue[tuple[str, trio.lowlevel.TrioToken, trio.Event] | Exception]
    ready = queue.Queue()

    async def main() -> None:
        hc = HypercornConfig()
        hc.bind = [f"{settings.host}:0"]
        hc.read_timeout = None
        hc.keep_alive_timeout = settings.idle_timeout
        hc.accesslog = None
        hc.errorlog = logging.getLogger("hypercorn.error")
        shutdown = trio.Event()
        async with (
            open_test_engine(backend or ScriptedBackend(), **engine_kw) as t,
            trio.open_nursery() as nursery,
        ):
            responses = await nursery.start(ResponseStore().run)
            cap = ConnectionCap(settings.max_connections)
            app = bound_requests(
                served(create_app(t.engine, settings, responses)), settings.max_connections, cap
            )
            async with trio.open_nursery() as http:
                binds = await http.start(
                    partial(serve_http, app, hc, cap, shutdown_trigger=shutdown.wait)
                )
                ready.put((binds[0], trio.lowlevel.current_trio_token(), shutdown))
            # Drained: what is left is the store's task.
            nursery.cancel_scope.cancel()

    def run() -> None:
        try:
            trio.run(main)
        except Exception as error:  # reported to the test's thread
            ready.put(error)

    thread = threading.Thread(target=run, name="scripted-server", daemon=True)
    thread.start()
    started = ready.get(timeout=START_S)
    if isinstance(started, Exception):
        raise started
    url, token, shutdown = started
    server = Server(url)
    try:
        yield server
    finally:
        server.client.close()
        trio.from_thread.run_sync(shutdown.set, trio_token=token)
        thread.join(START_S)
        assert not thread.is_alive(), "the scripted server did not stop"
        if not ready.empty():
            raise ready.get()
