"""``/v1/responses``: OpenAI's Responses API over the same chat path.

A thin translation, like chat completions: the body's ``instructions`` and
input items (plus, with ``previous_response_id``, the stored conversation
before them) become a ``ChatRequest``; the engine prepares it before any
byte is sent, so a bad request is a 400; then the chat's shaped events
become output items - ``reasoning`` (its text as ``reasoning_text``),
``message`` (``output_text``) and ``function_call`` - streamed as the
documented event sequence, each event with its ``sequence_number``::

    response.created, response.in_progress,
      per item: response.output_item.added,
        message:   response.content_part.added, response.output_text.delta...,
                   response.output_text.done, response.content_part.done
        reasoning: response.content_part.added, response.reasoning_text.delta...,
                   response.reasoning_text.done, response.content_part.done
        call:      response.function_call_arguments.delta...,
                   response.function_call_arguments.done
      response.output_item.done,
    response.completed | response.incomplete (max_output_tokens) | response.failed

Stored responses (``store``, the default) live in the ``ResponseStore``:
``GET`` and ``DELETE /v1/responses/{id}``, ``previous_response_id``, and
``background: true`` responses, which run as tasks in the store's nursery
until done or ``POST /v1/responses/{id}/cancel``. A chain's turns reach
the prompt cache as one growing conversation: each continuation's prompt
starts with the previous one's (content-addressed), and from the second
turn on the chain names its cache entry (``responses:<first id>``), so
``usage.input_tokens_details.cached_tokens`` grows turn by turn.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from quart import Response

from ..core.errors import GezelError, InvalidRequest, shown
from ..core.events import Failed, TokenLogprob, Usage
from ..core.images import ImagePart
from ..core.request import SamplingParams
from ..engine import (
    ChatChoice,
    ChatEvent,
    ChatFinished,
    ChatHandle,
    ChatLogprobs,
    ChatRequest,
    Engine,
    PreparedChat,
)
from ..shaping.custom_tools import RawInput, as_function, custom_input, input_arguments
from ..shaping.replies import TAIL_TOKENS, GeneratedReply, ReplyLedger, ReplySeal
from ..shaping.shaper import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallDone
from .edge import (
    IGNORED_TOOLS_HEADER,
    HttpError,
    NotFound,
    ProtocolBlueprint,
    error_response,
    json_view,
    refusal,
)
from .images import from_data_url
from .response_store import ResponseStore, StoredResponse
from .responses_wire import (
    MAX_COMPACTED_BYTES,
    ContentItem,
    CustomTool,
    CustomToolCallItem,
    CustomToolCallOutputItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    HostedTool,
    InputItem,
    MessageItem,
    NamespaceTool,
    ReasoningItem,
    ResponsesRequest,
    ToolChoiceAllowed,
    ToolChoiceCustom,
    ToolChoiceFunction,
    parse_compact_request,
    parse_responses_request,
    structure_items,
    without_compaction_trigger,
)
from .sse import (
    cache_miss_body,
    liveness_comment,
    speculation_body,
    stream_chat,
)
from .strict import dump_json
from .tenancy import current_tenant
from .tool_namespaces import flat_name

__all__ = ["IGNORED_TOOLS_HEADER", "RESPONSES_PATH", "blueprint", "items_to_messages"]

RESPONSES_PATH = "/v1/responses"

log = logging.getLogger("gezel_trio.http")

_LOGPROBS_INCLUDE = "message.output_text.logprobs"
_ENCRYPTED_INCLUDE = "reasoning.encrypted_content"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# --- input items -> chat messages ---------------------------------------------


def _content_text(content: str | list[ContentItem], where: str) -> str:
    if isinstance(content, str):
        return content
    out = []
    for j, part in enumerate(content):
        match part.type:
            case "input_text" | "output_text":
                out.append(part.text or "")
            case "refusal":
                out.append(part.refusal or part.text or "")
            case "input_image":
                raise InvalidRequest(
                    "an input_image may only appear in a user message", param=f"{where}[{j}]"
                )
            case _:
                raise InvalidRequest(
                    f"{part.type} content is not supported (text and images only)",
                    param=f"{where}[{j}]",
                )
    return "".join(out)


def _user_content(content: str | list[ContentItem], where: str) -> str | list[dict[str, Any]]:
    """A user message's content: its text, or with ``input_image`` parts a
    list of text and ``{"type": "image"}`` parts. An image part keeps its
    ``data:`` URL (checked here) and where it came from, so a stored
    conversation carries its pictures into a ``previous_response_id``
    continuation; templates read only ``type``."""
    if isinstance(content, str) or all(p.type != "input_image" for p in content):
        return _content_text(content, where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if part.type != "input_image":
            parts.append({"type": "text", "text": _content_text([part], f"{where}[{j}]")})
            continue
        param = f"{where}[{j}].image_url"
        if part.image_url is None:
            raise InvalidRequest(
                "an input_image needs image_url (file_id needs the Files API, which this "
                "server does not have)",
                param=param,
            )
        from_data_url(part.image_url, param)  # a 400 naming the part, now
        parts.append({"type": "image", "image_url": part.image_url, "param": param})
    return parts


def _images(messages: list[dict[str, Any]]) -> tuple[ImagePart, ...]:
    """The pictures of a conversation's image parts, in prompt order."""
    return tuple(
        from_data_url(part["image_url"], part["param"])
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if part.get("type") == "image" and "image_url" in part
    )


def items_to_messages(items: list[InputItem], where: str = "input") -> list[dict[str, Any]]:
    """Responses items as the chat messages a template renders. The
    assistant side of a turn - reasoning, message and function-call items in
    a row - is one assistant message (its reasoning, its text, its calls), as
    a chat completion's message is, so a replayed output renders as the
    stored conversation does; a call's output is a ``tool`` message."""
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message being gathered

    def assistant() -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            out.append(turn)
        return turn

    for i, item in enumerate(items):
        match item:
            case MessageItem(role="assistant", content=content):
                assistant()["content"] += _content_text(content, f"{where}[{i}].content")
            case MessageItem(role="user", content=content):
                turn = None
                out.append(
                    {"role": "user", "content": _user_content(content, f"{where}[{i}].content")}
                )
            case MessageItem(role=role, content=content):
                turn = None
                text = _content_text(content, f"{where}[{i}].content")
                out.append({"role": "system" if role == "developer" else role, "content": text})
            case FunctionCallItem(call_id=call_id, name=name, namespace=ns, arguments=arguments):
                # A namespaced tool's call under the flat name the model wrote.
                calls = assistant().setdefault("tool_calls", [])
                calls.append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": flat_name(ns, name), "arguments": arguments},
                    }
                )
            case CustomToolCallItem(call_id=call_id, name=name, namespace=ns, input=raw):
                # As the model generated it: a function call of one ``input`` string.
                calls = assistant().setdefault("tool_calls", [])
                fn = {"name": flat_name(ns, name), "arguments": input_arguments(raw)}
                calls.append({"id": call_id, "type": "function", "function": fn})
            case CustomToolCallOutputItem(call_id=call_id, output=output):
                turn = None
                text = _content_text(output, f"{where}[{i}].output")
                out.append({"role": "tool", "tool_call_id": call_id, "content": text})
            case FunctionCallOutputItem(call_id=call_id, output=output):
                turn = None
                text = _content_text(output, f"{where}[{i}].output")
                out.append({"role": "tool", "tool_call_id": call_id, "content": text})
            case ReasoningItem(content=content, summary=summary):
                parts = content if content else summary
                text = "".join(p.text for p in parts)
                if text:
                    msg = assistant()
                    msg["reasoning_content"] = msg.get("reasoning_content", "") + text
    return out


def _input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input items as chat messages (``items_to_messages``)."""
    return items_to_messages(req.items)


def _restore_sealed(
    replies: ReplyLedger | None, items: list[InputItem], messages: list[dict[str, Any]]
) -> None:
    """Put the replies sealed in reasoning items' ``encrypted_content``
    back into the ledger, under the assistant message each belongs to (as
    ``items_to_messages`` gathers them), so the prompt spells them with the
    ids this server generated. A blob that does not verify is ignored."""
    if replies is None or replies.seal is None:
        return
    turns = iter(m for m in messages if m["role"] == "assistant")
    turn: dict[str, Any] | None = None
    pending: list[GeneratedReply] = []
    for item in items:
        assistant_side = isinstance(item, FunctionCallItem | ReasoningItem) or (
            isinstance(item, MessageItem) and item.role == "assistant"
        )
        if not assistant_side:
            turn, pending = None, []
            continue
        if isinstance(item, ReasoningItem):
            if item.encrypted_content:
                reply = replies.seal.open(item.encrypted_content)
                if reply is not None:
                    pending.append(reply)
            text = "".join(p.text for p in (item.content or item.summary))
            if not text:
                continue  # a reasoning item without text starts no message
        if turn is None:
            turn = next(turns, None)
            if turn is None:
                return
        for reply in pending:
            replies.restore(turn, reply)
        pending = []
    # Nothing follows a trailing reasoning item: its message never formed.


def _output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This response's output items as chat messages (``items_to_messages``);
    a call cut short is left out, so a continuation never renders it."""
    whole = [
        item
        for item in output
        if not (
            item["type"] in ("function_call", "custom_tool_call") and item["status"] == "incomplete"
        )
    ]
    return items_to_messages(structure_items(whole), "output")


# --- the response object ------------------------------------------------------


def _usage(u: Usage | None) -> dict[str, Any] | None:
    if u is None:
        return None
    return {
        "input_tokens": u.input_tokens,
        "input_tokens_details": {
            "cached_tokens": u.cached_tokens,
            "cache_write_tokens": max(0, u.input_tokens - u.cached_tokens),
        },
        "output_tokens": u.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0, **speculation_body(u)},
        "total_tokens": u.total_tokens,
        "cache_miss": cache_miss_body(u.cache_miss),
    }


def _tools_echo(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The served tools as the request wrote them (a namespace as one)."""
    out: list[dict[str, Any]] = []
    for t in req.tools or []:
        if isinstance(t, NamespaceTool):
            inner = [_tool_echo(m) for m in t.tools if not isinstance(m, HostedTool)]
            echo = {"type": "namespace", "name": t.name, "description": t.description}
            out.append({**echo, "tools": inner})
        elif not isinstance(t, HostedTool):
            out.append(_tool_echo(t))
    return out


def _tool_echo(t: FunctionTool | CustomTool) -> dict[str, Any]:
    if isinstance(t, CustomTool):
        fmt = t.format_dict or {"type": "text"}
        return {"type": "custom", "name": t.name, "description": t.description, "format": fmt}
    return {
        "type": "function",
        "name": t.name,
        "description": t.description,
        "parameters": t.parameters,
        "strict": t.strict if t.strict is not None else True,
    }


def _tool_choice_echo(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceFunction | ToolChoiceCustom):
        echo = {"type": choice.type, "name": choice.name}
        return echo if choice.namespace is None else {**echo, "namespace": choice.namespace}
    if isinstance(choice, ToolChoiceAllowed):
        return {"type": "allowed_tools", "mode": choice.mode, "tools": choice.tools}
    return choice or "auto"


def _format_echo(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return {"type": "text"}
    out: dict[str, Any] = {"type": fmt.type}
    if fmt.type == "json_schema":
        out.update(
            name=fmt.name or "response",
            schema=fmt.schema,
            strict=fmt.strict,
            description=fmt.description,
        )
    return out


@attrs.define
class _Context:
    """What one response is: its id, request, model name and chain."""

    rid: str
    req: ResponsesRequest
    model: str
    history: list[dict[str, Any]]  # stored conversation + this input (no instructions)
    root: str
    created_at: int = attrs.field(factory=lambda: int(time.time()))
    seal: ReplySeal | None = None  # with include reasoning.encrypted_content
    temperature: float = 1.0  # what it samples with, echoed
    owner: str = ""  # the tenant (``http.tenancy``)

    def sealer(self, choice: ChatChoice) -> Callable[[], str | None] | None:
        """What seals ``choice``'s reply so far, for its reasoning items."""
        seal = self.seal
        if seal is None:
            return None
        tail = choice.prepared.request.prompt[-TAIL_TOKENS:]

        def sealed() -> str | None:
            tokens = choice.tokens
            return seal.seal(GeneratedReply(tail, tokens)) if tokens else None

        return sealed

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: Usage | None = None,
        *,
        error: GezelError | None = None,
        reason: str | None = None,
    ) -> dict[str, Any]:
        req = self.req
        tool_choice = _tool_choice_echo(req)
        done = status in ("completed", "incomplete", "failed", "cancelled")
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": bool(req.background),
            "error": (
                {"code": "server_error", "message": error.message} if error is not None else None
            ),
            # OpenAI names two reasons; a call cut short by anything but the
            # budget (a stop string) is incomplete without one.
            "incomplete_details": (
                {"reason": "max_output_tokens" if reason == "length" else None}
                if status == "incomplete"
                else None
            ),
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "prompt_cache_key": req.prompt_cache_key,
            "reasoning": {
                "effort": req.effort,
                "summary": req.reasoning.summary if req.reasoning is not None else None,
            },
            "safety_identifier": req.safety_identifier,
            "service_tier": "default",
            "store": req.stores,
            "temperature": self.temperature,
            "text": {
                "format": _format_echo(req),
                "verbosity": (req.text.verbosity if req.text else None) or "medium",
            },
            "tool_choice": tool_choice,
            "tools": _tools_echo(req),
            "top_logprobs": req.top_logprobs or 0,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": _usage(usage) if done else None,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    def record(self, body: dict[str, Any]) -> StoredResponse:
        messages = self.history + _output_messages(body["output"])
        return StoredResponse(self.rid, body, messages, self.root, owner=self.owner)


# --- output items and their stream events ---------------------------------------


def _logprob(t: TokenLogprob) -> dict[str, Any]:
    return {
        "token": t.token,
        "logprob": t.logprob,
        "bytes": list(t.token.encode()),
        "top_logprobs": [{"token": s, "logprob": lp, "bytes": list(s.encode())} for s, lp in t.top],
    }


class _Output:
    """A chat's shaped events as Responses output items, with the stream
    events that build them. Every caller (streamed, not, background) feeds
    every event, so the three agree on the items."""

    def __init__(
        self,
        logprobs: bool,
        custom: frozenset[str] = frozenset(),
        namespaced: Mapping[str, tuple[str, str]] | None = None,
    ) -> None:
        self.items: list[dict[str, Any]] = []
        # Calls of these names are custom tool calls: raw ``input``, not arguments.
        self._custom = custom
        # Flat names of namespaced tools: their calls name the tool as the
        # client wrote it, ``name`` and ``namespace``.
        self._namespaced = namespaced or {}
        self._raw: RawInput | None = None
        self._open: dict[str, Any] | None = None
        self._parts: list[str] = []
        self._logprobs = logprobs
        # With ``include: ["reasoning.encrypted_content"]``: the sealed ids
        # generated so far, for each reasoning item as it closes.
        self.sealer: Callable[[], str | None] | None = None
        self._pending_lp: list[dict[str, Any]] = []
        self._item_lp: list[dict[str, Any]] = []
        # A call whose markup broke off or whose arguments are not a JSON
        # object (``ToolCallDone.complete``): its item is ``incomplete``, and
        # so is the response, whatever the engine's finish reason.
        self.broken_call = False

    def feed(self, event: ChatEvent) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        match event:
            case TextDelta(text=text):
                out += self._ensure("message")
                item = self._open
                assert item is not None
                self._parts.append(text)
                lp, self._pending_lp = self._pending_lp, []
                self._item_lp += lp
                out.append(
                    {
                        "type": "response.output_text.delta",
                        "item_id": item["id"],
                        "output_index": len(self.items) - 1,
                        "content_index": 0,
                        "delta": text,
                        "logprobs": lp,
                    }
                )
            case ReasoningDelta(text=text):
                out += self._ensure("reasoning")
                item = self._open
                assert item is not None
                self._parts.append(text)
                out.append(
                    {
                        "type": "response.reasoning_text.delta",
                        "item_id": item["id"],
                        "output_index": len(self.items) - 1,
                        "content_index": 0,
                        "delta": text,
                    }
                )
            case ToolCallDelta(id=call_id, name=name, arguments=arguments):
                if name is not None:
                    out += self.close("completed")
                    if name in self._custom:
                        self._raw = RawInput()
                        item = {
                            "id": _new_id("ctc"),
                            "type": "custom_tool_call",
                            "status": "in_progress",
                            "call_id": call_id,
                            "name": name,
                            "input": "",
                        }
                    else:
                        item = {
                            "id": _new_id("fc"),
                            "type": "function_call",
                            "status": "in_progress",
                            "call_id": call_id,
                            "name": name,
                            "arguments": "",
                        }
                    if name in self._namespaced:
                        item["namespace"], item["name"] = self._namespaced[name]
                    out += self._add(item)
                if (
                    arguments
                    and self._open is not None
                    and self._open["type"] == "custom_tool_call"
                ):
                    self._parts.append(arguments)
                    assert self._raw is not None
                    delta = self._raw.feed(arguments)
                    if delta:
                        out.append(
                            {
                                "type": "response.custom_tool_call_input.delta",
                                "item_id": self._open["id"],
                                "output_index": len(self.items) - 1,
                                "delta": delta,
                            }
                        )
                elif arguments and self._open is not None:
                    self._parts.append(arguments)
                    out.append(
                        {
                            "type": "response.function_call_arguments.delta",
                            "item_id": self._open["id"],
                            "output_index": len(self.items) - 1,
                            "delta": arguments,
                        }
                    )
            case ToolCallDone(arguments=arguments, complete=complete):
                if self._open is not None and self._open["type"] in (
                    "function_call",
                    "custom_tool_call",
                ):
                    self._parts = [arguments]
                    self.broken_call |= not complete
                    out += self.close("completed" if complete else "incomplete")
            case ChatLogprobs(items=items):
                if self._logprobs:
                    self._pending_lp += [_logprob(t) for t in items]
        return out

    def close(self, status: str) -> list[dict[str, Any]]:
        """Finish the item being generated (if any) with ``status``."""
        item = self._open
        if item is None:
            return []
        self._open = None
        index = len(self.items) - 1
        text = "".join(self._parts)
        self._parts = []
        out: list[dict[str, Any]] = []
        base = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            lp = self._item_lp + self._pending_lp
            self._item_lp, self._pending_lp = [], []
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": lp}
            item["content"] = [part]
            out += [
                {
                    "type": "response.output_text.done",
                    **base,
                    "content_index": 0,
                    "text": text,
                    "logprobs": lp,
                },
                {"type": "response.content_part.done", **base, "content_index": 0, "part": part},
            ]
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            sealed = self.sealer() if self.sealer is not None else None
            if sealed is not None:
                item["encrypted_content"] = sealed
            out += [
                {"type": "response.reasoning_text.done", **base, "content_index": 0, "text": text},
                {"type": "response.content_part.done", **base, "content_index": 0, "part": part},
            ]
        elif item["type"] == "custom_tool_call":
            raw = custom_input(text)
            if raw is None:  # not {"input": "..."}: what was streamed, marked so
                raw = "".join(self._raw.text) if self._raw is not None else ""
                status = "incomplete"
                self.broken_call = True
            self._raw = None
            item["input"] = raw
            out.append({"type": "response.custom_tool_call_input.done", **base, "input": raw})
        else:
            item["arguments"] = text
            out.append(
                {
                    "type": "response.function_call_arguments.done",
                    **base,
                    "name": item["name"],
                    "arguments": text,
                }
            )
        item["status"] = status
        out.append({"type": "response.output_item.done", "output_index": index, "item": item})
        return out

    def _ensure(self, kind: str) -> list[dict[str, Any]]:
        if self._open is not None and self._open["type"] == kind:
            return []
        out = self.close("completed")
        if kind == "message":
            item: dict[str, Any] = {
                "id": _new_id("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part: dict[str, Any] = {
                "type": "output_text",
                "text": "",
                "annotations": [],
                "logprobs": [],
            }
        else:
            item = {
                "id": _new_id("rs"),
                "type": "reasoning",
                "status": "in_progress",
                "summary": [],
                "content": [],
            }
            part = {"type": "reasoning_text", "text": ""}
        out += self._add(item)
        out.append(
            {
                "type": "response.content_part.added",
                "item_id": item["id"],
                "output_index": len(self.items) - 1,
                "content_index": 0,
                "part": part,
            }
        )
        return out

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self._open = item
        self._parts = []
        return [
            {
                "type": "response.output_item.added",
                "output_index": len(self.items) - 1,
                "item": dict(item),
            }
        ]


def _output(req: ResponsesRequest, prepared: PreparedChat) -> _Output:
    return _Output(
        prepared.request.top_logprobs is not None,
        frozenset(prepared.chat.custom_tools),
        req.namespaced,
    )


def _final_status(reason: str, output: _Output) -> str:
    """``incomplete`` when the budget ran out (``max_output_tokens``) or a
    call was cut short: a ``completed`` response's calls always parse."""
    return "incomplete" if reason == "length" or output.broken_call else "completed"


# --- streamed responses --------------------------------------------------------


def _event_frame(event: dict[str, Any], seq: int) -> bytes:
    """``event`` as a named SSE frame, numbered ``seq`` (set on it)."""
    event["sequence_number"] = seq
    data = dump_json(event, compact=True)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


class _Events:
    """``sse.Translator`` for Responses: named events with sequence numbers.
    The response is stored before its terminal event is written, so a client
    that reads ``response.completed`` can continue from it at once."""

    def __init__(self, ctx: _Context, store: ResponseStore, output: _Output) -> None:
        self._ctx = ctx
        self._store = store
        self._output = output
        self._seq = 0
        self._opened = False

    def _frame(self, event: dict[str, Any]) -> bytes:
        self._seq += 1
        return _event_frame(event, self._seq - 1)

    def _frames(self, events: list[dict[str, Any]]) -> list[bytes]:
        return [self._frame(e) for e in events]

    def opening(self) -> list[bytes]:
        self._opened = True
        body = self._ctx.body("in_progress", [])
        return self._frames(
            [
                {"type": "response.created", "response": body},
                {"type": "response.in_progress", "response": body},
            ]
        )

    def render(self, event: ChatEvent, chat: ChatChoice) -> list[bytes]:
        note = liveness_comment(event)
        if note is not None:
            return [note]
        if self._output.sealer is None:
            self._output.sealer = self._ctx.sealer(chat)
        match event:
            case ChatFinished(reason=reason, usage=usage):
                status = _final_status(reason, self._output)
                events = self._output.close(status)
                body = self._ctx.body(status, self._output.items, usage, reason=reason)
                self._save(body)
                kind = "response.completed" if status == "completed" else "response.incomplete"
                return self._frames([*events, {"type": kind, "response": body}])
            case Failed(error=error):
                return self._failed(error, chat.usage)
        return self._frames(self._output.feed(event))

    def failure(self, err: GezelError) -> list[bytes]:
        return self._failed(err, None)

    def _failed(self, err: GezelError, usage: Usage | None) -> list[bytes]:
        frames = [] if self._opened else self.opening()
        events = self._output.close("incomplete")
        body = self._ctx.body("failed", self._output.items, usage, error=err)
        self._save(body)
        return frames + self._frames([*events, {"type": "response.failed", "response": body}])

    def _save(self, body: dict[str, Any]) -> None:
        if self._ctx.req.stores:
            self._store.put(self._ctx.record(body))


# --- not streamed, and in the background --------------------------------------------


async def _run(
    chat: ChatHandle, output: _Output, ctx: _Context | None = None
) -> tuple[ChatFinished | Failed, Usage | None]:
    if ctx is not None:
        output.sealer = ctx.sealer(chat.choices[0])
    async for _, event in chat:
        output.feed(event)
        if isinstance(event, ChatFinished | Failed):
            return event, chat.usage
    raise GezelError("the request ended without a result")  # pragma: no cover


def _finish(
    ctx: _Context, output: _Output, end: ChatFinished | Failed, usage: Usage | None
) -> dict[str, Any]:
    """The response's final body, its last item closed."""
    if isinstance(end, ChatFinished):
        status = _final_status(end.reason, output)
        output.close(status)
        return ctx.body(status, output.items, end.usage, reason=end.reason)
    output.close("incomplete")
    return ctx.body("failed", output.items, usage, error=end.error)


async def _background(
    engine: Engine, store: ResponseStore, ctx: _Context, prepared: PreparedChat
) -> None:
    """A background response's job, in the store's nursery. Whatever happens
    to it is recorded on it and goes no further: a bug here fails this
    response, never the store's nursery (nor the server it runs in)."""
    output = _output(ctx.req, prepared)
    chat: ChatHandle | None = None
    body: dict[str, Any] | None = None
    try:
        with engine.submit_chat_nowait(prepared) as chat:
            store.put(ctx.record(ctx.body("in_progress", [])))
            end, usage = await _run(chat, output, ctx)
            body = _finish(ctx, output, end, usage)
    except GezelError as err:
        usage = chat.usage if chat is not None else None
        body = ctx.body("failed", output.items, usage, error=err)
    except Exception:
        log.exception("background response %s failed", ctx.rid)
        usage = chat.usage if chat is not None else None
        body = ctx.body("failed", output.items, usage, error=GezelError("internal error"))
    finally:
        if body is None:  # cancelled: by the client, or by the server's shutdown
            # What it used until then (its prompt, the tokens it generated).
            usage = chat.usage if chat is not None else None
            output.close("incomplete")
            if store.was_cancelled(ctx.rid):
                body = ctx.body("cancelled", output.items, usage)
            else:
                gone = GezelError("the server shut down before this response finished")
                body = ctx.body("failed", output.items, usage, error=gone)
        if store.get(ctx.rid) is not None:  # not deleted meanwhile
            store.put(ctx.record(body))


# --- routes ---------------------------------------------------------------------------


def _chat_request(
    req: ResponsesRequest,
    messages: list[dict[str, Any]],
    cache_id: str | None,
    default_temperature: float = 1.0,
) -> ChatRequest:
    tools = None
    custom: dict[str, Any] = {}
    if req.served_tools:
        tools = []
        for t in req.served_tools:
            if isinstance(t, CustomTool):
                custom[t.name] = t.format_dict
                tools.append(as_function(t.name, t.description, t.format_dict))
                continue
            fn: dict[str, Any] = {"name": t.name}
            if t.description is not None:
                fn["description"] = t.description
            if t.parameters is not None:
                fn["parameters"] = t.parameters
            if t.strict is not None:
                fn["strict"] = t.strict
            tools.append({"type": "function", "function": fn})
    choice: str | dict[str, Any] | None
    match req.tool_choice:
        case (
            ToolChoiceFunction(name=name, namespace=ns) | ToolChoiceCustom(name=name, namespace=ns)
        ):
            choice = {"type": "function", "function": {"name": flat_name(ns, name)}}
        case ToolChoiceAllowed(mode="required") as allowed:
            choice = {"type": "allowed_tools", "names": allowed.names}
        case ToolChoiceAllowed():
            choice = "auto"
        case other:
            choice = other
    if tools is None and choice not in (None, "none"):
        # Only hosted tools (left out): the model answers in text.
        choice = None
    logprobs = req.top_logprobs is not None or _LOGPROBS_INCLUDE in (req.include or [])
    return ChatRequest(
        messages=messages,
        tools=tools,
        tool_choice=choice,
        response_format=req.response_format,
        sampling=SamplingParams(
            temperature=default_temperature if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=None if req.seed == -1 else req.seed,
        ),
        max_tokens=req.max_output_tokens,
        priority=req.priority,
        cache_id=cache_id,
        template_kwargs=req.template_kwargs,
        max_thinking_tokens=req.thinking_budget,
        top_logprobs=(req.top_logprobs or 0) if logprobs else None,
        speculate=req.speculation,
        images=_images(messages),
        custom_tools=custom,
        max_tool_calls=_max_tool_calls(req),
    )


def _max_tool_calls(req: ResponsesRequest) -> int | None:
    """``max_tool_calls``, and one call without ``parallel_tool_calls``: a
    call past them is never generated (OpenAI ignores further calls)."""
    if req.parallel_tool_calls is False:
        return 1
    return req.max_tool_calls


def _ignored(req: ResponsesRequest, response: Response) -> Response:
    """Name the tools left out of the prompt (hosted ones, kinds this server
    does not know), on the response and in the log (once per request)."""
    if req.ignored_tools:
        kinds = ", ".join(req.ignored_tools)
        response.headers[IGNORED_TOOLS_HEADER] = kinds
        log.info("responses: ignored tools this server cannot run: %s", kinds)
    return response


def _no_seal() -> HttpError:
    return HttpError(501, "not_implemented", "this engine has no key to seal histories")


def _seal_history(engine: Engine, body: Any) -> str:
    """The ``encrypted_content`` of a compaction of ``body``'s input, which
    is validated as a request carrying it would be; raises ``InvalidRequest``."""
    seal = engine.seal
    if seal is None:
        raise _no_seal()
    req, raw = parse_compact_request(body, seal)
    items_to_messages(req.items)  # what a request carrying it would refuse, now
    try:
        # Bounded as a request expands it, so what is sealed opens.
        return seal.seal_history(raw, MAX_COMPACTED_BYTES)
    except ValueError as exc:
        raise InvalidRequest(f"input cannot be compacted: {exc}", param="input") from None


@attrs.frozen
class _Sealed:
    """A Responses request that ends in a ``compaction_trigger``: its model
    and the compaction of the items before the trigger."""

    model: Any
    stream: bool
    blob: str


_NO_USAGE: dict[str, Any] = {
    "input_tokens": 0,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens": 0,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 0,
}


def _compaction_response(asked: _Sealed) -> Response:
    """A completed response whose one output item is the compaction (what
    Codex's compaction turn accepts: exactly one ``compaction`` item), as
    JSON or as the events of a streamed response. No model runs."""
    item = {"id": _new_id("cmp"), "type": "compaction", "encrypted_content": asked.blob}
    body: dict[str, Any] = {
        "id": _new_id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "status": "completed",
        "model": asked.model if isinstance(asked.model, str) else "",
        "output": [item],
        "usage": _NO_USAGE,
    }
    if not asked.stream:
        return Response(dump_json(body), mimetype="application/json")
    opened = {**body, "status": "in_progress", "output": []}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": opened},
        {"type": "response.in_progress", "response": opened},
        {"type": "response.output_item.added", "output_index": 0, "item": item},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed", "response": body},
    ]
    frames = b"".join(_event_frame(e, n) for n, e in enumerate(events))
    return Response(frames, mimetype="text/event-stream")


def _not_found(rid: str) -> NotFound:
    return NotFound(f"no stored response {shown(rid)}", param="response_id")


def blueprint(engine: Engine, store: ResponseStore) -> ProtocolBlueprint:
    """``/v1/responses`` and its stored responses (in ``store``) over
    ``engine``; errors leave in the OpenAI envelope."""
    bp = ProtocolBlueprint(
        "openai_responses", __name__, refusal(engine, error_response), url_prefix=RESPONSES_PATH
    )

    def parse(body: Any) -> ResponsesRequest | _Sealed:
        rest = without_compaction_trigger(body)
        if rest is not None:
            stream = rest.pop("stream", None)
            if stream is not None and not isinstance(stream, bool):
                raise InvalidRequest("stream must be a boolean", param="stream")
            return _Sealed(rest.get("model"), stream is True, _seal_history(engine, rest))
        return parse_responses_request(body, engine.seal)

    def view(req: ResponsesRequest | _Sealed) -> list[dict[str, Any]]:
        return [] if isinstance(req, _Sealed) else _input_messages(req)

    @bp.route("", methods=["POST"])
    async def create_response() -> Response:
        req, new = await json_view(parse, view)
        if isinstance(req, _Sealed):
            return _compaction_response(req)
        tenant = current_tenant()
        prev: StoredResponse | None = None
        if req.previous_response_id is not None:
            # Another tenant's response is not found, as an unknown one.
            prev = store.get(req.previous_response_id, owner=tenant.id)
            if prev is None:
                raise InvalidRequest(
                    f"previous response {shown(req.previous_response_id)} not found",
                    param="previous_response_id",
                )
            if prev.body.get("status") in ("queued", "in_progress"):
                raise InvalidRequest(
                    f"previous response {shown(prev.id)} has not finished",
                    param="previous_response_id",
                )
        _restore_sealed(engine.replies, req.items, new)
        history = (prev.messages if prev is not None else []) + new
        if not history:
            raise InvalidRequest("input is required", param="input")
        messages = history
        if req.instructions:
            messages = [{"role": "system", "content": req.instructions}, *history]
        rid = _new_id("resp")
        root = prev.root if prev is not None else rid
        # The chain's own prompt-cache entry from its second turn on; a lone
        # response is cached by content like any chat.
        cache_id = req.session_id or (f"responses:{root}" if prev is not None else None)
        if req.background and not store.running:
            # An app built without server.serve (an embedder's): no task runs them.
            raise InvalidRequest(
                "background responses need the server's response store, which this "
                "app was built without",
                param="background",
            )
        asked = _chat_request(req, messages, cache_id, engine.config.requests.default_temperature)
        prepared = await engine.prepare_chat(tenant.chat(asked, req.cache_salt))
        ctx = _Context(
            rid,
            req,
            req.model or engine.info.model_id,
            history,
            root,
            temperature=asked.sampling.temperature,
            owner=tenant.id,
        )
        if _ENCRYPTED_INCLUDE in (req.include or []) and engine.replies is not None:
            ctx.seal = engine.replies.seal
        if req.background:
            body = ctx.body("queued", [])
            store.put(ctx.record(body))
            store.start_background(rid, lambda: _background(engine, store, ctx, prepared))
            return _ignored(req, Response(dump_json(body), mimetype="application/json"))
        output = _output(req, prepared)
        if req.stream:
            stream = stream_chat(engine, prepared, _Events(ctx, store, output))
            return _ignored(req, stream)
        with engine.submit_chat_nowait(prepared) as chat:
            end, usage = await _run(chat, output, ctx)
        body = _finish(ctx, output, end, usage)
        if req.stores:
            store.put(ctx.record(body))
        if isinstance(end, Failed):
            raise end.error
        return _ignored(req, Response(dump_json(body), mimetype="application/json"))

    @bp.route("/compact", methods=["POST"])
    async def compact() -> Response:
        if engine.seal is None:
            raise _no_seal()
        _, blob = await json_view(lambda body: _seal_history(engine, body), lambda b: b)
        body = {
            "id": _new_id("resp"),
            "object": "response.compaction",
            "created_at": int(time.time()),
            "output": [{"id": _new_id("cmp"), "type": "compaction", "encrypted_content": blob}],
            # No model ran: the history is sealed, not summarized.
            "usage": _NO_USAGE,
        }
        return Response(dump_json(body), mimetype="application/json")

    @bp.websocket("")
    async def responses_websocket() -> Response:
        # Codex with ``supports_websockets`` opens one first: a 426 makes it
        # use HTTP for the rest of its session at once; any other refusal
        # is retried first (codex-rs ``WebsocketStreamOutcome::FallbackToHttp``).
        return error_response(
            HttpError(
                426,
                "websocket_not_supported",
                "Responses over a WebSocket are not served here: POST /v1/responses over HTTP",
            )
        )

    @bp.route("/<rid>", methods=["GET"])
    async def get_response(rid: str) -> Response:
        rec = store.get(rid, owner=current_tenant().id)
        if rec is None:
            raise _not_found(rid)
        return Response(dump_json(rec.body), mimetype="application/json")

    @bp.route("/<rid>", methods=["DELETE"])
    async def delete_response(rid: str) -> Response:
        if store.get(rid, owner=current_tenant().id) is None or not store.delete(rid):
            raise _not_found(rid)
        body = {"id": rid, "object": "response.deleted", "deleted": True}
        return Response(dump_json(body), mimetype="application/json")

    @bp.route("/<rid>/cancel", methods=["POST"])
    async def cancel_response(rid: str) -> Response:
        rec = store.get(rid, owner=current_tenant().id)
        if rec is None:
            raise _not_found(rid)
        if not rec.body.get("background"):
            raise InvalidRequest("only background responses can be cancelled", param="response_id")
        # The job records itself as cancelled as it leaves: wait for that.
        await store.cancel(rid)
        rec = store.get(rid) or rec
        return Response(dump_json(rec.body), mimetype="application/json")

    return bp
