"""Request bodies as typed, validated values (attrs + cattrs).

Validation is strict: a wrong type is an error, never coerced ("5" is not an
int, ``true`` is not a number), unknown fields are refused so that a typo in a
gezel extension (``cacheid``) cannot be silently ignored, and every error
names the field path. Every number must be finite, every string valid text
(no lone UTF-16 surrogates) and no value nested deeper than ``MAX_DEPTH``.
Limits on sizes (stop lists, logit biases, tools, template kwargs) keep
hostile bodies from costing the engine anything. The fields OpenAI's own API
accepts are accepted (most are recorded nowhere: ``store``, ``metadata``,
``service_tier``, ``prediction`` ...), so a proxy may forward what its callers
send.

The classes here are also the source of ``/openapi.json`` (``http.openapi``):
a field's type, its ``Range`` and its ``Pattern`` become its schema.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Callable
from functools import lru_cache
from typing import Any, Literal, TypeVar, get_args, get_origin

import attrs
import cattrs
import jsonschema
from cattrs.cols import list_structure_factory
from cattrs.errors import (
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
)
from cattrs.gen import make_dict_structure_fn
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..core.errors import InvalidImage, InvalidRequest
from ..core.images import ImagePart
from .images import from_base64, from_data_url

__all__ = [
    "MAX_DEPTH",
    "ChatCompletionRequest",
    "CompletionRequest",
    "ContentPart",
    "DetokenizeRequest",
    "FieldInvalid",
    "Message",
    "Pattern",
    "Range",
    "StreamOptions",
    "TokenizeRequest",
    "Tool",
    "ToolCall",
    "WarmRequest",
    "check_cache_id",
    "check_parameters",
    "check_stops",
    "check_text",
    "converter",
    "parse_chat_request",
    "parse_completion_request",
    "parse_detokenize_request",
    "parse_tokenize_request",
    "parse_warm_request",
    "structure",
    "tool_dicts",
]

T = TypeVar("T")

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 1024
MAX_MESSAGES = 4096
MAX_CACHE_ID_CHARS = 4096
MAX_PREFIX_IDS = 16
MAX_TOOLS = 128
MAX_TEMPLATE_CHARS = 65_536
MAX_DEPTH = 64
MAX_METADATA = 16
# Choices per request (n); the engine also bounds it by --max-concurrency.
MAX_N = 8
# Tokens one /tokenize-style prompt or /detokenize body may carry.
MAX_PROMPT_TOKENS = 1_000_000
# OpenAI's seed is an int64; the engine keys its random stream by 64 bits.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1

Role = Literal["system", "developer", "user", "assistant", "tool"]


class _FieldInvalid(ValueError):
    """A validator's verdict on one field; carries the field name for the path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# For validators and hooks in other protocols' wire modules.
FieldInvalid = _FieldInvalid


@attrs.frozen
class Range:
    """A field validator: ``lo <= value <= hi`` (``None``: unbounded);
    ``http.openapi`` reads the bounds into the schema."""

    lo: float | None = None
    hi: float | None = None

    def __call__(self, _: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is None:
            return
        if self.lo is not None and value < self.lo:
            raise _FieldInvalid(attr.name, f"{attr.name} must be >= {self.lo}, got {value}")
        if self.hi is not None and value > self.hi:
            raise _FieldInvalid(attr.name, f"{attr.name} must be <= {self.hi}, got {value}")


@attrs.frozen
class Pattern:
    """A field validator: the whole string matches ``regex``."""

    regex: str

    def __call__(self, _: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not re.fullmatch(self.regex, value):
            raise _FieldInvalid(attr.name, f"{attr.name} must match {self.regex}, got {value!r}")


def _range(lo: float | None, hi: float | None) -> Range:
    return Range(lo, hi)


_TOOL_NAME = r"[A-Za-z0-9_-]{1,64}"


@attrs.frozen
class ToolCallFunction:
    name: str
    arguments: str | dict[str, Any] = "{}"


@attrs.frozen
class ToolCall:
    function: ToolCallFunction
    id: str | None = None
    type: Literal["function"] = "function"
    # Streaming deltas carry it; an SDK's model_dump() of a message keeps it.
    index: int | None = attrs.field(default=None, validator=_range(0, None))


@attrs.frozen
class ImageUrl:
    url: str
    detail: str | None = None


@attrs.frozen
class ContentPart:
    type: Literal["text", "image_url", "input_text", "refusal"]
    text: str | None = None
    image_url: ImageUrl | None = None
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None


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
    # What an OpenAI SDK's ``model_dump()`` of an assistant message carries;
    # accepted and not rendered (a refusal is the assistant's text).
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: ToolCallFunction | None = None

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content if self.content is not None else self.refusal
        return "".join(
            (p.text if p.type != "refusal" else p.refusal) or ""
            for p in self.content
            if p.type in ("text", "input_text", "refusal")
        )

    def has_images(self) -> bool:
        parts = self.content if isinstance(self.content, list) else []
        return bool(self.images) or any(p.type == "image_url" for p in parts)

    def image_parts(self, index: int) -> list[ImagePart]:
        """This message's images, in the order ``to_template`` places them:
        the ``images`` extension first, then the ``image_url`` parts."""
        out = [
            from_base64(data, f"messages[{index}].images[{k}]")
            for k, data in enumerate(self.images or [])
        ]
        parts = self.content if isinstance(self.content, list) else []
        for j, p in enumerate(parts):
            if p.type == "image_url":
                where = f"messages[{index}].content[{j}]"
                if p.image_url is None:
                    raise InvalidImage(f"{where}: an image_url part needs image_url", param=where)
                out.append(from_data_url(p.image_url.url, where + ".image_url.url"))
        return out

    def _content(self) -> str | list[dict[str, Any]]:
        if not self.has_images():
            return self.text() or ""
        # Chat templates of vision models take content parts: an image is
        # {"type": "image"} where it sits (its pixels travel beside).
        out: list[dict[str, Any]] = [{"type": "image"} for _ in self.images or []]
        if isinstance(self.content, str):
            out.append({"type": "text", "text": self.content})
        for p in self.content if isinstance(self.content, list) else []:
            if p.type == "image_url":
                out.append({"type": "image"})
            elif p.type in ("text", "input_text"):
                out.append({"type": "text", "text": p.text or ""})
            elif p.type == "refusal":
                out.append({"type": "text", "text": p.refusal or ""})
        return out

    def to_template(self) -> dict[str, Any]:
        """The mapping a chat template sees: ``developer`` becomes ``system``;
        a legacy ``function_call`` becomes a tool call; a message with images
        has a list of text and ``{"type": "image"}`` parts."""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self._content(),
        }
        if self.name is not None:
            out["name"] = self.name
        calls = self.tool_calls or []
        if not calls and self.function_call is not None:
            calls = [ToolCall(self.function_call)]
        if calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        thinking = self.reasoning_content or self.reasoning
        if thinking:
            out["reasoning_content"] = thinking
        return out


@attrs.frozen
class FunctionDef:
    """A tool's function: ``parameters`` must be a JSON schema (checked against
    its metaschema, once per distinct schema)."""

    name: str = attrs.field(validator=Pattern(_TOOL_NAME))
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


@attrs.frozen
class Tool:
    function: FunctionDef
    type: Literal["function"] = "function"


def tool_dicts(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """Tools as the plain mappings templates and grammars read (unset fields dropped)."""
    if tools is None:
        return None
    out = []
    for t in tools:
        fn: dict[str, Any] = {"name": t.function.name}
        if t.function.description is not None:
            fn["description"] = t.function.description
        if t.function.parameters is not None:
            fn["parameters"] = t.function.parameters
        if t.function.strict is not None:
            fn["strict"] = t.function.strict
        out.append({"type": t.type, "function": fn})
    return out


@attrs.frozen
class WarmRequest:
    """``POST /v1/cache/warm`` (SPEC C8)."""

    cache_id: str
    messages: list[Message] = attrs.field()
    model: str | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template_override: str | None = None
    persist: bool = False

    @messages.validator
    def _check_messages(self, _: attrs.Attribute[Any], value: list[Message]) -> None:
        if not value:
            raise _FieldInvalid("messages", "messages must not be empty")
        if len(value) > MAX_MESSAGES:
            raise _FieldInvalid("messages", f"at most {MAX_MESSAGES} messages")


@attrs.frozen
class ToolGrammar:
    """gezel: constrain what the model may call (T3)."""

    mode: Literal["name-only"]


@attrs.frozen
class StreamOptions:
    include_usage: bool = False
    include_obfuscation: bool | None = None


@attrs.frozen
class ResponseFormat:
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


@attrs.frozen
class Prediction:
    """OpenAI's predicted output: accepted and ignored (no speculation on it)."""

    type: Literal["content"]
    content: str | list[ContentPart]


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
# reasoning_effort -> (thinking on, thinking budget in tokens; None: unbounded).
REASONING_EFFORT: dict[str, tuple[bool, int | None]] = {
    "none": (False, None),
    "minimal": (False, None),
    "low": (True, 512),
    "medium": (True, 2048),
    "high": (True, None),
    "xhigh": (True, None),
}


def effort_template_kwargs(
    chat_template_kwargs: dict[str, Any] | None, effort: str | None
) -> dict[str, Any]:
    """Template kwargs with a reasoning effort folded in: it switches
    thinking (unless the kwargs say otherwise) and is passed on for
    templates that read it (chat's ``reasoning_effort``, Responses'
    ``reasoning.effort``)."""
    kwargs = dict(chat_template_kwargs or {})
    if effort is not None:
        thinking, _ = REASONING_EFFORT[effort]
        kwargs.setdefault("enable_thinking", thinking)
        kwargs.setdefault("reasoning_effort", effort)
    return kwargs


def effort_thinking_budget(max_thinking_tokens: int | None, effort: str | None) -> int | None:
    """An explicit thinking budget, else what the effort implies."""
    if max_thinking_tokens is not None or effort is None:
        return max_thinking_tokens
    return REASONING_EFFORT[effort][1]


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
    # Any size: at or above the vocabulary it keeps every token (no filter).
    top_k: int | None = attrs.field(default=None, validator=_range(-1, None))
    min_p: float | None = attrs.field(default=None, validator=_range(0, 1))
    # -1: random; any other int64 (or uint64) seeds the request's own stream.
    seed: int | None = attrs.field(default=None, validator=_range(SEED_MIN, SEED_MAX))
    stop: str | list[str] | None = None
    # n > 1: choices of one prompt computed once; also bounded by --max-concurrency.
    n: int = attrs.field(default=1, validator=_range(1, MAX_N))
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
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # OpenAI's own fields, accepted as clients forward them (W6).
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    modalities: list[Literal["text"]] | None = None
    prediction: Prediction | None = None
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prompt_cache_key: str | None = None
    reasoning_effort: ReasoningEffort | None = None
    # gezel extensions (W3)
    cache_id: str | None = None
    prefix_cache_id: str | None = None
    prefix_cache_ids: list[str] | None = None
    stable_prefix_chars: int | None = attrs.field(default=None, validator=_range(0, None))
    priority: Literal["interactive", "background"] = "interactive"
    chat_template_override: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_thinking_tokens: int | None = attrs.field(default=None, validator=_range(0, None))
    tool_grammar: ToolGrammar | None = None
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
    def session_id(self) -> str | None:
        """``cache_id``, else OpenAI's ``prompt_cache_key``."""
        return self.cache_id if self.cache_id is not None else self.prompt_cache_key

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens

    @property
    def random_seed(self) -> int | None:
        """The seed for the engine: ``-1`` (OpenAI clients' "random") is none."""
        return None if self.seed == -1 else self.seed

    @property
    def bias(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` with its keys parsed (validated by ``parse_chat_request``)."""
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """``chat_template_kwargs`` with ``reasoning_effort`` folded in: it
        switches thinking (unless the kwargs say otherwise) and is passed on
        for templates that read it."""
        return effort_template_kwargs(self.chat_template_kwargs, self.reasoning_effort)

    @property
    def thinking_budget(self) -> int | None:
        """``max_thinking_tokens``, else what ``reasoning_effort`` implies."""
        return effort_thinking_budget(self.max_thinking_tokens, self.reasoning_effort)


@attrs.frozen
class CompletionRequest:
    """``POST /v1/completions`` (legacy): a raw prompt, no chat template.
    ``prompt`` is text, a list of one text, token ids, or a list of one list
    of token ids; ``suffix`` is refused; ``best_of`` must equal ``n``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    max_tokens: int | None = attrs.field(default=16, validator=_range(1, None))
    temperature: float | None = attrs.field(default=None, validator=_range(0, 2))
    top_p: float | None = attrs.field(default=None, validator=_range(0, 1))
    top_k: int | None = attrs.field(default=None, validator=_range(-1, None))
    min_p: float | None = attrs.field(default=None, validator=_range(0, 1))
    seed: int | None = attrs.field(default=None, validator=_range(SEED_MIN, SEED_MAX))
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    logprobs: int | None = attrs.field(default=None, validator=_range(0, 20))
    n: int = attrs.field(default=1, validator=_range(1, MAX_N))
    best_of: int | None = attrs.field(default=None, validator=_range(1, MAX_N))
    suffix: str | None = None
    presence_penalty: float | None = attrs.field(default=None, validator=_range(-2, 2))
    frequency_penalty: float | None = attrs.field(default=None, validator=_range(-2, 2))
    repetition_penalty: float | None = attrs.field(default=None, validator=_range(0, 10))
    repetition_context_size: int | None = attrs.field(default=None, validator=_range(1, 8192))
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = attrs.field(default=0, validator=_range(0, None))
    # gezel extensions (W3) that apply to a raw prompt
    cache_id: str | None = None
    prefix_cache_id: str | None = None
    prefix_cache_ids: list[str] | None = None
    priority: Literal["interactive", "background"] = "interactive"

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def prefix_ids(self) -> tuple[str, ...]:
        if self.prefix_cache_ids:
            return tuple(p for p in self.prefix_cache_ids if p)
        return (self.prefix_cache_id,) if self.prefix_cache_id else ()

    @property
    def random_seed(self) -> int | None:
        return None if self.seed == -1 else self.seed

    @property
    def bias(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    @property
    def raw_prompt(self) -> str | list[int]:
        """The one prompt: text or token ids (validated by ``parse_completion_request``)."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if p and isinstance(p[0], list | str):
            return p[0]
        return p  # type: ignore[return-value]


@attrs.frozen
class TokenizeRequest:
    """``POST /tokenize`` (vLLM's shape; llama.cpp's ``content`` and
    ``add_special`` are accepted too): text without a chat template, or
    ``messages`` rendered with it. ``add_special_tokens`` defaults to true
    for text and false for messages, as in vLLM."""

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: list[Message] | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    add_special: bool | None = None
    return_token_strs: bool = False
    with_pieces: bool = False


@attrs.frozen
class DetokenizeRequest:
    """``POST /detokenize``: token ids back to text (vLLM answers
    ``prompt``, llama.cpp ``content``: both are in the answer)."""

    tokens: list[int] = attrs.field()
    model: str | None = None

    @tokens.validator
    def _check_tokens(self, _: attrs.Attribute[Any], value: list[int]) -> None:
        if len(value) > MAX_PROMPT_TOKENS:
            raise _FieldInvalid("tokens", f"at most {MAX_PROMPT_TOKENS} tokens")


def _strict(kind: type[T], name: str) -> Callable[[Any, Any], T]:
    def hook(value: Any, _: Any) -> T:
        # bool is an int subclass; JSON true is not a number.
        if isinstance(value, bool) and kind is not bool:
            raise TypeError(f"expected {name}, got a boolean")
        if kind is float and isinstance(value, int):
            try:
                value = float(value)  # JSON 1 is a valid float
            except OverflowError:
                raise ValueError("expected a finite number") from None
        if not isinstance(value, kind):
            raise TypeError(f"expected {name}, got {type(value).__name__}")
        if kind is float and not math.isfinite(value):  # type: ignore[arg-type]
            raise ValueError("expected a finite number")
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

    def prompt_hook(value: Any, _: Any) -> Any:
        def ints(v: Any) -> bool:
            return isinstance(v, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in v
            )

        if isinstance(value, str) or ints(value):
            return value
        if isinstance(value, list) and (
            all(isinstance(v, str) for v in value) or all(ints(v) for v in value)
        ):
            return value
        raise TypeError("expected a string, a list of strings, token ids or lists of token ids")

    union(str | list[str] | list[int] | list[list[int]], prompt_hook)

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
            key = inote.index
            return _describe(sub, f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]")
        for sub in without_idx:
            return _describe(sub, path)
    if isinstance(exc, _FieldInvalid):
        return str(exc), f"{path}.{exc.field}" if path else exc.field
    if isinstance(exc, KeyError):
        return "required field missing", path or None
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        return _describe(exc.exceptions[0], path)
    return str(exc) or type(exc).__name__, path or None


_LOGIT_BIAS_KEY = re.compile(r"[0-9]{1,10}", re.ASCII)


def check_stops(stops: tuple[str, ...], param: str) -> None:
    """At most ``MAX_STOP_STRINGS`` stop strings of 1 to ``MAX_STOP_CHARS``
    characters each."""
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings", param=param)
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise InvalidRequest(
            f"each stop string must have 1 to {MAX_STOP_CHARS} characters", param=param
        )


def _check_limits(req: ChatCompletionRequest) -> None:
    _check_sampling_limits(req.stop_list, req.logit_bias)
    _check_messages(req)


def _check_sampling_limits(stops: tuple[str, ...], logit_bias: dict[str, float] | None) -> None:
    check_stops(stops, "stop")
    if logit_bias is not None:
        if len(logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"at most {MAX_LOGIT_BIAS} logit_bias entries", param="logit_bias")
        for key, val in logit_bias.items():
            # Parsed, not tested: "²".isdigit() is true and int("²") raises.
            if not _LOGIT_BIAS_KEY.fullmatch(key):
                raise InvalidRequest(
                    f"logit_bias keys are decimal token ids, got {key[:40]!r}", param="logit_bias"
                )
            if not -100 <= val <= 100:
                raise InvalidRequest(
                    "logit_bias values must be numbers in [-100, 100]", param="logit_bias"
                )


def _check_messages(req: ChatCompletionRequest) -> None:
    for i, m in enumerate(req.messages):
        if m.role in ("user", "system", "developer") and m.content is None:
            raise InvalidRequest(
                f"messages[{i}].content is required for role {m.role!r}",
                param=f"messages[{i}].content",
            )
    for name, value in (
        ("cache_id", req.cache_id),
        ("prefix_cache_id", req.prefix_cache_id),
        ("prompt_cache_key", req.prompt_cache_key),
    ):
        check_cache_id(value, name)
    if req.prefix_cache_ids is not None:
        if len(req.prefix_cache_ids) > MAX_PREFIX_IDS:
            raise InvalidRequest(f"at most {MAX_PREFIX_IDS} prefix ids", param="prefix_cache_ids")
        for i, pid in enumerate(req.prefix_cache_ids):
            check_cache_id(pid, f"prefix_cache_ids[{i}]")
    _check_kwargs(req.chat_template_kwargs)
    _check_tools(req.tools)
    check_template(req.chat_template_override)
    if req.metadata is not None:
        if len(req.metadata) > MAX_METADATA:
            raise InvalidRequest(f"at most {MAX_METADATA} metadata pairs", param="metadata")
        for key, value in req.metadata.items():
            if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
                raise InvalidRequest(
                    "metadata maps keys of at most 64 characters to strings of at most 512",
                    param=f"metadata.{key[:64]}",
                )


def _check_kwargs(kwargs: dict[str, Any] | None) -> None:
    if kwargs is None:
        return
    try:
        size = len(json.dumps(kwargs))
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(str(exc), param="chat_template_kwargs") from exc
    if size > 16_384:
        raise InvalidRequest("chat_template_kwargs is too large", param="chat_template_kwargs")


def _check_tools(tools: list[Tool] | None) -> None:
    if tools is None:
        return
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"at most {MAX_TOOLS} tools", param="tools")
    for i, tool in enumerate(tools):
        check_parameters(tool.function.parameters, f"tools[{i}].function.parameters")


def check_parameters(params: dict[str, Any] | None, where: str) -> None:
    """A tool's parameters must be an object JSON schema; ``where`` names it."""
    if params is None:
        return
    try:
        problem = _schema_problem(json.dumps(params, sort_keys=True))
    except (TypeError, ValueError, RecursionError) as exc:
        problem = str(exc)
    if problem is not None:
        raise InvalidRequest(f"{where} is not a JSON schema: {problem}", param=where)


@lru_cache(maxsize=256)
def _schema_problem(canonical: str) -> str | None:
    """Why a tool's ``parameters`` is not a JSON schema (``None``: it is).
    Checked once per distinct schema: an agent sends the same tools each turn."""
    schema = json.loads(canonical)
    if not isinstance(schema, dict):
        return "it must be an object"
    if schema.get("type", "object") != "object":
        return 'its "type" must be "object"'
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        return f"{exc.message[:200]}" + (f" (at {where})" if where else "")
    except RecursionError:
        return "it is nested too deeply"
    return None


def check_template(template: str | None) -> None:
    """``chat_template_override`` must be a Jinja template that compiles in
    the sandbox the renderer uses, within ``MAX_TEMPLATE_CHARS``."""
    if template is None:
        return
    if len(template) > MAX_TEMPLATE_CHARS:
        raise InvalidRequest(
            f"chat_template_override is longer than {MAX_TEMPLATE_CHARS} characters",
            param="chat_template_override",
        )
    problem = _template_problem(template)
    if problem is not None:
        raise InvalidRequest(
            f"chat_template_override does not compile: {problem}", param="chat_template_override"
        )


_SANDBOX = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)


@lru_cache(maxsize=32)
def _template_problem(template: str) -> str | None:
    """Compile once per distinct override (a bounded LRU: a client sending
    new templates each time costs one compile each, never unbounded memory)."""
    try:
        _SANDBOX.from_string(template)
    except TemplateError as exc:
        return f"{type(exc).__name__}: {exc}"[:300]
    except (RecursionError, MemoryError, ValueError) as exc:
        return f"{type(exc).__name__}"
    return None


def check_cache_id(value: str | None, param: str) -> None:
    """Any text is a valid id (ids are hashed, never used as paths), but an
    empty or unbounded one, or one with control characters (NUL separates
    internal keys), is a client bug worth naming."""
    if value is None:
        return
    if not value:
        raise InvalidRequest(f"{param} must not be empty", param=param)
    if len(value) > MAX_CACHE_ID_CHARS:
        raise InvalidRequest(f"{param} is longer than {MAX_CACHE_ID_CHARS} characters", param=param)
    if any(unicodedata.category(c) == "Cc" for c in value):
        raise InvalidRequest(f"{param} must not contain control characters", param=param)


def check_text(body: Any) -> None:
    """Every string valid Unicode text (no lone UTF-16 surrogate, which JSON
    escapes can carry and no tokenizer takes) and nothing nested deeper than
    ``MAX_DEPTH``; ``InvalidRequest`` names the first offending field."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(body, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_DEPTH:
            raise InvalidRequest(f"nested more than {MAX_DEPTH} levels deep", param=_path(path))
        if isinstance(value, str):
            if not value.isascii() and _has_surrogate(value):
                raise InvalidRequest(
                    "the text holds a lone UTF-16 surrogate, which is not valid Unicode",
                    param=_path(path) or None,
                )
        elif isinstance(value, dict):
            for k, v in value.items():
                if not k.isascii() and _has_surrogate(k):
                    raise InvalidRequest(
                        "a key holds a lone UTF-16 surrogate", param=_path(path) or None
                    )
                stack.append((v, (*path, k)))
        elif isinstance(value, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(value))


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _path(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def converter() -> cattrs.Converter:
    """A copy of the strict converter, for a protocol module to add its own
    hooks to (tagged unions of blocks) without touching this one."""
    return _CONVERTER.copy()


def structure(body: Any, cls: type[T], conv: cattrs.Converter | None = None) -> T:
    """Validate a decoded JSON body into ``cls`` (with ``conv``, default the
    strict converter); ``InvalidRequest`` names the field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    check_text(body)
    try:
        return (conv or _CONVERTER).structure(body, cls)
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


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a legacy completions body; ``InvalidRequest`` names the field."""
    req = structure(body, CompletionRequest)
    p = req.prompt
    if isinstance(p, list):
        if len(p) != 1 and (not p or not isinstance(p[0], int)):
            raise InvalidRequest(
                "prompt must be one prompt: a string, token ids, or a list holding one of them",
                param="prompt",
            )
        if not p or (isinstance(p[0], list) and not p[0]):
            raise InvalidRequest("prompt must not be empty", param="prompt")
    raw = req.raw_prompt
    if isinstance(raw, list) and len(raw) > MAX_PROMPT_TOKENS:
        raise InvalidRequest(f"at most {MAX_PROMPT_TOKENS} prompt tokens", param="prompt")
    if req.suffix is not None:
        raise InvalidRequest("suffix is not supported (no fill-in-the-middle)", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequest(
            "best_of must equal n: every generated sequence is returned, none ranked",
            param="best_of",
        )
    _check_sampling_limits(req.stop_list, req.logit_bias)
    for name, value in (("cache_id", req.cache_id), ("prefix_cache_id", req.prefix_cache_id)):
        check_cache_id(value, name)
    if req.prefix_cache_ids is not None:
        if len(req.prefix_cache_ids) > MAX_PREFIX_IDS:
            raise InvalidRequest(f"at most {MAX_PREFIX_IDS} prefix ids", param="prefix_cache_ids")
        for i, pid in enumerate(req.prefix_cache_ids):
            check_cache_id(pid, f"prefix_cache_ids[{i}]")
    return req


def parse_tokenize_request(body: Any) -> TokenizeRequest:
    req = structure(body, TokenizeRequest)
    given = [n for n in ("prompt", "content", "messages") if getattr(req, n) is not None]
    if len(given) != 1:
        raise InvalidRequest(
            "send exactly one of prompt (or content) and messages",
            param=given[-1] if given else None,
        )
    if req.messages is not None and not req.messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    if req.messages is not None and len(req.messages) > MAX_MESSAGES:
        raise InvalidRequest(f"at most {MAX_MESSAGES} messages", param="messages")
    if not req.add_generation_prompt:
        raise InvalidRequest(
            "add_generation_prompt: false is not supported", param="add_generation_prompt"
        )
    _check_kwargs(req.chat_template_kwargs)
    _check_tools(req.tools)
    return req


def parse_detokenize_request(body: Any) -> DetokenizeRequest:
    return structure(body, DetokenizeRequest)


def parse_warm_request(body: Any) -> WarmRequest:
    warm = structure(body, WarmRequest)
    check_cache_id(warm.cache_id, "cache_id")
    _check_kwargs(warm.chat_template_kwargs)
    _check_tools(warm.tools)
    check_template(warm.chat_template_override)
    return warm
