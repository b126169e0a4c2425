"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic Messages.

A thin translation, like ``openai_chat``: the body becomes a ``ChatRequest``
(system prompt and blocks onto the chat template's roles: ``tool_use`` ->
the assistant's ``tool_calls``, ``tool_result`` -> ``tool`` messages,
``thinking`` -> ``reasoning_content``), the engine prepares it before any
byte is sent, and the chat's shaped events become Anthropic's content
blocks - streamed as ``message_start`` (once the request is admitted, with
the prompt's cached and computed tokens), ``content_block_start`` /
``_delta`` / ``_stop``, ``message_delta``, ``message_stop`` (with SSE
comments while the request waits in the queue, ``ping`` while it
prefills), or returned as one ``message`` object. Errors on
these routes, and on any path under ``/v1/messages``, use Anthropic's
envelope (``{"type": "error", "error": {"type", "message"}}``).

Usage follows Anthropic's arithmetic: ``cache_read_input_tokens`` are the
prompt tokens served from the prompt cache, ``cache_creation_input_tokens``
those computed and written into a ``cache_control`` pin (by ttl in
``cache_creation``), ``input_tokens`` the rest; the three sum to the
prompt. Every prompt is cached anyway, as a side effect; a pin keeps its
prefix from eviction for its ttl.
"""

from __future__ import annotations

import hashlib
import logging
import re
import uuid
from collections.abc import Sequence
from functools import partial
from typing import Any

import trio
from quart import Response

from ..core.errors import EngineClosed, GezelError, InvalidRequest, QueueFull, QueueTimeout, shown
from ..core.events import Failed, Started, Usage
from ..core.images import ImagePart
from ..core.request import MessagePin, SamplingParams
from ..engine import ChatChoice, ChatEvent, ChatFinished, ChatRequest, Engine
from ..shaping.shaper import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallDone
from .anthropic_wire import (
    Block,
    CacheControlEphemeralParam,
    ContentBlockSourceParam,
    CountTokensRequest,
    DocumentBlockParam,
    ImageBlockParam,
    MessageParam,
    MessagesRequest,
    PlainTextSourceParam,
    RedactedThinkingBlockParam,
    TextBlockParam,
    ThinkingBlockParam,
    ThinkingConfigAdaptiveParam,
    ThinkingConfigDisabledParam,
    ThinkingConfigEnabledParam,
    ToolChoiceAnyParam,
    ToolChoiceAutoParam,
    ToolChoiceNoneParam,
    ToolChoiceToolParam,
    ToolParam,
    ToolResultBlockParam,
    ToolUseBlockParam,
    parse_count_tokens_request,
    parse_messages_request,
)
from .cache_diagnostics import FingerprintStore, fingerprint, system_block
from .edge import IGNORED_TOOLS_HEADER, ProtocolBlueprint, json_view, refusal
from .images import from_base64, from_data_url
from .sse import (
    cache_miss_body,
    liveness_comment,
    run_chat,
    speculation_body,
    stream_chat,
)
from .strict import dump_json, parse_json
from .tenancy import current_tenant

__all__ = [
    "MESSAGES_PATH",
    "blueprint",
    "chat_request",
    "error_body",
    "error_response",
]

MESSAGES_PATH = "/v1/messages"

log = logging.getLogger("gezel_trio.http")

# Blocks of one turn are paragraphs of one message for the chat template.
_JOIN = "\n\n"
_IMAGE_HERE = "an image block may only appear in a user message, beside its text"


# --- errors -----------------------------------------------------------------

# Anthropic's error types by status; anything else 4xx is an invalid request.
_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(err: GezelError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``; the message names
    the offending field when it does not already."""
    kind = _ERROR_TYPES.get(err.status)
    if kind is None:
        kind = "invalid_request_error" if err.status < 500 else "api_error"
    message = err.message
    if err.param and not re.search(rf"(?<![\w.\]]){re.escape(err.param)}(?!\w)", message):
        message = f"{err.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(err: GezelError) -> Response:
    """Anthropic's envelope as a response (``error_body``)."""
    resp = Response(dump_json(error_body(err)), status=err.status, mimetype="application/json")
    if isinstance(err, QueueFull | QueueTimeout | EngineClosed):
        resp.headers["Retry-After"] = str(err.retry_after)
    return resp


# --- request -> engine ----------------------------------------------------------


def _document(block: DocumentBlockParam, where: str) -> str:
    """A text document as paragraphs of its turn: title, context, text."""
    match block.source:
        case PlainTextSourceParam(data=data):
            text = data
        case ContentBlockSourceParam(content=content):
            text = _text_of(content, f"{where}.source.content")
    return _JOIN.join(t for t in (block.title, block.context, text) if t)


def _text_of(content: str | list[Any], where: str) -> str:
    """The text of a system message, a tool result or a document (text
    blocks and text documents)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        match block:
            case TextBlockParam(text=text):
                texts.append(text)
            case DocumentBlockParam():
                texts.append(_document(block, f"{where}[{j}]"))
            case ImageBlockParam():
                raise InvalidRequest(_IMAGE_HERE, param=f"{where}[{j}]")
            case _:
                raise InvalidRequest(
                    f"only text blocks may appear here, not {shown(block.type)}",
                    param=f"{where}[{j}]",
                )
    return _JOIN.join(texts)


def _image(block: ImageBlockParam, where: str) -> ImagePart:
    """An image block's source as the engine's image part: base64 data or a
    ``data:`` URL; a remote URL or a Files API id is refused by name."""
    source = block.source
    param = f"{where}.source"
    match source.type:
        case "base64":
            if source.data is None:
                raise InvalidRequest("a base64 image source needs data", param=param + ".data")
            return from_base64(source.data, param + ".data", source.media_type)
        case "url":
            if source.url is None:
                raise InvalidRequest("a url image source needs url", param=param + ".url")
            return from_data_url(source.url, param + ".url")
    raise InvalidRequest(
        "file image sources need the Files API, which this server does not have; "
        "send the image as a base64 source",
        param=param,
    )


def _user(blocks: list[Block], where: str, images: list[ImagePart]) -> list[dict[str, Any]]:
    """A user turn: its tool results (as ``tool`` messages, first, so they
    follow the calls they answer), then its text. With images its content is
    a list of text and ``{"type": "image"}`` parts in the blocks' order (the
    pixels go to ``images``, in the same order)."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        match block:
            case TextBlockParam(text=text):
                parts.append({"type": "text", "text": text})
            case DocumentBlockParam():
                parts.append({"type": "text", "text": _document(block, f"{where}[{j}]")})
            case ToolResultBlockParam(tool_use_id=call_id, content=content, is_error=is_error):
                text = _text_of(content or "", f"{where}[{j}].content")
                if is_error:
                    text = f"Error: {text}"
                out.append({"role": "tool", "tool_call_id": call_id, "content": text})
            case ImageBlockParam():
                images.append(_image(block, f"{where}[{j}]"))
                parts.append({"type": "image"})
            case _:
                raise InvalidRequest(
                    f"a user message cannot hold {block.type} blocks", param=f"{where}[{j}]"
                )
    if parts:
        out.append({"role": "user", "content": _content(parts)})
    return out


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text parts as one string (what every template reads); with an image,
    the parts themselves, adjacent text joined. Each text part loses its
    trailing line breaks, so parts are one blank line apart whatever they
    end with: Claude Code sends ``Say hello.`` on one request and
    ``Say hello.\n`` on the next (with a reminder block after it), and the
    prompt must not change there (the next request prefilled 2,695 of its
    33,668 tokens again from that line break on)."""
    parts = [{**p, "text": p["text"].rstrip("\r\n")} if p["type"] == "text" else p for p in parts]
    parts = [p for p in parts if p["type"] != "text" or p["text"]]
    if all(p["type"] == "text" for p in parts):
        return _JOIN.join(p["text"] for p in parts)
    out: list[dict[str, Any]] = []
    for p in parts:
        if p["type"] == "text" and out and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + _JOIN + p["text"]}
        else:
            out.append(p)
    return out


def _parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    return content


def _assistant(blocks: list[Block], where: str) -> dict[str, Any]:
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        match block:
            case TextBlockParam(text=text):
                texts.append(text)
            case ThinkingBlockParam(thinking=text):
                thinking.append(text)
            case RedactedThinkingBlockParam():
                pass  # opaque: nothing a template could render
            case ToolUseBlockParam(id=call_id, name=name, input=arguments):
                fn = {"name": name, "arguments": arguments}
                calls.append({"id": call_id, "type": "function", "function": fn})
            case ImageBlockParam():
                raise InvalidRequest(_IMAGE_HERE, param=f"{where}[{j}]")
            case _:
                raise InvalidRequest(
                    f"an assistant message cannot hold {block.type} blocks", param=f"{where}[{j}]"
                )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _reminder(text: str) -> str:
    """A system message as a user-side reminder, written as Claude Code writes
    its own."""
    return f"<system-reminder>\n{text}\n</system-reminder>"


def _merge(out: list[dict[str, Any]], message: dict[str, Any]) -> None:
    """Anthropic combines consecutive turns of one role; so does this, for
    plain user turns and for assistant turns (templates may insist on
    alternation)."""
    last = out[-1] if out else None
    role = message["role"]
    if last is None or last["role"] != role or role not in ("user", "assistant"):
        out.append(message)
        return
    if message["role"] == "user":
        last["content"] = _content([*_parts(last["content"]), *_parts(message["content"])])
        return
    last["content"] += message["content"]
    if message.get("reasoning_content"):
        last["reasoning_content"] = last.get("reasoning_content", "") + message["reasoning_content"]
    if message.get("tool_calls"):
        last["tool_calls"] = [*last.get("tool_calls", []), *message["tool_calls"]]


def chat_messages(
    system: str | list[TextBlockParam] | None,
    messages: list[MessageParam],
    images: list[ImagePart] | None = None,
) -> list[dict[str, Any]]:
    """The conversation in the chat template's roles. ``system`` and the
    ``system``-role messages before the first turn form one system message;
    one right after a user turn closes that turn as a ``<system-reminder>``
    block (how Claude Code re-sends it on its next request); other later
    ``system`` messages stay where they are. Image blocks of user
    turns are appended to ``images`` in prompt order."""
    if images is None:
        images = []
    head: list[str] = []
    if system is not None:
        head.append(_text_of(system, "system"))
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        if m.role == "system":
            text = _text_of(m.content, where)
            if out and out[-1]["role"] == "user":
                # Claude Code sends its mid-conversation system message after
                # the user's turn, and on its next request as this very
                # reminder block of that turn: rendered so from the first,
                # the next request re-reads it (~2,600 tokens) from the cache.
                _merge(out, {"role": "user", "content": _reminder(text)})
            elif out:
                out.append({"role": "system", "content": text})
            else:
                head.append(text)
            continue
        blocks: list[Block] = (
            [TextBlockParam("text", m.content)] if isinstance(m.content, str) else m.content
        )
        turn = _user(blocks, where, images) if m.role == "user" else [_assistant(blocks, where)]
        for message in turn:
            _merge(out, message)
    if not out:
        raise InvalidRequest(
            "messages holds nothing to answer: only system text or empty turns",
            param="messages",
        )
    system_text = _JOIN.join(t for t in head if t)
    if system_text:
        out.insert(0, {"role": "system", "content": system_text})
    return out


def _tools(req: CountTokensRequest) -> list[dict[str, Any]] | None:
    if not req.client_tools:
        return None
    tools = []
    for t in req.client_tools:
        fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
        if t.description is not None:
            fn["description"] = t.description
        if t.strict is not None:
            fn["strict"] = t.strict
        tools.append({"type": "function", "function": fn})
    return tools


def _tool_choice(req: CountTokensRequest) -> str | dict[str, Any] | None:
    """Anthropic's choice as the engine's: ``any`` is ``required``; a named
    tool is forced. A forced call is always one call (the grammar allows
    one); ``disable_parallel_tool_use`` is ``_one_call``."""
    match req.tool_choice:
        case None:
            return None
        case ToolChoiceAnyParam():
            return "required"
        case ToolChoiceToolParam(name=name):
            return {"type": "function", "function": {"name": name}}
        case ToolChoiceNoneParam():
            return "none"
    return "auto"


def _template_kwargs(req: CountTokensRequest) -> dict[str, Any]:
    match req.thinking:
        case ThinkingConfigEnabledParam() | ThinkingConfigAdaptiveParam():
            return {"enable_thinking": True}
        case ThinkingConfigDisabledParam():
            return {"enable_thinking": False}
    return {}  # the template's own default


# Anthropic's limit on cache breakpoints per request, and its ttls.
MAX_CACHE_BREAKPOINTS = 4
_TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


def _breakpoints(req: CountTokensRequest) -> list[tuple[str, CacheControlEphemeralParam, int]]:
    """Every ``cache_control`` in Anthropic's order (tools, system,
    messages): where it is, and the index of ``req.messages`` it is in
    (-1: tools or system; ``len(messages)``: the top-level one)."""
    found: list[tuple[str, CacheControlEphemeralParam, int]] = []
    for j, tool in enumerate(req.tools or ()):
        if isinstance(tool, ToolParam) and tool.cache_control is not None:
            found.append((f"tools[{j}].cache_control", tool.cache_control, -1))
    if isinstance(req.system, list):
        for j, block in enumerate(req.system):
            if block.cache_control is not None:
                found.append((f"system[{j}].cache_control", block.cache_control, -1))
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            continue
        for j, part in enumerate(m.content):
            control = getattr(part, "cache_control", None)
            if control is not None:
                found.append((f"messages[{i}].content[{j}].cache_control", control, i))
    if req.cache_control is not None:
        found.append(("cache_control", req.cache_control, len(req.messages)))
    return found


def _pins(req: MessagesRequest, messages: list[dict[str, Any]]) -> tuple[MessagePin, ...]:
    """``cache_control`` breakpoints as pins through the end of the chat
    message each block lands in: tools and system blocks pin the system turn
    (the template renders the tools there), a message's block that message
    (turns of one role are merged, as Anthropic does), the top-level one the
    whole conversation. At most four, as Anthropic allows."""
    found = _breakpoints(req)
    if len(found) > MAX_CACHE_BREAKPOINTS:
        raise InvalidRequest(
            f"A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be "
            f"provided. Found {len(found)}.",
            param=found[MAX_CACHE_BREAKPOINTS][0],
        )
    pins = []
    for _, control, i in found:
        seconds = _TTL_SECONDS[control.ttl or "5m"]
        if i < 0:
            at = 0
        elif i >= len(req.messages):
            at = len(messages) - 1
        else:
            try:
                at = len(chat_messages(req.system, req.messages[: i + 1], [])) - 1
            except InvalidRequest:  # only system text so far: the system turn
                at = 0
        pins.append(MessagePin(at, seconds))
    return tuple(pins)


def chat_request(req: MessagesRequest, *, default_temperature: float = 1.0) -> ChatRequest:
    """The engine's view of a validated Messages body; ``default_temperature``
    where it names none (Anthropic's is 1.0)."""
    images: list[ImagePart] = []
    messages = chat_messages(req.system, req.messages, images)
    if messages[-1]["role"] == "assistant":
        raise InvalidRequest(
            "the last message is the assistant's: continuing a partial assistant "
            "turn (prefill) is not supported; end with a user message",
            param="messages",
        )
    response_format = None
    if req.output_config is not None and req.output_config.format is not None:
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": req.output_config.format.schema},
        }
    budget = None
    if isinstance(req.thinking, ThinkingConfigEnabledParam):
        budget = req.thinking.budget_tokens
    return ChatRequest(
        messages=messages,
        tools=_tools(req),
        tool_choice=_tool_choice(req),
        response_format=response_format,
        sampling=SamplingParams(
            temperature=default_temperature if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
        ),
        max_tokens=req.max_tokens,
        stop=tuple(req.stop_sequences or ()),
        template_kwargs=_template_kwargs(req),
        max_thinking_tokens=budget,
        speculate=req.speculation,
        images=tuple(images),
        pins=_pins(req, messages),
        max_tool_calls=1 if _one_call(req) else None,
    )


def _one_call(req: MessagesRequest) -> bool:
    """``disable_parallel_tool_use``: at most one ``tool_use`` block, the
    answer ending at the first call's end."""
    match req.tool_choice:
        case ToolChoiceAutoParam() | ToolChoiceAnyParam() | ToolChoiceToolParam() as choice:
            return choice.disable_parallel_tool_use is True
    return False


# --- engine -> response -----------------------------------------------------------


def usage_body(u: Usage, system: Sequence[str] = ()) -> dict[str, Any]:
    """Anthropic's arithmetic: the prompt is ``input_tokens`` (computed, not
    pinned) plus ``cache_creation_input_tokens`` (computed and written into a
    ``cache_control`` pin) plus ``cache_read_input_tokens``. gezel's
    ``cache_miss`` names the ``system`` text block a miss in the system
    message falls in, as ``block``."""
    created = u.pinned_5m_tokens + u.pinned_1h_tokens
    miss = cache_miss_body(u.cache_miss)
    if miss is not None:
        miss["block"] = system_block(system, u.cache_miss)
    return {
        "input_tokens": u.input_tokens - u.cached_tokens - created,
        "output_tokens": u.output_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": created,
        "cache_creation": {
            "ephemeral_5m_input_tokens": u.pinned_5m_tokens,
            "ephemeral_1h_input_tokens": u.pinned_1h_tokens,
        },
        "cache_miss": miss,
        # gezel's: what speculation proposed (docs/speculation.md).
        "speculation": speculation_body(u),
    }


def system_texts(req: CountTokensRequest) -> tuple[str, ...]:
    """The request's ``system`` text blocks (a string is one)."""
    if req.system is None:
        return ()
    if isinstance(req.system, str):
        return (req.system,)
    return tuple(block.text for block in req.system)


def _stop(finished: ChatFinished) -> tuple[str, str | None]:
    """``stop_reason`` and ``stop_sequence``."""
    if finished.reason == "tool_calls":
        return "tool_use", None
    if finished.reason == "length":
        return "max_tokens", None
    if finished.stop_sequence is not None:
        return "stop_sequence", finished.stop_sequence
    return "end_turn", None


def _signature(thinking: str) -> str:
    """The thinking block's ``signature``: a digest of its text. Clients
    keep it and send it back; it is not checked."""
    return hashlib.sha256(thinking.encode()).hexdigest()


def _arguments(text: str) -> dict[str, Any]:
    """A call's arguments as the object ``tool_use.input`` must be; a call
    cut short (``max_tokens``) that does not parse is an empty object."""
    try:
        # Strict: a model that writes NaN or Infinity has written no JSON
        # object, and the body carrying this input must stay JSON.
        value = parse_json(text) if text.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_body(
    mid: str,
    model: str,
    finished: ChatFinished,
    *,
    show_thinking: bool,
    system: Sequence[str] = (),
) -> dict[str, Any]:
    msg = finished.message
    content: list[dict[str, Any]] = []
    thinking = msg.get("reasoning_content")
    if thinking:
        shown = thinking if show_thinking else ""
        content.append({"type": "thinking", "thinking": shown, "signature": _signature(thinking)})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or ():
        fn = call["function"]
        use = {"type": "tool_use", "id": call["id"], "name": fn["name"]}
        content.append({**use, "input": _arguments(fn["arguments"])})
    reason, sequence = _stop(finished)
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_body(finished.usage, system),
    }


def _event(name: str, data: dict[str, Any]) -> bytes:
    body = dump_json({"type": name, **data}, compact=True)
    return f"event: {name}\ndata: {body}\n\n".encode()


_PING = _event("ping", {})


class _Events:
    """``sse.Translator`` for Messages: one content block per run of text,
    of thinking, or per tool call, opened by the first delta of its kind and
    closed when another kind starts or the message ends (a thinking block
    closes with its ``signature_delta``)."""

    def __init__(
        self,
        mid: str,
        model: str,
        prompt_tokens: int,
        show_thinking: bool,
        diagnostics: dict[str, Any] | None = None,
        system: Sequence[str] = (),
    ) -> None:
        self._mid = mid
        self._model = model
        self._prompt_tokens = prompt_tokens
        self._show_thinking = show_thinking
        # The message's ``diagnostics`` when the request asked for them.
        self._diagnostics = diagnostics
        self._system = system
        self._started = False  # message_start sent
        self._index = -1
        self._open: str | None = None  # "text", "thinking" or "tool_use"
        self._thinking = hashlib.sha256()

    def opening(self) -> list[bytes]:
        # message_start waits for the admission (``Started``): clients that
        # show the context read the cached and computed split from it.
        return []

    def _begin(self, usage: Usage | None) -> list[bytes]:
        """``message_start`` (once) with the prompt's usage as known at
        admission; without it (a stream that never saw ``Started``), the
        whole prompt as computed."""
        if self._started:
            return []
        self._started = True
        body: dict[str, Any] = {
            "input_tokens": self._prompt_tokens,
            "output_tokens": 0,
            "cache_read_input_tokens": 0,
            "cache_creation_input_tokens": 0,
        }
        if usage is not None:
            body = usage_body(usage, self._system)
        message: dict[str, Any] = {
            "id": self._mid,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": body,
        }
        if self._diagnostics is not None:
            message["diagnostics"] = self._diagnostics["diagnostics"]
        return [_event("message_start", {"message": message}), _PING]

    def render(self, event: ChatEvent, chat: ChatChoice) -> list[bytes]:
        note = liveness_comment(event)
        if note is not None:
            # Before message_start only the SSE comment: Anthropic's streams
            # open with message_start, and every SSE reader skips comments.
            return [_PING, note] if self._started else [note]
        match event:
            case Started(usage=usage):
                return self._begin(usage)
            case Failed(error=error):
                return self.failure(error)
        return [*self._begin(None), *self._content(event)]

    def _content(self, event: ChatEvent) -> list[bytes]:
        match event:
            case TextDelta(text=text):
                return [*self._switch("text"), self._delta({"type": "text_delta", "text": text})]
            case ReasoningDelta(text=text):
                out = self._switch("thinking")
                self._thinking.update(text.encode())
                if self._show_thinking:
                    out.append(self._delta({"type": "thinking_delta", "thinking": text}))
                return out
            case ToolCallDelta(id=call_id, name=name, arguments=arguments) if name is not None:
                use: dict[str, Any] = {"type": "tool_use", "id": call_id, "name": name}
                use["input"] = {}  # filled by the input_json_delta fragments
                out = [*self._close(), *self._start("tool_use", use)]
                if arguments:
                    out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
                return out
            case ToolCallDelta(arguments=arguments) if arguments:
                return [self._delta({"type": "input_json_delta", "partial_json": arguments})]
            case ToolCallDone():
                return self._close()
            case ChatFinished():
                reason, sequence = _stop(event)
                return [
                    *self._close(),
                    _event(
                        "message_delta",
                        {
                            "delta": {"stop_reason": reason, "stop_sequence": sequence},
                            "usage": usage_body(event.usage, self._system),
                        },
                    ),
                    _event("message_stop", {}),
                ]
        return []

    def failure(self, err: GezelError) -> list[bytes]:
        return [_event("error", {"error": error_body(err)["error"]})]

    def _switch(self, kind: str) -> list[bytes]:
        if self._open == kind:
            return []
        block: dict[str, Any] = {"type": "text", "text": ""}
        if kind == "thinking":
            block = {"type": "thinking", "thinking": "", "signature": ""}
            self._thinking = hashlib.sha256()
        return [*self._close(), *self._start(kind, block)]

    def _start(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        self._index += 1
        self._open = kind
        return [_event("content_block_start", {"index": self._index, "content_block": block})]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        out = []
        if self._open == "thinking":
            signature = self._thinking.hexdigest()
            out.append(self._delta({"type": "signature_delta", "signature": signature}))
        self._open = None
        out.append(_event("content_block_stop", {"index": self._index}))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self._index, "delta": delta})


def _show_thinking(req: CountTokensRequest) -> bool:
    display = getattr(req.thinking, "display", None)
    return display != "omitted"


def blueprint(engine: Engine) -> ProtocolBlueprint:
    """``/v1/messages`` and ``/v1/messages/count_tokens`` over ``engine``;
    errors here and anywhere under ``/v1/messages`` leave in Anthropic's
    envelope."""
    bp = ProtocolBlueprint(
        "anthropic_messages", __name__, refusal(engine, error_response), url_prefix=MESSAGES_PATH
    )

    # Cache-diagnostics fingerprints of this app's responses, by id.
    fingerprints = FingerprintStore()

    @bp.route("", methods=["POST"])
    async def messages() -> Response:
        req, chat = await json_view(
            parse_messages_request,
            partial(chat_request, default_temperature=engine.config.requests.default_temperature),
        )
        tenant = current_tenant()
        prepared = await engine.prepare_chat(tenant.chat(chat, req.cache_salt))
        mid = f"msg_{uuid.uuid4().hex}"
        model = req.model or engine.info.model_id
        show = _show_thinking(req)
        diagnostics = None
        if req.diagnostics is not None:
            # Digests of the whole conversation: about 1 ms for 240k
            # characters, kept off the thread that serves every stream.
            prompt_tokens = len(prepared.request.prompt)
            keep = engine.config.shaping.keep_billing_header
            current = await trio.to_thread.run_sync(
                partial(fingerprint, model, chat, prompt_tokens, keep_billing_header=keep)
            )
            # Fingerprints by the tenant's own ids: another's message is not found.
            previous = tenant.name(req.diagnostics.previous_message_id)
            own = tenant.name(mid) or mid
            diagnostics = {"diagnostics": fingerprints.diagnose(own, previous, current)}
        system = system_texts(req)
        if req.stream:
            prompt = len(prepared.request.prompt)
            events = _Events(mid, model, prompt, show, diagnostics, system)
            return _ignored(req, stream_chat(engine, prepared, events))
        finished, _ = await run_chat(engine, prepared)
        body = message_body(mid, model, finished, show_thinking=show, system=system)
        if diagnostics is not None:
            body.update(diagnostics)
        return _ignored(req, Response(dump_json(body), mimetype="application/json"))

    @bp.route("/count_tokens", methods=["POST"])
    async def count_tokens() -> Response:
        req, (messages, images) = await json_view(parse_count_tokens_request, _counted)
        if images:
            # An image is as many tokens as its processor makes of it: the
            # engine prepares the whole request (decoding on a worker thread).
            count = await engine.count_tokens(
                ChatRequest(
                    messages=messages,
                    tools=_tools(req),
                    template_kwargs=_template_kwargs(req),
                    images=tuple(images),
                )
            )
        else:
            rendered = await engine.render_chat(
                messages, tools=_tools(req), template_kwargs=_template_kwargs(req)
            )
            count = len(rendered.tokens)
        body = {"input_tokens": count}
        return Response(dump_json(body), mimetype="application/json")

    return bp


def _ignored(req: MessagesRequest, response: Response) -> Response:
    """Name the Anthropic-defined tools left out of the prompt, on the
    response and in the log (once per request), as Responses does."""
    if req.ignored_tools:
        kinds = ", ".join(req.ignored_tools)
        response.headers[IGNORED_TOOLS_HEADER] = kinds
        log.info("messages: ignored tools this server cannot run: %s", kinds)
    return response


def _counted(req: CountTokensRequest) -> tuple[list[dict[str, Any]], list[ImagePart]]:
    """``count_tokens``'s conversation in the template's roles, and its images."""
    images: list[ImagePart] = []
    return chat_messages(req.system, req.messages, images), images
