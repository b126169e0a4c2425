"""The HTTP edge's shared pieces: error classes, error responses, JSON bodies."""

from __future__ import annotations

import json
from typing import Any

import trio
from quart import Response, request

from ..core.errors import EngineClosed, GezelError, InvalidRequest, QueueFull
from .sse import error_body

__all__ = [
    "Forbidden",
    "HttpError",
    "NotFound",
    "Unauthorized",
    "UnsupportedMedia",
    "error_response",
    "json_body",
    "parse_json",
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


def error_response(err: GezelError) -> Response:
    resp = Response(json.dumps(error_body(err)), status=err.status, mimetype="application/json")
    if isinstance(err, QueueFull | EngineClosed):
        resp.headers["Retry-After"] = str(err.retry_after)
    return resp


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def parse_json(raw: str | bytes) -> Any:
    """Strict JSON: ``NaN`` and ``Infinity`` (which Python's parser accepts)
    are refused, as are integers too long to parse; ``InvalidRequest`` on
    any of it."""
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        # JSONDecodeError is a ValueError; so are int-length limits.
        raise InvalidRequest(f"the body is not valid JSON: {str(exc)[:200]}") from None


async def json_body() -> Any:
    """The request's JSON body. Parsed on a worker thread: a body of several
    megabytes must not hold the event loop."""
    ctype = (request.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
    if ctype != "application/json":
        # A web page's text/plain form post must not run a completion (O5).
        raise UnsupportedMedia("requests must be sent as application/json")
    raw = await request.get_data(as_text=False)
    if len(raw) < 65_536:
        return parse_json(raw)
    return await trio.to_thread.run_sync(parse_json, raw)
