"""``POST /v1/responses`` bodies as typed, validated values (OpenAI Responses).

The same strict rules as every body (``http.strict``): wrong types are
errors, every error names its field path, and a field no class here
declares is ignored and reported (refused under ``--strict-fields``). Input
items and tools are discriminated by their ``type`` (hooks on this module's
own converter). A tool of a kind this server cannot run (a hosted tool such
as ``web_search``, or a kind it does not know) is left out of the prompt and
named in the response; an input item it cannot serve (``computer_call_output``)
is a 400 that names it, never silently dropped. The tools of a ``namespace``
are served under flat names (``tool_namespaces``). The classes are also the
source of the ``/openapi.json`` schemas for the route.

A ``compaction`` item (made by ``POST /v1/responses/compact``) stands for
the input items it sealed: they replace it, and the items sent before it,
as raw JSON, before anything else is read, so the request is exactly the
one that carried the whole history (``expand_compactions``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Literal

import attrs
import cattrs

from ..core.errors import InvalidRequest, shown
from ..shaping.replies import ReplySeal
from .checks import (
    MAX_MESSAGES,
    MAX_TOOLS,
    SEED_MAX,
    SEED_MIN,
    TOOL_NAME,
    check_cache_id,
    check_cache_salt,
    check_custom_grammar,
    check_metadata,
    check_parameters,
    check_template_kwargs,
)
from .reasoning_effort import ReasoningEffort, effort_template_kwargs, effort_thinking_budget
from .strict import (
    FieldInvalid,
    Pattern,
    Range,
    object_hook,
    register_union,
    strict_converter,
    structure,
)
from .tool_namespaces import flat_name

__all__ = [
    "COMPACTION_TRIGGER",
    "COMPACTION_TYPES",
    "MAX_COMPACTED_BYTES",
    "CompactRequest",
    "ContextManagement",
    "CustomTool",
    "CustomToolCallItem",
    "CustomToolCallOutputItem",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "FunctionTool",
    "HostedTool",
    "InputItem",
    "MessageItem",
    "NamespaceTool",
    "ReasoningItem",
    "ResponsesInput",
    "ResponsesRequest",
    "SkippedItem",
    "ToolChoiceAllowed",
    "ToolChoiceCustom",
    "expand_compactions",
    "parse_compact_request",
    "parse_responses_request",
    "structure_items",
    "without_compaction_trigger",
]

ItemStatus = Literal["in_progress", "completed", "incomplete"]

# Records of a hosted tool's run that a client re-sends with its history:
# skipped (the model saw their effect in the messages around them). Items
# whose output a client-side harness must pair with a call stay a 400.
SKIPPED_ITEM_TYPES = (
    "web_search_call",
    "file_search_call",
    "image_generation_call",
    "code_interpreter_call",
    "mcp_list_tools",
    "mcp_call",
    "tool_search_call",
    "tool_search_output",
)

# Input item types OpenAI defines that need its hosted services or a
# client-side harness this server does not run: named in the 400.
HOSTED_ITEM_TYPES = (
    "item_reference",
    "computer_call",
    "computer_call_output",
    "image_generation_call",
    "code_interpreter_call",
    "local_shell_call",
    "local_shell_call_output",
    "shell_call",
    "shell_call_output",
    "apply_patch_call",
    "apply_patch_call_output",
    "mcp_approval_request",
    "mcp_approval_response",
)

# A compacted history's item (``compaction_summary``: its earlier name, which
# Codex still reads). Expanded before the body is structured.
COMPACTION_TYPES = ("compaction", "compaction_summary")
# The last input item of a Responses request that asks for a compaction of
# the items before it instead of a reply (Codex's built-in provider).
COMPACTION_TRIGGER = "compaction_trigger"
_COMPACTION_KEYS = frozenset({"type", "encrypted_content", "id", "created_by"})

# The JSON a request's compaction items may expand to, in all: 4x the
# default 8 MiB body. A compacted history may outgrow a body, not unbounded.
MAX_COMPACTED_BYTES = 32 * 1024 * 1024


@attrs.frozen
class ContentItem:
    """A part of a message's content: ``input_text`` (user, system,
    developer), ``output_text`` / ``refusal`` (replayed assistant output),
    ``input_image`` (a ``data:`` URL, in user messages, for a vision model).
    Files and audio are refused."""

    type: Literal[
        "input_text", "output_text", "refusal", "input_image", "input_file", "input_audio"
    ]
    text: str | None = None
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None
    image_url: str | None = None
    file_id: str | None = None
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None
    detail: str | None = None
    input_audio: dict[str, Any] | None = None
    # OpenAI's explicit cache breakpoints: accepted, not needed (the prompt
    # cache is content-addressed: every prefix is found without them).
    prompt_cache_breakpoint: dict[str, Any] | None = None


@attrs.frozen
class MessageItem:
    """A message (``type`` may be left out, as in OpenAI's easy input form)."""

    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentItem]
    type: Literal["message"] = "message"
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None


@attrs.frozen
class FunctionCallItem:
    """A function call the model made (replayed output)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None


@attrs.frozen
class FunctionCallOutputItem:
    """A function call's result, linked to its call by ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentItem]
    id: str | None = None
    status: ItemStatus | None = None
    name: str | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None


@attrs.frozen
class SummaryText:
    type: Literal["summary_text"]
    text: str


@attrs.frozen
class ReasoningText:
    type: Literal["reasoning_text"]
    text: str


@attrs.frozen
class ReasoningItem:
    """A reasoning item (replayed output): its text goes back to the chat
    template as the next assistant turn's reasoning."""

    type: Literal["reasoning"]
    summary: list[SummaryText] = attrs.field(factory=list)
    id: str | None = None
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: ItemStatus | None = None


@attrs.frozen
class CustomToolCallItem:
    """A custom (freeform) tool call the model made: ``input`` is its raw text."""

    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    id: str | None = None
    status: ItemStatus | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None


@attrs.frozen
class CustomToolCallOutputItem:
    """A custom tool call's result, linked to its call by ``call_id``."""

    type: Literal["custom_tool_call_output"]
    call_id: str
    output: str | list[ContentItem]
    id: str | None = None
    status: ItemStatus | None = None
    caller: dict[str, Any] | None = None


@attrs.frozen
class SkippedItem:
    """A hosted tool's record in re-sent history (``SKIPPED_ITEM_TYPES``):
    accepted and not rendered."""

    type: str


InputItem = (
    MessageItem
    | FunctionCallItem
    | FunctionCallOutputItem
    | ReasoningItem
    | CustomToolCallItem
    | CustomToolCallOutputItem
    | SkippedItem
)


@attrs.frozen
class FunctionTool:
    """A function tool; ``parameters`` must be a JSON schema."""

    type: Literal["function"]
    name: str = attrs.field(validator=Pattern(TOOL_NAME))
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None
    # Accepted as the SDK sends them; none changes what is generated here.
    output_schema: dict[str, Any] | None = None
    allowed_callers: list[Literal["direct", "programmatic"]] | None = None
    defer_loading: bool | None = None


@attrs.frozen
class TextInputFormat:
    """A custom tool's ``format``: any text."""

    type: Literal["text"]


@attrs.frozen
class GrammarInputFormat:
    """A custom tool's ``format``: text matching a Lark or regex grammar."""

    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: str


@attrs.frozen
class CustomTool:
    """A custom (freeform) tool: its input is raw text, not JSON; rendered as
    a function taking one ``input`` string (``shaping.custom_tools``)."""

    type: Literal["custom"]
    name: str = attrs.field(validator=Pattern(TOOL_NAME))
    description: str | None = None
    format: TextInputFormat | GrammarInputFormat | None = None
    allowed_callers: list[Literal["direct", "programmatic"]] | None = None
    defer_loading: bool | None = None

    @property
    def format_dict(self) -> dict[str, Any] | None:
        return attrs.asdict(self.format) if self.format is not None else None


@attrs.frozen
class HostedTool:
    """A tool of any kind but function, custom and namespace: one OpenAI's
    platform runs (``web_search``, ``file_search``, ``tool_search`` ...) or
    one this server does not know. Left out of the prompt, named in the
    ``x-gezel-ignored-tools`` header and a log line."""

    type: str


MemberTool = FunctionTool | CustomTool | HostedTool


@attrs.frozen
class NamespaceTool:
    """A group of tools (Codex's MCP servers' tools): each function or custom
    tool inside is served under ``flat_name(name, its name)``; other kinds
    inside are ignored as at the top level."""

    type: Literal["namespace"]
    name: str = attrs.field(validator=Pattern(TOOL_NAME))
    description: str | None = None
    tools: list[MemberTool] = attrs.field(factory=list)


Tool = FunctionTool | CustomTool | NamespaceTool | HostedTool


@attrs.frozen
class ToolChoiceFunction:
    type: Literal["function"]
    name: str
    # A tool inside a namespace tool: named by its own name and the group's.
    namespace: str | None = None


@attrs.frozen
class ToolChoiceCustom:
    type: Literal["custom"]
    name: str
    namespace: str | None = None


@attrs.frozen
class ToolChoiceAllowed:
    """``allowed_tools``: ``required`` forces one call of one of ``tools``;
    ``auto`` leaves the choice to the model (every tool stays in the prompt,
    so its cache is kept, and the subset is not enforced)."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]

    @property
    def names(self) -> list[str]:
        return [
            flat_name(t.get("namespace"), str(t.get("name")))
            for t in self.tools
            if t.get("type") in ("function", "custom")
        ]


ToolChoice = (
    Literal["auto", "none", "required"] | ToolChoiceFunction | ToolChoiceCustom | ToolChoiceAllowed
)


@attrs.frozen
class TextFormat:
    """``text.format``: plain text, any JSON object, or JSON matching ``schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


@attrs.frozen
class TextConfig:
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


@attrs.frozen
class ReasoningConfig:
    """``effort`` switches thinking (``none``/``minimal`` off) and bounds it
    (``low`` 512 tokens, ``medium`` 2048); the reasoning comes back as
    ``reasoning`` items with ``reasoning_text`` content."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    # Past turns' reasoning is rendered as the chat template does it.
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: str | None = None


@attrs.frozen
class ContextManagement:
    """A ``context_management`` entry: compact the context once the input
    reaches ``compact_threshold`` tokens. Accepted and validated; this
    server compacts only when asked (``POST /v1/responses/compact``, a
    ``compaction_trigger`` item), so an
    input that outgrows the model's context is a 400 as without it."""

    type: Literal["compaction"]
    compact_threshold: int | None = attrs.field(default=None, validator=Range(1, None))


@attrs.frozen
class ResponsesStreamOptions:
    include_obfuscation: bool | None = None


@attrs.frozen
class ResponsesInput:
    """What a response and a compaction share: the history (``input``, on
    ``instructions`` and ``previous_response_id``) and the fields of the
    requests it belongs to."""

    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Tool] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # Codex sends it (who is calling); recorded nowhere.
    client_metadata: dict[str, Any] | None = None

    @property
    def items(self) -> list[InputItem]:
        """``input`` as items: a string is one user message."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)


@attrs.frozen
class ResponsesRequest(ResponsesInput):
    tool_choice: ToolChoice | None = None
    max_tool_calls: int | None = attrs.field(default=None, validator=Range(1, None))
    max_output_tokens: int | None = attrs.field(default=None, validator=Range(1, None))
    temperature: float | None = attrs.field(default=None, validator=Range(0, 2))
    top_p: float | None = attrs.field(default=None, validator=Range(0, 1))
    top_logprobs: int | None = attrs.field(default=None, validator=Range(0, 20))
    include: list[str] | None = None
    store: bool | None = None
    background: bool | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    truncation: Literal["disabled", "auto"] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    # vLLM's: the prompt cache reuses only what requests of the same salt left.
    cache_salt: str | None = attrs.field(default=None, validator=check_cache_salt)
    context_management: list[ContextManagement] | None = None
    # OpenAI platform features: accepted in the body so the 400 can name
    # them (see ``_PLATFORM_FIELDS``).
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    # gezel extensions, as on chat completions
    cache_id: str | None = None
    seed: int | None = attrs.field(default=None, validator=Range(SEED_MIN, SEED_MAX))
    priority: Literal["interactive", "background"] = "interactive"
    chat_template_kwargs: dict[str, Any] | None = None
    max_thinking_tokens: int | None = attrs.field(default=None, validator=Range(0, None))
    speculation: bool = True

    @property
    def served_tools(self) -> list[FunctionTool | CustomTool]:
        """The tools the model is shown: a namespace's under their flat
        names, the kinds this server cannot run left out."""
        out: list[FunctionTool | CustomTool] = []
        for t in self.tools or []:
            if isinstance(t, NamespaceTool):
                out += [
                    attrs.evolve(m, name=flat_name(t.name, m.name))
                    for m in t.tools
                    if not isinstance(m, HostedTool)
                ]
            elif not isinstance(t, HostedTool):
                out.append(t)
        return out

    @property
    def namespaced(self) -> dict[str, tuple[str, str]]:
        """Each namespaced tool's flat name -> its namespace and own name."""
        return {
            flat_name(t.name, m.name): (t.name, m.name)
            for t in self.tools or []
            if isinstance(t, NamespaceTool)
            for m in t.tools
            if not isinstance(m, HostedTool)
        }

    @property
    def ignored_tools(self) -> list[str]:
        """The types of the tools left out (at the top level or in a
        namespace), in order, once each."""
        kinds: list[str] = []
        for t in self.tools or []:
            members = t.tools if isinstance(t, NamespaceTool) else [t]
            kinds += [m.type for m in members if isinstance(m, HostedTool)]
        return list(dict.fromkeys(kinds))

    @property
    def stores(self) -> bool:
        """``store`` defaults to true, as OpenAI's."""
        return self.store is not False

    @property
    def session_id(self) -> str | None:
        return self.cache_id if self.cache_id is not None else self.prompt_cache_key

    @property
    def effort(self) -> str | None:
        return self.reasoning.effort if self.reasoning is not None else None

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """``chat_template_kwargs`` with ``reasoning.effort`` folded in, as
        chat completions fold ``reasoning_effort``."""
        return effort_template_kwargs(self.chat_template_kwargs, self.effort)

    @property
    def thinking_budget(self) -> int | None:
        return effort_thinking_budget(self.max_thinking_tokens, self.effort)

    @property
    def response_format(self) -> dict[str, Any] | None:
        """``text.format`` in the chat-completions ``response_format`` shape
        the grammar compiler reads."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        spec: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.schema}
        if fmt.strict is not None:
            spec["strict"] = fmt.strict
        return {"type": "json_schema", "json_schema": spec}


@attrs.frozen
class CompactRequest(ResponsesInput):
    """``POST /v1/responses/compact`` as Codex sends it: the history to
    compact (``input``) and the fields of the requests it belongs to, which
    are accepted and not sealed (they travel with every request anyway)."""


# --- structure hooks: items and tools are told apart by their ``type`` -------


def _item_type(value: Any) -> Any:
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, got {type(value).__name__}")
    if "type" not in value and "role" in value:
        return "message"
    return value.get("type")


_ITEM_CLASSES: dict[str, type] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
    "custom_tool_call": CustomToolCallItem,
    "custom_tool_call_output": CustomToolCallOutputItem,
}


def _converter() -> cattrs.Converter:
    conv = strict_converter()

    def input_item(value: Any, _: Any) -> InputItem:
        kind = _item_type(value)
        cls = _ITEM_CLASSES.get(kind) if isinstance(kind, str) else None
        if kind in SKIPPED_ITEM_TYPES:
            return SkippedItem(kind)
        if cls is None:
            if kind in HOSTED_ITEM_TYPES:
                raise FieldInvalid(
                    "type",
                    f"input items of type {shown(kind)} are not supported: this server runs "
                    "messages, function and custom tool calls and their outputs, and "
                    "reasoning items",
                )
            choices = ", ".join(repr(k) for k in _ITEM_CLASSES)
            raise FieldInvalid(
                "type", f"an input item's type must be one of {choices}; got {shown(kind)}"
            )
        item: InputItem = conv.structure(value, cls)
        return item

    # The attrs structure function itself: ``conv.structure(value,
    # FunctionTool)`` would come back to ``tool``.
    plain_tool = object_hook(FunctionTool, conv)
    custom_tool = object_hook(CustomTool, conv)

    def member(value: Any, _: Any) -> MemberTool:
        kind = _item_type(value)
        if kind == "custom":
            structured_custom: CustomTool = custom_tool(value, CustomTool)
            return structured_custom
        if kind == "function":
            structured: FunctionTool = plain_tool(value, FunctionTool)
            return structured
        if not isinstance(kind, str) or not kind:
            raise FieldInvalid("type", f"a tool's type must be a string; got {shown(kind)}")
        # Hosted, or a kind this server does not know: left out and named.
        return HostedTool(kind)

    # Its members' hook first: the structure function reads it when built.
    register_union(conv, MemberTool, member)
    namespace_tool = object_hook(NamespaceTool, conv)

    def tool(value: Any, t: Any) -> Tool:
        if _item_type(value) == "namespace":
            structured: NamespaceTool = namespace_tool(value, NamespaceTool)
            return structured
        return member(value, t)

    def input_format(value: Any, _: Any) -> TextInputFormat | GrammarInputFormat:
        kind = _item_type(value)
        if kind == "text":
            return conv.structure(value, TextInputFormat)
        if kind == "grammar":
            return conv.structure(value, GrammarInputFormat)
        raise FieldInvalid("type", f"a custom tool's format is text or grammar, not {shown(kind)}")

    def tool_choice(value: Any, _: Any) -> ToolChoice:
        if isinstance(value, str):
            if value not in ("auto", "none", "required"):
                raise TypeError(
                    f"must be 'auto', 'none', 'required' or an object; got {shown(value)}"
                )
            return value  # type: ignore[return-value]
        kind = _item_type(value)
        classes: dict[str, type] = {
            "function": ToolChoiceFunction,
            "custom": ToolChoiceCustom,
            "allowed_tools": ToolChoiceAllowed,
        }
        if kind not in classes:
            raise FieldInvalid(
                "type",
                f"tool_choice of type {shown(kind)} is not supported: name a function or a "
                'custom tool ({"type": "function" | "custom", "name": ...}), list '
                "allowed_tools, or use auto, none or required",
            )
        choice: ToolChoice = conv.structure(value, classes[kind])
        return choice

    def input_(value: Any, _: Any) -> str | list[InputItem]:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            items: list[InputItem] = conv.structure(value, list[InputItem])
            return items
        raise TypeError("expected a string or a list of input items")

    def content(value: Any, _: Any) -> str | list[ContentItem]:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            parts: list[ContentItem] = conv.structure(value, list[ContentItem])
            return parts
        raise TypeError("expected a string or a list of content parts")

    register_union(conv, InputItem, input_item)
    register_union(conv, Tool, tool)
    register_union(conv, TextInputFormat | GrammarInputFormat | None, _optional(input_format))
    register_union(conv, ToolChoice, tool_choice)
    register_union(conv, str | list[InputItem], input_)
    register_union(conv, str | list[ContentItem], content)
    return conv


def _optional(hook: Any) -> Any:
    return lambda value, t: None if value is None else hook(value, t)


_CONVERTER = _converter()


# --- the checks that span fields ----------------------------------------------


# Request fields that need OpenAI's platform: set, they are a 400 naming them.
_PLATFORM_FIELDS = {
    "conversation": "stored conversations are OpenAI's; chain with previous_response_id",
    "prompt": "stored prompt templates are OpenAI's; send instructions and input",
    "background_options": "completion windows are not supported; background runs at once",
    "moderation": "moderation is not supported",
    "access_programs": "access programs are not supported",
    "image": "image generation is not supported",
}


def _check(req: ResponsesRequest) -> None:
    for name, why in _PLATFORM_FIELDS.items():
        value = getattr(req, name)
        if value is not None and value != [] and value != {}:
            raise InvalidRequest(f"{name} is not supported by this server: {why}", param=name)
    items = req.items
    if len(items) > MAX_MESSAGES:
        raise InvalidRequest(f"at most {MAX_MESSAGES} input items", param="input")
    for name, value in (
        ("cache_id", req.cache_id),
        ("prompt_cache_key", req.prompt_cache_key),
        ("previous_response_id", req.previous_response_id),
    ):
        check_cache_id(value, name)
    check_template_kwargs(req.chat_template_kwargs)
    if req.tools is not None:
        _check_tools(req.tools)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema" and fmt.schema is None:
        raise InvalidRequest(
            "text.format of type json_schema needs a schema", param="text.format.schema"
        )
    check_metadata(req.metadata)
    if req.truncation == "auto":
        raise InvalidRequest(
            'truncation "auto" (dropping the oldest input to fit) is not supported; '
            'use "disabled": a prompt that does not fit is a 400',
            param="truncation",
        )
    if req.background:
        if not req.stores:
            raise InvalidRequest(
                "background responses must be stored (store: true)", param="background"
            )
        if req.stream:
            raise InvalidRequest(
                "background responses are not streamed here: poll GET /v1/responses/{id}",
                param="stream",
            )


def _served(tools: list[Tool]) -> Iterator[tuple[str, str, FunctionTool | CustomTool]]:
    """Each tool the model is shown, in order: its field path, the name it
    is served under and the tool."""
    for i, tool in enumerate(tools):
        if isinstance(tool, NamespaceTool):
            for j, member in enumerate(tool.tools):
                if not isinstance(member, HostedTool):
                    yield f"tools[{i}].tools[{j}]", flat_name(tool.name, member.name), member
        elif not isinstance(tool, HostedTool):
            yield f"tools[{i}]", tool.name, tool


def _check_tools(tools: list[Tool]) -> None:
    """At most ``MAX_TOOLS`` served, each name (a namespace's tools' flat
    names included) once, each schema and grammar sound."""
    served = list(_served(tools))
    if len(served) > MAX_TOOLS:
        raise InvalidRequest(f"at most {MAX_TOOLS} tools", param="tools")
    names: set[str] = set()
    for where, name, tool in served:
        if not re.fullmatch(TOOL_NAME, name):
            raise InvalidRequest(
                f"{where}.name is served as {shown(name)}, which must match {TOOL_NAME}",
                param=f"{where}.name",
            )
        if name in names:
            raise InvalidRequest(f"{where}.name {shown(name)} is repeated", param=f"{where}.name")
        names.add(name)
        if isinstance(tool, FunctionTool):
            check_parameters(tool.parameters, f"{where}.parameters")
        elif isinstance(tool.format, GrammarInputFormat):
            check_custom_grammar(tool.format.syntax, tool.format.definition, f"{where}.format")


def parse_responses_request(body: Any, seal: ReplySeal | None = None) -> ResponsesRequest:
    """Validate a decoded JSON body, its compaction items expanded with
    ``seal``'s key; raises ``InvalidRequest`` naming the field."""
    req = structure(expand_compactions(body, seal), ResponsesRequest, _CONVERTER)
    _check(req)
    return req


def parse_compact_request(
    body: Any, seal: ReplySeal | None = None
) -> tuple[CompactRequest, list[Any]]:
    """A compact body validated as ``parse_responses_request`` validates
    input, and its input items as raw JSON (compaction items expanded), as
    a later request will carry them; raises ``InvalidRequest``."""
    body = expand_compactions(body, seal)
    req = structure(body, CompactRequest, _CONVERTER)
    if req.previous_response_id is not None:
        raise InvalidRequest(
            "previous_response_id is not supported on compact: send the history as input",
            param="previous_response_id",
        )
    check_cache_id(req.prompt_cache_key, "prompt_cache_key")
    items = req.items
    if not items:
        raise InvalidRequest("input is required: the history to compact", param="input")
    if len(items) > MAX_MESSAGES:
        raise InvalidRequest(f"at most {MAX_MESSAGES} input items", param="input")
    raw = body["input"]
    return req, [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw)


def without_compaction_trigger(body: Any) -> dict[str, Any] | None:
    """``body`` without its last input item when that item is a
    ``compaction_trigger`` (the request then asks for a compaction); None
    for any other body."""
    if not isinstance(body, dict) or not isinstance(body.get("input"), list):
        return None
    items = body["input"]
    if not items or not isinstance(items[-1], dict):
        return None
    if items[-1].get("type") != COMPACTION_TRIGGER:
        return None
    return {**body, "input": items[:-1]}


def _is_compaction(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type") in COMPACTION_TYPES


def expand_compactions(body: Any, seal: ReplySeal | None) -> Any:
    """``body`` with each compaction item in its ``input`` replaced by the
    items it sealed, raw (the same body when it has none). A compaction
    stands for the whole history up to it, so the items sent before it go:
    Codex 0.171 re-sends the user messages it keeps and its context before
    the item, copies of what the item holds; kept, they rendered twice (a
    real session's next prompt grew from 15,566 to 23,318 tokens and read
    14,082 from the cache). Raises ``InvalidRequest`` naming an item
    ``seal``'s key did not make (or that was altered), and past
    ``MAX_COMPACTED_BYTES`` expanded in all."""
    if not isinstance(body, dict) or not isinstance(body.get("input"), list):
        return body
    if not any(_is_compaction(item) for item in body["input"]):
        return body
    expanded: list[Any] = []
    room = MAX_COMPACTED_BYTES
    for i, item in enumerate(body["input"]):
        if not _is_compaction(item):
            expanded.append(item)
            continue
        where = f"input[{i}]"
        for key, value in item.items():
            if key not in _COMPACTION_KEYS:
                raise InvalidRequest(
                    f"invalid request at {where}.{key}: a compaction item has no field "
                    f"{shown(key)}",
                    param=f"{where}.{key}",
                )
            if key in ("id", "created_by") and not isinstance(value, str | None):
                raise InvalidRequest(f"{where}.{key} must be a string", param=f"{where}.{key}")
        blob = item.get("encrypted_content")
        param = f"{where}.encrypted_content"
        if not isinstance(blob, str):
            raise InvalidRequest(f"{param} must be the string compact returned", param=param)
        if seal is None:
            raise InvalidRequest(
                f"{where}: this server has no key to open compactions with", param=param
            )
        try:
            items, size = seal.open_history(blob, room)
        except ValueError as exc:
            raise InvalidRequest(
                f"{where} is not a compaction this server can expand: {exc}", param=param
            ) from None
        room -= size
        expanded = list(items)
    return {**body, "input": expanded}


def structure_items(items: list[dict[str, Any]]) -> list[InputItem]:
    """Output items as served (plain mappings) back into input items, as a
    continuation replays them."""
    structured: list[InputItem] = _CONVERTER.structure(items, list[InputItem])
    return structured
