"""The HTTP edge's shared pieces: error classes, the OpenAI error envelope,
the blueprint every protocol is, and JSON bodies.

Every body is read by ``json_body`` / ``json_view``, so the fields a body
holds that the server does not implement (``http.strict``: dropped where
they are structured) are reported here, once for every route: the
``x-gezel-ignored-fields`` header on the response (a stream's too), an
info line the first time the app meets each name, and
``gezel_ignored_fields_total`` by name (``FieldNotes``). With
``--strict-fields`` they are a 400 instead."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar, cast

import trio
from prometheus_client import Counter
from quart import Blueprint, Response, after_this_request, current_app, request

from ..core.errors import EngineClosed, GezelError, QueueFull, QueueTimeout, clipped, shown
from ..engine import Engine
from .sse import error_body
from .strict import (
    IgnoredFields,
    collecting_fields,
    dump_json,
    header_path,
    parse_json,
    parse_json_yielding,
)

__all__ = [
    "FIELD_NOTES",
    "IGNORED_FIELDS_HEADER",
    "IGNORED_TOOLS_HEADER",
    "Envelope",
    "FieldNotes",
    "Forbidden",
    "ForbiddenOrigin",
    "HttpError",
    "NotFound",
    "ProtocolBlueprint",
    "Unauthorized",
    "UnsupportedMedia",
    "closing",
    "error_response",
    "json_body",
    "json_view",
    "refusal",
]

T = TypeVar("T")

IGNORED_FIELDS_HEADER = "x-gezel-ignored-fields"

# Where an app keeps its ``FieldNotes`` (``create_app`` puts them there).
FIELD_NOTES = "gezel_trio.field_notes"

log = logging.getLogger("gezel_trio.http")
V = TypeVar("V")

# Names the tools of a request that were left out of its prompt (kinds this
# server cannot run), comma-separated, once each, on every protocol.
IGNORED_TOOLS_HEADER = "x-gezel-ignored-tools"


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


def closing(send: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """An ASGI ``send`` whose response says ``Connection: close``: the
    server closes the connection after it."""

    async def closing_send(message: Any) -> None:
        if message["type"] == "http.response.start":
            headers = [h for h in message.get("headers", ()) if h[0].lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return closing_send


def error_response(err: GezelError) -> Response:
    """The OpenAI envelope: ``{"error": {"message", "type", "code", "param"}}``."""
    resp = Response(dump_json(error_body(err)), status=err.status, mimetype="application/json")
    if isinstance(err, QueueFull | QueueTimeout | EngineClosed):
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


# Field names with a label of their own on the counter; later ones are
# counted as "other", so no client can grow the scrape without bound.
_LABELLED_NAMES = 64
# Field names logged (once each); past it, one line says logging stopped.
_LOGGED_NAMES = 256
# A name as a label or in the log line, at most this many characters.
_NAME_CHARS = 64


class FieldNotes:
    """What an app tells of the fields its bodies held and it ignored: the
    counter by name and a log line the first time each name is met (per
    app: the server has one). ``strict``: such a field is a 400 instead."""

    def __init__(self, counter: Counter, *, strict: bool) -> None:
        self.strict = strict
        self._counter = counter
        self._labelled: set[str] = set()
        self._logged: set[str] = set()

    def tell(self, ignored: IgnoredFields, where: str) -> None:
        """Count and log what one request's body held (``where``: its route)."""
        for name in ignored.names:
            label = clipped(name, _NAME_CHARS)
            if label not in self._labelled and len(self._labelled) < _LABELLED_NAMES:
                self._labelled.add(label)
            self._counter.labels(label if label in self._labelled else "other").inc()
            self._log_once(name, ignored, where)
        if ignored.more_names:
            self._counter.labels("other").inc(ignored.more_names)

    def _log_once(self, name: str, ignored: IgnoredFields, where: str) -> None:
        if name in self._logged or len(self._logged) > _LOGGED_NAMES:
            return
        self._logged.add(name)
        if len(self._logged) > _LOGGED_NAMES:
            log.info("ignored fields: more than %d names met; no more are logged", _LOGGED_NAMES)
            return
        first = next((p for p in ignored.paths if p[-1] == name), (name,))
        log.info(
            "ignored field %s, not implemented here (first at %s on %s); requests holding "
            "it are named in the %s header and counted in gezel_ignored_fields_total",
            shown(name, _NAME_CHARS),
            header_path(first),
            where,
            IGNORED_FIELDS_HEADER,
        )


# Bodies below this size are parsed, structured and checked on the Trio
# thread. The costliest shape measured, a chat of many short messages, takes
# about 0.14 ms per KB (97 KB: 13.5 ms), so 16 KB holds the loop ~2 ms; a
# worker-thread round trip costs ~0.1 ms, worth paying only above that.
_INLINE_BODY_BYTES = 16_384
# Worker threads that parse large bodies at once: more large bodies wait for
# one, so a burst of 8 MB bodies cannot take every worker thread (which the
# engine's own thread calls share) nor multiply the memory held by parses.
_BODY_PARSERS = 2


async def json_body(parse: Callable[[Any], T]) -> T:
    """The request's JSON body, validated by ``parse`` (a protocol's
    ``parse_*_request``). A large body is parsed, structured and checked on a
    worker thread: an 8 MB prompt of 4M token ids held the event loop 6.4 s
    (``/health`` and every running stream stalled with it).

    Cancellation while a worker parses leaves the parse to finish on its
    thread, its result dropped (a parse is bounded by the body's size)."""
    return await _from_body(parse)


async def json_view(parse: Callable[[Any], T], view: Callable[[T], V]) -> tuple[T, V]:
    """``json_body(parse)`` and ``view`` of it (the engine's request a
    protocol builds from its wire request), a large body's on the same
    worker thread: building the engine's view of 4,096 messages of 50 parts
    each held the loop 40-73 ms on every protocol."""

    def both(body: Any) -> tuple[T, V]:
        req = parse(body)
        return req, view(req)

    return await _from_body(both)


async def _from_body(parse: Callable[[Any], T]) -> T:
    ctype = (request.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
    if ctype != "application/json":
        # A web page's text/plain form post (which a browser sends to any
        # origin without asking) must not run a completion.
        raise UnsupportedMedia("requests must be sent as application/json")
    raw = await request.get_data(as_text=False)
    notes: FieldNotes = current_app.extensions[FIELD_NOTES]
    if len(raw) < _INLINE_BODY_BYTES:
        parsed, ignored = _parse_body(parse, raw, notes.strict, parse_json)
    else:
        parsed, ignored = await trio.to_thread.run_sync(
            _parse_body,
            parse,
            raw,
            notes.strict,
            parse_json_yielding,
            limiter=_body_parsers(),
            abandon_on_cancel=True,
        )
        _free_off_loop(parsed)
    if ignored:
        notes.tell(ignored, f"{request.method} {request.path}")
        header = ignored.header()

        async def name_them(response: Any) -> Any:  # quart's or werkzeug's Response
            response.headers[IGNORED_FIELDS_HEADER] = header
            return response

        after_this_request(name_them)
    return parsed


def _free_off_loop(parsed: object) -> None:
    """Have ``parsed`` dropped on a body-parser thread, where it was made,
    when the request has its response (unless something else, a running
    stream, still holds it). One drop of the largest body (8 MB of 268k
    one-character parts) holds the GIL 19-24 ms of CPU here; freeing it a
    slice at a time shortened each hold to the switch interval but cost
    89-99 ms of CPU, and no bound asks for the shorter hold."""
    held = [parsed]

    async def free(response: Any) -> Any:  # quart's or werkzeug's Response
        await trio.to_thread.run_sync(held.clear, limiter=_body_parsers())
        return response

    after_this_request(free)


def _parse_body(
    parse: Callable[[Any], T],
    raw: str | bytes,
    strict: bool,
    read: Callable[[str | bytes], Any],
) -> tuple[T, IgnoredFields]:
    # On a worker thread, ``read`` is ``parse_json_yielding``: parsed a
    # piece at a time, as json.loads held the GIL, and so the Trio thread,
    # ~150 ms for an 8 MB body even there. The report is opened here, on
    # the thread the parse runs on.
    try:
        with collecting_fields(strict=strict) as report:
            parsed = parse(read(raw))
        return parsed, report.ignored
    except GezelError as err:
        # A refusal leaves without the frames it was raised through: they
        # hold the parsed body (4M ids: two lists of 4M), which would
        # otherwise be freed on the Trio thread with the error, ~50 ms.
        err.__context__ = err.__cause__ = None
        raise err.with_traceback(None) from None


def _body_parsers() -> trio.CapacityLimiter:
    """The app's limiter on large-body parses, made on first use."""
    limiter = current_app.extensions.get("gezel_body_parsers")
    if limiter is None:
        limiter = current_app.extensions["gezel_body_parsers"] = trio.CapacityLimiter(_BODY_PARSERS)
    return cast(trio.CapacityLimiter, limiter)
