"""The fields chat and legacy completions share, and those a response and a
compaction share, are declared once: each is checked the same way on every
body that carries it, the same 400 naming the same field, and a field no
class declares is still dropped and named. ``tool_grammar.format`` takes the
names the markup families declare, old spellings included.

Pure parsing: no engine, no model."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from gezel_trio.core.errors import InvalidRequest
from gezel_trio.http.openai_wire import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    parse_chat_request,
    parse_completion_request,
)
from gezel_trio.http.responses_wire import (
    CompactRequest,
    ResponsesInput,
    ResponsesRequest,
    parse_compact_request,
    parse_responses_request,
)
from gezel_trio.http.strict import collecting_fields
from gezel_trio.shaping.toolcalls import GEMMA4, TOOL_GRAMMAR_NAMES

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}

# A bad value for fields of the shared base, and the field the 400 names.
BAD_SHARED = [
    ("temperature", 3),
    ("top_k", -2),
    ("seed", 2**70),
    ("n", 0),
    ("stop", 5),
    ("min_tokens", -1),
    ("priority", "soon"),
    ("cache_salt", ""),
    ("no_stop_trim", True),
    ("skip_special_tokens", False),
    ("stream_options", {"include_usage": "yes"}),
]


def refusal(parse: Any, body: dict[str, Any]) -> tuple[str, str | None]:
    with pytest.raises(InvalidRequest) as caught:
        parse(body)
    return caught.value.message, caught.value.param


@pytest.mark.parametrize(("field", "value"), BAD_SHARED)
def test_a_shared_field_is_refused_alike_on_chat_and_completions(field: str, value: Any) -> None:
    chat = refusal(parse_chat_request, {**CHAT, field: value})
    completion = refusal(parse_completion_request, {**COMPLETION, field: value})
    assert chat == completion
    assert chat[1] is not None
    assert chat[1].startswith(field)


def test_the_shared_fields_are_declared_once() -> None:
    shared = {f.name for f in attrs.fields(GenerationRequest)}
    assert len(shared) == 27
    for cls in (ChatCompletionRequest, CompletionRequest):
        assert issubclass(cls, GenerationRequest)
        own = {f.name for f in attrs.fields(cls)} - shared
        assert own
        assert not own & shared
    assert {f.name for f in attrs.fields(CompactRequest)} == {
        f.name for f in attrs.fields(ResponsesInput)
    }
    assert issubclass(ResponsesRequest, ResponsesInput)


def test_the_required_field_still_comes_first() -> None:
    # An error in a shared field does not hide the missing prompt or messages.
    assert refusal(parse_chat_request, {"model": 5})[1] == "messages"
    assert refusal(parse_completion_request, {"model": 5})[1] == "prompt"
    assert next(f.name for f in attrs.fields(ChatCompletionRequest)) == "messages"
    assert next(f.name for f in attrs.fields(CompletionRequest)) == "prompt"


@pytest.mark.parametrize(
    ("parse", "body"),
    [
        (parse_chat_request, CHAT),
        (parse_completion_request, COMPLETION),
        (parse_responses_request, {"input": "hi"}),
        (parse_compact_request, {"input": "hi"}),
    ],
)
def test_an_unknown_field_is_still_dropped_and_named(parse: Any, body: dict[str, Any]) -> None:
    with collecting_fields(strict=False) as report:
        parse({**body, "future_knob": 1, "model": "m"})
    assert report.ignored.header() == "future_knob"


def test_a_shared_responses_field_is_refused_alike_on_both() -> None:
    body = {"input": "hi", "service_tier": "fastest"}
    assert refusal(parse_responses_request, body) == refusal(
        lambda b: parse_compact_request(b), body
    )


@pytest.mark.parametrize("name", ["gemma4", "gemma"])
def test_tool_grammar_format_takes_gemma4_and_the_seed_clients_gemma(name: str) -> None:
    req = parse_chat_request({**CHAT, "tool_grammar": {"format": name}})
    assert req.tool_grammar is not None
    assert req.tool_grammar.format == name
    assert name in (GEMMA4.name, *GEMMA4.client_names)


def test_an_unknown_tool_grammar_format_is_a_400_listing_the_names() -> None:
    message, param = refusal(parse_chat_request, {**CHAT, "tool_grammar": {"format": "llama"}})
    assert param == "tool_grammar.format"
    for name in TOOL_GRAMMAR_NAMES:
        assert repr(name) in message
