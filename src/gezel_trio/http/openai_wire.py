"""OpenAI chat completions, legacy completions, ``/tokenize``,
``/detokenize`` and the cache-warm body as typed, validated values.

Strict, as every body (``http.strict``): wrong types are errors and every
error names the field path; a field no class here declares is ignored and
named in the ``x-gezel-ignored-fields`` header (a 400 under
``--strict-fields``). The fields OpenAI's own API accepts are declared
(most are recorded nowhere: ``store``, ``metadata``, ``service_tier``,
``prediction`` ...), so a proxy may forward what its callers send, strict
or not. The checks that span fields or that a type cannot
say are here beside the classes (``parse_*``); the ones every protocol
shares are in ``http.checks``.

The classes are also the source of ``/openapi.json`` (``http.openapi``):
a field's type, its ``Range`` and its ``Pattern`` become its schema.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Literal

import attrs
import cattrs

from ..core.errors import InvalidImage, InvalidRequest
from ..core.images import ImagePart
from ..core.prepare import MIN_REPETITION_PENALTY
from ..core.request import SamplingParams
from ..shaping.custom_tools import as_function, input_arguments
from ..shaping.toolcalls import TOOL_GRAMMAR_NAMES
from .checks import (
    MAX_MESSAGES,
    MAX_TOOLS,
    SEED_MAX,
    SEED_MIN,
    TOOL_NAME,
    check_cache_id,
    check_cache_salt,
    check_custom_grammar,
    check_messages,
    check_metadata,
    check_parameters,
    check_stops,
    check_template,
    check_template_kwargs,
)
from .images import from_base64, from_data_url
from .reasoning_effort import ReasoningEffort, effort_template_kwargs, effort_thinking_budget
from .strict import (
    FieldInvalid,
    Is,
    Pattern,
    Range,
    only,
    register_union,
    strict_converter,
    structure,
)

__all__ = [
    "MAX_LOGIT_BIAS",
    "MAX_N",
    "MAX_PREFIX_IDS",
    "MAX_PROMPT_TOKENS",
    "ChatCompletionRequest",
    "CompletionRequest",
    "ContentPart",
    "DetokenizeRequest",
    "GenerationRequest",
    "InfillChunk",
    "InfillRequest",
    "Message",
    "StreamOptions",
    "TokenizeRequest",
    "Tool",
    "ToolCall",
    "WarmRequest",
    "custom_formats",
    "parse_chat_request",
    "parse_completion_request",
    "parse_detokenize_request",
    "parse_infill_request",
    "parse_tokenize_request",
    "parse_warm_request",
    "sampling_params",
    "tool_dicts",
]

MAX_LOGIT_BIAS = 1024
MAX_PREFIX_IDS = 16
# Choices per request (n); the engine also bounds it by --max-concurrency.
MAX_N = 8
# Tokens one /tokenize-style prompt or /detokenize body may carry.
MAX_PROMPT_TOKENS = 1_000_000

Role = Literal["system", "developer", "user", "assistant", "tool"]

if TYPE_CHECKING:
    ToolGrammarFormat = str
else:
    # The names tool_grammar.format takes, read from the markup families
    # (``shaping.toolcalls``): checked as a literal, listed in /openapi.json.
    ToolGrammarFormat = Literal[TOOL_GRAMMAR_NAMES]


@attrs.frozen
class ToolCallFunction:
    name: str
    arguments: str | dict[str, Any] = "{}"


@attrs.frozen
class CustomCall:
    """A custom tool call's name and raw input."""

    name: str
    input: str


@attrs.frozen
class ToolCall:
    function: ToolCallFunction | None = None
    id: str | None = None
    type: Literal["function", "custom"] = "function"
    custom: CustomCall | None = None
    # Streaming deltas carry it; an SDK's model_dump() of a message keeps it.
    index: int | None = attrs.field(default=None, validator=Range(0, None))


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
            out["tool_calls"] = [_template_call(c) for c in calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        thinking = self.reasoning_content or self.reasoning
        if thinking:
            out["reasoning_content"] = thinking
        return out


def _template_call(c: ToolCall) -> dict[str, Any]:
    """A call as the template renders it; a custom call is the function call
    of one ``input`` string it was generated as."""
    fn: dict[str, Any]
    if c.custom is not None:
        fn = {"name": c.custom.name, "arguments": input_arguments(c.custom.input)}
    elif c.function is not None:
        fn = {"name": c.function.name, "arguments": c.function.arguments}
    else:  # every body with messages may carry calls: refused here, once for all
        field = "custom" if c.type == "custom" else "function"
        raise InvalidRequest(f"a tool call of type {c.type} needs {field}", param="messages")
    return {"id": c.id, "type": "function", "function": fn}


@attrs.frozen
class FunctionDef:
    """A tool's function: ``parameters`` must be a JSON schema (checked against
    its metaschema, once per distinct schema)."""

    name: str = attrs.field(validator=Pattern(TOOL_NAME))
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


@attrs.frozen
class CustomDef:
    """A custom (freeform) tool: raw-text input, ``format`` ``{"type":
    "text"}`` or ``{"type": "grammar", "grammar": {"syntax": "lark" |
    "regex", "definition": ...}}``."""

    name: str = attrs.field(validator=Pattern(TOOL_NAME))
    description: str | None = None
    format: dict[str, Any] | None = None

    @property
    def responses_format(self) -> dict[str, Any] | None:
        """The format in the Responses shape (``shaping.custom_tools`` reads)."""
        fmt = self.format
        if fmt is None or fmt.get("type") != "grammar":
            return None
        grammar = fmt.get("grammar") or {}
        return {"type": "grammar", **grammar}


@attrs.frozen
class Tool:
    function: FunctionDef | None = None
    type: Literal["function", "custom"] = "function"
    custom: CustomDef | None = None


def custom_formats(tools: list[Tool] | None) -> dict[str, dict[str, Any] | None]:
    """The custom tools' names and formats (Responses shape)."""
    return {t.custom.name: t.custom.responses_format for t in tools or [] if t.custom is not None}


def tool_dicts(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """Tools as the plain mappings templates and grammars read (unset fields
    dropped); a custom tool as the function of one ``input`` string it is
    shown as."""
    if tools is None:
        return None
    out = []
    for t in tools:
        if t.custom is not None:
            c = t.custom
            out.append(as_function(c.name, c.description, c.responses_format))
            continue
        if t.function is None:  # _check_tools refuses it first
            raise InvalidRequest("a function tool needs function", param="tools")
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
    """``POST /v1/cache/warm``: a conversation whose prompt becomes a named
    cache entry, built through the engine before any request uses it."""

    cache_id: str
    messages: list[Message] = attrs.field(validator=check_messages)
    model: str | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template_override: str | None = None
    persist: bool = False
    # vLLM's: the prompt cache reuses only what requests of the same salt left.
    cache_salt: str | None = attrs.field(default=None, validator=check_cache_salt)


@attrs.frozen
class ToolGrammar:
    """gezel (the seed's field): constrain tool calls with a grammar.
    ``name-only``: calls may name only the declared tools, arguments free;
    ``name-and-params`` (the seed's default): the whole call by the tool's
    schema. ``format`` names the markup family the client expects; the
    template's own markup is used either way (``shaping.grammar``).
    ``allowed_names``: the tools this turn may call (all stay in the prompt)."""

    mode: Literal["name-only", "name-and-params"] = "name-and-params"
    format: ToolGrammarFormat | None = None
    allowed_names: list[str] | None = None


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


# SGLang's per-request fields that vllm-router (grown from SGLang's
# router) sends on every chat and completions request, at these values:
# accepted at what this server does, refused otherwise. Declared rather
# than left to be ignored: another value would change the answer
# (``no_stop_trim: true`` keeps the stop string), so it must be a 400, and
# --strict-fields accepts routed requests too.
NO_STOP_TRIM = Is(False, "a stop string is never part of the text")
SKIP_SPECIAL_TOKENS = Is(True, "special tokens are not written into the text")
RETURN_HIDDEN_STATES = Is(False, "hidden states are not returned")


def _required_first(cls: type, fields: list[attrs.Attribute[Any]]) -> list[attrs.Attribute[Any]]:
    """A request's own required field (``messages``, ``prompt``; keyword-only,
    as it follows fields with defaults) before the shared fields it
    inherits: checked first, so an error there is the one a 400 names."""
    return sorted(fields, key=lambda f: f.default is not attrs.NOTHING)


@attrs.frozen
class GenerationRequest:
    """The fields chat and legacy completions share: sampling, stops, the
    prompt cache, scheduling and the routers' fields."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = attrs.field(default=None, validator=Range(0, 2))
    top_p: float | None = attrs.field(default=None, validator=Range(0, 1))
    # Any size: at or above the vocabulary it keeps every token (no filter).
    top_k: int | None = attrs.field(default=None, validator=Range(-1, None))
    min_p: float | None = attrs.field(default=None, validator=Range(0, 1))
    # -1: random; any other int64 (or uint64) seeds the request's own stream.
    seed: int | None = attrs.field(default=None, validator=Range(SEED_MIN, SEED_MAX))
    stop: str | list[str] | None = None
    # n > 1: choices of one prompt computed once; also bounded by --max-concurrency.
    n: int = attrs.field(default=1, validator=Range(1, MAX_N))
    presence_penalty: float | None = attrs.field(default=None, validator=Range(-2, 2))
    frequency_penalty: float | None = attrs.field(default=None, validator=Range(-2, 2))
    repetition_penalty: float | None = attrs.field(
        default=None, validator=Range(MIN_REPETITION_PENALTY, 10)
    )
    repetition_context_size: int | None = attrs.field(default=None, validator=Range(1, 8192))
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = attrs.field(default=0, validator=Range(0, None))
    user: str | None = None
    # gezel extensions
    cache_id: str | None = None
    prefix_cache_id: str | None = None
    prefix_cache_ids: list[str] | None = None
    # vLLM's: the prompt cache reuses only what requests of the same salt left.
    cache_salt: str | None = attrs.field(default=None, validator=check_cache_salt)
    priority: Literal["interactive", "background"] = "interactive"
    speculation: bool = True
    # SGLang's fields, which vllm-router adds to every chat and completions
    # request they forward (docs/scale-out.md), at what this server does.
    no_stop_trim: bool = attrs.field(default=False, validator=NO_STOP_TRIM)
    skip_special_tokens: bool = attrs.field(default=True, validator=SKIP_SPECIAL_TOKENS)
    return_hidden_states: bool = attrs.field(default=False, validator=RETURN_HIDDEN_STATES)

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
    def random_seed(self) -> int | None:
        """The seed for the engine: ``-1`` (OpenAI clients' "random") is none."""
        return None if self.seed == -1 else self.seed

    @property
    def bias(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` with its keys parsed (validated by the body's ``parse_*``)."""
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())


@attrs.frozen(field_transformer=_required_first)
class ChatCompletionRequest(GenerationRequest):
    messages: list[Message] = attrs.field(validator=check_messages, kw_only=True)
    max_tokens: int | None = attrs.field(default=None, validator=Range(1, None))
    max_completion_tokens: int | None = attrs.field(default=None, validator=Range(1, None))
    logprobs: bool | None = None
    top_logprobs: int | None = attrs.field(default=None, validator=Range(0, 20))
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # OpenAI's own fields, accepted as clients forward them.
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    modalities: list[Literal["text"]] | None = None
    prediction: Prediction | None = None
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prompt_cache_key: str | None = None
    reasoning_effort: ReasoningEffort | None = None
    # gezel extensions
    stable_prefix_chars: int | None = attrs.field(default=None, validator=Range(0, None))
    chat_template_override: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_thinking_tokens: int | None = attrs.field(default=None, validator=Range(0, None))
    tool_grammar: ToolGrammar | None = None
    disable_speculation: bool = False
    # llama.cpp's per-request field: ``none`` leaves the think block in
    # content as written; ``auto`` and ``deepseek`` (llama.cpp's name for
    # the same split) send it as ``reasoning_content``; absent: the
    # server's --reasoning-format.
    reasoning_format: Literal["auto", "deepseek", "none"] | None = None
    # SGLang's chat-only fields that vllm-router adds, at what this server does.
    continue_final_message: bool = attrs.field(
        default=False,
        validator=Is(False, "a trailing assistant message is prefilled as the answer's start"),
    )
    separate_reasoning: bool = attrs.field(
        default=True, validator=Is(True, "reasoning_format says where reasoning goes")
    )
    stream_reasoning: bool = attrs.field(
        default=True, validator=Is(True, "reasoning streams as it is written")
    )
    include_reasoning: bool = attrs.field(
        default=True, validator=Is(True, "reasoning_format says where reasoning goes")
    )

    @property
    def session_id(self) -> str | None:
        """``cache_id``, else OpenAI's ``prompt_cache_key``."""
        return self.cache_id if self.cache_id is not None else self.prompt_cache_key

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens

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


@attrs.frozen(field_transformer=_required_first)
class CompletionRequest(GenerationRequest):
    """``POST /v1/completions`` (legacy): a raw prompt, no chat template.
    ``prompt`` is text, a list of one text, token ids, or a list of one list
    of token ids; ``suffix`` (with a text prompt) asks for the middle
    between them (``http.fim``); ``best_of`` must equal ``n``."""

    prompt: str | list[str] | list[int] | list[list[int]] = attrs.field(kw_only=True)
    max_tokens: int | None = attrs.field(default=16, validator=Range(1, None))
    echo: bool = False
    logprobs: int | None = attrs.field(default=None, validator=Range(0, 20))
    best_of: int | None = attrs.field(default=None, validator=Range(1, MAX_N))
    suffix: str | None = None

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
class InfillChunk:
    """One piece of ``/infill``'s ``input_extra``: another file's text."""

    filename: str = ""
    text: str = ""


@attrs.frozen
class InfillRequest:
    """llama.cpp's ``POST /infill``: the code before and after the gap
    (``input_prefix``, ``input_suffix``), other files (``input_extra``), and
    ``prompt``, the text after the FIM middle token (the current line up to
    the cursor), with llama.cpp's ``/completion`` sampling names.
    ``n_predict`` -1 is no limit but the context window."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillChunk] | None = None
    prompt: str = ""
    model: str | None = None
    n_predict: int = attrs.field(default=-1, validator=Range(-1, None))
    temperature: float | None = attrs.field(default=None, validator=Range(0, 2))
    top_p: float | None = attrs.field(default=None, validator=Range(0, 1))
    top_k: int | None = attrs.field(default=None, validator=Range(-1, None))
    min_p: float | None = attrs.field(default=None, validator=Range(0, 1))
    seed: int | None = attrs.field(default=None, validator=Range(SEED_MIN, SEED_MAX))
    stop: list[str] | None = None
    stream: bool = False
    repeat_penalty: float | None = attrs.field(
        default=None, validator=Range(MIN_REPETITION_PENALTY, 10)
    )
    # llama.cpp's: -1 the whole context, 0 none.
    repeat_last_n: int | None = attrs.field(default=None, validator=Range(-1, 8192))
    presence_penalty: float | None = attrs.field(default=None, validator=Range(-2, 2))
    frequency_penalty: float | None = attrs.field(default=None, validator=Range(-2, 2))
    # Every prompt is cached: true is what happens anyway.
    cache_prompt: bool = True
    cache_salt: str | None = attrs.field(default=None, validator=check_cache_salt)

    def completion(self, tokens: list[int]) -> CompletionRequest:
        """The legacy completion this infill runs as, over the FIM prompt ``tokens``."""
        last_n = self.repeat_last_n
        return CompletionRequest(
            prompt=tokens,
            model=self.model,
            max_tokens=None if self.n_predict == -1 else self.n_predict,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            stream=self.stream,
            repetition_penalty=self.repeat_penalty if last_n != 0 else None,
            repetition_context_size=last_n if last_n is not None and last_n > 0 else None,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            cache_salt=self.cache_salt,
        )


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
    # vllm-router's kv_aware policy asks /tokenize for a chat request's
    # tokens with this field (docs/scale-out.md, "KV events").
    continue_final_message: bool = attrs.field(
        default=False,
        validator=Is(False, "a trailing assistant message is prefilled as the answer's start"),
    )


@attrs.frozen
class DetokenizeRequest:
    """``POST /detokenize``: token ids back to text (vLLM answers
    ``prompt``, llama.cpp ``content``: both are in the answer)."""

    tokens: list[int] = attrs.field()
    model: str | None = None

    @tokens.validator
    def _check_tokens(self, _: attrs.Attribute[Any], value: list[int]) -> None:
        if len(value) > MAX_PROMPT_TOKENS:
            raise FieldInvalid("tokens", f"at most {MAX_PROMPT_TOKENS} tokens")


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest, *, default_temperature: float = 1.0
) -> SamplingParams:
    """The engine's sampling parameters from a chat or legacy completions
    body; ``default_temperature`` where it names none (OpenAI's is 1.0)."""
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    return SamplingParams(
        temperature=default_temperature if req.temperature is None else req.temperature,
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


# --- the converter: the strict one, with the unions of these bodies --------------


_INTS = frozenset({int})


def _converter() -> cattrs.Converter:
    conv = strict_converter()

    def content_hook(value: Any, _: Any) -> str | list[ContentPart]:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return [conv.structure(v, ContentPart) for v in value]
        raise TypeError("expected a string or a list of content parts")

    register_union(conv, str | list[ContentPart], content_hook)

    def prompt_hook(value: Any, _: Any) -> Any:
        def ints(v: Any) -> bool:
            # C passes over the element types: a prompt may be 4M ids.
            return isinstance(v, list) and only(_INTS, v)

        if isinstance(value, str) or ints(value):
            return value
        if isinstance(value, list) and (
            all(isinstance(v, str) for v in value) or all(ints(v) for v in value)
        ):
            return value
        raise TypeError("expected a string, a list of strings, token ids or lists of token ids")

    register_union(conv, str | list[str] | list[int] | list[list[int]], prompt_hook)
    return conv


_CONVERTER = _converter()


# --- the checks that span fields -------------------------------------------------

_LOGIT_BIAS_KEY = re.compile(r"[0-9]{1,10}", re.ASCII)


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


def _check_prefix_ids(prefix_cache_ids: list[str] | None) -> None:
    if prefix_cache_ids is not None:
        if len(prefix_cache_ids) > MAX_PREFIX_IDS:
            raise InvalidRequest(f"at most {MAX_PREFIX_IDS} prefix ids", param="prefix_cache_ids")
        for i, pid in enumerate(prefix_cache_ids):
            check_cache_id(pid, f"prefix_cache_ids[{i}]")


def _check_tools(tools: list[Tool] | None) -> None:
    if tools is None:
        return
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"at most {MAX_TOOLS} tools", param="tools")
    for i, tool in enumerate(tools):
        if tool.type == "custom":
            _check_custom(tool.custom, f"tools[{i}].custom")
            continue
        if tool.function is None:
            raise InvalidRequest(f"tools[{i}].function is required", param=f"tools[{i}].function")
        check_parameters(tool.function.parameters, f"tools[{i}].function.parameters")


def _check_custom(custom: CustomDef | None, where: str) -> None:
    if custom is None:
        raise InvalidRequest(f"{where} is required for a custom tool", param=where)
    fmt = custom.format
    if fmt is None or (fmt.get("type") == "text" and set(fmt) == {"type"}):
        return
    grammar = fmt.get("grammar")
    if (
        fmt.get("type") != "grammar"
        or set(fmt) != {"type", "grammar"}
        or not isinstance(grammar, dict)
        or set(grammar) != {"syntax", "definition"}
        or grammar.get("syntax") not in ("lark", "regex")
        or not isinstance(grammar.get("definition"), str)
    ):
        raise InvalidRequest(
            f'{where}.format must be {{"type": "text"}} or {{"type": "grammar", "grammar": '
            '{"syntax": "lark" | "regex", "definition": "..."}}',
            param=f"{where}.format",
        )
    check_custom_grammar(grammar["syntax"], grammar["definition"], f"{where}.format.grammar")


def _check_calls(messages: list[Message]) -> None:
    for i, m in enumerate(messages):
        for j, c in enumerate(m.tool_calls or []):
            where = f"messages[{i}].tool_calls[{j}]"
            if (c.custom if c.type == "custom" else c.function) is None:
                field = "custom" if c.type == "custom" else "function"
                raise InvalidRequest(f"{where}.{field} is required", param=f"{where}.{field}")


def _check_chat(req: ChatCompletionRequest) -> None:
    _check_sampling_limits(req.stop_list, req.logit_bias)
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
    _check_prefix_ids(req.prefix_cache_ids)
    check_template_kwargs(req.chat_template_kwargs)
    _check_tools(req.tools)
    _check_calls(req.messages)
    check_template(req.chat_template_override)
    check_metadata(req.metadata)


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """Validate a decoded JSON body; raises ``InvalidRequest`` naming the field."""
    req = structure(body, ChatCompletionRequest, _CONVERTER)
    _check_chat(req)
    return req


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a legacy completions body; ``InvalidRequest`` names the field."""
    req = structure(body, CompletionRequest, _CONVERTER)
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
    if req.suffix is not None and not isinstance(raw, str):
        raise InvalidRequest(
            "suffix needs a text prompt (the text before the gap), not token ids", param="suffix"
        )
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequest(
            "best_of must equal n: every generated sequence is returned, none ranked",
            param="best_of",
        )
    _check_sampling_limits(req.stop_list, req.logit_bias)
    for name, value in (("cache_id", req.cache_id), ("prefix_cache_id", req.prefix_cache_id)):
        check_cache_id(value, name)
    _check_prefix_ids(req.prefix_cache_ids)
    return req


def parse_infill_request(body: Any) -> InfillRequest:
    """Validate an ``/infill`` body; ``InvalidRequest`` names the field."""
    req = structure(body, InfillRequest, _CONVERTER)
    if req.n_predict == 0:
        raise InvalidRequest("n_predict must be -1 (no limit) or at least 1", param="n_predict")
    _check_sampling_limits(tuple(req.stop or ()), None)
    return req


def parse_tokenize_request(body: Any) -> TokenizeRequest:
    """Validate a ``/tokenize`` body; ``InvalidRequest`` names the field."""
    req = structure(body, TokenizeRequest, _CONVERTER)
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
    check_template_kwargs(req.chat_template_kwargs)
    _check_tools(req.tools)
    return req


def parse_detokenize_request(body: Any) -> DetokenizeRequest:
    """Validate a ``/detokenize`` body; ``InvalidRequest`` names the field."""
    return structure(body, DetokenizeRequest, _CONVERTER)


def parse_warm_request(body: Any) -> WarmRequest:
    """Validate a ``/v1/cache/warm`` body; ``InvalidRequest`` names the field."""
    warm = structure(body, WarmRequest, _CONVERTER)
    check_cache_id(warm.cache_id, "cache_id")
    check_template_kwargs(warm.chat_template_kwargs)
    _check_tools(warm.tools)
    check_template(warm.chat_template_override)
    return warm
