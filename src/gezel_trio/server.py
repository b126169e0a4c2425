"""The sidecar process: one nursery owning the engine and the HTTP server.

::

    serve()  ── nursery
                ├─ run_engine          started first; ready = model loaded on
                │   └─ host thread     its thread, so the socket binds only then
                ├─ hypercorn serve     the quart-trio app, bound after the engine
                └─ signal watcher      SIGINT/SIGTERM -> graceful drain

Shutdown: a signal stops hypercorn from accepting and lets in-flight requests
finish for up to ``graceful_timeout`` seconds; then the nursery is cancelled,
which closes the engine (remaining requests fail with ``EngineClosed``) and
the host thread stops after its current step.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import attrs
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from .config import EngineConfig
from .engine import run_engine
from .errors import GezelError
from .http.app import HttpSettings, create_app

__all__ = ["ServerConfig", "serve"]

log = logging.getLogger("gezel_trio.server")


@attrs.frozen
class ServerConfig:
    engine: EngineConfig = attrs.field(factory=EngineConfig)
    http: HttpSettings = attrs.field(factory=HttpSettings)
    port: int = 8080
    graceful_timeout: float = 10.0


async def _watch_signals(shutdown: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s: draining", signal.Signals(signum).name)
            shutdown.set()
            return


async def _serve_http(  # noqa: ASYNC128 - hypercorn.serve calls started()
    app: object,
    hc: HypercornConfig,
    shutdown: trio.Event,
    owner: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    try:
        await hypercorn_serve(app, hc, shutdown_trigger=shutdown.wait, task_status=task_status)  # type: ignore[arg-type]
    finally:
        # The HTTP server has drained (or failed): the engine goes with it.
        owner.cancel()


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


async def serve(config: ServerConfig) -> None:
    """Run the server until SIGINT/SIGTERM drains it (or until cancelled)."""
    hc = HypercornConfig()
    hc.bind = [f"{_bracket(config.http.host)}:{config.port}"]
    hc.graceful_timeout = config.graceful_timeout
    hc.read_timeout = None  # a long stream must not be cut by an idle read timer
    hc.keep_alive_timeout = 75
    hc.accesslog = None
    # Route hypercorn through our logging config (its default adds a second handler).
    hc.errorlog = logging.getLogger("hypercorn.error")
    async with trio.open_nursery() as nursery:
        engine = await nursery.start(run_engine, config.engine)
        log.info("model %s ready (context %d)", engine.info.model_id, engine.info.context_length)
        shutdown = trio.Event()
        nursery.start_soon(_watch_signals, shutdown)
        app = create_app(engine, config.http)
        binds = await nursery.start(_serve_http, app, hc, shutdown, nursery.cancel_scope)
        for bind in binds:
            # Tests and supervisors read this line to learn the port.
            print(f"gezel-trio listening on {bind}", flush=True)


def exit_with_parent() -> None:
    """Ask the kernel to send us SIGTERM when our parent dies (O2), so a
    sidecar whose app crashed drains and exits like any other SIGTERM - no
    watchdog loop. Linux only (prctl PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError("--exit-with-parent is supported on Linux only")
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() == 1:
        # The parent died before the request took effect: act on it now.
        os.kill(os.getpid(), signal.SIGTERM)


def main_serve(config: ServerConfig) -> int:
    """Run ``serve`` in a fresh Trio loop; a load failure is one clean line."""
    status = 0
    try:
        trio.run(serve, config)
    except* GezelError as group:
        for err in group.exceptions:
            print(f"gezel-trio: {err}", file=sys.stderr)
        status = 1
    except* KeyboardInterrupt:  # a second Ctrl-C while draining
        status = 130
    return status
