"""Request bodies as typed, validated values (attrs + cattrs).

Validation is strict: a wrong type is an error, never coerced ("5" is not an
int, ``true`` is not a number), unknown fields are refused so that a typo in a
gezel extension (``cacheid``) cannot be silently ignored, and every error
names the field path. Limits on sizes (stop lists, logit biases, template
kwargs) keep hostile bodies from costing the engine anything.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal, TypeVar, get_args, get_origin

import attrs
import cattrs
from cattrs.cols import list_structure_factory
from cattrs.errors import (
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
)
from cattrs.gen import make_dict_structure_fn

from ..errors import InvalidRequest

__all__ = [
    "ChatCompletionRequest",
    "ContentPart",
    "Message",
    "StreamOptions",
    "ToolCall",
    "WarmRequest",
    "check_cache_id",
    "parse_chat_request",
    "structure",
]

T = TypeVar("T")

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 1024
MAX_MESSAGES = 4096
MAX_CACHE_ID_CHARS = 4096
MAX_PREFIX_IDS = 16

Role = Literal["system", "developer", "user", "assistant", "tool"]


class _FieldInvalid(ValueError):
    """A validator's verdict on one field; carries the field name for the path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _range(lo: float | None, hi: float | None) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is None:
            return
        if lo is not None and value < lo:
            raise _FieldInvalid(attr.name, f"{attr.name} must be >= {lo}, got {value}")
        if hi is not None and value > hi:
            raise _FieldInvalid(attr.name, f"{attr.name} must be <= {hi}, got {value}")

    return check


@attrs.frozen
class ToolCallFunction:
    name: str
    arguments: str | dict[str, Any] = "{}"


@attrs.frozen
class ToolCall:
    function: ToolCallFunction
    id: str | None = None
    type: Literal["function"] = "function"


@attrs.frozen
class ImageUrl:
    url: str
    detail: str | None = None


@attrs.frozen
class ContentPart:
    type: Literal["text", "image_url", "input_text"]
    text: str | None = None
    image_url: ImageUrl | None = None


@attrs.frozen
class Message:
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    images: list[str] | None = None

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type in ("text", "input_text"))

    def has_images(self) -> bool:
        parts = self.content if isinstance(self.content, list) else []
        return bool(self.images) or any(p.type == "image_url" for p in parts)

    def to_template(self) -> dict[str, Any]:
        """The mapping a chat template sees: ``developer`` becomes ``system``."""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text() or "",
        }
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        thinking = self.reasoning_content or self.reasoning
        if thinking:
            out["reasoning_content"] = thinking
        return out


@attrs.frozen
class WarmRequest:
    """``POST /v1/cache/warm`` (SPEC C8)."""

    cache_id: str
    messages: list[Message] = attrs.field()
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template_override: str | None = None
    persist: bool = False

    @messages.validator
    def _check_messages(self, _: attrs.Attribute[Any], value: list[Message]) -> None:
        if not value:
            raise _FieldInvalid("messages", "messages must not be empty")


@attrs.frozen
class StreamOptions:
    include_usage: bool = False


@attrs.frozen
class ResponseFormat:
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


@attrs.frozen
class ChatCompletionRequest:
    messages: list[Message] = attrs.field()
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = attrs.field(default=None, validator=_range(1, None))
    max_completion_tokens: int | None = attrs.field(default=None, validator=_range(1, None))
    temperature: float | None = attrs.field(default=None, validator=_range(0, 2))
    top_p: float | None = attrs.field(default=None, validator=_range(0, 1))
    top_k: int | None = attrs.field(default=None, validator=_range(-1, None))
    min_p: float | None = attrs.field(default=None, validator=_range(0, 1))
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = attrs.field(default=1, validator=_range(1, 1))
    presence_penalty: float | None = attrs.field(default=None, validator=_range(-2, 2))
    frequency_penalty: float | None = attrs.field(default=None, validator=_range(-2, 2))
    repetition_penalty: float | None = attrs.field(default=None, validator=_range(0, 10))
    repetition_context_size: int | None = attrs.field(default=None, validator=_range(1, 8192))
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = attrs.field(default=None, validator=_range(0, 20))
    ignore_eos: bool = False
    min_tokens: int = attrs.field(default=0, validator=_range(0, None))
    user: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # gezel extensions (W3)
    cache_id: str | None = None
    prefix_cache_id: str | None = None
    prefix_cache_ids: list[str] | None = None
    stable_prefix_chars: int | None = attrs.field(default=None, validator=_range(0, None))
    priority: Literal["interactive", "background"] = "interactive"
    chat_template_override: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_thinking_tokens: int | None = attrs.field(default=None, validator=_range(0, None))
    tool_grammar: dict[str, Any] | None = None
    disable_speculation: bool = False

    @messages.validator
    def _check_messages(self, _: attrs.Attribute[Any], value: list[Message]) -> None:
        if not value:
            raise _FieldInvalid("messages", "messages must not be empty")
        if len(value) > MAX_MESSAGES:
            raise _FieldInvalid("messages", f"at most {MAX_MESSAGES} messages")

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def prefix_ids(self) -> tuple[str, ...]:
        """Most specific first; ``prefix_cache_ids`` wins over the singular."""
        if self.prefix_cache_ids:
            return tuple(p for p in self.prefix_cache_ids if p)
        return (self.prefix_cache_id,) if self.prefix_cache_id else ()

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens


def _strict(kind: type[T], name: str) -> Callable[[Any, Any], T]:
    def hook(value: Any, _: Any) -> T:
        # bool is an int subclass; JSON true is not a number.
        if isinstance(value, bool) and kind is not bool:
            raise TypeError(f"expected {name}, got a boolean")
        if kind is float and isinstance(value, int):
            return float(value)  # type: ignore[return-value]  # JSON 1 is a valid float
        if not isinstance(value, kind):
            raise TypeError(f"expected {name}, got {type(value).__name__}")
        return value

    return hook


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)
    conv.register_structure_hook(int, _strict(int, "an integer"))
    conv.register_structure_hook(float, _strict(float, "a number"))
    conv.register_structure_hook(str, _strict(str, "a string"))
    conv.register_structure_hook(bool, _strict(bool, "a boolean"))

    def any_hook(value: Any, _: Any) -> Any:
        return value

    conv.register_structure_hook(Any, any_hook)

    def strict_list(t: Any, c: cattrs.Converter) -> Callable[[Any, Any], Any]:
        inner = list_structure_factory(t, c)

        def hook(value: Any, tt: Any) -> Any:
            # A string is iterable; without this "abc" would become ["a", "b", "c"].
            if not isinstance(value, list):
                raise TypeError(f"expected a list, got {type(value).__name__}")
            return inner(value, tt)

        return hook

    def strict_object(t: Any, c: cattrs.Converter) -> Callable[[Any, Any], Any]:
        inner = make_dict_structure_fn(t, c, _cattrs_forbid_extra_keys=True)

        def hook(value: Any, tt: Any) -> Any:
            if not isinstance(value, dict):
                raise TypeError(f"expected an object, got {type(value).__name__}")
            return inner(value, tt)

        return hook

    def literal(t: Any) -> Callable[[Any, Any], Any]:
        allowed = get_args(t)

        def hook(value: Any, _: Any) -> Any:
            if isinstance(value, bool) or value not in allowed:
                choices = ", ".join(repr(a) for a in allowed)
                raise TypeError(f"must be one of {choices}; got {value!r}")
            return value

        return hook

    def origin_is(kind: Any) -> Callable[[Any], bool]:
        return lambda t: bool(get_origin(t) is kind)

    conv.register_structure_hook_factory(origin_is(Literal), literal)
    conv.register_structure_hook_factory(origin_is(list), strict_list)
    conv.register_structure_hook_factory(attrs.has, strict_object)

    def union(tp: Any, hook: Callable[[Any, Any], Any]) -> None:
        # cattrs cannot tell these unions apart by itself; also cover ``tp | None``.
        def maybe(value: Any, t: Any) -> Any:
            return None if value is None and t != tp else hook(value, t)

        conv.register_structure_hook_func(lambda t: t in (tp, tp | None), maybe)

    def mapping_hook(value: Any, _: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise TypeError(f"expected an object, got {type(value).__name__}")
        return value

    union(dict[str, Any], mapping_hook)

    def str_or_list(value: Any, _: Any) -> str | list[str]:
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        raise TypeError("expected a string or a list of strings")

    union(str | list[str], str_or_list)

    def content_hook(value: Any, _: Any) -> str | list[ContentPart]:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return [conv.structure(v, ContentPart) for v in value]
        raise TypeError("expected a string or a list of content parts")

    union(str | list[ContentPart], content_hook)

    def arguments_hook(value: Any, _: Any) -> str | dict[str, Any]:
        if isinstance(value, str | dict):
            return value
        raise TypeError("expected a JSON string or an object")

    union(str | dict[str, Any], arguments_hook)

    return conv


_CONVERTER = _make_converter()


def _describe(exc: BaseException, path: str = "") -> tuple[str, str | None]:
    """The first error in a cattrs exception tree, as (message, field path)."""
    if isinstance(exc, ForbiddenExtraKeysError):
        names = sorted(exc.extra_fields)
        field = f"{path}.{names[0]}" if path else names[0]
        return f"unknown field {', '.join(map(repr, names))}", field
    if isinstance(exc, ClassValidationError):
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            return _describe(sub, f"{path}.{note.name}" if path else note.name)
        for sub in without:
            return _describe(sub, path)
    if isinstance(exc, IterableValidationError):
        with_idx, without_idx = exc.group_exceptions()
        for sub, inote in with_idx:
            return _describe(sub, f"{path}[{inote.index}]")
        for sub in without_idx:
            return _describe(sub, path)
    if isinstance(exc, _FieldInvalid):
        return str(exc), f"{path}.{exc.field}" if path else exc.field
    if isinstance(exc, KeyError):
        return "required field missing", path or None
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        return _describe(exc.exceptions[0], path)
    return str(exc) or type(exc).__name__, path or None


def _check_limits(req: ChatCompletionRequest) -> None:
    stops = req.stop_list
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise InvalidRequest(
            f"each stop string must have 1 to {MAX_STOP_CHARS} characters", param="stop"
        )
    if req.logit_bias is not None:
        if len(req.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"at most {MAX_LOGIT_BIAS} logit_bias entries", param="logit_bias")
        for key, val in req.logit_bias.items():
            if not key.isdigit():
                raise InvalidRequest(
                    f"logit_bias keys are token ids, got {key!r}", param="logit_bias"
                )
            if isinstance(val, bool) or not isinstance(val, int | float) or not -100 <= val <= 100:
                raise InvalidRequest(
                    "logit_bias values must be numbers in [-100, 100]", param="logit_bias"
                )
    for i, m in enumerate(req.messages):
        if m.role in ("user", "system", "developer") and m.content is None:
            raise InvalidRequest(
                f"messages[{i}].content is required for role {m.role!r}",
                param=f"messages[{i}].content",
            )
    for name, value in (("cache_id", req.cache_id), ("prefix_cache_id", req.prefix_cache_id)):
        check_cache_id(value, name)
    if req.prefix_cache_ids is not None:
        if len(req.prefix_cache_ids) > MAX_PREFIX_IDS:
            raise InvalidRequest(f"at most {MAX_PREFIX_IDS} prefix ids", param="prefix_cache_ids")
        for i, pid in enumerate(req.prefix_cache_ids):
            check_cache_id(pid, f"prefix_cache_ids[{i}]")
    if req.chat_template_kwargs is not None:
        try:
            size = len(json.dumps(req.chat_template_kwargs))
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(str(exc), param="chat_template_kwargs") from exc
        if size > 16_384:
            raise InvalidRequest("chat_template_kwargs is too large", param="chat_template_kwargs")


def check_cache_id(value: str | None, param: str) -> None:
    """Any string is a valid id (ids are hashed, never used as paths), but
    an empty or unbounded one is a client bug worth naming."""
    if value is None:
        return
    if not value:
        raise InvalidRequest(f"{param} must not be empty", param=param)
    if len(value) > MAX_CACHE_ID_CHARS:
        raise InvalidRequest(f"{param} is longer than {MAX_CACHE_ID_CHARS} characters", param=param)


def structure(body: Any, cls: type[T]) -> T:
    """Validate a decoded JSON body into ``cls``; ``InvalidRequest`` names the field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        return _CONVERTER.structure(body, cls)
    except (ClassValidationError, ForbiddenExtraKeysError, IterableValidationError) as exc:
        msg, path = _describe(exc)
        where = f" at {path}" if path else ""
        raise InvalidRequest(f"invalid request{where}: {msg}", param=path) from None
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"invalid request: {exc}") from None


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """Validate a decoded JSON body; raises ``InvalidRequest`` naming the field."""
    req = structure(body, ChatCompletionRequest)
    _check_limits(req)
    return req
