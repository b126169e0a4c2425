"""The error hierarchy: every failure a caller can see is a ``GezelError``.

MLX, tokenizer and template errors are mapped to these classes where they are
raised; the HTTP edge turns them into OpenAI-shaped JSON using ``status``,
``error_type`` and ``code``. ``BaseException`` (``Cancelled``,
``KeyboardInterrupt``) is never mapped.
"""

from __future__ import annotations

__all__ = [
    "MAX_SHOWN",
    "EngineClosed",
    "EngineFailure",
    "GezelError",
    "InvalidImage",
    "InvalidRequest",
    "ModelLoadError",
    "QueueFull",
    "QueueTimeout",
    "RequestFailed",
    "SlowConsumer",
    "clipped",
    "shown",
]

# How much of a client's value an error quotes: a 2 MB field once made a
# 2 MB error (6 MB when it was an unknown key, named three times).
MAX_SHOWN = 200
# The backstop for a whole message (and a field path) built from values.
MAX_MESSAGE = 1000


def clipped(text: str, limit: int = MAX_SHOWN) -> str:
    """``text`` as it is, or its first ``limit`` characters, an ellipsis and
    its full length."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def shown(value: object, limit: int = MAX_SHOWN) -> str:
    """A client's value quoted for a message (its ``repr``), at most about
    ``limit`` characters: a longer one is cut, with an ellipsis and the
    full length of the value."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    return clipped(repr(value), limit)


class GezelError(Exception):
    """Base class. ``status`` is the HTTP status the edge answers with."""

    status: int = 500
    error_type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        # Bounded whatever a raiser quoted: an error goes back to the client
        # and into logs, never as large as the body that caused it.
        message = clipped(message, MAX_MESSAGE)
        super().__init__(message)
        self.message = message
        self.param = clipped(param, MAX_MESSAGE) if param is not None else None


class InvalidRequest(GezelError, ValueError):
    """The request cannot be served as written; ``param`` names the field."""

    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class InvalidImage(InvalidRequest):
    """An image that cannot be used: not a ``data:`` URL, not base64, not a
    PNG, JPEG, WebP or GIF, truncated, or over a limit. A 400, not a 422:
    every other bad input is a 400, so images are too; ``param`` names the
    content part."""

    code = "invalid_image"


class QueueFull(GezelError):
    """The admission queue is at its bound; retry after ``retry_after`` s."""

    status = 429
    error_type = "rate_limit_error"
    code = "queue_full"
    retry_after = 1


class QueueTimeout(GezelError):
    """The request waited in the admission queue longer than its bound
    (``EngineConfig.scheduling.background_queue_timeout``) and was dropped from it;
    retry after ``retry_after`` s."""

    status = 503
    error_type = "server_error"
    code = "queue_timeout"
    retry_after = 30


class EngineClosed(GezelError):
    """The engine is shutting down or has stopped; nothing new is admitted."""

    status = 503
    error_type = "server_error"
    code = "shutting_down"
    retry_after = 5


class SlowConsumer(GezelError):
    """The reader stopped draining its events; the sequence was dropped."""

    status = 500
    error_type = "server_error"
    code = "slow_consumer"


class EngineFailure(GezelError):
    """The shared model step failed (the sequences in it were failed), or
    the engine itself stopped working (every request fails with this)."""

    status = 500
    error_type = "server_error"
    code = "engine_failure"


class RequestFailed(GezelError):
    """Something built or done for this one request raised on the host thread
    (its sampler, a logits processor, its detokenizer, a cache save); the
    request was failed alone and every other request went on."""

    status = 500
    error_type = "server_error"
    code = "request_failed"


class ModelLoadError(GezelError):
    """The model directory could not be loaded."""

    status = 500
    error_type = "server_error"
    code = "model_load_failed"
