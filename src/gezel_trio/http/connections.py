"""How many HTTP requests the server serves at once: a bound at the ASGI
edge, in front of the app.

Hypercorn has no setting for it (its ``backlog`` is the kernel's accept
queue, ``h2_max_concurrent_streams`` is per connection), and every request
in progress holds memory: its body (up to ``--max-body-mb``), its parse, its
stream. Past the bound a request is answered 503 at once, before its body is
read, with ``Retry-After`` and ``Connection: close``, so the client's unsent
body is never waited for. ``/health`` is always answered: a probe must see
a busy server as busy, not as dead.

A slot is a request in progress, from its headers to its response's last
byte (a stream holds one to its end); an idle keep-alive connection holds
none (hypercorn closes it after its keep-alive timeout).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ..core.errors import GezelError
from . import anthropic_messages
from .sse import error_body
from .strict import dump_json

__all__ = ["TooBusy", "bound_requests"]

# The ASGI callable hypercorn serves.
Asgi = Callable[[Any, Any, Any], Awaitable[None]]

# Paths answered whatever the load.
_ALWAYS = frozenset({"/health"})


class TooBusy(GezelError):
    status = 503
    error_type = "server_error"
    code = "too_many_connections"
    retry_after = 1


def bound_requests(app: Asgi, limit: int) -> Asgi:
    """``app`` serving at most ``limit`` HTTP requests at once (``/health``
    besides); the one past it is answered 503 without running ``app``.

    Cancellation: a cancelled request's slot is given back as ``app``
    returns."""
    slots = trio.Semaphore(limit)

    async def bounded(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in _ALWAYS:
            await app(scope, receive, send)
            return
        try:
            slots.acquire_nowait()
        except trio.WouldBlock:
            await _refuse(scope, send, limit)
            return
        try:
            await app(scope, receive, send)
        finally:
            slots.release()

    return bounded


async def _refuse(scope: Any, send: Any, limit: int) -> None:
    err = TooBusy(f"the server is serving its limit of {limit} requests (--max-connections)")
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
