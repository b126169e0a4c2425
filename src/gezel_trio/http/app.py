"""The quart-trio application: one blueprint per protocol, the server's own
routes, the checks every request passes, and error mapping.

Each protocol is a ``ProtocolBlueprint`` that answers its own errors in its
own envelope (Anthropic's on ``/v1/messages``, OpenAI's elsewhere). What
fails before a route's view runs - a refused key or host, a body too large,
an unknown path or method - is answered here, in the envelope of the
blueprint whose route or ``url_prefix`` the path is, else OpenAI's.

The app holds a reference to the engine it was created for; it owns no tasks.
A streaming response's generator submits the request as its first act and
withdraws it in ``with handle:`` on every exit path - when the client goes
away, quart-trio cancels the generator (about 1 ms after the close) and the
sequence leaves the batch at the next engine step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
from prometheus_client import CONTENT_TYPE_LATEST
from quart import Response, g, has_websocket_context, request, websocket
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException
from werkzeug.routing.exceptions import WebsocketMismatch

from ..core.errors import GezelError
from ..core.settings import MIB, setting
from ..engine import Engine
from ..shaping.shaper import REASONING_FORMATS, ReasoningFormat
from . import (
    anthropic_messages,
    cache_api,
    checks,
    openai_chat,
    openai_completions,
    openai_responses,
)
from .edge import (
    FIELD_NOTES,
    FieldNotes,
    Forbidden,
    ForbiddenOrigin,
    HttpError,
    NotFound,
    ProtocolBlueprint,
    Unauthorized,
    error_response,
    refusal,
)
from .openapi import openapi_json
from .origins import OriginPolicy, check_origins
from .probe import HEALTH_PATH, Asgi, HealthProbe, health_first
from .response_store import ResponseStore
from .sse import STREAM_HOLD_KEY
from .strict import StrictJSONProvider
from .tenancy import NO_TENANT, KeyRing, bodies_after_keys, read_key_file

__all__ = ["HttpSettings", "create_app", "served"]

log = logging.getLogger("gezel_trio.http")


def _keys(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``api_key`` as given: one key, several, or none."""
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _check_keys(keys: tuple[str, ...]) -> None:
    if any(not k for k in keys):
        raise ValueError("--api-key must not be empty")


@attrs.frozen
class HttpSettings:
    """The HTTP edge's settings: ``http.app`` reads them and hands each to
    the part that applies it (``http.connections``, ``http.origins``,
    ``http.tenancy``, the protocols' blueprints).

    Declared like ``EngineConfig``'s (``core.settings``)."""

    host: str = setting("127.0.0.1", flag="--host", help="the address to listen on")
    # Each key is a tenant (``http.tenancy``); one given as a string is one key.
    api_key: tuple[str, ...] = setting(
        (),
        flag="--api-key",
        repeat=True,
        converter=_keys,
        validator=lambda _i, _a, keys: _check_keys(keys),
        help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY'; repeat for more keys, "
        "each a tenant with its own stored responses and cache entries",
    )
    api_key_file: Path | None = setting(
        None,
        flag="--api-key-file",
        validator=lambda _i, _a, path: path is None or read_key_file(path),
        help="more keys, one a line (blank lines and # comments skipped), as --api-key",
    )
    max_body_bytes: int = setting(
        8 * MIB,
        flag="--max-body-mb",
        flag_type=float,
        per_unit=MIB,
        help="largest request body, in MB",
    )
    # Each open connection holds a descriptor, each request in progress its
    # body, its parse and its stream; hypercorn bounds none of it
    # (``http.connections``).
    max_connections: int = setting(
        256,
        flag="--max-connections",
        validator=attrs.validators.gt(0),
        help="open HTTP connections, idle keep-alive ones included, and requests in progress; "
        "past it the longest idle connection is closed, or with none idle a request is "
        "answered 503 at once (Retry-After, its connection closed, its body unread); "
        "/health is always answered",
    )
    # 75 s outlasts the keep-alive of the clients and proxies in front
    # (httpx 5 s, Node 4-5 s, a load balancer's 60 s), so they close first
    # and never send on a connection closing under them.
    idle_timeout: float = setting(
        75.0,
        flag="--idle-timeout",
        flag_type=float,
        validator=attrs.validators.gt(0),
        help="seconds a connection with no request in progress stays open: a new one that "
        "sends nothing, or a keep-alive one between requests",
    )
    # A browser page's state-changing requests (POST, DELETE) are refused
    # unless its Origin is the server's own, a loopback one, or one of these
    # (``http.origins``); these also get CORS headers, so such a page can call
    # the API.
    allowed_origins: tuple[str, ...] = setting(
        (),
        flag="--allowed-origin",
        repeat=True,
        validator=lambda _i, _a, value: check_origins(value),
        help="an origin (https://app.example) whose web pages may send POST and DELETE "
        "requests, with CORS headers; repeat for more, * for any",
    )
    # Against DNS rebinding: the Host names answered besides loopback names
    # (and IP literals, when bound beyond loopback without --api-key).
    allowed_hosts: tuple[str, ...] = setting(
        (),
        flag="--allowed-host",
        repeat=True,
        help="a Host name the server answers besides loopback names and IP addresses "
        "(checked when bound to loopback, or beyond it without --api-key); repeat for more",
    )
    # Off: a streamed tool call comes whole, in one chunk, when the answer
    # ends (the seed's --stream-tool-calls absent); on: as argument deltas.
    stream_tool_calls: bool = setting(
        True,
        flag="--stream-tool-calls",
        on_off=True,
        help="on: tool calls stream as argument deltas; off: each call comes whole, "
        "in one chunk, when the answer ends",
    )
    # The seed sidecar answered a bare array of its named entries, and its
    # client (the gezel app's cache adapter) reads nothing else.
    cache_stats_format: str = setting(
        "object",
        flag="--cache-stats-format",
        help="GET /v1/cache/stats as an 'object' (entries under data, with totals) or as "
        "an 'array' of the named entries, as the seed sidecar answered",
        validator=attrs.validators.in_(("object", "array")),
    )
    # The seed sent the think block inside content, as written, and its
    # client splits <think> itself (llama.cpp's --reasoning-format none).
    reasoning_format: ReasoningFormat = setting(
        "auto",
        flag="--reasoning-format",
        flag_type=str,
        choices=REASONING_FORMATS,
        validator=attrs.validators.in_(REASONING_FORMATS),
        help="chat completions: 'auto' sends the think block as reasoning_content; "
        "'none' leaves it in content as the model wrote it (<think> markers included); "
        "a request's reasoning_format field wins",
    )
    # A stream's output waits up to this long for the tokens due before
    # then (``http.sse.ChatStream``): on a CPU each send takes the compute's
    # cores (8 streams of the dense bench model: 0.944-0.948 of raw with
    # one frame per token, 1.005-1.010 with two; docs/performance.md).
    stream_hold_ms: float = setting(
        25.0,
        flag="--stream-hold-ms",
        flag_type=float,
        validator=[attrs.validators.ge(0), attrs.validators.le(1000)],
        help="a streamed answer's tokens wait up to this many ms for the next ones "
        "(sent together, in one write) when the model makes them faster than that; "
        "the first token and the end are never held; 0 sends each token as it comes",
    )
    # Off: a field the server does not implement is ignored and named in
    # the x-gezel-ignored-fields header (http.edge); on: it is a 400.
    strict_fields: bool = setting(
        False,
        flag="--strict-fields",
        help="refuse a request naming a field this server does not implement (400 naming "
        "it) instead of ignoring it and naming it in the x-gezel-ignored-fields header",
    )
    # Told of every bug a route survived (answered 500): the server's stdout
    # protocol prints it tagged, so a supervisor never reads it as a death.
    on_bug: Callable[[BaseException, str], None] | None = attrs.field(default=None, eq=False)


def _closing_unread(resp: Response) -> Response:
    """``resp``, answering a request whose body was not read: when one may
    follow the headers, the connection closes after ``resp``, so the body is
    never read nor waited for (nor taken for the next request's start)."""
    if request.headers.get("Content-Length", "0") != "0" or "Transfer-Encoding" in request.headers:
        resp.headers["Connection"] = "close"
    return resp


def _preflight(origin: str) -> Response:
    """A CORS preflight's answer for an allowed origin: any method the API
    has, and the headers the browser asked to send."""
    resp = Response("", status=204)
    resp.headers["Access-Control-Allow-Origin"] = origin
    resp.headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE"
    asked = request.headers.get("Access-Control-Request-Headers")
    if asked:
        resp.headers["Access-Control-Allow-Headers"] = asked
    resp.headers["Access-Control-Max-Age"] = "600"
    resp.vary.add("Origin")
    return resp


def create_app(
    engine: Engine, settings: HttpSettings, responses: ResponseStore | None = None
) -> QuartTrio:
    """The app over ``engine``. ``responses`` holds stored Responses; the
    server passes the one running in its nursery (without it: an in-memory
    store that refuses ``background: true``)."""
    app = QuartTrio(__name__)
    # The dicts views return are written refusing NaN and Infinity too.
    app.json = StrictJSONProvider(app)
    # Quart's default 60 s response timeout silently cuts long streams.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 60
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.config[STREAM_HOLD_KEY] = settings.stream_hold_ms / 1000
    keys = KeyRing.of(settings.api_key, settings.api_key_file)
    policy = OriginPolicy.of(
        settings.host, bool(keys), settings.allowed_hosts, settings.allowed_origins
    )

    store = responses if responses is not None else ResponseStore()
    engine.metrics.sizes(
        "http", lambda: {"stored_response_bytes": store.total_bytes, **checks.bookkeeping()}
    )
    protocols: list[ProtocolBlueprint] = [
        cache_api.blueprint(engine, stats_format=settings.cache_stats_format),
        openai_chat.blueprint(
            engine,
            stream_tool_calls=settings.stream_tool_calls,
            reasoning_format=settings.reasoning_format,
        ),
        openai_completions.blueprint(engine),
        openai_responses.blueprint(engine, store),
        anthropic_messages.blueprint(engine),
    ]
    refuse_openai = refusal(engine, error_response)
    probe = HealthProbe(engine, store, policy)
    app.extensions[_PROBE] = probe
    app.extensions[_KEYS] = keys
    app.extensions[FIELD_NOTES] = FieldNotes(
        engine.metrics.ignored_fields, strict=settings.strict_fields
    )

    def refuse(err: GezelError) -> Response:
        # Each protocol's errors in its own envelope, whatever raised them:
        # the blueprint of the matched route, else the one whose url_prefix
        # the path is under (an unknown path or method there).
        incoming = _incoming()
        for protocol in protocols:
            if incoming.blueprint == protocol.name or protocol.owns(incoming.path):
                return protocol.refuse(err)
        return refuse_openai(err)

    @app.before_request
    async def guard() -> Response | None:
        # Nothing of the body is read before the checks below: a 500 MB
        # upload with a wrong key gets its 401 at once (``_closing_unread``).
        host = request.host or ""
        origin = request.headers.get("Origin")
        try:
            # DNS rebinding: a page on evil.example resolving to this server
            # must not reach it (http.origins).
            if (problem := policy.host_problem(host)) is not None:
                raise Forbidden(problem)
            # A page on another origin posting a form or a bodiless POST:
            # browsers send those without a preflight.
            if (problem := policy.origin_problem(request.method, origin, host)) is not None:
                raise ForbiddenOrigin(problem)
            if request.method == "OPTIONS" and (allowed := policy.cors_origin(origin)):
                # A preflight carries no key: answered before the key check.
                return _closing_unread(_preflight(allowed))
            # The key names the tenant; without keys, everyone is the one tenant.
            tenant = NO_TENANT
            if keys and request.path != HEALTH_PATH:
                found = keys.tenant(request.headers)
                if found is None:
                    raise Unauthorized("missing or wrong API key")
                tenant = found
            g.gezel_tenant = tenant
        except GezelError as err:
            return _closing_unread(refuse(err))
        # Every body is read, whatever the route does with it: hypercorn can
        # stall the next request on a keep-alive connection when a response
        # goes out before the body was received (a GET with a body, a 404).
        await request.get_data(cache=True)
        return None

    @app.after_request
    async def cors(resp: Response) -> Response:
        allowed = policy.cors_origin(request.headers.get("Origin"))
        if allowed is not None:
            resp.headers["Access-Control-Allow-Origin"] = allowed
            resp.vary.add("Origin")
        return resp

    # Every error leaves as a JSON envelope, never an HTML page.
    @app.errorhandler(GezelError)
    async def on_gezel_error(err: GezelError) -> Response:
        return refuse(err)

    @app.errorhandler(HTTPException)
    async def on_http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        incoming = _incoming()
        if status == 404:
            return refuse(NotFound(f"no route {incoming.method} {incoming.path}"))
        if isinstance(exc, WebsocketMismatch) and has_websocket_context():
            message = f"{incoming.path} is not served over a WebSocket"
            return refuse(HttpError(400, "websocket_not_supported", message))
        if status == 405:
            message = f"method {incoming.method} is not allowed on {incoming.path}"
            resp = refuse(HttpError(405, "method_not_allowed", message))
            allowed = getattr(exc, "valid_methods", None)
            if allowed:
                resp.headers["Allow"] = ", ".join(sorted(allowed))
            return resp
        if status == 413:
            message = f"the request body exceeds {settings.max_body_bytes} bytes"
            return refuse(HttpError(413, "body_too_large", message))
        name = (exc.name or "error").lower().replace(" ", "_")
        return refuse(HttpError(status, name, exc.description or exc.name or "HTTP error"))

    @app.errorhandler(Exception)
    async def on_bug(exc: Exception) -> Response:
        # A bug, not the client's fault: logged with its traceback, and
        # answered in the envelope like everything else.
        incoming = _incoming()
        log.error("unhandled error on %s %s", incoming.method, incoming.path, exc_info=exc)
        if settings.on_bug is not None:
            settings.on_bug(exc, f"{incoming.method} {incoming.path} answered 500; serving on")
        return refuse(GezelError(f"internal error: {type(exc).__name__}"))

    for protocol in protocols:
        app.register_blueprint(protocol)

    @app.route(HEALTH_PATH)
    async def health() -> Response:
        code, body = probe.answer()
        return Response(body, status=code, mimetype="application/json")

    @app.route("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.exposition(), mimetype=CONTENT_TYPE_LATEST)

    @app.route("/openapi.json")
    async def openapi() -> Response:
        document = openapi_json(engine.info.model_id, settings.strict_fields)
        return Response(document, mimetype="application/json")

    def model_card() -> dict[str, Any]:
        # The window under both names editors read: ``max_model_len``
        # (vLLM's; Cline and opencode) and ``context_length``.
        return {
            "id": engine.info.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "gezel-trio",
            "max_model_len": engine.info.context_length,
            "context_length": engine.info.context_length,
        }

    @app.route("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.route("/v1/models/<path:model_id>")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != engine.info.model_id:
            raise HttpError(404, "model_not_found", f"the model {model_id!r} is not served here")
        return model_card()

    return app


_PROBE = "gezel_trio.health_probe"
_KEYS = "gezel_trio.keys"


def _incoming() -> Any:
    """The request, or the WebSocket handshake, being answered: the error
    handlers run for both (a handshake on an HTTP route reached them with
    no request and answered a bare 500)."""
    return websocket if has_websocket_context() else request


def served(app: QuartTrio) -> Asgi:
    """The ASGI callable to serve ``app`` (made by ``create_app``) with: a
    plain ``GET /health`` is answered before Quart runs (``http.probe``),
    and a request without a valid key never has its body read
    (``tenancy.bodies_after_keys``)."""
    probe: HealthProbe = app.extensions[_PROBE]
    keys: KeyRing = app.extensions[_KEYS]
    return health_first(bodies_after_keys(app, keys), probe)
