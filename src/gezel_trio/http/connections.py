"""Open connections and requests in progress: the server's bounds on both,
and the accept loop in front of hypercorn's connection handling that keeps
them.

Hypercorn has no connection cap (its ``backlog`` is the kernel's accept
queue, ``h2_max_concurrent_streams`` is per connection) and every open
connection holds a descriptor: 2,000 idle keep-alive connections left an
uncapped server at its open-file limit, answering nobody. So the server
accepts its connections itself (``serve_http``) and hands each to
hypercorn's own connection handler.

The policy, with ``--max-connections N``:

* **At most N connections are open**, idle keep-alive ones included. A
  connection is *idle* while no request is in progress on it: before its
  first request's headers are whole, and between requests.
* **A connection past N closes the oldest idle one**: the longest idle
  connection is closed at once and the new one admitted, so an idle flood
  costs the flooder its own connections, never a working client its answer.
* **With every connection busy**, a new one is admitted past N, up to
  ``OVERFLOW`` more, to be refused: each of its requests is answered 503 at
  once (``Retry-After``, ``Connection: close``, its body unread), except
  ``/health``, which is answered - a probe must see a busy server as busy,
  not as dead. Beyond those, a connection is closed as it is accepted.
* **An idle connection is closed after ``--idle-timeout`` seconds**, a new
  one that sends nothing as well as a keep-alive one between requests; a
  refused one after ``REFUSED_IDLE_S``.
* **A connection whose peer has gone closes as its last response ends**,
  its descriptor given back then: hypercorn's keep-alive timer task kept a
  closed connection's descriptor until the timer fired (75 s), so a burst
  of 2,000 closed connections left 2,000 descriptors held.
* **Out of descriptors** (``EMFILE``, ``ENFILE`` on accept), the oldest
  idle connection is closed and the accept retried; one log line per
  ``CAPACITY_LOG_S`` says so, never a traceback per try.

Within the connections, at most N *requests* are in progress at once
(``bound_requests``: an HTTP/2 connection carries many); the one past it is
answered 503 the same way. A slot is a request in progress, from its
headers to its response's last byte (a stream holds one to its end).

The server keeps N below the process's open-file limit, with room for the
model's files and the persisted ones (``check_connection_cap``).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Event, Updated
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.statsd import StatsdLogger
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.utils import ShutdownError, parse_socket_addr, raise_shutdown, repr_socket_addr

from ..core.errors import GezelError
from . import anthropic_messages
from .edge import closing
from .probe import HEALTH_PATH
from .sse import error_body
from .strict import dump_json

__all__ = [
    "FD_HEADROOM",
    "OVERFLOW",
    "ConnectionCap",
    "TooBusy",
    "bound_requests",
    "check_connection_cap",
    "serve_http",
]

log = logging.getLogger("gezel_trio.http.connections")

# The ASGI callable hypercorn serves.
Asgi = Callable[[Any, Any, Any], Awaitable[None]]

# Paths answered whatever the load.
_ALWAYS = frozenset({HEALTH_PATH})

# Connections admitted past the cap while every one is busy, each only to be
# answered 503 (or its /health): a probe still gets through a full server.
OVERFLOW = 16
# Seconds a refused connection may stay open without a request.
REFUSED_IDLE_S = 5.0
# Descriptors kept free beside the connections: the listening sockets, the
# model's files (a sharded model holds one per shard while it loads), the
# persisted cache and responses, logs, pipes and the threads' own.
FD_HEADROOM = 256
# Out of descriptors: a log line at most this often, and the accept retried
# after this long when no connection was closed meanwhile.
CAPACITY_LOG_S = 10.0
ACCEPT_RETRY_S = 0.1
# A bound on each close: a connection's, its idle timer's, the listening
# sockets' on the way out (none of them waits on a peer).
CLOSE_S = 1.0
_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class TooBusy(GezelError):
    status = 503
    error_type = "server_error"
    code = "too_many_connections"
    retry_after = 1


def check_connection_cap(max_connections: int, open_files: int) -> None:
    """Raise ``ValueError`` naming both when ``max_connections`` (with the
    refused overflow and ``FD_HEADROOM``) does not fit ``open_files``, the
    process's open-file limit."""
    needed = max_connections + OVERFLOW + FD_HEADROOM
    fits = max(0, open_files - OVERFLOW - FD_HEADROOM)
    if needed > open_files:
        raise ValueError(
            f"--max-connections {max_connections} needs {needed} open files "
            f"({OVERFLOW} refused connections and {FD_HEADROOM} for the model's and the "
            f"server's files besides), above the process's open-file limit of {open_files} "
            f"(ulimit -n): lower --max-connections to {fits}"
            " or raise the limit"
        )


class _Throttled:
    """One log line per ``every`` seconds, counting the ones held back."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._next = -float("inf")
        self._held = 0

    def warn(self, message: str, *args: object) -> None:
        now = trio.current_time()
        if now < self._next:
            self._held += 1
            return
        held, self._held = self._held, 0
        self._next = now + self.every
        suffix = f" ({held} more since the last such line)" if held else ""
        log.warning(message + suffix, *args)


class ConnectionCap:
    """The open connections: how many, which are idle (oldest first), which
    were admitted only to be refused. The accept loop (``accept``) admits,
    evicts and refuses by it; ``bound_requests`` asks it which connections
    are refused."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        # Admitted and not evicted: what the cap counts.
        self.open = 0
        # Admitted past the cap to be refused, by peer address (ASGI's
        # scope["client"]).
        self.refused: set[tuple[str, int]] = set()
        self._overflow = 0
        # Idle connections, the longest idle first, each with its idle
        # timer's cancel scope: cancelling it closes the connection.
        self._idle: dict[_Connection, trio.CancelScope] = {}
        self._released = trio.Event()
        self._out_of_files = _Throttled(CAPACITY_LOG_S)
        self._turned_away = _Throttled(CAPACITY_LOG_S)

    @property
    def idle(self) -> int:
        return len(self._idle)

    def refuses(self, client: Any) -> bool:
        """Whether the connection from ``client`` (an ASGI scope's) was
        admitted only to be refused."""
        return bool(self.refused) and tuple(client or ()) in self.refused

    def _went_idle(self, conn: _Connection, timer: trio.CancelScope) -> None:
        self._idle.pop(conn, None)  # to the end: now the most recently idle
        self._idle[conn] = timer

    def _went_busy(self, conn: _Connection, timer: trio.CancelScope) -> None:
        if self._idle.get(conn) is timer:
            del self._idle[conn]

    def _evict_oldest(self) -> bool:
        """Close the longest idle connection; whether there was one."""
        if not self._idle:
            return False
        conn = next(iter(self._idle))
        timer = self._idle.pop(conn)
        conn.evicted = True
        self.open -= 1
        timer.cancel()
        return True

    def _admit(self) -> str | None:
        """``"served"``, ``"refused"`` or ``None`` (closed at once) for a
        connection just accepted."""
        if self.open >= self.limit and not self._evict_oldest():
            if self._overflow >= OVERFLOW:
                return None
            self._overflow += 1
            return "refused"
        self.open += 1
        return "served"

    def _closed(self, conn: _Connection | None, admitted: str) -> None:
        if admitted == "refused":
            self._overflow -= 1
        elif conn is None or not conn.evicted:
            self.open -= 1
        if conn is not None:
            self._idle.pop(conn, None)
            if conn.peer is not None:
                self.refused.discard(conn.peer)
        self._released.set()
        self._released = trio.Event()

    async def accept(
        self,
        listener: trio.SocketListener,
        connection: Callable[[trio.SocketStream], _Connection],
        nursery: trio.Nursery,
    ) -> None:
        """Accept from ``listener`` until cancelled, each connection served
        by ``connection(stream)`` in ``nursery``."""
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _CAPACITY_ERRNOS:
                    raise
                self._out_of_files.warn(
                    "accept failed: %s (%d connections open, %d idle): closing the "
                    "longest idle one and retrying",
                    errno.errorcode.get(exc.errno or 0, str(exc.errno)),
                    self.open,
                    self.idle,
                )
                # A failed accept does not yield: without this wait the loop
                # would close every idle connection before the first closed.
                # One closed, the next accept waits for it (or for a
                # descriptor given back elsewhere).
                self._evict_oldest()
                with trio.move_on_after(ACCEPT_RETRY_S):
                    await self._released.wait()
                continue
            admitted = self._admit()
            if admitted is None:
                self._turned_away.warn(
                    "a connection closed as it was accepted: all %d connections are busy "
                    "and %d more are being refused (--max-connections)",
                    self.limit,
                    OVERFLOW,
                )
                await stream.aclose()
                continue
            nursery.start_soon(self._serve, connection, stream, admitted)

    async def _serve(
        self,
        connection: Callable[[trio.SocketStream], _Connection],
        stream: trio.SocketStream,
        admitted: str,
    ) -> None:
        conn = None
        try:
            conn = connection(stream)
            conn.refused = admitted == "refused"
            if conn.refused and conn.peer is not None:
                self.refused.add(conn.peer)
            await conn.run()
        finally:
            # Hypercorn's own close sends an EOF first, which a cancelled
            # connection (a stop without a drain) never gets past.
            with trio.move_on_after(CLOSE_S, shield=True):
                await stream.aclose()
            self._closed(conn, admitted)


class _Connection(TCPServer):
    """Hypercorn's connection handler, its idle timer kept by ``cap`` (and
    cancelled by it to evict the connection), and closed as soon as its
    peer is gone."""

    def __init__(self, cap: ConnectionCap, *args: Any) -> None:
        super().__init__(*args)
        self.cap = cap
        self.evicted = False
        self.refused = False
        self._reading = True
        try:
            sock = self.stream.socket
            self.peer: tuple[str, int] | None = parse_socket_addr(sock.family, sock.getpeername())
        except OSError:  # the peer left already
            self.peer = None

    async def _read_data(self) -> None:
        try:
            await super()._read_data()
        finally:
            # Nothing more comes: no keep-alive timer may hold the
            # descriptor (it held it 75 s), the connection ends with its
            # last request.
            self._reading = False
            with trio.move_on_after(CLOSE_S, shield=True):
                await self.idle_task.stop()

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, Updated) and event.idle and not self._reading:
            return  # the peer is gone: no timer for a next request
        await super().protocol_send(event)

    async def _close(self) -> None:
        # Without hypercorn's shutdown(SHUT_WR) first: close() sends the FIN
        # itself, so a peer that sees the end knows the descriptor is gone.
        await self.stream.aclose()

    async def _idle_timeout(self) -> None:
        idle_for = REFUSED_IDLE_S if self.refused else self.config.keep_alive_timeout
        with trio.move_on_after(idle_for) as timer:
            self.cap._went_idle(self, timer)
            try:
                await self.context.terminated.wait()
            finally:
                self.cap._went_busy(self, timer)
        if not self.evicted:
            # Stopped by hypercorn (a request began): the connection stays.
            await trio.lowlevel.checkpoint_if_cancelled()
        with trio.move_on_after(CLOSE_S, shield=True):
            await self._initiate_server_close()


async def serve_http(  # noqa: ASYNC128 - started() once the sockets listen
    app: Asgi,
    config: HypercornConfig,
    cap: ConnectionCap,
    *,
    shutdown_trigger: Callable[[], Awaitable[object]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``config``'s binds as hypercorn's ``serve`` does
    (its lifespan, its graceful shutdown once ``shutdown_trigger``
    returns), each connection accepted under ``cap``. Starts with the bound
    addresses (``http://HOST:PORT``). Plain HTTP only: the server sets no
    certificate.

    Cancellation: the connections are cancelled with it, the listening
    sockets closed."""
    config.set_statsd_logger_class(StatsdLogger)
    wrapped = ASGIWrapper(app)
    lifespan = Lifespan(wrapped, config, {})
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            sockets = config.create_sockets()
            listeners = []
            binds = []
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
                binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
            connection = partial(_Connection, cap, wrapped, config, context, {})
            task_status.started(binds)
            try:
                async with trio.open_nursery(strict_exception_groups=True) as nursery:
                    nursery.start_soon(raise_shutdown, shutdown_trigger)
                    for listener in listeners:
                        nursery.start_soon(cap.accept, listener, connection, server_nursery)
            except BaseExceptionGroup as error:
                _, others = error.split(ShutdownError)
                if others is not None:
                    raise others from None
            finally:
                # Closing a socket and setting an event: nothing here waits.
                with trio.move_on_after(CLOSE_S, shield=True):
                    for listener in listeners:
                        await listener.aclose()
                    await context.terminated.set()
                server_nursery.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


def bound_requests(app: Asgi, limit: int, cap: ConnectionCap | None = None) -> Asgi:
    """``app`` serving at most ``limit`` HTTP requests at once (``/health``
    besides); the one past it, and every one on a connection ``cap``
    refuses, is answered 503 without running ``app`` (``/health`` on a
    refused connection is answered, its connection closed after it).

    Cancellation: a cancelled request's slot is given back as ``app``
    returns."""
    slots = trio.Semaphore(limit)

    async def bounded(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        refused = cap is not None and cap.refuses(scope.get("client"))
        if scope.get("path") in _ALWAYS:
            await app(scope, receive, closing(send) if refused else send)
            return
        if refused:
            await _refuse(scope, send, "connections", limit)
            return
        try:
            slots.acquire_nowait()
        except trio.WouldBlock:
            await _refuse(scope, send, "requests", limit)
            return
        try:
            await app(scope, receive, send)
        finally:
            slots.release()

    return bounded


async def _refuse(scope: Any, send: Any, what: str, limit: int) -> None:
    if what == "connections":
        message = f"the server holds its limit of {limit} connections, each serving a request"
    else:
        message = f"the server is serving its limit of {limit} requests"
    err = TooBusy(f"{message} (--max-connections)")
    path = str(scope.get("path", ""))
    messages = path == anthropic_messages.MESSAGES_PATH or path.startswith(
        anthropic_messages.MESSAGES_PATH + "/"
    )
    body = dump_json(anthropic_messages.error_body(err) if messages else error_body(err)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(err.retry_after).encode()),
                # The body the client may still be sending is never read.
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
