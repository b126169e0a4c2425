"""``POST /v1/chat/completions``: OpenAI chat completions, with the gezel
extensions (cache ids, priorities, template kwargs, thinking budgets).

A thin translation: the wire body becomes a ``ChatRequest``, the engine
prepares it (render, constraints, checks) before any byte is sent, so a bad
request is a 400 and never an error frame in a 200 stream; then the chat's
shaped events become ``chat.completion.chunk`` frames, or one
``chat.completion`` body.
"""

from __future__ import annotations

import time
import uuid
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
from ..shaping.custom_tools import RawInput, custom_input
from ..shaping.shaper import ReasoningDelta, ReasoningFormat, TextDelta, ToolCallDelta
from .edge import ProtocolBlueprint, error_response, json_view, refusal
from .openai_wire import (
    ChatCompletionRequest,
    custom_formats,
    parse_chat_request,
    sampling_params,
    tool_dicts,
)
from .sse import (
    DONE,
    chunk,
    completion,
    error_body,
    frame,
    liveness_comment,
    run_choices,
    stream_chat,
)
from .strict import dump_json
from .tenancy import current_tenant

__all__ = ["blueprint", "chat_request", "logprobs_body"]


def _refuse_unsupported(req: ChatCompletionRequest, *, vision: bool) -> None:
    """Fields the wire contract names but this build does not serve yet are
    refused loudly rather than ignored."""
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    if not vision:
        for i, m in enumerate(req.messages):
            if m.has_images():
                raise InvalidRequest(
                    "the loaded model is text-only: it takes no images",
                    param=f"messages[{i}].content",
                )


def chat_request(
    req: ChatCompletionRequest,
    *,
    vision: bool = True,
    default_temperature: float = 1.0,
    reasoning_format: ReasoningFormat = "auto",
) -> ChatRequest:
    """The engine's view of a validated chat-completions body. ``vision``:
    whether the model takes images (a text-only model refuses them here);
    ``default_temperature``: where the body names none; ``reasoning_format``:
    the server's, which the body's own field overrides."""
    _refuse_unsupported(req, vision=vision)
    images = tuple(p for i, m in enumerate(req.messages) for p in m.image_parts(i))
    return ChatRequest(
        messages=[m.to_template() for m in req.messages],
        tools=tool_dicts(req.tools),
        tool_choice=_tool_choice(req.tool_choice),
        custom_tools=custom_formats(req.tools),
        response_format=attrs.asdict(req.response_format) if req.response_format else None,
        tool_grammar=attrs.asdict(req.tool_grammar) if req.tool_grammar else None,
        sampling=sampling_params(req, default_temperature=default_temperature),
        max_tokens=req.max_output_tokens,
        stop=req.stop_list,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        priority=req.priority,
        cache_id=req.session_id,
        prefix_ids=req.prefix_ids,
        stable_prefix_chars=req.stable_prefix_chars,
        template_kwargs=req.template_kwargs,
        template_override=req.chat_template_override,
        max_thinking_tokens=req.thinking_budget,
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        speculate=req.speculation and not req.disable_speculation,
        images=images,
        n=req.n,
        reasoning_format=_reasoning_format(req.reasoning_format, reasoning_format),
        # At most one call: generation stops at the first call's end.
        max_tool_calls=1 if req.parallel_tool_calls is False else None,
    )


def _reasoning_format(asked: str | None, default: ReasoningFormat) -> ReasoningFormat:
    """The body's ``reasoning_format`` (llama.cpp's names), else the server's."""
    if asked is None:
        return default
    return "none" if asked == "none" else "auto"


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """A custom tool named (``{"type": "custom", "custom": {"name"}}``) is
    forced as the function it is shown as; ``allowed_tools`` in ``required``
    mode forces one call of one of them, in ``auto`` mode every tool stays
    in the prompt and the choice is the model's. Anything else goes to the
    grammar compiler as it came (which names a bad one)."""
    if not isinstance(choice, dict):
        return choice
    kind = choice.get("type")
    if kind == "custom" and isinstance(choice.get("custom"), dict):
        return {"type": "function", "function": {"name": choice["custom"].get("name")}}
    allowed = choice.get("allowed_tools")
    if kind == "allowed_tools" and isinstance(allowed, dict):
        if allowed.get("mode") == "auto":
            return "auto"
        names = []
        for t in allowed.get("tools") or []:
            inner = t.get(t.get("type"), {}) if isinstance(t, dict) else {}
            names.append(inner.get("name") if isinstance(inner, dict) else None)
        return {"type": "allowed_tools", "names": names}
    return choice


def _custom_message(message: dict[str, Any], custom: frozenset[str]) -> dict[str, Any]:
    """The assistant message with calls of custom tools as ``custom`` calls
    (their raw input)."""
    calls = message.get("tool_calls")
    if not calls or not custom:
        return message
    out = []
    for c in calls:
        fn = c["function"]
        if fn["name"] not in custom:
            out.append(c)
        else:
            raw = custom_input(fn["arguments"])
            if raw is None:  # cut short (finish_reason length): as far as it went
                reader = RawInput()
                reader.feed(fn["arguments"])
                raw = "".join(reader.text)
            out.append(
                {"id": c["id"], "type": "custom", "custom": {"name": fn["name"], "input": raw}}
            )
    return {**message, "tool_calls": out}


def logprobs_body(items: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's ``logprobs.content`` list."""

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**entry(t.token, t.logprob), "top_logprobs": [entry(s, lp) for s, lp in t.top]}
            for t in items
        ]
    }


def _delta(event: ChatEvent) -> dict[str, Any] | None:
    match event:
        case TextDelta(text=text):
            return {"content": text}
        case ReasoningDelta(text=text):
            return {"reasoning_content": text, "reasoning": text}
        case ToolCallDelta(index=index, id=call_id, name=name, arguments=arguments):
            if name is not None:
                call: dict[str, Any] = {
                    "index": index,
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            else:
                call = {"index": index, "function": {"arguments": arguments}}
            return {"tool_calls": [call]}
    return None


class _Chunks:
    """``sse.Translator`` for chat completions: one chunk per shaped delta,
    usage on every chunk, logprobs riding on the next chunk out (text held
    back as a possible marker delays them, never drops them). With ``n``
    choices each chunk names its choice's ``index`` and carries that
    choice's usage; the chunk that finishes the last choice carries the
    usage of all (the prompt once)."""

    def __init__(
        self,
        cid: str,
        model: str,
        include_usage: bool,
        logprobs: bool,
        n: int = 1,
        *,
        stream_tool_calls: bool = True,
        custom: frozenset[str] = frozenset(),
    ) -> None:
        self._custom = custom
        # A custom call's raw input, decoded as its arguments stream: (choice, call).
        self._raw: dict[tuple[int, int], RawInput] = {}
        self._cid = cid
        self._model = model
        self._created = int(time.time())
        self._include_usage = include_usage
        self._logprobs: list[list[TokenLogprob]] | None = (
            [[] for _ in range(n)] if logprobs else None
        )
        self._n = n
        self._finished: dict[int, Usage] = {}
        # --no-stream-tool-calls: each choice's calls held back and sent whole
        # at its end.
        self._held_calls: list[dict[int, dict[str, Any]]] | None = (
            None if stream_tool_calls else [{} for _ in range(n)]
        )

    def opening(self) -> list[bytes]:
        return [
            self._chunk(i, {"role": "assistant", "content": ""}, None, None) for i in range(self._n)
        ]

    def render(self, event: ChatEvent, chat: ChatChoice) -> list[bytes]:
        note = liveness_comment(event)
        if note is not None:
            return [note]
        match event:
            case ChatLogprobs(items=items):
                if self._logprobs is not None:
                    self._logprobs[chat.index] += items
                return []
            case ToolCallDelta(index=index, id=call_id, name=name, arguments=arguments) if (
                self._held_calls is not None
            ):
                # Held back (--no-stream-tool-calls), custom ones too: sent whole at the end.
                call = self._held_calls[chat.index].setdefault(
                    index,
                    {
                        "index": index,
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name or "", "arguments": ""},
                    },
                )
                call["function"]["arguments"] += arguments
                return []
            case ToolCallDelta(index=index, id=call_id, name=name, arguments=arguments) if (
                chat.index,
                index,
            ) in self._raw or name in self._custom:
                key = (chat.index, index)
                if name is not None:
                    self._raw[key] = RawInput()
                    custom_call = {"name": name, "input": ""}
                    call = {"index": index, "id": call_id, "type": "custom", "custom": custom_call}
                    return [self._chunk(chat.index, {"tool_calls": [call]}, None, chat.usage)]
                piece = self._raw[key].feed(arguments)
                if not piece:
                    return []
                call = {"index": index, "custom": {"input": piece}}
                return [self._chunk(chat.index, {"tool_calls": [call]}, None, chat.usage)]
            case ChatFinished(reason=reason, usage=usage):
                self._finished[chat.index] = usage
                held = self._held_calls[chat.index] if self._held_calls is not None else {}
                held_calls = _custom_message({"tool_calls": list(held.values())}, self._custom)
                out = [
                    self._chunk(chat.index, {"tool_calls": [call]}, None, usage)
                    for call in held_calls["tool_calls"]
                ]
                if len(self._finished) < self._n:
                    return [*out, self._chunk(chat.index, {}, reason, usage)]
                total = combined_usage(list(self._finished.values()))
                out.append(self._chunk(chat.index, {}, reason, total))
                if self._include_usage:
                    body = chunk(self._cid, self._model, self._created, {}, None, total)
                    body["choices"] = []
                    out.append(frame(body))
                return [*out, DONE]
            case Failed(error=error):
                return self.failure(error)
        delta = _delta(event)
        return [] if delta is None else [self._chunk(chat.index, delta, None, chat.usage)]

    def failure(self, err: GezelError) -> list[bytes]:
        return [frame(error_body(err)), DONE]

    def _chunk(
        self, index: int, delta: dict[str, Any], reason: str | None, usage: Usage | None
    ) -> bytes:
        body = chunk(self._cid, self._model, self._created, delta, reason, usage)
        body["choices"][0]["index"] = index
        if self._logprobs and self._logprobs[index]:
            body["choices"][0]["logprobs"] = logprobs_body(self._logprobs[index])
            self._logprobs[index] = []
        return frame(body)


def blueprint(
    engine: Engine, *, stream_tool_calls: bool = True, reasoning_format: ReasoningFormat = "auto"
) -> ProtocolBlueprint:
    """The chat completions route (and its alias without ``/v1``) over
    ``engine``; errors leave in the OpenAI envelope. ``reasoning_format``:
    where the think block goes unless a request says (``--reasoning-format``)."""
    bp = ProtocolBlueprint("openai_chat", __name__, refusal(engine, error_response))

    @bp.route("/v1/chat/completions", methods=["POST"])
    @bp.route("/chat/completions", methods=["POST"])
    async def chat_completions() -> Response:
        req, chat = await json_view(
            parse_chat_request,
            partial(
                chat_request,
                vision=engine.info.vision,
                default_temperature=engine.config.requests.default_temperature,
                reasoning_format=reasoning_format,
            ),
        )
        prepared = await engine.prepare_chat(current_tenant().chat(chat, req.cache_salt))
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        model = req.model or engine.info.model_id
        logprobs = prepared.request.top_logprobs is not None
        custom = frozenset(prepared.chat.custom_tools)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            translator = _Chunks(
                cid,
                model,
                include_usage,
                logprobs,
                req.n,
                stream_tool_calls=stream_tool_calls,
                custom=custom,
            )
            return stream_chat(engine, prepared, translator)
        results = await run_choices(engine, prepared)
        usage = combined_usage([finished.usage for finished, _ in results])
        first = _custom_message(results[0][0].message, custom)
        body = completion(cid, model, first, results[0][0].reason, usage)
        body["choices"] = [
            {
                "index": i,
                "message": _custom_message(finished.message, custom),
                "finish_reason": finished.reason,
                "logprobs": logprobs_body(items) if logprobs else None,
            }
            for i, (finished, items) in enumerate(results)
        ]
        return Response(dump_json(body), mimetype="application/json")

    return bp
