"""Property-based fuzzing of every route, shared by
``tests/http/test_fuzz.py`` (a bounded count in CI) and the ``fuzz`` bench
scenario (``python -m bench fuzz``, ``bench/scenarios/fuzz.py``).

Requests are drawn by hypothesis: well-formed bodies with random valid
values, and the same bodies with one field replaced by a hostile JSON value
(wrong types, extreme and non-finite numbers, huge and deep values, unicode
edge cases including lone surrogates), fields dropped or unknown ones added,
raw bytes and wrong content types, unknown routes and methods, probes with
a body. The invariants, checked on every response:

* the status is below 500, and every 4xx is the OpenAI JSON error envelope
  (Anthropic's on ``/v1/messages``);
* the ``x-gezel-ignored-fields`` header, where the server names the
  unknown fields it ignored, is ASCII and at most 1024 characters, however
  odd or long the names;
* a 200 stream never carries an error frame of the engine's own making
  (``request_failed``, ``engine_failure``; ``api_error`` on Messages);
* the server stays alive (``/health`` answers ``ok`` after each request);
* a healthy greedy stream, running in a loop beside the fuzzer, produces
  byte-identical text every time (``HealthyStream``).

Generation is bounded so examples stay cheap: the server under test runs
with ``--max-tokens-default 16``, and an accepted ``max_tokens``-like value
above 64 is lowered to 64 before sending, except, with
``requests(huge_budgets=True)`` against a server whose window is short,
values of 2^31 and more (2^63, 2^64, 10^400: where an overflow would show),
which go as drawn and are cut to the window.

``image_requests`` sends one broken image (headers stating 65,535 x 65,535,
PNG metadata that inflates to megabytes, files cut at any byte or with a
byte flipped, magic numbers followed by noise, broken base64) on every
protocol that takes images, to a vision model: each is a 400, never a 500.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

import attrs
import httpx2 as httpx
import openai
from hypothesis import strategies as st

from tests.support.hostile_images import HOSTILE

__all__ = [
    "FUZZ_SERVER_ARGS",
    "HealthyStream",
    "Outcome",
    "bomb_request",
    "check",
    "grammar_bombs",
    "image_requests",
    "requests",
    "send",
]

# How the fuzzed server runs: short default generations, a short park bound
# (the healthy stream keeps interactive work running, so background requests
# are parked most of the time), and a short stall timeout.
FUZZ_SERVER_ARGS = ("--max-tokens-default", "16", "--max-park-seconds", "0.2")

LENGTH_FIELDS = (
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "min_tokens",
    "max_thinking_tokens",
)
_HEALTHY_PROMPT = [{"role": "user", "content": "Tell me about the harbour, slowly."}]

# --- hostile JSON values -----------------------------------------------------

_edge_ints = st.sampled_from(
    [0, -1, 1, 2**31, -(2**31), 2**63, -(2**63) - 1, 2**64, 2**70, 10**30, 10**400]
)
_edge_floats = st.sampled_from(
    [0.0, -0.0, 1e-320, 1e308, -1e308, float("nan"), float("inf"), -float("inf"), 0.5, 2.0001]
)
_edge_text = st.sampled_from(
    [
        "",
        "a\ud800b",
        "\udfff",
        "\x00",
        "²",
        "١٢٣",
        "𝟗",
        "\u202e",
        "\ufeff",
        "{{ 7*7 }}",
        "{% for x in range(99999) %}{% endfor %}",
        "../../etc/passwd",
        "<|im_end|>",
        "<tool_call>",
        "</think>",
        "x" * 5000,
    ]
)
_texts = st.one_of(st.text(max_size=40), _edge_text)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    _edge_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    _edge_floats,
    _texts,
)
json_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(_texts, inner, max_size=4)
    ),
    max_leaves=12,
)


def _deep(depth: int) -> Any:
    value: Any = "bottom"
    for _ in range(depth):
        value = [value]
    return value


hostile = st.one_of(
    json_values,
    st.integers(40, 200).map(_deep),
    st.integers(1, 3).map(lambda k: "y" * (k * 40_000)),
)

# --- well-formed bodies ------------------------------------------------------

_roles = st.sampled_from(["system", "developer", "user", "assistant"])
_message = st.fixed_dictionaries(
    {"role": _roles, "content": st.text(max_size=60)},
)
_tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True)},
            optional={
                "description": st.text(max_size=30),
                "parameters": st.just({"type": "object", "properties": {"q": {"type": "string"}}}),
            },
        ),
    }
)
_chat_optional: dict[str, st.SearchStrategy[Any]] = {
    "model": st.text(max_size=10),
    "stream": st.booleans(),
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(-1, 5000),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1), max_size=3)),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(st.integers(0, 4000).map(str), st.floats(-100, 100), max_size=3),
    "logprobs": st.booleans(),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 8),
    "user": st.text(max_size=10),
    "tools": st.lists(_tool, max_size=2),
    "tool_choice": st.sampled_from(["auto", "none", "required"]),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "store": st.booleans(),
    "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    "service_tier": st.sampled_from(["auto", "default", "flex"]),
    "reasoning_effort": st.sampled_from(["none", "minimal", "low", "medium", "high"]),
    "prompt_cache_key": st.text(min_size=1, max_size=12),
    "cache_id": st.text(min_size=1, max_size=12),
    "prefix_cache_ids": st.lists(st.text(min_size=1, max_size=8), max_size=2),
    "stable_prefix_chars": st.integers(0, 100),
    "priority": st.sampled_from(["interactive", "background"]),
    "chat_template_kwargs": st.fixed_dictionaries({"enable_thinking": st.booleans()}),
    "max_thinking_tokens": st.integers(0, 8),
    "n": st.integers(1, 3),
}
chat_bodies = st.fixed_dictionaries(
    {"messages": st.lists(_message, min_size=1, max_size=4)}, optional=_chat_optional
)
_input_item = st.one_of(
    _message,
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": st.text(min_size=1, max_size=8),
            "name": st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True),
            "arguments": st.sampled_from(['{"q": "x"}', "{}", "not json"]),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call_output"),
            "call_id": st.text(min_size=1, max_size=8),
            "output": st.text(max_size=30),
        }
    ),
)
_responses_optional: dict[str, st.SearchStrategy[Any]] = {
    "model": st.text(max_size=10),
    "instructions": st.text(max_size=40),
    "stream": st.booleans(),
    "max_output_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "tools": st.lists(
        st.fixed_dictionaries(
            {
                "type": st.just("function"),
                "name": st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True),
            },
            optional={
                "parameters": st.just({"type": "object", "properties": {"q": {"type": "string"}}})
            },
        ),
        max_size=2,
    ),
    "tool_choice": st.sampled_from(["auto", "none", "required"]),
    "text": st.sampled_from(
        [{"format": {"type": "text"}}, {"format": {"type": "json_object"}}, {"verbosity": "low"}]
    ),
    "reasoning": st.fixed_dictionaries({"effort": st.sampled_from(["none", "low", "high"])}),
    "store": st.booleans(),
    "background": st.booleans(),
    "previous_response_id": st.text(min_size=1, max_size=12),
    "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    "prompt_cache_key": st.text(min_size=1, max_size=12),
    "top_logprobs": st.integers(0, 5),
    "truncation": st.sampled_from(["disabled", "auto"]),
}
responses_bodies = st.fixed_dictionaries(
    {"input": st.one_of(st.text(max_size=60), st.lists(_input_item, min_size=1, max_size=4))},
    optional=_responses_optional,
)
_cache_control = st.just({"type": "ephemeral"})
_text_block = st.fixed_dictionaries(
    {"type": st.just("text"), "text": st.text(max_size=40)},
    optional={"cache_control": _cache_control},
)
_anthropic_block = st.one_of(
    _text_block,
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": st.text(max_size=8),
            "name": st.just("q"),
            "input": st.fixed_dictionaries({}, optional={"q": st.text(max_size=10)}),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": st.text(max_size=8)},
        optional={
            "content": st.one_of(st.text(max_size=20), st.lists(_text_block, max_size=2)),
            "is_error": st.booleans(),
        },
    ),
    st.fixed_dictionaries(
        {"type": st.just("thinking"), "thinking": st.text(max_size=20)},
        optional={"signature": st.text(max_size=8)},
    ),
    st.fixed_dictionaries({"type": st.just("redacted_thinking"), "data": st.text(max_size=8)}),
    st.fixed_dictionaries(
        {
            "type": st.just("document"),
            "source": st.fixed_dictionaries(
                {
                    "type": st.just("text"),
                    "media_type": st.just("text/plain"),
                    "data": st.text(max_size=40),
                }
            ),
        },
        optional={"title": st.text(max_size=10), "context": st.text(max_size=10)},
    ),
)
_anthropic_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system"]),
        "content": st.one_of(st.text(max_size=60), st.lists(_anthropic_block, max_size=3)),
    }
)
_anthropic_tool = st.fixed_dictionaries(
    {
        "name": st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True),
        "input_schema": st.just({"type": "object", "properties": {"q": {"type": "string"}}}),
    },
    optional={"description": st.text(max_size=30), "cache_control": _cache_control},
)
_count_optional: dict[str, st.SearchStrategy[Any]] = {
    "model": st.text(max_size=10),
    "system": st.one_of(st.text(max_size=40), st.lists(_text_block, max_size=2)),
    "tools": st.lists(_anthropic_tool, max_size=2),
    "tool_choice": st.sampled_from(
        [{"type": "auto"}, {"type": "any"}, {"type": "none"}, {"type": "tool", "name": "q"}]
    ),
    "thinking": st.sampled_from(
        [{"type": "disabled"}, {"type": "adaptive"}, {"type": "enabled", "budget_tokens": 4}]
    ),
}
_messages_optional: dict[str, st.SearchStrategy[Any]] = {
    **_count_optional,
    "stream": st.booleans(),
    "stop_sequences": st.lists(st.text(min_size=1, max_size=5), max_size=3),
    "temperature": st.floats(0, 1),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(0, 5000),
    "metadata": st.fixed_dictionaries({"user_id": st.text(max_size=10)}),
}
messages_bodies = st.fixed_dictionaries(
    {
        "messages": st.lists(_anthropic_message, min_size=1, max_size=4),
        "max_tokens": st.integers(1, 8),
    },
    optional=_messages_optional,
)
count_bodies = st.fixed_dictionaries(
    {"messages": st.lists(_anthropic_message, min_size=1, max_size=4)}, optional=_count_optional
)
warm_bodies = st.fixed_dictionaries(
    {
        "cache_id": st.text(min_size=1, max_size=12),
        "messages": st.lists(_message, min_size=1, max_size=3),
    },
    optional={"persist": st.booleans(), "model": st.text(max_size=8), "tools": st.lists(_tool)},
)

_token_ids = st.lists(st.integers(0, 300), min_size=1, max_size=20)
_completion_optional: dict[str, st.SearchStrategy[Any]] = {
    **{
        k: _chat_optional[k]
        for k in (
            "model",
            "stream",
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "stop",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "logit_bias",
            "ignore_eos",
            "min_tokens",
            "user",
            "cache_id",
            "prefix_cache_ids",
            "priority",
        )
    },
    "echo": st.booleans(),
    "logprobs": st.integers(0, 3),
    "n": st.integers(1, 3),
    "best_of": st.integers(1, 3),
    "repetition_context_size": st.integers(1, 64),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "prefix_cache_id": st.text(min_size=1, max_size=12),
    # The demo models the fuzzers run have no FIM tokens: any suffix is a 400.
    "suffix": st.sampled_from([None, None, None, "x"]),
}
completion_bodies = st.fixed_dictionaries(
    {"prompt": st.one_of(st.text(max_size=40), _token_ids, st.lists(_token_ids, max_size=2))},
    optional=_completion_optional,
)
_tokenize_text_optional: dict[str, st.SearchStrategy[Any]] = {
    "model": st.text(max_size=8),
    "add_special_tokens": st.booleans(),
    "add_special": st.booleans(),
    "return_token_strs": st.booleans(),
    "with_pieces": st.booleans(),
}
tokenize_bodies = st.one_of(
    st.fixed_dictionaries({"prompt": st.text(max_size=40)}, optional=_tokenize_text_optional),
    st.fixed_dictionaries({"content": st.text(max_size=40)}, optional=_tokenize_text_optional),
    st.fixed_dictionaries(
        {"messages": st.lists(_message, min_size=1, max_size=3)},
        optional={
            "tools": st.lists(_tool, max_size=2),
            "chat_template_kwargs": _chat_optional["chat_template_kwargs"],
            "add_generation_prompt": st.booleans(),
            "return_token_strs": st.booleans(),
        },
    ),
)
detokenize_bodies = st.fixed_dictionaries(
    {"tokens": st.lists(st.integers(0, 300), max_size=20)}, optional={"model": st.text(max_size=8)}
)


@st.composite
def _mutated(
    draw: st.DrawFn,
    bodies: st.SearchStrategy[dict[str, Any]],
    optional: dict[str, st.SearchStrategy[Any]] = _chat_optional,
    items: str = "messages",
) -> Any:
    body = draw(bodies)
    how = draw(st.sampled_from(["keep", "replace", "drop", "unknown", "nested", "whole"]))
    if how == "replace":
        key = draw(st.sampled_from(sorted({*body, *optional, items})))
        body[key] = draw(hostile)
    elif how == "drop" and body:
        del body[draw(st.sampled_from(sorted(body)))]
    elif how == "unknown":
        body[draw(_texts)] = draw(json_values)
    elif how == "nested" and isinstance(body.get(items), list) and body[items]:
        i = draw(st.integers(0, len(body[items]) - 1))
        field = draw(
            st.sampled_from(["role", "content", "tool_calls", "name", "refusal", "type", "zz"])
        )
        body[items][i][field] = draw(hostile)
    elif how == "whole":
        return draw(hostile)
    return body


@attrs.frozen
class Request:
    method: str
    path: str
    content: bytes | None = None
    content_type: str | None = "application/json"


# --- grammar bombs -----------------------------------------------------------
# Grammars and schemas small in bytes but deep or wide where llguidance
# recurses or slows: on an 8 MiB stack a chain of 2,700 rules, 3,500
# terminals or 920 "$ref"-linked object definitions overflowed it (SIGSEGV).


def rule_chain(n: int) -> str:
    """``start: r0``, ``r0: r1 "a"`` ... ``rn: "b"``: n rules, each the next's only user."""
    return "\n".join(["start: r0", *(f'r{i}: r{i + 1} "a"' for i in range(n)), f'r{n}: "b"'])


def terminal_chain(n: int) -> str:
    lines = ["start: T0", *(f'T{i}: T{i + 1} "a"' for i in range(n)), f'T{n}: "b"']
    return "\n".join(lines)


def nested_parens(n: int) -> str:
    return "start: " + "(" * n + '"a"' + ")" * n


def many_alternatives(n: int) -> str:
    return "start: " + " | ".join(f'"a{i}"' for i in range(n))


def nested_groups(n: int) -> str:
    """A regex of n nested groups."""
    return "(" * n + "a" + ")" * n


def ref_chain(n: int) -> dict[str, Any]:
    """An object schema whose property is a chain of n ``$defs``, each's
    one property a ``$ref`` to the next (1,000: 55 kB, under the schema size
    bound; 900 overflowed an 8 MiB stack)."""
    defs: dict[str, Any] = {
        f"{i:x}": {"properties": {"a": {"$ref": f"#/$defs/{i + 1:x}"}}} for i in range(n)
    }
    defs[f"{n:x}"] = {"type": "string"}
    return {"type": "object", "properties": {"a": {"$ref": "#/$defs/0"}}, "$defs": defs}


def nested_schema(n: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


_ASK = [{"role": "user", "content": "Go."}]


def bomb_request(carrier: str, bomb: str | dict[str, Any]) -> Request:
    """``bomb`` (a Lark grammar, a regex or a JSON schema) in one of the
    fields that reach llguidance, as a request that compiles it."""
    if isinstance(bomb, str):
        syntax = "regex" if carrier.endswith("regex") else "lark"
        if carrier.startswith("responses"):
            fmt = {"type": "grammar", "syntax": syntax, "definition": bomb}
            body: dict[str, Any] = {
                "input": "Go.",
                "max_output_tokens": 4,
                "tools": [{"type": "custom", "name": "t", "format": fmt}],
                "tool_choice": {"type": "custom", "name": "t"},
            }
            return Request("POST", "/v1/responses", _encode(body))
        grammar = {"syntax": syntax, "definition": bomb}
        tool = {"name": "t", "format": {"type": "grammar", "grammar": grammar}}
        body = {
            "messages": _ASK,
            "max_tokens": 4,
            "tools": [{"type": "custom", "custom": tool}],
            "tool_choice": {"type": "custom", "custom": {"name": "t"}},
        }
        return Request("POST", "/v1/chat/completions", _encode(body))
    if carrier == "response_format":
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": bomb}}
        body = {"messages": _ASK, "max_tokens": 4, "response_format": fmt}
        return Request("POST", "/v1/chat/completions", _encode(body))
    if carrier == "text_format":
        fmt = {"type": "json_schema", "name": "s", "schema": bomb}
        body = {"input": "Go.", "max_output_tokens": 4, "text": {"format": fmt}}
        return Request("POST", "/v1/responses", _encode(body))
    if carrier == "input_schema":
        tool = {"name": "f", "input_schema": bomb}
        body = {
            "messages": _ASK,
            "max_tokens": 4,
            "tools": [tool],
            "tool_choice": {"type": "any"},
        }
        return Request("POST", "/v1/messages", _encode(body))
    fn = {"name": "f", "parameters": bomb}
    body = {
        "messages": _ASK,
        "max_tokens": 4,
        "tools": [{"type": "function", "function": fn}],
        "tool_choice": "required",
    }
    return Request("POST", "/v1/chat/completions", _encode(body))


def _sizes(limit: int, top: int) -> st.SearchStrategy[int]:
    """Sizes around a bound: small ones (accepted, and cheap to serve) and
    ones past it, up to well beyond where llguidance crashed."""
    return st.one_of(st.integers(1, min(limit, 60)), st.integers(limit - 2, top))


_lark_bombs = st.one_of(
    _sizes(200, 4_000).map(rule_chain),
    _sizes(200, 5_000).map(terminal_chain),
    _sizes(32, 200).map(nested_parens),
    _sizes(2_000, 5_000).map(many_alternatives),
    _sizes(100, 300).map(lambda n: f"start: /{nested_groups(n)}/"),
    _sizes(85, 1_000).map(lambda n: "start: %json " + json.dumps(ref_chain(n))),
)
_schema_bombs = st.one_of(_sizes(85, 1_200).map(ref_chain), _sizes(64, 200).map(nested_schema))
grammar_bombs = st.one_of(
    st.tuples(st.sampled_from(["responses", "chat"]), _lark_bombs),
    st.tuples(
        st.sampled_from(["responses_regex", "chat_regex"]),
        _sizes(100, 1_000).map(nested_groups),
    ),
    st.tuples(
        st.sampled_from(["response_format", "text_format", "input_schema", "parameters"]),
        _schema_bombs,
    ),
).map(lambda pair: bomb_request(*pair))


def _encode(body: Any) -> bytes:
    # allow_nan: the fuzzer sends NaN/Infinity literals on purpose.
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


# From here on a budget is sent as drawn when the server's window is short
# (``requests(huge_budgets=True)``): past int64 and beyond, where an overflow
# would show.
HUGE_BUDGET = 2**31


def _bounded(body: Any, huge_budgets: bool = False) -> Any:
    if isinstance(body, dict):
        for key in LENGTH_FIELDS:
            value = body.get(key)
            # Any size: a max_tokens beyond the context window is served
            # (cut to fit), so a huge one would decode to the context's end.
            huge = huge_budgets and isinstance(value, int) and value >= HUGE_BUDGET
            if isinstance(value, int) and not isinstance(value, bool) and value > 64 and not huge:
                body[key] = 64
    return body


_GET_ROUTES = ["/v1/models", "/health", "/metrics", "/openapi.json", "/v1/cache/stats"]


@st.composite
def requests(draw: st.DrawFn, huge_budgets: bool = False) -> Request:
    """One request to any route, well-formed or not. ``huge_budgets``: a
    ``max_tokens``-like value of 2^31 or more goes as drawn (for a server
    whose context window is short, so it is cut to a few hundred tokens)."""
    bounded = functools.partial(_bounded, huge_budgets=huge_budgets)
    route = draw(
        st.sampled_from(
            [
                *("chat", "chat", "chat", "alias", "messages", "messages", "count"),
                *("warm", "delete", "flush", "get", "odd"),
                *("completions", "tokenize", "detokenize"),
                *("responses", "responses", "response", "probe", "bomb"),
            ]
        )
    )
    if route == "bomb":
        return draw(grammar_bombs)
    if route == "completions":
        body = bounded(draw(_mutated(completion_bodies)))
        return Request("POST", "/v1/completions", _encode(body))
    if route == "tokenize":
        return Request("POST", "/tokenize", _encode(draw(_mutated(tokenize_bodies))))
    if route == "detokenize":
        return Request("POST", "/detokenize", _encode(draw(_mutated(detokenize_bodies))))
    if route in ("chat", "alias"):
        path = "/v1/chat/completions" if route == "chat" else "/chat/completions"
        return Request("POST", path, _encode(bounded(draw(_mutated(chat_bodies)))))
    if route == "responses":
        body = _mutated(responses_bodies, _responses_optional, "input")
        return Request("POST", "/v1/responses", _encode(bounded(draw(body))))
    if route == "response":
        key = urllib.parse.quote(draw(_texts).encode("utf-8", "surrogatepass"), safe="")
        method, tail = draw(st.sampled_from([("GET", ""), ("DELETE", ""), ("POST", "/cancel")]))
        return Request(method, f"/v1/responses/{key or 'x'}{tail}", None, None)
    if route == "messages":
        body = draw(_mutated(messages_bodies, _messages_optional))
        return Request("POST", "/v1/messages", _encode(bounded(body)))
    if route == "count":
        body = draw(_mutated(count_bodies, _count_optional))
        return Request("POST", "/v1/messages/count_tokens", _encode(body))
    if route == "warm":
        return Request("POST", "/v1/cache/warm", _encode(draw(_mutated(warm_bodies))))
    if route == "delete":
        key = urllib.parse.quote(draw(_texts).encode("utf-8", "surrogatepass"), safe="")
        return Request("DELETE", f"/v1/cache/{key or 'x'}", None, None)
    if route == "flush":
        raw = str(draw(st.one_of(st.integers(), _texts))).encode("utf-8", "surrogatepass")
        settle = urllib.parse.quote(raw, safe="")
        return Request("POST", f"/admin/flush?settle_ms={settle}", None, None)
    if route == "probe":
        # A probe with a body: answered from its headers, the body never read.
        content = draw(st.one_of(st.none(), st.binary(max_size=64)))
        return Request(draw(st.sampled_from(["GET", "HEAD"])), "/health", content, None)
    if route == "get":
        path = draw(
            st.sampled_from(
                ["/v1/models", "/health", "/metrics", "/openapi.json", "/v1/cache/stats"]
            )
        )
        return Request("GET", path, None, None)
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]))
    path = "/" + urllib.parse.quote(draw(_texts).encode("utf-8", "surrogatepass"), safe="/")
    content = draw(st.one_of(st.none(), st.binary(max_size=64)))
    ctype = draw(
        st.sampled_from([None, "application/json", "text/plain", "application/x-www-form"])
    )
    return Request(method, path, content, ctype)


# --- hostile images, on a vision model ------------------------------------------


@functools.cache
def _small_images() -> tuple[tuple[bytes, str], ...]:
    """One small picture in each format (the same bytes every time: a
    strategy's choices must not change between runs)."""
    from PIL import Image

    picture = Image.merge(
        "RGB",
        [
            Image.linear_gradient("L").resize((24, 20)),
            *[Image.radial_gradient("L").resize((24, 20))] * 2,
        ],
    )
    out = []
    for fmt, media in [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")]:
        buf = io.BytesIO()
        picture.save(buf, fmt)
        out.append((buf.getvalue(), media))
    buf = io.BytesIO()
    picture.convert("P").save(buf, "GIF")
    out.append((buf.getvalue(), "image/gif"))
    return tuple(out)


@st.composite
def _image_bytes(draw: st.DrawFn) -> tuple[bytes, str]:
    """A hostile file, a good one cut at any byte or with bytes flipped, or
    random bytes behind a real format's magic."""
    kind = draw(st.sampled_from(["hostile", "cut", "flipped", "magic"]))
    if kind == "hostile":
        raw, _ = HOSTILE[draw(st.sampled_from(sorted(HOSTILE)))]
        return raw, "image/png"
    good, media = draw(st.sampled_from(_small_images()))
    if kind == "cut":
        return good[: draw(st.integers(1, len(good) - 1))], media
    if kind == "flipped":
        at = draw(st.integers(0, len(good) - 1))
        return good[:at] + bytes([good[at] ^ draw(st.integers(1, 255))]) + good[at + 1 :], media
    magic = draw(st.sampled_from([b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a", b"RIFF"]))
    return magic + draw(st.binary(max_size=64)), media


@st.composite
def image_requests(draw: st.DrawFn) -> Request:
    """A request carrying one image that is broken in some way (or, rarely,
    a good one), on any protocol that takes images, as base64 that may
    itself be broken."""
    raw, media = draw(_image_bytes())
    b64 = base64.b64encode(raw).decode()
    b64 = draw(st.sampled_from([b64, b64, b64[:-1], "@@" + b64, b64 + "==="]))
    url = f"data:{media};base64,{b64}"
    text = {"type": "text", "text": "What is this?"}
    route = draw(st.sampled_from(["chat", "images", "messages", "responses"]))
    if route == "chat":
        image = {"type": "image_url", "image_url": {"url": url}}
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": [image, text]}],
            "max_tokens": 2,
        }
        return Request("POST", "/v1/chat/completions", _encode(body))
    if route == "images":
        body = {"messages": [{"role": "user", "content": "Hm.", "images": [b64]}], "max_tokens": 2}
        return Request("POST", "/v1/chat/completions", _encode(body))
    if route == "messages":
        source = {"type": "base64", "media_type": media, "data": b64}
        body = {
            "model": "m",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "image", "source": source}, text]}],
        }
        return Request("POST", "/v1/messages", _encode(body))
    image = {"type": "input_image", "image_url": url}
    content = [image, {"type": "input_text", "text": "What is this?"}]
    body = {"input": [{"role": "user", "content": content}], "max_output_tokens": 2}
    return Request("POST", "/v1/responses", _encode(body))


@attrs.frozen
class Outcome:
    status: int
    violations: tuple[str, ...]
    seconds: float


def send(client: httpx.Client, req: Request) -> httpx.Response:
    headers = {"Content-Type": req.content_type} if req.content_type else {}
    return client.request(req.method, req.path, content=req.content, headers=headers)


def check(resp: httpx.Response) -> tuple[str, ...]:
    """The invariants on one response (see the module docstring)."""
    problems = []
    if resp.status_code >= 500:
        problems.append(f"status {resp.status_code}: {resp.text[:300]}")
    ctype = resp.headers.get("content-type", "")
    path = resp.request.url.path
    anthropic = path == "/v1/messages" or path.startswith("/v1/messages/")
    named = resp.headers.get("x-gezel-ignored-fields")
    if named is not None and (len(named) > 1024 or not named.isascii()):
        problems.append(f"an unbounded x-gezel-ignored-fields header: {named[:300]!r}")
    if resp.status_code >= 400:
        try:
            body = resp.json()
            err = body["error"]
            assert isinstance(err["message"], str)
            assert "type" in err
            if anthropic:
                assert body["type"] == "error"
            else:
                assert "code" in err
        except Exception:
            problems.append(f"{resp.status_code} without the JSON envelope: {resp.text[:200]}")
    elif ctype.startswith("text/event-stream") and anthropic:
        for line in resp.text.splitlines():
            error = json.loads(line[6:]) if line.startswith('data: {"type":"error"') else None
            if error is not None and error["error"]["type"] == "api_error":
                problems.append(f"stream error event: {line[:300]}")
    elif ctype.startswith("text/event-stream"):
        for line in resp.text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                code = json.loads(line[6:]).get("error", {}).get("code")
                if code in ("request_failed", "engine_failure", "slow_consumer"):
                    problems.append(f"stream error frame {code}: {line[:300]}")
    return tuple(problems)


class HealthyStream:
    """A greedy stream in a loop on its own thread; every run must match the
    first (taken before the fuzzer starts). ``stop()`` returns (runs,
    mismatches)."""

    def __init__(self, url: str, max_tokens: int = 48) -> None:
        self._client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        self._kw: dict[str, Any] = dict(
            model="demo",
            messages=_HEALTHY_PROMPT,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
        )
        self.reference = self._once()
        self.runs = 0
        self.mismatches: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _once(self) -> str:
        out = []
        for chunk in self._client.chat.completions.create(**self._kw):
            if chunk.choices and chunk.choices[0].delta.content:
                out.append(chunk.choices[0].delta.content)
        return "".join(out)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                text = self._once()
            except Exception as exc:  # a failed healthy request is a finding, not a crash
                self.mismatches.append(f"{type(exc).__name__}: {exc}")
                continue
            self.runs += 1
            if text != self.reference:
                self.mismatches.append(text)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> tuple[int, list[str]]:
        self._stop.set()
        self._thread.join(120)
        self._client.close()
        return self.runs, self.mismatches


def health_ok(client: httpx.Client) -> str | None:
    """``None`` if the server is alive and well, else what is wrong."""
    try:
        r = client.get("/health")
    except httpx.HTTPError as exc:
        return f"/health unreachable: {exc}"
    if r.status_code != 200 or r.json().get("status") not in ("ok", "degraded"):
        return f"/health: {r.status_code} {r.text[:200]}"
    if r.json().get("status") == "degraded" and any(
        "model step" in reason for reason in r.json().get("reasons", [])
    ):
        return f"a model step failed: {r.text[:200]}"
    return None


Runner = Callable[[Request], Outcome]
