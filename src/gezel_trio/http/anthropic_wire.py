"""Anthropic Messages request bodies as strict attrs classes.

``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` take the shapes
of the current ``anthropic`` SDK (``anthropic/types/message_create_params.py``
and the ``*Param`` classes it names; the classes here keep those names), so
whatever the SDK or a Claude-style client sends is accepted: a ``system``
role inside ``messages``, ``cache_control`` on any block, the SDK's newer
top-level fields (``output_config``, ``container``, ``service_tier`` ...).
A field nobody defines is ignored and named in the ``x-gezel-ignored-fields``
header, like every body's (``http.strict``; a 400 under ``--strict-fields``).

Blocks are a tagged union on ``type``: each kind is its own class, so a
``text`` block without ``text`` is refused with that path, and a documented
kind this server does not serve (server-tool results, PDF documents) is
refused with a sentence saying so rather than a list of the kinds it knows.
Anthropic-defined tools (``web_search_...``, ``bash_...``,
``text_editor_...``: any tool whose ``type`` is not ``custom``) are run by
Anthropic's platform, not here: they are left out of the prompt and the
response names them (``ServerToolParam``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeVar, get_args, get_type_hints

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn

from ..core.errors import InvalidRequest, shown
from .checks import MAX_TOOLS, check_cache_salt, check_messages, check_parameters, check_stops
from .strict import FieldInvalid, Pattern, Range, register_union, strict_converter, structure

__all__ = [
    "Block",
    "ContentBlockSourceParam",
    "CountTokensRequest",
    "DiagnosticsParam",
    "DocumentBlockParam",
    "ImageBlockParam",
    "MessageParam",
    "MessagesRequest",
    "PlainTextSourceParam",
    "RedactedThinkingBlockParam",
    "ServerToolParam",
    "TextBlockParam",
    "ThinkingBlockParam",
    "ToolChoice",
    "ToolParam",
    "ToolResultBlockParam",
    "ToolUseBlockParam",
    "parse_count_tokens_request",
    "parse_messages_request",
]

T = TypeVar("T")

# Anthropic's rule for tool names (wider than OpenAI's 64).
_TOOL_NAME = r"[A-Za-z0-9_-]{1,128}"


@attrs.frozen
class DiagnosticsParam:
    """Cache diagnostics: the previous response's id (``null`` on a first
    turn, to opt in); ``http.cache_diagnostics``."""

    previous_message_id: str | None = None


@attrs.frozen
class CacheControlEphemeralParam:
    """A prompt-cache breakpoint: pins the prefix through its block for its ttl."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


@attrs.frozen
class TextBlockParam:
    type: Literal["text"]
    text: str
    cache_control: CacheControlEphemeralParam | None = None
    citations: list[dict[str, Any]] | None = None


@attrs.frozen
class ImageSourceParam:
    type: Literal["base64", "url", "file"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None
    file_id: str | None = None


@attrs.frozen
class ImageBlockParam:
    """Accepted in shape, refused with a 400 while no vision model is loaded."""

    type: Literal["image"]
    source: ImageSourceParam
    cache_control: CacheControlEphemeralParam | None = None
    transformations: dict[str, Any] | None = None


@attrs.frozen
class ToolUseBlockParam:
    """A call the assistant made: becomes one of its ``tool_calls``."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControlEphemeralParam | None = None
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


@attrs.frozen
class PlainTextSourceParam:
    """A document's text, given inline."""

    type: Literal["text"]
    data: str
    media_type: Literal["text/plain"] = "text/plain"


SourceBlock = TextBlockParam | ImageBlockParam


@attrs.frozen
class ContentBlockSourceParam:
    """A document given as content blocks (text; images need a vision model)."""

    type: Literal["content"]
    content: str | list[SourceBlock]


DocumentSource = PlainTextSourceParam | ContentBlockSourceParam

# Document sources that need a feature this server does not have.
_UNSERVED_SOURCES = {
    "base64": "PDF documents are not supported; send the document's text "
    "(a text source, or a text block)",
    "url": "documents by URL are not supported (this server fetches nothing); "
    "send the document's text (a text source, or a text block)",
    "file": "the Files API is not supported; send the document's text "
    "(a text source, or a text block)",
}


@attrs.frozen
class CitationsConfigParam:
    """Accepted; answers carry no citations."""

    enabled: bool | None = None


@attrs.frozen
class DocumentBlockParam:
    """A text document: its title, context and text become part of the turn.
    PDF, URL and file sources are refused with a 400 naming the source."""

    type: Literal["document"]
    source: DocumentSource
    title: str | None = None
    context: str | None = None
    cache_control: CacheControlEphemeralParam | None = None
    citations: CitationsConfigParam | None = None


ResultBlock = TextBlockParam | ImageBlockParam | DocumentBlockParam


@attrs.frozen
class ToolResultBlockParam:
    """A tool's answer: becomes a ``tool`` message linked by ``tool_use_id``."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ResultBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControlEphemeralParam | None = None
    toolset_name: str | None = None


@attrs.frozen
class ThinkingBlockParam:
    """Earlier reasoning, replayed: becomes the message's ``reasoning_content``
    (the signature is not checked)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: CacheControlEphemeralParam | None = None


@attrs.frozen
class RedactedThinkingBlockParam:
    """Opaque reasoning from another server: accepted and left out of the prompt."""

    type: Literal["redacted_thinking"]
    data: str
    cache_control: CacheControlEphemeralParam | None = None


Block = (
    TextBlockParam
    | ImageBlockParam
    | DocumentBlockParam
    | ToolUseBlockParam
    | ToolResultBlockParam
    | ThinkingBlockParam
    | RedactedThinkingBlockParam
)

# Documented block kinds that need a server feature this one does not have.
_UNSERVED_BLOCKS = {
    "search_result": "search_result blocks are not supported; send the result as text",
    "container_upload": "container_upload blocks are not supported (no code execution)",
    "server_tool_use": "server tools are not supported, so neither are their blocks",
    "mcp_tool_use": "MCP servers are not supported, so neither are their blocks",
    "mcp_tool_result": "MCP servers are not supported, so neither are their blocks",
    "tool_reference": "tool_reference blocks are not supported (no tool search)",
    "browser_state": "browser_state blocks are not supported (no browser tool)",
    "compaction": "compaction blocks are not supported (no server-side compaction)",
}
_SERVER_RESULT = "server tools are not supported, so neither are their results ({})"


def _unserved_block(tag: str) -> str | None:
    """Why a documented block kind is refused, or None for an unknown kind."""
    if tag in _UNSERVED_BLOCKS:
        return _UNSERVED_BLOCKS[tag]
    if tag.endswith("_tool_result") and tag != "tool_result":
        return _SERVER_RESULT.format(tag[:80])
    return None


@attrs.frozen
class MessageParam:
    """A turn. ``system`` here is what Claude-style clients send inside
    ``messages``: leading ones join the system prompt, later ones stay in place."""

    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


@attrs.frozen
class ToolParam:
    """A client tool: ``input_schema`` is its arguments' JSON schema."""

    name: str = attrs.field(validator=Pattern(_TOOL_NAME))
    input_schema: dict[str, Any] = attrs.field()
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControlEphemeralParam | None = None
    strict: bool | None = None
    defer_loading: bool | None = None
    input_examples: list[dict[str, Any]] | None = None
    eager_input_streaming: bool | None = None
    allowed_callers: list[str] | None = None


@attrs.frozen
class ServerToolParam:
    """An Anthropic-defined tool (any ``type`` but ``custom``): this server
    runs none, so it is left out of the prompt and named in the response."""

    type: str


@attrs.frozen
class ToolChoiceAutoParam:
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


@attrs.frozen
class ToolChoiceAnyParam:
    """Call some tool: a grammar constrains the output to one call."""

    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


@attrs.frozen
class ToolChoiceToolParam:
    """Call this tool: a grammar constrains the output to one call of it."""

    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


@attrs.frozen
class ToolChoiceNoneParam:
    type: Literal["none"]


ToolChoice = ToolChoiceAutoParam | ToolChoiceAnyParam | ToolChoiceToolParam | ToolChoiceNoneParam


@attrs.frozen
class ThinkingConfigEnabledParam:
    """Thinking on, the think block closed after ``budget_tokens`` tokens."""

    type: Literal["enabled"]
    budget_tokens: int = attrs.field(validator=Range(1, None))
    display: Literal["summarized", "omitted"] | None = None


@attrs.frozen
class ThinkingConfigDisabledParam:
    type: Literal["disabled"]


@attrs.frozen
class ThinkingConfigAdaptiveParam:
    """Thinking on, without a budget."""

    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


Thinking = ThinkingConfigEnabledParam | ThinkingConfigDisabledParam | ThinkingConfigAdaptiveParam


@attrs.frozen
class MetadataParam:
    user_id: str | None = None


@attrs.frozen
class JSONOutputFormatParam:
    """Structured output: a grammar constrains the answer to this JSON schema."""

    type: Literal["json_schema"]
    schema: dict[str, Any]


@attrs.frozen
class OutputConfigParam:
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JSONOutputFormatParam | None = None


@attrs.frozen(kw_only=True)
class CountTokensRequest:
    """``POST /v1/messages/count_tokens``: the prompt a Messages request would render."""

    messages: list[MessageParam] = attrs.field(validator=check_messages)
    model: str | None = None
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam | ServerToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfigParam | None = None
    cache_control: CacheControlEphemeralParam | None = None
    context_management: dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @property
    def client_tools(self) -> list[ToolParam]:
        """The tools the model is shown: Anthropic-defined ones left out."""
        return [t for t in self.tools or () if isinstance(t, ToolParam)]

    @property
    def ignored_tools(self) -> list[str]:
        """The Anthropic-defined tools' types, in order, once each."""
        kinds = [t.type for t in self.tools or () if isinstance(t, ServerToolParam)]
        return list(dict.fromkeys(kinds))


@attrs.frozen(kw_only=True)
class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages`` (Anthropic Messages)."""

    max_tokens: int = attrs.field(validator=Range(1, None))
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = attrs.field(default=None, validator=Range(0, 1))
    top_p: float | None = attrs.field(default=None, validator=Range(0, 1))
    top_k: int | None = attrs.field(default=None, validator=Range(0, None))
    metadata: MetadataParam | None = None
    container: Any = None
    diagnostics: DiagnosticsParam | None = None
    inference_geo: str | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    # Beta fields about billing and refusals: nothing here bills or declines.
    billing_policy: dict[str, Any] | None = None
    fallback_credit_token: Any = None
    fallbacks: Any = None
    # gezel (vLLM's, an extra body field): the prompt cache reuses only what
    # requests of the same salt left.
    cache_salt: str | None = attrs.field(default=None, validator=check_cache_salt)
    # gezel: false opts this request out of speculative decoding.
    speculation: bool = True


def _tag(cls: type) -> str:
    (tag,) = get_args(get_type_hints(cls)["type"])
    return str(tag)


def _tagged(
    conv: cattrs.Converter,
    union: Any,
    what: str,
    unserved: Callable[[str], str | None] = lambda _: None,
) -> Callable[[Any, Any], Any]:
    """A structure hook for a union of classes told apart by their ``type``."""
    classes = {_tag(c): c for c in get_args(union)}
    choices = ", ".join(repr(t) for t in classes)

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise TypeError(f"expected an object, got {type(value).__name__}")
        tag = value.get("type")
        cls = classes.get(tag) if isinstance(tag, str) else None
        if cls is not None:
            return conv.structure(value, cls)
        why = unserved(tag) if isinstance(tag, str) else None
        if why is not None:
            raise FieldInvalid("type", why)
        raise FieldInvalid("type", f"{what} type must be one of {choices}; got {shown(tag)}")

    return hook


def _converter() -> cattrs.Converter:
    conv = strict_converter()

    def register(tp: Any, hook: Callable[[Any, Any], Any]) -> None:
        register_union(conv, tp, hook)

    register(Block, _tagged(conv, Block, "a content block's", _unserved_block))
    register(ResultBlock, _tagged(conv, ResultBlock, "a tool_result block's", _unserved_block))
    register(SourceBlock, _tagged(conv, SourceBlock, "a document content block's"))
    register(
        DocumentSource, _tagged(conv, DocumentSource, "a document source's", _UNSERVED_SOURCES.get)
    )
    register(ToolChoice, _tagged(conv, ToolChoice, "tool_choice"))
    client_tool = make_dict_structure_fn(ToolParam, conv, _cattrs_forbid_extra_keys=True)

    def tool(value: Any, _: Any) -> ToolParam | ServerToolParam:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(kind, str) and kind != "custom":
            return ServerToolParam(kind)
        structured: ToolParam = client_tool(value, ToolParam)
        return structured

    register(ToolParam | ServerToolParam, tool)
    register(Thinking, _tagged(conv, Thinking, "thinking"))

    def text_or(blocks: Any) -> Callable[[Any, Any], Any]:
        def hook(value: Any, _: Any) -> Any:
            if isinstance(value, str):
                return value
            if isinstance(value, list):
                return conv.structure(value, blocks)
            raise TypeError("expected a string or a list of content blocks")

        return hook

    register(str | list[Block], text_or(list[Block]))
    register(str | list[ResultBlock], text_or(list[ResultBlock]))
    register(str | list[SourceBlock], text_or(list[SourceBlock]))
    register(str | list[TextBlockParam], text_or(list[TextBlockParam]))
    return conv


_CONVERTER = _converter()


# Beta fields that ask for server features this one does not have.
_UNSERVED_FIELDS = {
    "compaction": "server-side context compaction is not supported; "
    "send the conversation as it should be read",
    "thread": "server-held threads are not supported; re-send the history "
    "(the prompt cache makes that cheap)",
}


def _check_unserved_fields(body: dict[str, Any]) -> None:
    for field, why in _UNSERVED_FIELDS.items():
        if field in body:
            raise InvalidRequest(why, param=field)


def _check_tools_raw(body: dict[str, Any]) -> None:
    """The tool count, before the list is structured."""
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"at most {MAX_TOOLS} tools", param="tools")


def _check(req: CountTokensRequest) -> None:
    for i, tool in enumerate(req.tools or ()):
        if isinstance(tool, ToolParam):
            check_parameters(tool.input_schema, f"tools[{i}].input_schema")
    if req.mcp_servers:
        raise InvalidRequest(
            "MCP servers are not supported; run the tools on the client", param="mcp_servers"
        )


def parse_count_tokens_request(body: Any) -> CountTokensRequest:
    """Validate a decoded body; ``InvalidRequest`` names the field."""
    if isinstance(body, dict):
        _check_tools_raw(body)
    req = structure(body, CountTokensRequest, _CONVERTER)
    _check(req)
    return req


def parse_messages_request(body: Any) -> MessagesRequest:
    """Validate a decoded body; ``InvalidRequest`` names the field."""
    if isinstance(body, dict):
        _check_unserved_fields(body)
        _check_tools_raw(body)
    req = structure(body, MessagesRequest, _CONVERTER)
    _check(req)
    check_stops(tuple(req.stop_sequences or ()), "stop_sequences")
    budget = getattr(req.thinking, "budget_tokens", None)
    if budget is not None and budget >= req.max_tokens:
        raise InvalidRequest(
            "thinking.budget_tokens must be less than max_tokens "
            "(thinking counts toward max_tokens)",
            param="thinking.budget_tokens",
        )
    return req
