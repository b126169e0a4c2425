"""``GET /openapi.json``: the wire contract as an OpenAPI 3.1 document.

Request schemas are generated from the attrs classes in the wire modules
(``openai_wire``, ``responses_wire``, ``anthropic_wire``) - the same
classes that validate requests - so the document cannot drift from what the
server accepts: a field's annotation is its type, a ``Range`` validator its
``minimum``/``maximum``, a ``Pattern`` its ``pattern``. An object allows
properties it does not declare (the server ignores them and names them in
the ``x-gezel-ignored-fields`` header), except under ``--strict-fields``,
where every object refuses them, as the server then does. Routes and responses are
listed here, with the gezel extensions described.
"""

from __future__ import annotations

import types
import typing
from functools import lru_cache
from typing import Any, Literal, Union, get_args, get_origin

import attrs

from ..shaping.toolcalls import TOOL_GRAMMAR_NAMES
from . import anthropic_wire, openai_wire, responses_wire
from .checks import CACHE_ID_REFUSED, MAX_CACHE_ID_CHARS, MAX_CACHE_SALT_CHARS, MAX_MESSAGES
from .strict import Is, Pattern, Range, dump_json

__all__ = ["document", "openapi_json"]

_SCALARS: dict[Any, dict[str, Any]] = {
    str: {"type": "string"},
    int: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
    Any: {},
}

# What the gezel extensions and a few OpenAI fields mean here.
_DOCS: dict[str, str] = {
    "cache_id": "gezel: the prompt-cache session entry to reuse and save.",
    "prefix_cache_id": "gezel: a shared prefix entry to seed from and publish to.",
    "prefix_cache_ids": "gezel: shared prefix entries, most specific first.",
    "cache_salt": "vLLM: the prompt cache reuses only what requests of the same salt "
    "(and the same API key) left.",
    "stable_prefix_chars": "gezel: characters of the system message that siblings share.",
    "priority": "gezel: interactive (default) or background; background requests "
    "are parked while interactive ones run.",
    "chat_template_override": "gezel: a Jinja chat template used instead of the model's.",
    "chat_template_kwargs": "gezel: extra variables for the chat template (enable_thinking ...).",
    "max_thinking_tokens": "gezel: close the think block after this many tokens.",
    "tool_grammar": "gezel: constrain tool calls with a grammar; mode name-only (names) or "
    "name-and-params (the whole call, by schema); format "
    + " or ".join([", ".join(TOOL_GRAMMAR_NAMES[:-1]), TOOL_GRAMMAR_NAMES[-1]])
    + "; allowed_names: the tools a call may name.",
    "disable_speculation": "gezel (the seed's): opt out of speculative decoding.",
    "speculation": "gezel: false opts this request out of speculative decoding "
    "(docs/speculation.md).",
    "ignore_eos": "vLLM: generate exactly max_tokens tokens.",
    "min_tokens": "vLLM: hold end-of-sequence back for this many tokens.",
    "top_k": "Sample from the k most likely tokens; at or above the vocabulary: no filter.",
    "top_p": "Nucleus sampling; 0 (anything below 1e-5): the most likely token only.",
    "temperature": "0 (anything below 1e-5): greedy, the most likely token.",
    "seed": "A private random stream per request; -1: random.",
    "logit_bias": "Token id (decimal string, inside the vocabulary) to a bias in [-100, 100].",
    "prompt_cache_key": "OpenAI: used as cache_id when no cache_id is given.",
    "reasoning_effort": "OpenAI: none/minimal turn thinking off; low/medium bound it.",
    "repetition_penalty": "mlx-lm: penalize recently generated tokens.",
    "persist": "gezel: write the warmed entry to disk at once.",
    "n": "Choices of one prompt, computed once; at most --max-concurrency.",
    "echo": "Prepend the prompt to each choice's text (and its tokens to logprobs).",
    "best_of": "Must equal n: every generated sequence is returned, none ranked.",
    "suffix": "The text after the gap: a fill-in-the-middle prompt with the model's FIM "
    "tokens (400 where it has none).",
    "add_special_tokens": "Default true for text; messages are tokenized as chat runs them.",
    "previous_response_id": "Continue a stored response's conversation; the prompt cache "
    "serves what it shares (usage.input_tokens_details.cached_tokens).",
    "background": "Run after answering (needs store); poll GET, stop with POST .../cancel.",
    "max_output_tokens": "Generated tokens at most (reasoning included); the end is "
    "status incomplete with reason max_output_tokens.",
    "effort": "none/minimal turn thinking off; low/medium bound it; the reasoning is "
    "returned as reasoning items.",
    "ResponsesRequest.conversation": "OpenAI platform feature: refused (400) when set.",
    "ResponsesRequest.prompt": "OpenAI platform feature: refused (400) when set.",
    "ResponsesRequest.context_management": (
        "Accepted and validated; this server compacts only when asked: "
        "POST /v1/responses/compact, or a compaction_trigger input item."
    ),
    "ResponsesRequest.background_options": "OpenAI platform feature: refused (400) when set.",
    "ResponsesRequest.moderation": "OpenAI platform feature: refused (400) when set.",
    "ResponsesRequest.access_programs": "OpenAI platform feature: refused (400) when set.",
    "ResponsesRequest.image": "OpenAI platform feature: refused (400) when set.",
}


class _Builder:
    def __init__(self, strict_fields: bool) -> None:
        self.strict_fields = strict_fields
        self.components: dict[str, Any] = {}
        self._classes: dict[str, type] = {}

    def schema(self, tp: Any) -> dict[str, Any]:
        if tp in _SCALARS:
            return dict(_SCALARS[tp])
        origin = get_origin(tp)
        if origin is Literal:
            values = list(get_args(tp))
            return {"enum": values}
        if origin in (Union, types.UnionType):
            return {"anyOf": [self.schema(a) for a in get_args(tp)]}
        if origin is list:
            (item,) = get_args(tp)
            return {"type": "array", "items": self.schema(item)}
        if origin is dict:
            _, value = get_args(tp)
            return {"type": "object", "additionalProperties": self.schema(value)}
        if attrs.has(tp):
            return self.ref(tp)
        raise TypeError(f"no schema for {tp!r}")

    def ref(self, cls: type) -> dict[str, Any]:
        name = cls.__name__
        # Components are named by class: two protocols' classes must not share one.
        if self._classes.setdefault(name, cls) is not cls:
            raise TypeError(f"two wire classes are named {name}")
        if name not in self.components:
            self.components[name] = {}  # a placeholder stops recursion
            self.components[name] = self.object(cls)
        return {"$ref": f"#/components/schemas/{name}"}

    def object(self, cls: type) -> dict[str, Any]:
        hints = typing.get_type_hints(cls)
        props: dict[str, Any] = {}
        required = []
        for field in attrs.fields(cls):
            prop = self.schema(hints[field.name])
            _constrain(prop, field)
            # A field's doc: its class's own ("Class.field") or the shared one.
            doc = _DOCS.get(f"{cls.__name__}.{field.name}", _DOCS.get(field.name))
            if doc is not None:
                prop["description"] = doc
            props[field.name] = prop
            if field.default is attrs.NOTHING:
                required.append(field.name)
        out: dict[str, Any] = {"type": "object", "properties": props}
        if self.strict_fields:
            out["additionalProperties"] = False
        if cls.__doc__:
            out["description"] = " ".join(cls.__doc__.split())
        if required:
            out["required"] = required
        return out


def _constrain(prop: dict[str, Any], field: attrs.Attribute[Any]) -> None:
    """Copy the field's validators into its schema (on the non-null branch)."""
    target = prop
    if "anyOf" in prop:
        branches = [b for b in prop["anyOf"] if b.get("type") != "null"]
        if len(branches) == 1:
            target = branches[0]
    v = field.validator
    checks = getattr(v, "_validators", (v,))
    for check in checks:
        if isinstance(check, Range):
            if check.lo is not None:
                target["minimum"] = check.lo
            if check.hi is not None:
                target["maximum"] = check.hi
        elif isinstance(check, Pattern):
            target["pattern"] = f"^{check.regex}$"
        elif isinstance(check, Is):
            target["const"] = check.value
            target["description"] = f"Only {dump_json(check.value)}: {check.why}."
    if field.name == "messages":
        target["minItems"] = 1
        target["maxItems"] = MAX_MESSAGES
    if field.name in _CACHE_ID_FIELDS:
        target.update(_CACHE_ID)
    if field.name == "cache_salt":
        target.update({"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS})
    if field.name == "prefix_cache_ids":
        target["items"] = dict(_CACHE_ID)
        target["maxItems"] = openai_wire.MAX_PREFIX_IDS


_CACHE_ID_FIELDS = ("cache_id", "prefix_cache_id", "prompt_cache_key")
# What ``checks.check_cache_id`` accepts: 1..4096 characters, no whitespace
# or control characters.
_CACHE_ID = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_CACHE_ID_CHARS,
    "pattern": f"^[^{CACHE_ID_REFUSED}]+$",
}


def _error_response(description: str, schema: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
    }


_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "code": {"type": ["string", "null"]},
                "param": {"type": ["string", "null"]},
            },
        }
    },
}

# Anthropic's envelope, on the Messages routes.
_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}

_COMMON_ERRORS = {
    "401": "Missing or wrong API key (with --api-key).",
    "403": (
        "A Host header the server does not answer (DNS rebinding), or a POST or "
        "DELETE from a web page on an origin that is not allowed."
    ),
    "404": "No such route or entry.",
    "405": "Method not allowed on this route.",
    "500": "An internal error, in the error envelope.",
    "503": "Shutting down, or the engine failed.",
}


def _responses(ok: dict[str, Any], *extra: str, error: str = "Error") -> dict[str, Any]:
    out: dict[str, Any] = {"200": ok}
    descriptions = {
        "400": "Invalid request; error.param names the field.",
        "413": "The body exceeds --max-body-mb.",
        "415": "The body is not application/json.",
        "429": "The admission queue is full (Retry-After).",
        **_COMMON_ERRORS,
    }
    for code in sorted({*extra, *_COMMON_ERRORS}):
        out[code] = _error_response(descriptions[code], error)
    return out


def _json_ok(description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": schema or {"type": "object"}}},
    }


def _body(ref: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": ref}}}


@lru_cache(maxsize=8)
def document(model_id: str, strict_fields: bool = False) -> dict[str, Any]:
    b = _Builder(strict_fields)
    chat = b.ref(openai_wire.ChatCompletionRequest)
    warm = b.ref(openai_wire.WarmRequest)
    responses = b.ref(responses_wire.ResponsesRequest)
    compact = b.ref(responses_wire.CompactRequest)
    response_id = [
        {
            "name": "response_id",
            "in": "path",
            "required": True,
            "schema": {"type": "string", "minLength": 1},
        }
    ]
    response_ok = _json_ok("The Response object as stored.")
    chat_ok = {
        "description": "A chat.completion object, or with stream: true server-sent "
        "chat.completion.chunk events ending in data: [DONE].",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {}},
        },
    }
    chat_op = {
        "summary": "Chat completion (OpenAI-compatible, with gezel extensions)",
        "requestBody": _body(chat),
        "responses": _responses(chat_ok, "400", "413", "415", "429"),
    }
    paths: dict[str, Any] = {
        "/v1/chat/completions": {"post": {**chat_op, "operationId": "chatCompletions"}},
        "/chat/completions": {"post": {**chat_op, "operationId": "chatCompletionsAlias"}},
        "/v1/responses": {
            "post": {
                "operationId": "createResponse",
                "summary": "OpenAI Responses over the same chat path (docs/protocols.md)",
                "requestBody": _body(responses),
                "responses": _responses(
                    {
                        "description": "A Response object, or with stream: true server-sent "
                        "response.* events, each with its sequence_number.",
                        "content": {
                            "application/json": {"schema": {"type": "object"}},
                            "text/event-stream": {"schema": {}},
                        },
                    },
                    "400",
                    "413",
                    "415",
                    "429",
                ),
            }
        },
        "/v1/responses/compact": {
            "post": {
                "operationId": "compactResponse",
                "summary": "Seal a history into one compaction item (no model call) that "
                "a later request expands in place (docs/clients/codex.md)",
                "requestBody": _body(compact),
                "responses": _responses(
                    _json_ok("A response.compaction object: output holds the item."),
                    "400",
                    "413",
                    "415",
                ),
            }
        },
        "/v1/responses/{response_id}": {
            "get": {
                "operationId": "getResponse",
                "summary": "A stored response (store: true, the default)",
                "parameters": response_id,
                "responses": _responses(response_ok),
            },
            "delete": {
                "operationId": "deleteResponse",
                "summary": "Forget a stored response (a running background one is cancelled)",
                "parameters": response_id,
                "responses": _responses(_json_ok("response.deleted")),
            },
        },
        "/v1/responses/{response_id}/cancel": {
            "post": {
                "operationId": "cancelResponse",
                "summary": "Cancel a background response; the prompt cache keeps its prefill",
                "parameters": response_id,
                "responses": _responses(response_ok, "400"),
            }
        },
        "/v1/models": {
            "get": {
                "operationId": "listModels",
                "summary": "The served model",
                "responses": _responses(
                    _json_ok("A list with the one served model (its window: max_model_len).")
                ),
            }
        },
        "/v1/models/{model_id}": {
            "get": {
                "operationId": "retrieveModel",
                "summary": "The served model by its id; another id is a 404",
                "parameters": [
                    {
                        "name": "model_id",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "string", "minLength": 1},
                    }
                ],
                "responses": _responses(_json_ok("The model, with max_model_len.")),
            }
        },
        "/health": {
            "get": {
                "operationId": "health",
                "summary": "ok, degraded (with reasons), shutting_down or failed (503)",
                "responses": _responses(_json_ok("The engine's condition.")),
            }
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "summary": "Prometheus metrics",
                "responses": _responses(
                    {
                        "description": "Prometheus text exposition.",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                ),
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "summary": "This document",
                "responses": _responses(_json_ok("OpenAPI 3.1.")),
            }
        },
        "/v1/cache/stats": {
            "get": {
                "operationId": "cacheStats",
                "summary": "Prompt-cache entries in memory",
                "responses": _responses(
                    _json_ok(
                        "Entries with id, tokens, bytes, last use: an object (entries under "
                        "data, with totals), or with --cache-stats-format array (the seed "
                        "profile's) an array of the named entries.",
                        {"type": ["object", "array"]},
                    )
                ),
            }
        },
        "/v1/cache/{cache_id}": {
            "delete": {
                "operationId": "cacheDelete",
                "summary": "Drop an entry from memory and disk",
                "parameters": [
                    {
                        "name": "cache_id",
                        "in": "path",
                        "required": True,
                        "schema": dict(_CACHE_ID),
                    }
                ],
                "responses": _responses(_json_ok("What was deleted."), "400"),
            }
        },
        "/v1/cache/warm": {
            "post": {
                "operationId": "cacheWarm",
                "summary": "Build a cache entry through the engine",
                "requestBody": _body(warm),
                "responses": _responses(
                    _json_ok("warmed or skipped, with the reason."), "400", "413", "415", "429"
                ),
            }
        },
        "/admin/flush": {
            "post": {
                "operationId": "adminFlush",
                "summary": "Persist every dirty entry, after settling cancellations",
                "parameters": [
                    {
                        "name": "settle_ms",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 0, "maximum": 60_000},
                    }
                ],
                "responses": _responses(_json_ok("How many entries were written."), "400"),
            }
        },
    }
    paths.update(_completion_paths(b))
    paths.update(_messages_paths(b))
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "gezel-trio",
            "version": "0.1.0",
            "description": f"OpenAI-compatible MLX inference sidecar serving {model_id}.",
        },
        "paths": paths,
        "components": {
            "schemas": {**b.components, "Error": _ERROR, "AnthropicError": _ANTHROPIC_ERROR}
        },
    }


def _messages_paths(b: _Builder) -> dict[str, Any]:
    """Anthropic Messages: its own bodies and error envelope."""
    messages_ok = {
        "description": "A message object, or with stream: true Anthropic's server-sent "
        "events (message_start ... message_stop, with ping while waiting).",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {}},
        },
    }
    count_ok = _json_ok(
        "The prompt's token count.",
        {
            "type": "object",
            "required": ["input_tokens"],
            "properties": {"input_tokens": {"type": "integer", "minimum": 0}},
        },
    )
    errors = ("400", "413", "415")
    return {
        "/v1/messages": {
            "post": {
                "operationId": "anthropicMessages",
                "summary": "Anthropic Messages (x-api-key and anthropic-version accepted)",
                "requestBody": _body(b.ref(anthropic_wire.MessagesRequest)),
                "responses": _responses(messages_ok, *errors, "429", error="AnthropicError"),
            }
        },
        "/v1/messages/count_tokens": {
            "post": {
                "operationId": "anthropicCountTokens",
                "summary": "The prompt tokens a Messages request would render",
                "requestBody": _body(b.ref(anthropic_wire.CountTokensRequest)),
                "responses": _responses(count_ok, *errors, error="AnthropicError"),
            }
        },
    }


def _completion_paths(b: _Builder) -> dict[str, Any]:
    """Legacy completions, /tokenize and /detokenize."""
    completion_ok = {
        "description": "A text_completion object, or with stream: true server-sent "
        "text_completion chunks ending in data: [DONE].",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {}},
        },
    }
    completion_op = {
        "summary": "Legacy completion of a raw prompt (no chat template); n choices of "
        "one prompt computed once",
        "requestBody": _body(b.ref(openai_wire.CompletionRequest)),
        "responses": _responses(completion_ok, "400", "413", "415", "429"),
    }
    tokenize_ok = _json_ok(
        "tokens, count and max_model_len (vLLM); token_strs when asked; "
        "with_pieces: tokens as {id, piece} (llama.cpp).",
        {
            "type": "object",
            "required": ["tokens", "count", "max_model_len"],
            "properties": {
                "tokens": {"type": "array"},
                "count": {"type": "integer"},
                "max_model_len": {"type": "integer"},
                "token_strs": {"type": "array", "items": {"type": "string"}},
            },
        },
    )
    detokenize_ok = _json_ok(
        "The text, as prompt (vLLM) and content (llama.cpp).",
        {
            "type": "object",
            "required": ["prompt", "content"],
            "properties": {"prompt": {"type": "string"}, "content": {"type": "string"}},
        },
    )
    return {
        "/v1/completions": {"post": {**completion_op, "operationId": "completions"}},
        "/completions": {"post": {**completion_op, "operationId": "completionsAlias"}},
        "/infill": {
            "post": {
                "operationId": "infill",
                "summary": "llama.cpp's fill-in-the-middle: input_prefix, input_suffix, "
                "input_extra and prompt (after the middle token), with the model's FIM tokens",
                "requestBody": _body(b.ref(openai_wire.InfillRequest)),
                "responses": _responses(
                    {
                        "description": "llama.cpp's /completion object (content, stop, "
                        "tokens_cached, timings), or with stream: true server-sent events "
                        "of it.",
                        "content": {
                            "application/json": {"schema": {"type": "object"}},
                            "text/event-stream": {"schema": {}},
                        },
                    },
                    "400",
                    "413",
                    "415",
                    "429",
                ),
            }
        },
        "/tokenize": {
            "post": {
                "operationId": "tokenize",
                "summary": "Text (no chat template) or messages (the chat prompt) to token ids",
                "requestBody": _body(b.ref(openai_wire.TokenizeRequest)),
                "responses": _responses(tokenize_ok, "400", "413", "415"),
            }
        },
        "/detokenize": {
            "post": {
                "operationId": "detokenize",
                "summary": "Token ids to text",
                "requestBody": _body(b.ref(openai_wire.DetokenizeRequest)),
                "responses": _responses(detokenize_ok, "400", "413", "415"),
            }
        },
    }


def openapi_json(model_id: str, strict_fields: bool = False) -> str:
    return dump_json(document(model_id, strict_fields))
