"""Request shapes as Codex (openai/codex, the Rust CLI) sends them.

Recorded from openai/codex: the apply_patch Lark grammar is
``codex-rs/core/src/tools/handlers/tool_apply_patch.lark`` at
openai/codex@71163530a46dc568775f9ee95a9b57de3385cd9a (comment line
included, as sent); the freeform tool's name and description from
``create_apply_patch_freeform_tool`` (``codex-rs/tools/src/apply_patch_tool.rs``),
``exec_command`` / ``write_stdin`` from ``codex-rs/tools/src/local_tool.rs`` at
openai/codex@13bdd524f296e2c7917bef959ad0a8f97bd16ed1 (the approval
parameters left out), ``web_search`` as the hosted tool Codex adds when web search is on.
The request fields are those ``codex-rs/core/src/client.rs`` sets on every
Responses call: ``store: false``, ``include: ["reasoning.encrypted_content"]``,
``parallel_tool_calls``, ``tool_choice: "auto"``, ``reasoning``,
``text.verbosity`` and ``prompt_cache_key``, the whole history in ``input``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "APPLY_PATCH_GRAMMAR",
    "APPLY_PATCH_TOOL",
    "CODEX_NAMESPACE_TOOL",
    "CODEX_TOOLS",
    "ORDERS_NAMESPACE",
    "codex_request",
    "lark_for_library",
]

APPLY_PATCH_GRAMMAR = """start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

# core/src/tools/handlers/tool_apply_patch.lark
filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
"""

APPLY_PATCH_TOOL: dict[str, Any] = {
    "type": "custom",
    "name": "apply_patch",
    "description": (
        "Use the `apply_patch` tool to edit files. This is a FREEFORM tool, so do not "
        "wrap the patch in JSON."
    ),
    "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_GRAMMAR},
}

_NUMBER = "How long to wait (in milliseconds) for output before yielding."

CODEX_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "exec_command",
        "description": (
            "Runs a command in a PTY, returning output or a session ID for ongoing interaction."
        ),
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {
                "cmd": {"type": "string", "description": "Shell command to execute."},
                "workdir": {
                    "type": "string",
                    "description": (
                        "Optional working directory to run the command in; defaults to the "
                        "turn cwd."
                    ),
                },
                "yield_time_ms": {"type": "number", "description": _NUMBER},
                "max_output_tokens": {
                    "type": "number",
                    "description": "Maximum number of tokens to return. Excess output will be "
                    "truncated.",
                },
            },
            "required": ["cmd"],
            "additionalProperties": False,
        },
    },
    {
        "type": "function",
        "name": "write_stdin",
        "description": (
            "Writes characters to an existing unified exec session and returns recent output."
        ),
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {
                "session_id": {
                    "type": "number",
                    "description": "Identifier of the running unified exec session.",
                },
                "chars": {
                    "type": "string",
                    "description": "Bytes to write to stdin (may be empty to poll).",
                },
                "yield_time_ms": {"type": "number", "description": _NUMBER},
            },
            "required": ["session_id"],
            "additionalProperties": False,
        },
    },
    APPLY_PATCH_TOOL,
    {"type": "web_search", "external_web_access": False},
]


def codex_request(model: str, history: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A Responses body as Codex builds it for ``history`` (the whole of it)."""
    body: dict[str, Any] = {
        "model": model,
        "instructions": "You are Codex, a coding agent. Keep answers short.",
        "input": history,
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "codex-session-0001",
        "text": {"verbosity": "low"},
        "client_metadata": {"originator": "codex_cli_rs"},
    }
    body.update(extra)
    return body


def lark_for_library(grammar: str) -> str:
    """The grammar as the ``lark`` package reads it: its Earley parser refuses
    terminals that can match nothing (``/(.*)/``), so those become ``/.+/``
    made optional, and ``#`` lines (llguidance reads them as comments) go."""
    lines = [line for line in grammar.splitlines() if not line.startswith("#")]
    return "\n".join(lines).replace("/(.*)/", "/(.+)/?")


# Codex groups its MCP servers' tools (and, in its "lite" protocol, its own
# functions) in ``namespace`` tools: ``ToolSpec::Namespace`` of
# ``ResponsesApiNamespace {name, description, tools}`` in
# ``codex-rs/tools/src/tool_spec.rs`` (serialized shape pinned by
# ``namespace_tool_spec_serializes_expected_wire_shape`` in
# ``tool_spec_tests.rs``; the namespace of an MCP server is
# ``mcp__<server>__``). Codex CLI 0.171 sends one after its own tools, so it
# is ``tools[4]`` beside ``CODEX_TOOLS``. The model's call of a tool inside
# comes back as a ``function_call`` item whose ``name`` is the inner tool's
# and whose ``namespace`` is the group's (``ResponseItem::FunctionCall``,
# ``codex-rs/protocol/src/models.rs``, routed by ``ToolName::new(namespace,
# name)`` in ``codex-rs/core/src/tools/router.rs``); Codex re-sends it so.
ORDERS_NAMESPACE = "mcp__orders__"

CODEX_NAMESPACE_TOOL: dict[str, Any] = {
    "type": "namespace",
    "name": ORDERS_NAMESPACE,
    "description": "Tools in the mcp__orders__ namespace.",
    "tools": [
        {
            "type": "function",
            "name": "lookup_order",
            "description": "Look up an order",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string", "enum": ["A1", "B2"]}},
                "required": ["order_id"],
                "additionalProperties": False,
            },
        },
        {
            "type": "function",
            "name": "cancel_order",
            "description": "Cancel an order",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string", "enum": ["A1", "B2"]}},
                "required": ["order_id"],
                "additionalProperties": False,
            },
        },
    ],
}
