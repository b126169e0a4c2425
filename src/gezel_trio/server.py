"""The sidecar process: one nursery owning the engine and the HTTP server.

::

    serve()  ── nursery
                ├─ stdout writer       the only writer of stdout (stdout_protocol)
                ├─ run_engine          started next; ready = model loaded on
                │   └─ host thread     its thread, so the socket binds only then
                ├─ stdout watch        the engine's notes -> Prefill markers,
                │                      tagged contained failures
                ├─ ResponseStore.run   stored Responses, their files, background
                │                      responses (one task each, cancellable)
                ├─ serve_http          the quart-trio app under hypercorn, bound after
                │                      the engine; its own accept loop (http.connections)
                ├─ signal watcher      SIGINT/SIGTERM -> graceful drain
                └─ grace closer        the drain's end -> what still runs fails

Shutdown: a signal stops hypercorn from accepting, closes idle keep-alive
connections at once (``_idle_closable``) and lets in-flight requests
finish for up to ``graceful_timeout`` seconds. A request still running
then fails with ``EngineClosed`` (``_close_at_grace``): a stream gets its
error frame and a plain request its 503, with ``GRACE_FLUSH_S`` more to
write them, before hypercorn cancels what is left. Then the nursery is
cancelled, which closes the engine and the host thread stops after its
current step and a flush bounded by ``EngineConfig.cache.shutdown_timeout``.

Engine failure: when the engine stops working (its host thread died, or too
many model steps failed in a row) every request has already failed with
``EngineFailure``; ``/health`` answers 503 with the reason for
``DEAD_LINGER`` seconds, then the server drains like a SIGTERM, prints the
failure's traceback untagged on stdout (the one bare leaf line a supervisor
reads as a death) and ``serve`` raises it, so the process exits non-zero and
a supervisor restarts it.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import trio
from hypercorn.config import Config as HypercornConfig

from .addons import MissingExtra, host_runner, kv_events_publisher
from .core.backend import Backend
from .core.config import EngineConfig
from .core.errors import EngineFailure, GezelError
from .core.settings import setting
from .engine import Engine, run_engine
from .host.loop import HostRunner, in_thread
from .http.app import HttpSettings, create_app, served
from .http.connections import ConnectionCap, bound_requests, check_connection_cap, serve_http
from .http.response_store import ResponseStore
from .mlx import group_backend, group_rank, mlx_backend, open_file_limit
from .stdout_protocol import StdoutProtocol, StdoutSettings
from .tuning import applies
from .tuning.sched import EVENT_LOOP_SLICE_NS, request_slice

__all__ = ["Orphaned", "ServerConfig", "serve"]

log = logging.getLogger("gezel_trio.server")


# Seconds a failed engine's server keeps answering (503 with the reason)
# before it drains and exits: a probe sees why, not a refused connection.
DEAD_LINGER = 1.0
# How often the parent is checked where the kernel cannot signal its death.
PARENT_POLL = 1.0
# Seconds past the graceful timeout for the requests failed then to write
# their error frames or 503s before hypercorn cancels its connections.
GRACE_FLUSH_S = 1.0


@attrs.frozen
class ServerConfig:
    """The process's own settings, read by ``server`` (its port, its drain,
    its stored Responses) and ``cli`` (the parent watch).

    It holds the whole server's: the engine's, the HTTP edge's, the stdout
    lines', and its own, declared like ``EngineConfig``'s
    (``core.settings``)."""

    engine: EngineConfig = attrs.field(factory=EngineConfig)
    http: HttpSettings = attrs.field(factory=HttpSettings)
    port: int = setting(8080, flag="--port", help="0 picks a free port")
    graceful_timeout: float = setting(
        10.0,
        flag="--graceful-timeout",
        help="seconds in-flight requests get to finish on SIGTERM",
    )
    # Read by the command (cli.main) before the server starts: on Linux the
    # kernel's parent-death signal is asked for then, elsewhere
    # ``watch_parent`` below is polled.
    exit_with_parent: bool = setting(
        False,
        flag="--exit-with-parent",
        on_off=True,
        help="on: drain and exit when the parent process dies, and refuse to start "
        "when it is already gone (sidecar use)",
    )
    # Drain and exit once this process's parent is no longer this pid
    # (--exit-with-parent where the kernel cannot signal it: macOS).
    watch_parent: int | None = None
    # Seconds a failed engine's server keeps answering before it drains.
    dead_linger: float = DEAD_LINGER
    # The supervisor's stdout lines (prefill marker cadence).
    stdout: StdoutSettings = attrs.field(factory=StdoutSettings)
    responses_budget_mb: float = setting(
        256.0,
        flag="--responses-budget-mb",
        help="MB of stored Responses (store: true) kept, least recently used dropped beyond "
        "it; with --persist-dir also on disk",
        validator=attrs.validators.gt(0),
    )


async def _watch_signals(shutdown: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s: draining", signal.Signals(signum).name)
            shutdown.set()
            return


async def _close_at_grace(engine: Engine, shutdown: trio.Event, grace: float) -> None:
    """``grace`` seconds after the drain began, fail every request still
    queued or running: its client is told why (an error frame, a 503)
    instead of finding its connection cut when hypercorn's own timeout,
    ``GRACE_FLUSH_S`` later, cancels it. A rank of a group that died
    leaves rank 0's step waiting on it; its streams end this way too."""
    await shutdown.wait()
    await trio.sleep(grace)
    log.info("the drain's %g s are up: failing the requests still running", grace)
    engine.close_nowait(
        f"the server is shutting down: the request did not finish within its {grace:g} s"
        " (--graceful-timeout)"
    )


async def _watch_parent(parent: int, shutdown: trio.Event) -> None:
    """Polls ``getppid``: without ``PR_SET_PDEATHSIG`` (macOS) nothing tells a
    process its parent died except being re-parented."""
    # No event exists to wait on (ASYNC110): re-parenting is only seen by looking.
    while os.getppid() == parent:  # noqa: ASYNC110
        await trio.sleep(PARENT_POLL)
    log.info("the parent process %d is gone: draining", parent)
    shutdown.set()


def _backend(config: EngineConfig) -> Backend:
    """The composition root's backend: MLX's, and under ``mlx.launch``
    rank 0's of the group (``mlx.group``); the other ranks follow it
    (``cli``). Called on the host thread, as every backend factory is."""
    return group_backend(config) if group_rank() is not None else mlx_backend(config)


async def _run_engine(  # noqa: ASYNC128 - run_engine calls started() once the model loaded
    config: EngineConfig,
    shutdown: trio.Event,
    died: list[EngineFailure],
    linger: float,
    *,
    backend_factory: Callable[[EngineConfig], Backend] | None = None,
    host: HostRunner = in_thread,
    task_status: trio.TaskStatus[Engine] = trio.TASK_STATUS_IGNORED,
) -> None:
    try:
        # The composition root picks the backend: MLX unless a test injects one.
        await run_engine(config, backend_factory or _backend, host=host, task_status=task_status)
    except EngineFailure as failure:  # only raised once the engine was ready
        died.append(failure)
        log.critical("the engine failed (%s): exiting after a drain", failure.message)
        await trio.sleep(linger)  # /health answers 503 with the reason meanwhile
        shutdown.set()


def _idle_closable(app: Any) -> Any:
    """``app`` with its last send of each response shielded, so that hypercorn
    closes the connection at once on shutdown while it idles between requests.

    Hypercorn closes an idle keep-alive connection from a task it starts when
    the previous response ends, inside the app's last send. quart-trio
    cancels its own nursery as that response ends, and a task started from a
    cancelled scope is never moved to the connection's nursery (trio's
    ``started`` leaves it where it is): it dies at once, and nothing closes
    the idle connection until ``graceful_timeout`` runs out, which cost
    every stop the whole 10 s. The shielded send is the one that writes the
    response's end, which hypercorn already writes shielded."""

    async def shielded_end(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def send_end_shielded(message: Any) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        await app(scope, receive, send_end_shielded)

    return shielded_end


async def _serve_http(  # noqa: ASYNC128 - serve_http calls started()
    app: Any,
    hc: HypercornConfig,
    cap: ConnectionCap,
    shutdown: trio.Event,
    owner: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    try:
        await serve_http(
            _idle_closable(app),
            hc,
            cap,
            shutdown_trigger=shutdown.wait,
            task_status=task_status,
        )
    finally:
        # The HTTP server has drained (or failed): the engine goes with it.
        owner.cancel()


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _tune_process(_engine: Engine, *, tuned: bool = True) -> None:
    """What the server process does once its engine runs, on its Trio
    thread (``main_serve``; ``serve`` called as a library leaves the
    caller's process as it is):

    - The Trio thread asks for a short scheduler slice (``tuning.sched``): it
      answers /health while the compute fills the cores. Asked for once the
      host thread has started, which would have inherited it. Not with
      the platform tuning off (``tuned``).
    - What start-up made (the modules, the model's and the tokenizer's
      objects) is left out of every later garbage collection. A full
      collection walks every tracked object with the GIL held: on SmolLM2
      one took 45-80 ms while streams decoded, and every thread waited for
      it (docs/performance.md). Collected first, so that start-up's garbage
      is not kept.
    """
    refused = request_slice(EVENT_LOOP_SLICE_NS) if tuned else "platform tuning off"
    if refused is None:
        log.info("the Trio thread: %d us slices", EVENT_LOOP_SLICE_NS // 1000)
    else:
        log.info("the Trio thread: the default slice (%s)", refused)
    gc.collect()
    gc.freeze()
    log.info("start-up's %d objects left out of garbage collection", gc.get_freeze_count())


async def serve(
    config: ServerConfig,
    *,
    backend_factory: Callable[[EngineConfig], Backend] | None = None,
    on_engine: Callable[[Engine], object] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the server until SIGINT/SIGTERM drains it (or until cancelled).

    Startable like hypercorn's ``serve``: ``binds = await
    nursery.start(serve, config)`` returns once the model has loaded and the
    sockets are bound, with the bound addresses (``http://127.0.0.1:PORT``;
    port 0 picks a free one). Cancelling it stops the server without a
    drain: in-flight requests are cancelled, the engine closes and its host
    thread stops after its current step and the shutdown flush.

    Raises ``EngineFailure`` after draining if the engine stopped working;
    a model that does not load is a ``ModelLoadError`` out of its nursery
    (in an exception group), before ``started``; a flag whose add-on is
    not installed, ``MissingExtra`` before anything starts. ``backend_factory``
    replaces the MLX backend (fault-injection tests); ``on_engine`` is
    handed the engine once it is ready (tests read its state)."""
    # The add-ons a flag asks for attach here, at the composition root.
    host = host_runner(config.engine)
    hc = HypercornConfig()
    hc.bind = [f"{_bracket(config.http.host)}:{config.port}"]
    hc.graceful_timeout = config.graceful_timeout + GRACE_FLUSH_S
    hc.read_timeout = None  # a long stream must not be cut by an idle read timer
    hc.keep_alive_timeout = config.http.idle_timeout
    hc.accesslog = None
    # Route hypercorn through our logging config (its default adds a second handler).
    hc.errorlog = logging.getLogger("hypercorn.error")
    shutdown = trio.Event()
    died: list[EngineFailure] = []
    stdout = StdoutProtocol(config.stdout)
    async with trio.open_nursery() as nursery:
        # First in, so every line below goes out in order through one writer.
        await nursery.start(stdout.run)
        stdout.startup_nowait(config.engine.model or "the default model")
        engine: Engine = await nursery.start(
            partial(_run_engine, backend_factory=backend_factory, host=host),
            config.engine,
            shutdown,
            died,
            config.dead_linger,
        )
        if on_engine is not None:
            on_engine(engine)
        log.info("model %s ready (context %d)", engine.info.model_id, engine.info.context_length)
        stdout.say_nowait("Model and processor loaded successfully.")
        stdout.say_nowait(
            f"[batch] engine ready max_concurrency={config.engine.scheduling.max_concurrency} "
            f"prefill_step_size={config.engine.scheduling.prefill_step_size} "
            f"context={engine.info.context_length}"
        )
        nursery.start_soon(stdout.watch, engine.watch(waiting_every=config.stdout.waiting_interval))
        nursery.start_soon(_watch_signals, shutdown)
        nursery.start_soon(_close_at_grace, engine, shutdown, config.graceful_timeout)
        if config.watch_parent is not None:
            nursery.start_soon(_watch_parent, config.watch_parent, shutdown)
        http = attrs.evolve(config.http, on_bug=partial(stdout.contained_nowait, "http"))
        persist = config.engine.cache.persist_dir
        responses = ResponseStore(
            int(config.responses_budget_mb * 1024 * 1024),
            persist / "responses" if persist is not None else None,
        )
        await nursery.start(responses.run)
        app = create_app(engine, http, responses)
        cap = ConnectionCap(http.max_connections)
        bounded = bound_requests(served(app), http.max_connections, cap)
        binds = await nursery.start(_serve_http, bounded, hc, cap, shutdown, nursery.cancel_scope)
        stdout.say_nowait("Application startup complete.")
        for bind in binds:
            # The seed printed its server's line by hand; a supervisor may key on it.
            stdout.say_nowait(f"Uvicorn running on {bind} (Press CTRL+C to quit)")
            # Tests and supervisors read this line to learn the port.
            stdout.say_nowait(f"gezel-trio listening on {bind}")
        task_status.started(binds)
    if died:
        stdout.death(died[0])  # the one untagged traceback: the engine is dead
        raise died[0]


class Orphaned(Exception):
    """The parent process was gone before the server started."""


def exit_with_parent() -> int | None:
    """Drain and exit when our parent dies. On Linux the kernel sends
    SIGTERM (prctl PR_SET_PDEATHSIG), so a sidecar whose app crashed drains
    like any other SIGTERM, and this returns ``None``. Elsewhere (macOS) it
    returns the parent's pid, for ``ServerConfig.watch_parent`` to poll.

    Raises ``Orphaned`` when we were re-parented to init already (the
    parent died before, or while, the request took effect): as the seed
    did, the model is not loaded only to be dropped again."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # Checked after the request: a parent that dies later is signalled.
    parent = os.getppid()
    if parent == 1:
        raise Orphaned("the parent process is already gone (parent pid 1): not starting")
    return None if sys.platform.startswith("linux") else parent


def main_serve(
    config: ServerConfig, *, backend_factory: Callable[[EngineConfig], Backend] | None = None
) -> int:
    """Run ``serve`` in a fresh Trio loop; a load failure or an engine
    failure is one clean line and exit status 1; ``--max-connections``
    above what the open-file limit allows, or a flag whose extra is not
    installed, exit status 2.

    The process's open-file limit is raised to its hard limit first
    (``open_file_limit``): each connection holds a descriptor."""
    try:
        kv_events_publisher(config.engine)  # first: before the model loads
    except MissingExtra as exc:
        print(f"gezel-trio: {exc}", file=sys.stderr)
        return 2
    open_files = open_file_limit()
    try:
        check_connection_cap(config.http.max_connections, open_files)
    except ValueError as exc:
        print(f"gezel-trio: {exc}", file=sys.stderr)
        return 2
    log.info(
        "open-file limit %d: up to %d connections (--max-connections)",
        open_files,
        config.http.max_connections,
    )
    status = 0
    try:
        tune = partial(_tune_process, tuned=applies(config.engine.tuning))
        trio.run(partial(serve, config, backend_factory=backend_factory, on_engine=tune))
    except* GezelError as group:
        for err in group.exceptions:
            print(f"gezel-trio: {err}", file=sys.stderr)
        status = 1
    except* KeyboardInterrupt:  # a second Ctrl-C while draining
        status = 130
    return status
