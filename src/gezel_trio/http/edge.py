"""The HTTP edge's shared pieces: error classes, error responses, JSON bodies."""

from __future__ import annotations

import json
from typing import Any

from quart import Response, request

from ..errors import EngineClosed, GezelError, InvalidRequest, QueueFull
from .sse import error_body

__all__ = [
    "Forbidden",
    "NotFound",
    "Unauthorized",
    "UnsupportedMedia",
    "error_response",
    "json_body",
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


def error_response(err: GezelError) -> Response:
    resp = Response(json.dumps(error_body(err)), status=err.status, mimetype="application/json")
    if isinstance(err, QueueFull | EngineClosed):
        resp.headers["Retry-After"] = str(err.retry_after)
    return resp


async def json_body() -> Any:
    ctype = (request.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
    if ctype != "application/json":
        # A web page's text/plain form post must not run a completion (O5).
        raise UnsupportedMedia("requests must be sent as application/json")
    raw = await request.get_data(as_text=False)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
