"""The HTTP edge's shared pieces: error classes, the OpenAI error envelope,
the blueprint every protocol is, and JSON bodies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio
from quart import Blueprint, Response, request

from ..core.errors import EngineClosed, GezelError, QueueFull
from ..engine import Engine
from .sse import error_body
from .strict import dump_json, parse_json

__all__ = [
    "Envelope",
    "Forbidden",
    "ForbiddenOrigin",
    "HttpError",
    "NotFound",
    "ProtocolBlueprint",
    "Unauthorized",
    "UnsupportedMedia",
    "error_response",
    "json_body",
    "refusal",
]


class Unauthorized(GezelError):
    status = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class UnsupportedMedia(GezelError):
    status = 415
    error_type = "invalid_request_error"
    code = "unsupported_media_type"


class Forbidden(GezelError):
    status = 403
    error_type = "invalid_request_error"
    code = "forbidden_host"


class ForbiddenOrigin(Forbidden):
    code = "forbidden_origin"


class NotFound(GezelError):
    status = 404
    error_type = "invalid_request_error"
    code = "not_found"


class HttpError(GezelError):
    """An HTTP-level refusal (405, 413, 408 ...) in the OpenAI envelope."""

    error_type = "invalid_request_error"

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


# How one protocol writes an error as a response.
Envelope = Callable[[GezelError], Response]


def error_response(err: GezelError) -> Response:
    """The OpenAI envelope: ``{"error": {"message", "type", "code", "param"}}``."""
    resp = Response(dump_json(error_body(err)), status=err.status, mimetype="application/json")
    if isinstance(err, QueueFull | EngineClosed):
        resp.headers["Retry-After"] = str(err.retry_after)
    return resp


def refusal(engine: Engine, envelope: Envelope) -> Envelope:
    """``envelope``, each error counted in ``engine``'s metrics first."""

    def refuse(err: GezelError) -> Response:
        engine.metrics.http_errors.labels(str(err.status), err.code or "").inc()
        return envelope(err)

    return refuse


class ProtocolBlueprint(Blueprint):
    """One protocol's routes, and how its errors leave (``refuse``).

    The errors its views raise are handled here. What fails before a view
    runs - a refused key or host, an unknown path or method under
    ``url_prefix`` - reaches the app's handlers, which ask ``owns`` and
    answer with this blueprint's ``refuse`` too."""

    def __init__(
        self, name: str, import_name: str, refuse: Envelope, *, url_prefix: str | None = None
    ) -> None:
        super().__init__(name, import_name, url_prefix=url_prefix)
        self.refuse = refuse
        self.register_error_handler(GezelError, self._on_error)

    def owns(self, path: str) -> bool:
        """Whether ``path`` lies under this blueprint's ``url_prefix``."""
        prefix = self.url_prefix
        return prefix is not None and (path == prefix or path.startswith(prefix + "/"))

    async def _on_error(self, err: GezelError) -> Response:
        # A coroutine: Quart would run a plain function on a worker thread.
        return self.refuse(err)


async def json_body() -> Any:
    """The request's JSON body. Parsed on a worker thread: a body of several
    megabytes must not hold the event loop."""
    ctype = (request.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
    if ctype != "application/json":
        # A web page's text/plain form post (which a browser sends to any
        # origin without asking) must not run a completion.
        raise UnsupportedMedia("requests must be sent as application/json")
    raw = await request.get_data(as_text=False)
    if len(raw) < 65_536:
        return parse_json(raw)
    return await trio.to_thread.run_sync(parse_json, raw)
