"""``/health``: the body it answers, and the answer given at the ASGI edge
before the Quart app runs.

A probe polls ``/health`` while the server works, and what it measures is
the answer's latency. Through Quart a ``GET /health`` costs about 0.65 ms
of Python on this project's CPUs (request and context objects, the
before/after hooks, routing, the response object); ``health_first``
answers the plain probe (a ``GET`` with no body and no ``Origin``, whose
``Host`` the origin policy allows) with the same bytes from the ASGI scope
alone. Anything else - a ``HEAD``, a body, a browser's request, a refused
host - goes through the app, which answers it as it answers every route.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..engine import Engine
from .origins import OriginPolicy
from .response_store import ResponseStore
from .strict import dump_json

__all__ = ["HEALTH_PATH", "Asgi", "HealthProbe", "health_first"]

HEALTH_PATH = "/health"

Asgi = Callable[[Any, Any, Any], Awaitable[None]]


class HealthProbe:
    """What ``/health`` answers: the engine's condition, the response
    store's, and the queue, as ``(status code, JSON bytes)``."""

    def __init__(self, engine: Engine, store: ResponseStore, policy: OriginPolicy) -> None:
        self.engine = engine
        self.store = store
        self.policy = policy

    def answer(self) -> tuple[int, bytes]:
        h = self.engine.health()
        state = self.engine.state()
        status, reasons = h.status, list(h.reasons)
        if self.store.problem is not None and status in ("ok", "degraded"):
            # Serving still: only the stored responses' files are missing.
            status = "degraded"
            reasons.append(
                f"stored responses not persisted: {self.store.problem} "
                f"({self.store.failed_writes} failed writes)"
            )
        body = {
            "status": status,
            "reasons": reasons,
            "model": self.engine.info.model_id,
            "queued": len(state.queued),
            "running": len(state.running),
            "live": state.live,
            "step": state.step,
        }
        group = self.engine.info.group
        if group is not None:
            now = time.monotonic()
            body["group"] = {
                "world_size": group.world_size,
                "split": group.split,
                # Each rank's finished steps, as it told rank 0, and how long ago.
                "ranks": [
                    {"rank": r.rank, "steps": r.steps, "seconds_ago": round(now - r.at, 3)}
                    for r in state.ranks
                ],
            }
        code = 503 if status in ("failed", "shutting_down") else 200
        return code, dump_json(body).encode()

    def plain(self, scope: Any) -> bool:
        """Whether ``scope`` is a probe this module may answer itself."""
        if scope["type"] != "http" or scope["path"] != HEALTH_PATH or scope["method"] != "GET":
            return False
        host = ""
        for name, value in scope["headers"]:
            if name in (b"origin", b"transfer-encoding"):
                return False
            if name == b"content-length" and value.strip() != b"0":
                return False
            if name == b"host":
                host = value.decode("latin-1")
        # No Host header: the app's check answers that.
        return bool(host) and self.policy.host_problem(host) is None


def health_first(app: Asgi, probe: HealthProbe) -> Asgi:
    """``app`` with a plain ``GET /health`` answered before it runs."""

    async def answered(scope: Any, receive: Any, send: Any) -> None:
        if not probe.plain(scope):
            await app(scope, receive, send)
            return
        # The request is whole (no body was announced); read its one message
        # so that the server sees the body consumed before the response.
        await receive()
        code, body = probe.answer()
        await send(
            {
                "type": "http.response.start",
                "status": code,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return answered
