"""The quart-trio application: routes, validation at the edge, error mapping.

The app holds a reference to the engine it was created for; it owns no tasks.
A streaming response's generator submits the request as its first act and
withdraws it in ``with handle:`` on every exit path - when the client goes
away, quart-trio cancels the generator (about 1 ms after the close) and the
sequence leaves the batch at the next engine step.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections import deque
from typing import Any

import attrs
import trio
from prometheus_client import CONTENT_TYPE_LATEST
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from ..engine import Engine, RequestHandle
from ..errors import GezelError, InvalidRequest
from ..events import (
    Delta,
    Event,
    Failed,
    Finished,
    Parked,
    Progress,
    Queued,
    Resumed,
    TokenLogprob,
    Usage,
)
from ..request import CacheRequest, GenerationRequest, SamplingParams
from .cache_api import add_cache_routes, roster_fingerprint
from .edge import Forbidden, HttpError, NotFound, Unauthorized, error_response, json_body
from .openapi import openapi_json
from .shaping import Shaper, logprobs_body
from .sse import DONE, chunk, comment, completion, error_body, frame
from .wire import ChatCompletionRequest, parse_chat_request, tool_dicts

__all__ = ["HttpSettings", "create_app"]

log = logging.getLogger("gezel_trio.http")

_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


@attrs.frozen
class HttpSettings:
    host: str = "127.0.0.1"
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    allowed_origins: tuple[str, ...] = ()


def _sampling(req: ChatCompletionRequest) -> SamplingParams:
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        min_p=req.min_p or 0.0,
        seed=req.random_seed,
        repetition_penalty=req.repetition_penalty,
        repetition_context_size=req.repetition_context_size or 20,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=req.bias,
    )


def _refuse_unsupported(req: ChatCompletionRequest) -> None:
    """Fields the wire contract names but this build does not serve yet are
    refused loudly rather than ignored."""
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    for i, m in enumerate(req.messages):
        if m.has_images():
            raise InvalidRequest(
                "this server has no vision model loaded", param=f"messages[{i}].content"
            )


def _host_name(host: str) -> str:
    """The name part of a Host header: ``[::1]:8080`` -> ``[::1]``, ``a:80`` -> ``a``."""
    host = host.lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0]


def create_app(engine: Engine, settings: HttpSettings) -> QuartTrio:
    app = QuartTrio(__name__)
    # Quart's default 60 s response timeout silently cuts long streams.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 60
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    loopback_bound = settings.host in _LOOPBACK_HOSTS

    def refuse(err: GezelError) -> Response:
        engine.metrics.http_errors.labels(str(err.status), err.code or "").inc()
        return error_response(err)

    @app.before_request
    async def guard() -> Response | None:
        # Every body is read, whatever the route does with it: hypercorn can
        # stall the next request on a keep-alive connection when a response
        # goes out before the body was received (a GET with a body, a 404).
        await request.get_data(cache=True)
        try:
            # DNS rebinding: a page on evil.example resolving to 127.0.0.1 must
            # not reach a loopback-bound server.
            if loopback_bound and _host_name(request.host or "") not in _LOOPBACK_HOSTS:
                raise Forbidden(f"host {request.host!r} is not allowed")
            if settings.api_key is not None and request.path != "/health":
                given = request.headers.get("Authorization", "")
                expected = f"Bearer {settings.api_key}"
                if not hmac.compare_digest(given.encode(), expected.encode()):
                    raise Unauthorized("missing or wrong API key")
        except GezelError as err:
            return refuse(err)
        return None

    # Every error leaves as the OpenAI JSON envelope, never an HTML page.
    @app.errorhandler(GezelError)
    async def on_gezel_error(err: GezelError) -> Response:
        return refuse(err)

    @app.errorhandler(HTTPException)
    async def on_http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        if status == 404:
            return refuse(NotFound(f"no route {request.method} {request.path}"))
        if status == 405:
            message = f"method {request.method} is not allowed on {request.path}"
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
        log.error("unhandled error on %s %s", request.method, request.path, exc_info=exc)
        return refuse(GezelError(f"internal error: {type(exc).__name__}"))

    add_cache_routes(app, engine)

    @app.route("/health")
    async def health() -> Response:
        h = engine.health()
        state = engine.state()
        body = {
            "status": h.status,
            "reasons": list(h.reasons),
            "model": engine.info.model_id,
            "queued": len(state.queued),
            "running": len(state.running),
            "live": state.live,
            "step": state.step,
        }
        status = 503 if h.status in ("failed", "shutting_down") else 200
        return Response(json.dumps(body), status=status, mimetype="application/json")

    @app.route("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.exposition(), mimetype=CONTENT_TYPE_LATEST)

    @app.route("/openapi.json")
    async def openapi() -> Response:
        return Response(openapi_json(engine.info.model_id), mimetype="application/json")

    @app.route("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": engine.info.model_id,
                    "object": "model",
                    "created": 0,
                    "owned_by": "gezel-trio",
                    "context_length": engine.info.context_length,
                }
            ],
        }

    @app.route("/v1/chat/completions", methods=["POST"])
    @app.route("/chat/completions", methods=["POST"])
    async def chat_completions() -> Response:
        body = await json_body()
        req = parse_chat_request(body)
        _refuse_unsupported(req)
        engine.check_admission()
        messages = [m.to_template() for m in req.messages]
        tools = tool_dicts(req.tools)
        rendered = await engine.render_chat(
            messages,
            tools=tools,
            template_kwargs=req.template_kwargs,
            template_override=req.chat_template_override,
            band_chars=req.stable_prefix_chars,
        )
        prompt = rendered.tokens
        max_tokens = engine.bound_max_tokens(len(prompt), req.max_output_tokens)
        constraint = await engine.compile_constraint(
            response_format=attrs.asdict(req.response_format) if req.response_format else None,
            tools=tools,
            tool_choice=req.tool_choice,
            tool_grammar=attrs.asdict(req.tool_grammar) if req.tool_grammar else None,
        )
        gen = GenerationRequest(
            prompt=prompt,
            max_tokens=max_tokens,
            sampling=_sampling(req),
            stop=req.stop_list,
            ignore_eos=req.ignore_eos,
            min_tokens=min(req.min_tokens, max_tokens),
            priority=req.priority,
            cache=CacheRequest(
                cache_id=req.session_id,
                prefix_ids=req.prefix_ids,
                band_end=rendered.band_end,
                boundaries=rendered.boundaries,
                roster=roster_fingerprint(tools),
            ),
            constraint=constraint,
            max_thinking_tokens=req.thinking_budget,
            top_logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        )
        # Against the model (token ids, numbers) before any byte is sent:
        # a bad request is a 400, never an error frame in a 200 stream.
        engine.check_request(gen)
        parse_tools = bool(tools) and req.tool_choice != "none"
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        model = req.model or engine.info.model_id
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            resp = Response(
                _SseBody(engine, gen, cid, model, include_usage, parse_tools),
                mimetype="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
            resp.timeout = None
            return resp
        return await _complete(engine, gen, cid, model, parse_tools)

    return app


async def _complete(
    engine: Engine, gen: GenerationRequest, cid: str, model: str, parse_tools: bool
) -> Response:
    shaper = Shaper(engine.info, gen.prompt, tools=parse_tools)
    logprobs: list[TokenLogprob] = []
    with engine.submit_nowait(gen) as handle:
        async for event in handle:
            match event:
                case Delta(text=text, logprobs=lps):
                    shaper.feed(text)
                    logprobs += lps
                case Finished(reason=reason, usage=usage):
                    shaper.finish()
                    body = completion(
                        cid, model, shaper.message(), shaper.finish_reason(reason), usage
                    )
                    if gen.top_logprobs is not None:
                        body["choices"][0]["logprobs"] = logprobs_body(logprobs)
                    return Response(json.dumps(body), mimetype="application/json")
                case Failed(error=error):
                    raise error
    raise GezelError("the request ended without a result")  # pragma: no cover


class _SseBody:
    """The SSE body as an explicit async iterator, not a generator, so its
    cleanup never depends on when a suspended generator is finalized.

    It submits the request on the first ``__anext__`` and withdraws it when
    the stream ends, when ``__anext__`` is cancelled (quart-trio cancels it
    about 1 ms after the client closes) and in ``aclose`` (Quart calls it when
    the response ends by any path). Errors after the first byte become an
    error frame and ``[DONE]``; ``Cancelled`` propagates untouched.
    """

    def __init__(
        self,
        engine: Engine,
        gen: GenerationRequest,
        cid: str,
        model: str,
        include_usage: bool,
        parse_tools: bool,
    ) -> None:
        self._shaper = Shaper(engine.info, gen.prompt, tools=parse_tools)
        self._logprobs: list[TokenLogprob] = []
        self._engine = engine
        self._gen = gen
        self._cid = cid
        self._model = model
        self._include_usage = include_usage
        self._created = int(time.time())
        self._handle: RequestHandle | None = None
        self._pending: deque[bytes] = deque()
        self._started = False
        self._ended = False

    def __aiter__(self) -> _SseBody:
        return self

    async def __anext__(self) -> bytes:
        while not self._pending:
            if self._ended:
                raise StopAsyncIteration
            if not self._started:
                self._start()
                continue
            assert self._handle is not None
            try:
                event = await self._handle.__anext__()
            except BaseException:
                self._close()
                raise
            self._render(event)
        return self._pending.popleft()

    async def aclose(self) -> None:
        self._close()
        await trio.lowlevel.checkpoint()

    def _start(self) -> None:
        self._started = True
        try:
            self._handle = self._engine.submit_nowait(self._gen)
        except GezelError as err:
            self._pending += (frame(error_body(err)), DONE)
            self._ended = True
            return
        self._pending.append(self._chunk({"role": "assistant", "content": ""}, None, None))

    def _render(self, event: Event) -> None:
        match event:
            case Progress(done=done, total=total):
                self._pending.append(comment(f"prefill {done}/{total}"))
            case Queued(position=position):
                self._pending.append(comment(f"queued {position}"))
            case Parked():
                self._pending.append(comment("parked"))
            case Resumed():
                self._pending.append(comment("resumed"))
            case Delta(text=text, usage=usage, logprobs=lps):
                self._logprobs += lps
                for delta in self._shaper.feed(text):
                    self._pending.append(self._chunk(delta, None, usage))
            case Finished(reason=reason, usage=usage):
                for delta in self._shaper.finish():
                    self._pending.append(self._chunk(delta, None, usage))
                self._pending.append(self._chunk({}, self._shaper.finish_reason(reason), usage))
                if self._include_usage:
                    body = chunk(self._cid, self._model, self._created, {}, None, usage)
                    body["choices"] = []
                    self._pending.append(frame(body))
                self._finish()
            case Failed(error=error):
                log.warning("stream %s failed: %s", self._cid, error.message)
                self._pending.append(frame(error_body(error)))
                self._finish()

    def _chunk(self, delta: dict[str, Any], reason: str | None, usage: Usage | None) -> bytes:
        body = chunk(self._cid, self._model, self._created, delta, reason, usage)
        if self._gen.top_logprobs is not None and self._logprobs:
            # Logprobs ride on the next chunk out: text held back (a possible
            # marker) delays them, never drops them.
            body["choices"][0]["logprobs"] = logprobs_body(self._logprobs)
            self._logprobs = []
        return frame(body)

    def _finish(self) -> None:
        self._pending.append(DONE)
        self._ended = True
        self._close()

    def _close(self) -> None:
        self._ended = True
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
            self._handle = None
