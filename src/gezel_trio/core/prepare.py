"""What a request becomes before it is queued: the pure half of preparation.

A ``ChatRequest`` names a conversation and what to do with it. The engine
renders it (and decodes its images, compiles its constraint) on worker
threads, then ``prepare`` turns those parts into the ``GenerationRequest``
the host will run and checks it against the model (``ModelInfo``) and the
engine's configuration, once. ``check_request`` is that check alone, for a
``GenerationRequest`` an embedder builds itself.

Why the check exists: MLX evaluates lazily, so an out-of-range token id is
no error at all but a gather past the logits - a wild memory access. Every
token id a request names (prompt, ``logit_bias``) is checked against the
vocabulary and every number for finiteness and range before anything is
queued; a bad request is refused by name (HTTP 400), never an error frame.

No Trio, no MLX, no clock: plain functions over frozen values.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

from .config import EngineConfig, RequestDefaults, SchedulingSettings
from .constraint import Constraint
from .errors import InvalidRequest
from .images import ImagePart, VisionPrompt
from .model import ModelInfo
from .request import (
    CacheRequest,
    GenerationRequest,
    MessagePin,
    Pin,
    Priority,
    RenderedPrompt,
    SamplingParams,
)

__all__ = [
    "MAX_PENALTY",
    "MAX_REPETITION_CONTEXT",
    "MAX_TOP_LOGPROBS",
    "MIN_REPETITION_PENALTY",
    "ChatRequest",
    "PreparedChat",
    "bound_max_tokens",
    "check_n",
    "check_request",
    "prepare",
    "roster_fingerprint",
    "wants_constraint",
]

# Bounds on what a request may ask of the model: alternatives per token, and
# the window a repetition penalty looks back over.
MAX_TOP_LOGPROBS = 20
MAX_REPETITION_CONTEXT = 8192
# A repetition penalty divides a repeated token's positive logit: at 0 that is
# +inf and every logprob NaN, and below about 1e-38 a float32 logit of 30
# overflows too. At 0.01 a float16 logit overflows only past 655 (real
# models' stay under 100).
MIN_REPETITION_PENALTY = 0.01
# Presence and frequency penalties: OpenAI's and vLLM's [-2, 2]. Subtracted
# per occurrence, a large negative one lifts a logit to +inf (NaN again).
MAX_PENALTY = 2.0
# A forced (grammar-constrained) answer after a think block keeps at least
# this many tokens, or half the budget, for itself.
_MIN_FORCED_ROOM = 64


def roster_fingerprint(tools: Sequence[Mapping[str, Any]] | None) -> str:
    """A short id of the exact tool list a prompt was rendered with."""
    if not tools:
        return "none"
    canon = json.dumps(list(tools), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


@attrs.frozen
class ChatRequest:
    """A conversation and how to continue it.

    ``messages`` and ``tools`` are OpenAI chat shapes (what a chat template
    renders). Instead of ``messages``, ``prompt`` is a raw prompt (legacy
    completions): text, tokenized without a chat template, or token ids;
    its output is plain text (no reasoning or tool-call splitting). ``n``
    sequences continue the same prompt, which is computed once.

    ``tool_choice`` (``"auto"``, ``"none"``, ``"required"`` or a named
    function), ``response_format`` (``json_object`` / ``json_schema``) and
    ``tool_grammar`` are enforced by grammars. ``max_tokens`` ``None``
    means what the context window leaves, up to the engine's default.
    ``cache_id`` and ``prefix_ids`` name prompt-cache entries; without them
    the request is still cached. ``template_kwargs`` go to the chat template
    (``enable_thinking``); ``max_thinking_tokens`` bounds a think block.
    ``images`` fill the ``{"type": "image"}`` content parts, in order.
    ``reasoning_format`` ``none`` leaves the think block in the answer text
    as the model wrote it (``auto``: split out as reasoning).
    ``max_tool_calls`` bounds the calls a reply carries: generation stops
    at the end of the last one allowed (chat's ``parallel_tool_calls:
    false`` is 1).
    """

    messages: Sequence[Mapping[str, Any]] = ()
    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: str | Mapping[str, Any] | None = None
    response_format: Mapping[str, Any] | None = None
    tool_grammar: Mapping[str, Any] | None = None
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: Priority = "interactive"
    cache_id: str | None = None
    prefix_ids: tuple[str, ...] = ()
    stable_prefix_chars: int | None = None
    template_kwargs: Mapping[str, Any] = attrs.field(factory=dict)
    template_override: str | None = None
    max_thinking_tokens: int | None = None
    top_logprobs: int | None = None
    # False: never speculate for this request (``disable_speculation``).
    speculate: bool = True
    # The images, in the order their ``{"type": "image"}`` parts appear in
    # ``messages``; each protocol maps its own image blocks onto these.
    images: tuple[ImagePart, ...] = ()
    prompt: str | Sequence[int] | None = None
    n: int = 1
    # Prefixes to keep cached for a while, through the end of a message
    # (Anthropic's ``cache_control`` breakpoints).
    pins: tuple[MessagePin, ...] = ()
    # Custom (freeform) tools among ``tools``, rendered as functions taking
    # one ``input`` string: name -> Responses format (``shaping.custom_tools``).
    custom_tools: Mapping[str, Mapping[str, Any] | None] = attrs.field(factory=dict)
    # ``shaping.shaper.ReasoningFormat``.
    reasoning_format: Literal["auto", "none"] = "auto"
    # The prompt cache's partition (``CacheRequest.salt``): the tenant's, and
    # the request's own ``cache_salt``.
    cache_salt: str = ""
    # At most this many tool calls per choice: the choice ends at the end of
    # the last one (``parallel_tool_calls: false`` is 1; None: no bound).
    max_tool_calls: int | None = None

    @property
    def parses_tools(self) -> bool:
        """Whether tool markup in the output becomes calls."""
        return bool(self.tools) and self.tool_choice != "none" and self.prompt is None


def wants_constraint(
    response_format: Mapping[str, Any] | None,
    tool_choice: str | Mapping[str, Any] | None,
    tool_grammar: Mapping[str, Any] | None,
) -> bool:
    """Whether these ask for decoding constrained by a grammar."""
    return (
        (response_format or {}).get("type") in ("json_object", "json_schema")
        or tool_choice not in (None, "auto", "none")
        or bool(tool_grammar)
    )


@attrs.frozen
class PreparedChat:
    """A chat rendered, constrained and checked: ``request`` is what the
    engine will run (``chat.n`` times, one prompt); nothing is queued yet."""

    chat: ChatRequest
    request: GenerationRequest


def bound_max_tokens(
    info: ModelInfo, defaults: RequestDefaults, prompt_len: int, requested: int | None
) -> int:
    """The ``max_tokens`` a request may have: at most what the context
    window and the KV room (``ModelInfo.kv_room``) leave (``None``: that,
    up to the configured default; more: that, unless
    ``defaults.strict_max_tokens``). Raises ``InvalidRequest`` when the prompt
    leaves no room, or when strict and it does not fit."""
    if requested is None:
        room = min(_room(info, prompt_len), defaults.default_max_tokens)
    elif defaults.strict_max_tokens:
        _check_fits(info, prompt_len, requested)
        _check_kv_fits(info, prompt_len, requested)
        return requested
    else:
        # The answer then ends with finish "length" at the context's end.
        room = min(requested, _room(info, prompt_len))
    # The same for the KV the memory limit leaves room for (at least one
    # token: a prompt that alone does not fit is refused by name).
    return max(1, _kv_tokens_left(info, prompt_len, room))


def _room(info: ModelInfo, prompt_len: int) -> int:
    """What the context window leaves after the prompt; ``InvalidRequest``
    when that is nothing."""
    window = info.context_length
    room = window - prompt_len
    if room < 1:
        raise InvalidRequest(
            f"the prompt has {prompt_len} tokens; the model's context window is {window}",
            param="messages",
        )
    return room


def _check_fits(info: ModelInfo, prompt_len: int, max_tokens: int) -> None:
    if max_tokens > _room(info, prompt_len):
        raise InvalidRequest(
            f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceeds "
            f"the context window of {info.context_length}",
            param="max_tokens",
        )


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _kv_tokens_left(info: ModelInfo, prompt_len: int, most: int) -> int:
    """The most tokens (up to ``most``) a sequence may generate after a
    ``prompt_len`` prompt within the KV room."""
    kv = info.kv
    if kv is None or info.kv_room <= 0 or kv.bytes_for(prompt_len + most) <= info.kv_room:
        return most
    lo, hi = 0, most  # bytes_for grows with the length: the last that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if kv.bytes_for(prompt_len + mid) <= info.kv_room:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _check_kv_fits(info: ModelInfo, prompt_len: int, max_tokens: int) -> None:
    """A sequence whose KV (prompt plus ``max_tokens``) would not fit in
    what the memory limit leaves even with nothing else running is refused
    now: admitted, its step would fail every sequence of its lane."""
    if info.kv is None or info.kv_room <= 0:
        return
    tokens = prompt_len + max_tokens
    need = info.kv.bytes_for(tokens)
    if need <= info.kv_room:
        return
    alone = info.kv.bytes_for(prompt_len + 1) > info.kv_room
    raise InvalidRequest(
        f"needs {_size(need)} of KV for {tokens:,} tokens (the prompt's {prompt_len:,} plus "
        f"max_tokens={max_tokens:,}); the memory limit leaves {_size(info.kv_room)} for KV "
        "after the weights",
        param="messages" if alone else "max_tokens",
    )


def prepare(
    chat: ChatRequest,
    rendered: RenderedPrompt,
    *,
    max_tokens: int,
    vision: VisionPrompt | None,
    constraint: Constraint | None,
    info: ModelInfo,
    config: EngineConfig,
    image_token: int | None = None,
) -> PreparedChat:
    """The request ``chat`` asks for, from its rendered prompt, its
    ``max_tokens`` (``bound_max_tokens``), its images and its compiled
    constraint, checked once (``check_request``)."""
    thinking = chat.max_thinking_tokens
    if constraint is not None and info.think_ids is not None:
        # A forced output must fit after the think block: thinking gets at
        # most what the output does not need.
        room = max(0, max_tokens - max(_MIN_FORCED_ROOM, max_tokens // 2))
        thinking = room if thinking is None else min(thinking, room)
    request = GenerationRequest(
        prompt=rendered.tokens,
        max_tokens=max_tokens,
        sampling=chat.sampling,
        stop=chat.stop,
        ignore_eos=chat.ignore_eos,
        min_tokens=min(chat.min_tokens, max_tokens),
        priority=chat.priority,
        cache=CacheRequest(
            cache_id=chat.cache_id,
            prefix_ids=chat.prefix_ids,
            band_end=rendered.band_end,
            boundaries=rendered.boundaries,
            roster=roster_fingerprint(chat.tools),
            message_starts=rendered.message_starts,
            message_roles=rendered.message_roles,
            pins=_pins(chat.pins, rendered),
            salt=chat.cache_salt,
        ),
        constraint=constraint,
        max_thinking_tokens=thinking,
        top_logprobs=chat.top_logprobs,
        speculate=chat.speculate,
        vision=vision,
        continues_text=chat.prompt is not None,
    )
    check_request(request, info, config, image_token=image_token)
    return PreparedChat(chat, request)


def _pins(asked: Sequence[MessagePin], rendered: RenderedPrompt) -> tuple[Pin, ...]:
    """The pins whose message end the renderer found, as token positions."""
    return tuple(
        Pin(end, pin.seconds)
        for pin, end in zip(asked, rendered.pin_ends, strict=False)
        if end is not None and end > 0
    )


def check_n(scheduling: SchedulingSettings, n: int) -> None:
    """``n`` sequences of one prompt must fit in one batch."""
    limit = scheduling.max_concurrency
    if not 1 <= n <= limit:
        raise InvalidRequest(f"n must be in [1, {limit}] (--max-concurrency)", param="n")


def check_request(
    request: GenerationRequest,
    info: ModelInfo,
    config: EngineConfig,
    *,
    image_token: int | None = None,
) -> None:
    """Raise ``InvalidRequest`` (naming the field) unless ``request`` is
    something this model can serve: token ids
    inside the vocabulary, finite sampling numbers in range, ``max_tokens``
    inside the context window. ``image_token`` is the model's image
    placeholder (a vision model), which only an image may bring."""
    if not request.prompt:
        raise InvalidRequest("the prompt is empty", param="messages")
    if request.max_tokens < 1:
        raise InvalidRequest("max_tokens must be >= 1", param="max_tokens")
    # A request as the engine runs it must fit, whatever the setting: the
    # cut to fit is made before (``bound_max_tokens``).
    _check_fits(info, len(request.prompt), request.max_tokens)
    _check_kv_fits(info, len(request.prompt), request.max_tokens)
    _check_prompt(request, info, image_token)
    _check_sampling(request.sampling, info.vocab_size)
    if request.top_logprobs is not None and not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs"
        )
    if request.min_tokens < 0:
        raise InvalidRequest("min_tokens must be >= 0", param="min_tokens")
    if request.max_thinking_tokens is not None and request.max_thinking_tokens < 0:
        raise InvalidRequest("max_thinking_tokens must be >= 0", param="max_thinking_tokens")


def _check_prompt(request: GenerationRequest, info: ModelInfo, image_token: int | None) -> None:
    vocab = info.vocab_size
    ids = request.prompt
    if request.vision is not None:
        if not info.vision:
            raise InvalidRequest(f"the model {info.model_id} takes no images", param="messages")
        # The prompt is the cache key (core.images); the model sees these.
        ids = request.vision.model_tokens
        if len(ids) != len(request.prompt) or (
            request.vision.spans and request.vision.end >= len(ids)
        ):
            raise InvalidRequest("the prompt must go on after its last image", param="messages")
    if vocab and not all(0 <= t < vocab for t in ids):
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
    if image_token is not None:
        # A placeholder without its pixels (a message that spells the image
        # marker out) would embed a token the model never saw alone.
        placed = sum(s.length for s in request.vision.spans) if request.vision else 0
        if ids.count(image_token) != placed:
            raise InvalidRequest(
                "the prompt holds the model's image placeholder token without an image",
                param="messages",
            )


def _check_sampling(p: SamplingParams, vocab: int) -> None:
    for name, value, lo, hi in (
        ("temperature", p.temperature, 0.0, math.inf),
        ("top_p", p.top_p, 0.0, 1.0),
        ("min_p", p.min_p, 0.0, 1.0),
        ("presence_penalty", p.presence_penalty, -MAX_PENALTY, MAX_PENALTY),
        ("frequency_penalty", p.frequency_penalty, -MAX_PENALTY, MAX_PENALTY),
        ("repetition_penalty", p.repetition_penalty, MIN_REPETITION_PENALTY, math.inf),
    ):
        if value is not None and not (math.isfinite(value) and lo <= value <= hi):
            raise InvalidRequest(f"{name} must be a finite number in [{lo}, {hi}]", param=name)
    if p.top_k < -1:
        raise InvalidRequest("top_k must be >= -1 (-1 or 0: no top-k)", param="top_k")
    if not 1 <= p.repetition_context_size <= MAX_REPETITION_CONTEXT:
        raise InvalidRequest(
            f"repetition_context_size must be in [1, {MAX_REPETITION_CONTEXT}]",
            param="repetition_context_size",
        )
    for token, bias in p.logit_bias:
        if not (0 <= token < vocab or (not vocab and token >= 0)):
            raise InvalidRequest(
                f"logit_bias names token {token}, outside the vocabulary [0, {vocab})",
                param="logit_bias",
            )
        if not (math.isfinite(bias) and -100 <= bias <= 100):
            raise InvalidRequest(
                "logit_bias values must be finite numbers in [-100, 100]", param="logit_bias"
            )
