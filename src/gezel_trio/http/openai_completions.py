"""``POST /v1/completions`` (legacy OpenAI completions), llama.cpp's
``POST /infill``, ``POST /tokenize`` and ``POST /detokenize``.

A legacy completion is a chat with a raw prompt (``ChatRequest.prompt``):
no chat template, plain text out, through the same engine path as chat
completions - prepared before any byte is sent, the same prompt cache,
usage, liveness comments and cancellation, ``n`` choices of one prompt
computed once. Its events become ``text_completion`` objects (streamed as
chunks ending in ``data: [DONE]``) with the legacy ``logprobs`` object.
With ``suffix``, and on ``/infill``, the prompt is a fill-in-the-middle one
built with the model's FIM tokens (``http.fim``); ``/infill`` answers in
llama.cpp's ``/completion`` shape.

Tokenizing runs on a worker thread (``Engine.tokenize``), never the MLX
thread.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from functools import partial
from typing import Any

import attrs
from quart import Response

from ..core.errors import GezelError, InvalidRequest
from ..core.events import Failed, TokenLogprob, Usage
from ..engine import (
    ChatChoice,
    ChatEvent,
    ChatFinished,
    ChatLogprobs,
    ChatRequest,
    Engine,
    combined_usage,
)
from ..shaping.shaper import TextDelta
from .edge import ProtocolBlueprint, error_response, json_body, json_view, refusal
from .fim import fim_prompt
from .openai_wire import (
    CompletionRequest,
    parse_completion_request,
    parse_detokenize_request,
    parse_infill_request,
    parse_tokenize_request,
    sampling_params,
    tool_dicts,
)
from .sse import (
    DONE,
    error_body,
    frame,
    liveness_comment,
    run_choices,
    stream_chat,
    usage_body,
)
from .strict import dump_json
from .tenancy import current_tenant

__all__ = ["blueprint", "completion_request"]


def completion_request(req: CompletionRequest, *, default_temperature: float = 1.0) -> ChatRequest:
    """The engine's view of a validated legacy completions body;
    ``default_temperature`` where it names none."""
    return ChatRequest(
        prompt=req.raw_prompt,
        sampling=sampling_params(req, default_temperature=default_temperature),
        max_tokens=req.max_tokens,
        stop=req.stop_list,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        priority=req.priority,
        cache_id=req.cache_id,
        prefix_ids=req.prefix_ids,
        top_logprobs=req.logprobs,
        speculate=req.speculation,
        n=req.n,
    )


class _Echo:
    """What ``echo`` prepends to each choice: the prompt's text, and its
    tokens for ``logprobs`` (their own logprobs are not computed: ``null``,
    as OpenAI reports the first token's)."""

    def __init__(self, text: str = "", tokens: tuple[str, ...] = ()) -> None:
        self.text = text
        self.tokens = tokens


class _Logprobs:
    """One choice's legacy ``logprobs`` object, built as tokens arrive:
    ``text_offset`` counts characters from the start of the choice's text
    (the echoed prompt included)."""

    def __init__(self, echo: _Echo) -> None:
        self._offset = 0
        self._pending: dict[str, list[Any]] = self._empty()
        self._add_prompt(echo.tokens)

    @staticmethod
    def _empty() -> dict[str, list[Any]]:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _add_prompt(self, tokens: tuple[str, ...]) -> None:
        for token in tokens:
            self._append(token, None, None)

    def add(self, items: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> None:
        for t in items:
            top = {s: lp for s, lp in t.top}
            top.setdefault(t.token, t.logprob)  # the sampled token is always there
            self._append(t.token, t.logprob, top)

    def _append(self, token: str, logprob: float | None, top: dict[str, float] | None) -> None:
        p = self._pending
        p["tokens"].append(token)
        p["token_logprobs"].append(logprob)
        p["top_logprobs"].append(top)
        p["text_offset"].append(self._offset)
        self._offset += len(token)

    def take(self) -> dict[str, list[Any]] | None:
        """What was added since the last ``take`` (``None``: nothing)."""
        if not self._pending["tokens"]:
            return None
        out, self._pending = self._pending, self._empty()
        return out


def _choice(index: int, text: str, logprobs: Any, reason: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


def _body(
    cid: str, model: str, created: int, choices: list[dict[str, Any]], usage: Usage | None
) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_body(usage) if usage is not None else None,
    }


class _TextChunks:
    """``sse.Translator`` for legacy completions: one ``text_completion``
    chunk per text delta, naming its choice; the echoed prompt opens each
    choice; usage on every chunk (the choice's own, the prompt once on the
    chunk that finishes the last choice), and with
    ``stream_options.include_usage`` a last chunk with no choices."""

    def __init__(
        self,
        cid: str,
        model: str,
        n: int,
        echo: _Echo | None,
        logprobs: bool,
        include_usage: bool,
    ) -> None:
        self._cid = cid
        self._model = model
        self._created = int(time.time())
        self._n = n
        self._echo = echo
        self._logprobs = [_Logprobs(echo or _Echo()) for _ in range(n)] if logprobs else None
        self._include_usage = include_usage
        self._finished: dict[int, Usage] = {}

    def opening(self) -> list[bytes]:
        if self._echo is None:
            return []
        return [self._chunk(i, self._echo.text, None, None) for i in range(self._n)]

    def render(self, event: ChatEvent, chat: ChatChoice) -> list[bytes]:
        note = liveness_comment(event)
        if note is not None:
            return [note]
        match event:
            case ChatLogprobs(items=items):
                if self._logprobs is not None:
                    self._logprobs[chat.index].add(items)
                return []
            case TextDelta(text=text):
                return [self._chunk(chat.index, text, None, chat.usage)]
            case ChatFinished(reason=reason, usage=usage):
                self._finished[chat.index] = usage
                if len(self._finished) < self._n:
                    return [self._chunk(chat.index, "", reason, usage)]
                total = combined_usage(list(self._finished.values()))
                out = [self._chunk(chat.index, "", reason, total)]
                if self._include_usage:
                    out.append(frame(_body(self._cid, self._model, self._created, [], total)))
                return [*out, DONE]
            case Failed(error=error):
                return self.failure(error)
        return []  # raw prompts are not split: no reasoning or tool-call events

    def failure(self, err: GezelError) -> list[bytes]:
        return [frame(error_body(err)), DONE]

    def _chunk(self, index: int, text: str, reason: str | None, usage: Usage | None) -> bytes:
        logprobs = self._logprobs[index].take() if self._logprobs is not None else None
        choice = _choice(index, text, logprobs, reason)
        return frame(_body(self._cid, self._model, self._created, [choice], usage))


def _infill_end(model: str, finished: ChatFinished) -> dict[str, Any]:
    """llama.cpp's last ``/completion`` object for a finished infill."""
    u = finished.usage
    stop_type = "limit" if finished.reason == "length" else "eos"
    if finished.stop_sequence is not None:
        stop_type = "word"
    return {
        "content": finished.message.get("content") or "",
        "id_slot": 0,
        "stop": True,
        "model": model,
        "tokens_predicted": u.output_tokens,
        "tokens_evaluated": u.input_tokens,
        "tokens_cached": u.cached_tokens,
        "stop_type": stop_type,
        "stopping_word": finished.stop_sequence or "",
        "truncated": False,
        "timings": {
            "cache_n": u.cached_tokens,
            "prompt_n": u.input_tokens - u.cached_tokens,
            "predicted_n": u.output_tokens,
            "prompt_per_second": u.prompt_tps,
            "predicted_per_second": u.generation_tps,
        },
    }


class _InfillChunks:
    """``sse.Translator`` for a streamed ``/infill``, as llama.cpp streams
    ``/completion``: ``{"content", "stop": false}`` per text delta, then the
    whole last object (``stop: true``, counts and timings); no ``[DONE]``."""

    def __init__(self, model: str) -> None:
        self._model = model

    def opening(self) -> list[bytes]:
        return []

    def render(self, event: ChatEvent, chat: ChatChoice) -> list[bytes]:
        note = liveness_comment(event)
        if note is not None:
            return [note]
        match event:
            case TextDelta(text=text):
                return [frame({"content": text, "id_slot": 0, "stop": False})]
            case ChatFinished():
                return [frame({**_infill_end(self._model, event), "content": ""})]
            case Failed(error=error):
                return self.failure(error)
        return []

    def failure(self, err: GezelError) -> list[bytes]:
        return [frame(error_body(err))]


async def _echo(engine: Engine, req: CompletionRequest, prompt: tuple[int, ...]) -> _Echo | None:
    if not req.echo:
        return None
    raw = req.raw_prompt
    text = raw if isinstance(raw, str) else await engine.detokenize(prompt)
    tokens = await engine.token_texts(prompt) if req.logprobs is not None else ()
    return _Echo(text, tokens)


def blueprint(engine: Engine) -> ProtocolBlueprint:
    """Legacy completions (and the alias without ``/v1``), ``/tokenize`` and
    ``/detokenize`` over ``engine``; errors leave in the OpenAI envelope."""
    bp = ProtocolBlueprint("openai_completions", __name__, refusal(engine, error_response))

    @bp.route("/v1/completions", methods=["POST"])
    @bp.route("/completions", methods=["POST"])
    async def completions() -> Response:
        req, chat = await json_view(
            parse_completion_request,
            partial(
                completion_request, default_temperature=engine.config.requests.default_temperature
            ),
        )
        if req.suffix is not None:
            # A text prompt (parse_completion_request checked): the code before the gap.
            assert isinstance(req.raw_prompt, str)
            tokens = await fim_prompt(engine, req.raw_prompt, req.suffix, param="suffix")
            chat = attrs.evolve(chat, prompt=tokens)
        prepared = await engine.prepare_chat(current_tenant().chat(chat, req.cache_salt))
        echo = await _echo(engine, req, prepared.request.prompt)
        cid = f"cmpl-{uuid.uuid4().hex}"
        model = req.model or engine.info.model_id
        logprobs = req.logprobs is not None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            translator = _TextChunks(cid, model, req.n, echo, logprobs, include_usage)
            return stream_chat(engine, prepared, translator)
        results = await run_choices(engine, prepared)
        choices = []
        for i, (finished, items) in enumerate(results):
            text = finished.message.get("content") or ""
            lp = None
            if logprobs:
                built = _Logprobs(echo or _Echo())
                built.add(items)
                lp = built.take() or _Logprobs._empty()
            prefix = echo.text if echo is not None else ""
            choices.append(_choice(i, prefix + text, lp, finished.reason))
        usage = combined_usage([finished.usage for finished, _ in results])
        body = _body(cid, model, int(time.time()), choices, usage)
        return Response(dump_json(body), mimetype="application/json")

    @bp.route("/infill", methods=["POST"])
    async def infill() -> Response:
        req = await json_body(parse_infill_request)
        extra: Sequence[tuple[str, str]] = [(c.filename, c.text) for c in req.input_extra or ()]
        tokens = await fim_prompt(
            engine,
            req.input_prefix,
            req.input_suffix,
            param="input_prefix",
            extra=extra,
            middle=req.prompt,
        )
        chat = completion_request(
            req.completion(tokens), default_temperature=engine.config.requests.default_temperature
        )
        prepared = await engine.prepare_chat(current_tenant().chat(chat, req.cache_salt))
        model = req.model or engine.info.model_id
        if req.stream:
            return stream_chat(engine, prepared, _InfillChunks(model))
        ((finished, _),) = await run_choices(engine, prepared)
        return Response(dump_json(_infill_end(model, finished)), mimetype="application/json")

    @bp.route("/tokenize", methods=["POST"])
    async def tokenize() -> dict[str, Any]:
        req = await json_body(parse_tokenize_request)
        if req.messages is not None:
            if req.add_special_tokens or req.add_special:
                raise InvalidRequest(
                    "messages are tokenized as chat completions runs them: the chat "
                    "template places the special tokens",
                    param="add_special_tokens",
                )
            rendered = await engine.render_chat(
                [m.to_template() for m in req.messages],
                tools=tool_dicts(req.tools),
                template_kwargs=req.chat_template_kwargs,
            )
            tokens = rendered.tokens
        else:
            text = req.prompt if req.prompt is not None else req.content
            assert text is not None
            add = req.add_special_tokens
            if add is None:
                add = req.add_special if req.add_special is not None else True
            tokens = await engine.tokenize(text, add_special_tokens=add)
        body: dict[str, Any] = {
            "tokens": list(tokens),
            "count": len(tokens),
            "max_model_len": engine.info.context_length,
        }
        if req.return_token_strs or req.with_pieces:
            strs = await engine.token_texts(tokens)
            if req.return_token_strs:
                body["token_strs"] = list(strs)
            if req.with_pieces:  # llama.cpp's shape
                body["tokens"] = [{"id": t, "piece": p} for t, p in zip(tokens, strs, strict=True)]
        return body

    @bp.route("/detokenize", methods=["POST"])
    async def detokenize() -> dict[str, Any]:
        req = await json_body(parse_detokenize_request)
        text = await engine.detokenize(req.tokens)
        return {"prompt": text, "content": text}

    return bp
