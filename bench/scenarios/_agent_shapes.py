"""Recorded request shapes of the two most used coding agents, with no gezel
field: Claude Code on ``/v1/messages`` and Codex on ``/v1/responses``.

Shared by the ``agent`` bench scenario (``--mode claude-code|codex``) and the
real-SDK session tests (``tests/clients/test_coding_agents.py``). The texts
are shortened (Claude Code's real prompt is 15-30k tokens, Codex's ~10k) so a
test turn stays at one to two thousand tokens; what is kept is everything
that decides what a prompt cache sees.

Claude Code (modelled on captured ``/v1/messages`` bodies of Claude Code
2.1.69-2.1.257 pasted in public threads: the wire-format capture at
qntx.sbvh.nl/research/claude-api-wire-format.html, context-audit.tj-zhang.com's
count-tokens captures, anthropics/claude-code#68900, cortexkit/anthropic-auth#181,
icebear0828/codex-proxy#580, EasyMetaAu/helm-api#208, SaladDay/cc-switch-cli#147,
and Anthropic's "Mid-conversation system messages" page)
    ``system`` is a list of text blocks: ``system[0]`` is the billing /
    attribution header ``x-anthropic-billing-header: cc_version=V.XYZ;
    cc_entrypoint=cli; cch=HHHHH;`` with no ``cache_control``, whose ``cch``
    (5 hex) and version suffix (3 hex) change on every request; newer builds
    add ``cc_prev_req=req_…`` (the previous response's request id) and
    ``cc_prompt_id`` after it, here on the block's second line. Then the
    identity block and the main prompt, each with an ephemeral
    ``cache_control`` (the main prompt's with ``ttl: "1h"``). ``tools`` is the
    built-in roster (Bash, Read, Edit, Write, Glob, Grep, TodoWrite) with JSON
    schemas; ``metadata.user_id`` is ``user_<hash>_account_<uuid>_session_<uuid>``;
    ``thinking`` and ``stream: true`` on every request. User messages carry
    ``<system-reminder>`` text blocks beside the user's text and the tool
    results; a ``{"role": "system"}`` message may stand in the middle of
    ``messages`` (the mid-conversation system message). Assistant turns come
    back as Claude Code received them: text (and thinking) blocks, then
    ``tool_use`` blocks, answered by a user message of ``tool_result`` blocks.

Codex (read in ``codex-rs/core``: ``client_common.rs``
``ResponsesApiRequest`` and ``tools::ToolSpec`` at
openai/codex@001cb8e233f250c7086c791c51390286c087faea, ``client.rs``'s
request builder, ``tools/spec.rs`` ``create_exec_command_tool`` /
``create_shell_tool``, and the apply_patch grammar
``tools/handlers/tool_apply_patch.lark`` at
openai/codex@71163530a46dc568775f9ee95a9b57de3385cd9a)
    ``instructions`` (the base prompt), ``input`` the whole history re-sent
    every turn (never ``previous_response_id``): a developer message, the
    ``<environment_context>`` user message, the user's task, then every
    output item as it came back (``reasoning`` with its
    ``encrypted_content``, ``message``, ``function_call``,
    ``custom_tool_call``) followed by the outputs (``function_call_output``,
    ``custom_tool_call_output``), ids dropped as Codex serializes them.
    ``tools``: function tools (``exec_command``, ``write_stdin``,
    ``update_plan``, ``view_image``; ``strict: false``), the freeform
    ``{"type": "custom", "name": "apply_patch", "format": {"type":
    "grammar", "syntax": "lark", "definition": …}}`` and the hosted
    ``{"type": "web_search"}``. ``tool_choice: "auto"``,
    ``parallel_tool_calls: false``, ``reasoning: {"effort", "summary"}``,
    ``store: false``, ``stream: true``, ``include:
    ["reasoning.encrypted_content"]``, ``prompt_cache_key`` (the
    conversation id).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "APPLY_PATCH_GRAMMAR",
    "CC_TOOLS",
    "CODEX_COMMIT",
    "CODEX_TOOLS",
    "ClaudeCodeSession",
    "CodexSession",
    "anthropic_to_chat",
    "billing_header",
    "lark_compatible",
    "resent_item",
    "responses_to_chat",
    "sse_events",
]

CODEX_COMMIT = "001cb8e233f250c7086c791c51390286c087faea"
CC_VERSION = "2.1.257"
SESSION_UUID = "b4e5aaaa-9a3e-47c4-84ad-3a70f38c676e"
USER_ID = (
    "user_0784b260bff170afd2c41e6a9c5e1d7f0b3a8e4c2d19f6a7b5c3e8d0a1f2b4c6"
    f"_account_261d5434-c8c2-431f-b07d-2e480cd4622f_session_{SESSION_UUID}"
)
# What Claude Code sends besides the body (the anthropic SDK adds its own).
CC_HTTP_HEADERS = {
    "anthropic-beta": (
        "claude-code-20250219,interleaved-thinking-2025-05-14,"
        "context-management-2025-06-27,prompt-caching-scope-2026-01-05,"
        "mid-conversation-system-2026-04-07,effort-2025-11-24"
    ),
    "x-app": "cli",
    "User-Agent": f"claude-cli/{CC_VERSION} (external, cli)",
}


def _hex(seed: str, n: int) -> str:
    return hashlib.sha256(seed.encode()).hexdigest()[:n]


def billing_header(request: int, *, prev_req: bool = False) -> str:
    """The text of ``system[0]`` on request ``request`` (1-based): a new
    ``cch`` and version suffix every request, as Claude Code computes them
    from the request body. ``prev_req``: the newer variant, whose second line
    names the previous response's request id and the prompt's id."""
    line = (
        f"x-anthropic-billing-header: cc_version={CC_VERSION}.{_hex(f'v{request}', 3)}; "
        f"cc_entrypoint=cli; cch={_hex(f'cch{request}', 5)};"
    )
    if prev_req and request > 1:
        line += (
            f"\ncc_prev_req=req_011C{_hex(f'req{request - 1}', 20)}; "
            f"cc_prompt_id={_hex(f'prompt{request}', 8)}-{_hex(f'p{request}', 4)};"
        )
    return line


CC_IDENTITY = "You are Claude Code, Anthropic's official CLI for Claude."

CC_SYSTEM_PROMPT = """\
You are an interactive CLI tool that helps users with software engineering tasks. \
Use the instructions below and the tools available to you to assist the user.

IMPORTANT: Assist with defensive security tasks only. Refuse to create, modify, or \
improve code that may be used maliciously.

# Tone and style
You should be concise, direct, and to the point. Your output will be displayed on a \
command line interface. Answer the user's question directly, without elaboration, \
explanation, or details, unless they ask for them. One word answers are best. Avoid \
introductions, conclusions, and explanations.

# Following conventions
When making changes to files, first understand the file's code conventions. Mimic \
code style, use existing libraries and utilities, and follow existing patterns. \
NEVER assume that a given library is available, even if it is well known. Always \
follow security best practices. Never introduce code that exposes or logs secrets.

# Doing tasks
- Use the available search tools to understand the codebase and the user's query.
- Implement the solution using all tools available to you.
- Verify the solution with tests. NEVER assume a specific test framework or script.
- When you have completed a task, run the lint and typecheck commands if they exist.
- NEVER commit changes unless the user explicitly asks you to.

Here is useful information about the environment you are running in:
<env>
Working directory: /home/dev/harbour
Is directory a git repo: Yes
Platform: darwin
OS Version: Darwin 24.6.0
Today's date: 2026-12-01
</env>
You are powered by the model named Opus 4.8. The exact model ID is claude-opus-4-8.

gitStatus: This is the git status at the start of the conversation.
Current branch: fix/ledger-midnight
Main branch (you will usually use this for PRs): main
Status:
M harbour/ledger.py
Recent commits:
3f2c1ab ledger: count arrivals by hour
9d81e07 report: night totals from the ledger
"""


def _tool(name: str, description: str, props: dict[str, Any], required: list[str]) -> Any:
    return {
        "name": name,
        "description": description,
        "input_schema": {
            "type": "object",
            "properties": props,
            "required": required,
            "additionalProperties": False,
        },
    }


_S = {"type": "string"}
CC_TOOLS: list[dict[str, Any]] = [
    _tool(
        "Bash",
        "Executes a given bash command in a persistent shell session with optional "
        "timeout. Avoid cat, head, tail, sed, awk or echo: use the dedicated tools.",
        {
            "command": _S,
            "timeout": {"type": "number", "description": "Timeout in milliseconds"},
            "description": {**_S, "description": "What this command does, in 5-10 words"},
        },
        ["command"],
    ),
    _tool(
        "Glob",
        'Fast file pattern matching: "**/*.py". Returns matching paths by modification time.',
        {"pattern": _S, "path": _S},
        ["pattern"],
    ),
    _tool(
        "Grep",
        "A search tool built on ripgrep. Supports full regex syntax.",
        {
            "pattern": _S,
            "path": _S,
            "output_mode": {"type": "string", "enum": ["content", "files_with_matches"]},
            "-n": {"type": "boolean"},
        },
        ["pattern"],
    ),
    _tool(
        "Read",
        "Reads a file from the local filesystem. The file_path must be absolute.",
        {
            "file_path": _S,
            "offset": {"type": "number"},
            "limit": {"type": "number"},
        },
        ["file_path"],
    ),
    _tool(
        "Edit",
        "Performs exact string replacements in files. Read the file first.",
        {
            "file_path": _S,
            "old_string": _S,
            "new_string": _S,
            "replace_all": {"type": "boolean"},
        },
        ["file_path", "old_string", "new_string"],
    ),
    _tool(
        "Write",
        "Writes a file to the local filesystem, overwriting it.",
        {"file_path": _S, "content": _S},
        ["file_path", "content"],
    ),
    _tool(
        "TodoWrite",
        "Create and manage a structured task list for the current session.",
        {
            "todos": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "content": _S,
                        "status": {"enum": ["pending", "in_progress", "completed"]},
                    },
                    "required": ["content", "status"],
                },
            }
        },
        ["todos"],
    ),
]
# The last tool carries a breakpoint, as Claude Code marks it.
CC_TOOLS[-1]["cache_control"] = {"type": "ephemeral"}

_REMINDER_CONTEXT = (
    "<system-reminder>\nAs you answer the user's questions, you can use the following "
    "context:\n# claudeMd\nCodebase and user instructions are shown below.\n\n"
    "Contents of /home/dev/harbour/CLAUDE.md:\n- Run tests with `uv run pytest -q`.\n"
    "- Hours are 0-23; 0 is midnight.\n# currentDate\nToday's date is 2026-12-01.\n\n"
    "      IMPORTANT: this context may or may not be relevant to your tasks.\n"
    "</system-reminder>\n"
)
_REMINDER_TODO = (
    "<system-reminder>\nThe TodoWrite tool hasn't been used recently. If you're working on "
    "tasks that would benefit from tracking progress, consider using it.\n</system-reminder>"
)
CC_TASK = "The ledger test fails since the last merge. Find the wrong line and fix it."
# (tool, input, result) of the tool rounds, cycled.
CC_ROUNDS: list[tuple[str, dict[str, Any], str]] = [
    (
        "Grep",
        {"pattern": "def count", "path": "harbour", "output_mode": "content", "-n": True},
        "harbour/ledger.py:41:    def count(self) -> int:\n"
        "harbour/report.py:12:def count_night(l):",
    ),
    (
        "Read",
        {"file_path": "/home/dev/harbour/harbour/ledger.py", "offset": 38, "limit": 6},
        "    38\t\n    39\t\n    40\tclass Ledger:\n    41\t    def count(self) -> int:\n"
        "    42\t        return sum(1 for s in self.ships if 0 < s.hour < 24)\n    43\t",
    ),
    (
        "Bash",
        {"command": "uv run pytest -q tests/test_ledger.py", "description": "Run ledger tests"},
        "F...........\nFAILED tests/test_ledger.py::test_ships_counted - assert 2 == 3\n"
        "1 failed, 11 passed in 0.41s",
    ),
    (
        "Edit",
        {
            "file_path": "/home/dev/harbour/harbour/ledger.py",
            "old_string": "0 < s.hour < 24",
            "new_string": "0 <= s.hour < 24",
        },
        "The file /home/dev/harbour/harbour/ledger.py has been updated.",
    ),
]
CC_MID_SYSTEM = (
    "The user switched to plan mode: describe the change you would make and ask before "
    "editing any file."
)
CC_FOLLOW_UP = "Does the night report use the same filter?"


def _text(text: str, **extra: Any) -> dict[str, Any]:
    return {"type": "text", "text": text, **extra}


class ClaudeCodeSession:
    """One Claude Code conversation, request by request.

    ``request()`` is the body of the next request; ``record(content)`` appends
    the assistant message as the server returned it (its content blocks), and
    the next step adds what Claude Code adds: step 1 is the user's task, then
    tool rounds (the assistant's text followed by the ``tool_use`` block of
    round n, answered by its ``tool_result`` with a reminder), a
    mid-conversation ``system`` message at ``system_at`` and a new user
    question at ``follow_up_at`` (0: never). ``prev_req`` switches the billing
    header to the variant with ``cc_prev_req`` from request 2 on.

    ``thinking``: Claude Code's ``thinking`` field. The sessions here send
    ``{"type": "disabled"}`` by default: a Qwen-style template drops every
    earlier think block once a newer user-side message follows (a
    mid-conversation reminder is one), a documented cost of the template,
    not of the cache these sessions measure. ``temperature``: none by
    default, as Claude Code sends (the anthropic SDK 2.x has no sampling
    parameters left).
    """

    def __init__(
        self,
        *,
        model: str = "claude-opus-4-8",
        max_tokens: int = 16,
        prev_req: bool = False,
        system_at: int = 3,
        follow_up_at: int = 5,
        thinking: Mapping[str, Any] | None = None,
        temperature: float | None = None,
    ) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self.prev_req = prev_req
        self.system_at = system_at
        self.follow_up_at = follow_up_at
        self.thinking = dict(thinking) if thinking is not None else {"type": "disabled"}
        self.temperature = temperature
        self.messages: list[dict[str, Any]] = [
            {
                "role": "user",
                "content": [
                    _text(_REMINDER_CONTEXT),
                    _text(CC_TASK, cache_control={"type": "ephemeral"}),
                ],
            }
        ]
        self.requests = 0
        self._pending: list[dict[str, Any]] | None = None

    def system(self) -> list[dict[str, Any]]:
        return [
            _text(billing_header(self.requests + 1, prev_req=self.prev_req)),
            _text(CC_IDENTITY, cache_control={"type": "ephemeral"}),
            _text(CC_SYSTEM_PROMPT, cache_control={"type": "ephemeral", "ttl": "1h"}),
        ]

    def request(self) -> dict[str, Any]:
        """The next request's body (``stream: true``, as Claude Code sends it)."""
        if self._pending is not None:
            raise RuntimeError("record() the previous reply first")
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "system": self.system(),
            "messages": copy.deepcopy(self.messages),
            "tools": copy.deepcopy(CC_TOOLS),
            "metadata": {"user_id": USER_ID},
            "thinking": dict(self.thinking),
            "stream": True,
        }
        if self.temperature is not None:
            body["temperature"] = self.temperature
        self.requests += 1
        self._pending = []
        return body

    def record(self, content: Iterable[Mapping[str, Any]]) -> None:
        """Append the reply (its content blocks, as returned) and what Claude
        Code sends after it on the next request."""
        if self._pending is None:
            raise RuntimeError("no request is waiting for its reply")
        self._pending = None
        blocks = [_resent_block(b) for b in content]
        step = self.requests + 1  # the request these messages go out with
        if step == self.follow_up_at:
            self.messages.append({"role": "assistant", "content": blocks or [_text(".")]})
            self.messages.append({"role": "user", "content": [_text(CC_FOLLOW_UP)]})
            return
        name, args, result = CC_ROUNDS[(step - 2) % len(CC_ROUNDS)]
        use_id = f"toolu_01{_hex(f'use{step}', 22)}"
        blocks.append({"type": "tool_use", "id": use_id, "name": name, "input": args})
        self.messages.append({"role": "assistant", "content": blocks})
        user: list[dict[str, Any]] = [
            {"type": "tool_result", "tool_use_id": use_id, "content": result}
        ]
        if step % 2 == 0:
            user.append(_text(_REMINDER_TODO))
        self.messages.append({"role": "user", "content": user})
        if step == self.system_at:
            self.messages.append({"role": "system", "content": CC_MID_SYSTEM})


def _resent_block(block: Mapping[str, Any]) -> dict[str, Any]:
    """A returned content block as Claude Code sends it back: the block's own
    fields, without the response-only ones (citations: None ...)."""
    kind = block.get("type")
    if kind == "text":
        return _text(str(block.get("text", "")))
    if kind == "thinking":
        return {"type": "thinking", "thinking": block["thinking"], "signature": block["signature"]}
    if kind == "tool_use":
        return {
            "type": "tool_use",
            "id": block["id"],
            "name": block["name"],
            "input": block["input"],
        }
    return {k: v for k, v in block.items() if v is not None}


# --- Codex --------------------------------------------------------------------

# tools/handlers/tool_apply_patch.lark, verbatim (its comment line left out).
APPLY_PATCH_GRAMMAR = r"""start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
"""


def lark_compatible(grammar: str) -> str:
    """``grammar`` for the ``lark`` package, which refuses zero-width
    terminals (llguidance's Lark accepts them): ``/(.*)/`` becomes the same
    language as an optional ``/(.+)/``."""
    return grammar.replace("/(.*)/", "/(.+)/?")


# Codex's base prompt in its own words (shortened), kept as data beside
# this module.
CODEX_INSTRUCTIONS = (Path(__file__).parent / "recorded" / "codex-instructions.txt").read_text(
    "utf-8"
)

_APPLY_PATCH_DESCRIPTION = (
    "Use the `apply_patch` tool to edit files. This is a FREEFORM tool, so do not wrap "
    "the patch in JSON."
)


def _fn(name: str, description: str, props: dict[str, Any], required: list[str]) -> Any:
    return {
        "type": "function",
        "name": name,
        "description": description,
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": props,
            "required": required,
            "additionalProperties": False,
        },
    }


CODEX_TOOLS: list[dict[str, Any]] = [
    _fn(
        "exec_command",
        "Runs a command in a PTY, returning output or a session ID for ongoing interaction.",
        {
            "cmd": {"type": "string", "description": "Shell command to execute."},
            "workdir": {"type": "string", "description": "Defaults to the turn cwd."},
            "yield_time_ms": {"type": "number"},
            "sandbox_permissions": {"type": "string"},
        },
        ["cmd"],
    ),
    _fn(
        "write_stdin",
        "Writes characters to an existing unified exec session and returns recent output.",
        {
            "session_id": {"type": "number"},
            "chars": {"type": "string", "description": "May be empty to poll."},
        },
        ["session_id"],
    ),
    _fn(
        "update_plan",
        "Updates the task plan. Provide an optional explanation and a list of steps, each "
        "with a status. At most one step can be in_progress at a time.",
        {
            "explanation": {"type": "string"},
            "plan": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "step": {"type": "string"},
                        "status": {"type": "string"},
                    },
                    "required": ["step", "status"],
                    "additionalProperties": False,
                },
            },
        },
        ["plan"],
    ),
    {
        "type": "custom",
        "name": "apply_patch",
        "description": _APPLY_PATCH_DESCRIPTION,
        "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_GRAMMAR},
    },
    _fn(
        "view_image",
        "Attach a local image (by filesystem path) to the conversation context for this turn.",
        {"path": {"type": "string"}},
        ["path"],
    ),
    {"type": "web_search"},
]

CODEX_DEVELOPER = (
    "<permissions instructions>\nFilesystem sandboxing: workspace-write. Network access is "
    "restricted. Approval policy: on-request. Commands that need to write outside the "
    "workspace must be run with sandbox_permissions set to require_escalated.\n"
    "</permissions instructions>"
)
CODEX_ENVIRONMENT = (
    "<environment_context>\n  <cwd>/home/dev/harbour</cwd>\n  <approval_policy>on-request"
    "</approval_policy>\n  <sandbox_mode>workspace-write</sandbox_mode>\n  <network_access>"
    "restricted</network_access>\n  <shell>zsh</shell>\n</environment_context>"
)
CODEX_AGENTS_MD = (
    "# AGENTS.md instructions for /home/dev/harbour\n\n<INSTRUCTIONS>\n- Python 3.12, "
    "uv for everything: `uv run pytest -q`.\n- Hours are 0-23; 0 is midnight.\n"
    "</INSTRUCTIONS>"
)
CODEX_TASK = "tests/test_ledger.py fails since the last merge. Find the wrong line and fix it."
# A recorded first step: the call and its output as Codex re-sends them.
CODEX_RECORDED: list[dict[str, Any]] = [
    {
        "type": "function_call",
        "name": "exec_command",
        "arguments": json.dumps(
            {"cmd": "rg -n 'def count' harbour", "workdir": "/home/dev/harbour"}
        ),
        "call_id": "call_7Qm2xYpV0aLrT1bN",
    },
    {
        "type": "function_call_output",
        "call_id": "call_7Qm2xYpV0aLrT1bN",
        "output": (
            "Chunk ID: 3f9a1c\nWall time: 0.0312 seconds\nProcess exited with code 0\n"
            "Output:\nharbour/ledger.py:41:    def count(self) -> int:\n"
            "harbour/ledger.py:42:        return sum(1 for s in self.ships if 0 < s.hour < 24)\n"
        ),
    },
]
CODEX_PATCH_OUTPUT = json.dumps(
    {"output": "Success. Updated the following files:\nM harbour/ledger.py\n",
     "metadata": {"exit_code": 0, "duration_seconds": 0.0}}
)  # fmt: skip
CODEX_EXEC_OUTPUT = (
    "Chunk ID: 81d0e2\nWall time: 0.4104 seconds\nProcess exited with code 0\nOutput:\n"
    "............\n12 passed in 0.40s\n"
)

# The output item fields Codex keeps when it re-sends an item (its
# ResponseItem serialization: ids and statuses are not sent with store false).
_RESENT_FIELDS = {
    "message": ("type", "role", "content"),
    "reasoning": ("type", "summary", "content", "encrypted_content"),
    "function_call": ("type", "name", "arguments", "call_id"),
    "custom_tool_call": ("type", "name", "input", "call_id"),
}


def resent_item(item: Mapping[str, Any]) -> dict[str, Any] | None:
    """An output item as Codex puts it in the next request's ``input``
    (None: a kind Codex does not re-send)."""
    fields = _RESENT_FIELDS.get(str(item.get("type")))
    if fields is None:
        return None
    out = {k: copy.deepcopy(item[k]) for k in fields if item.get(k) is not None}
    if out["type"] == "message":
        out["content"] = [
            {"type": c["type"], "text": c.get("text", "")}
            for c in out.get("content", [])
            if c.get("type") in ("output_text", "refusal")
        ]
    if out["type"] == "reasoning":
        out.setdefault("summary", [])
    return out


class CodexSession:
    """One Codex conversation on ``/v1/responses``, request by request.

    ``request(tool_choice=...)`` is the next body; ``record(output)`` appends
    the response's output items as Codex re-sends them, and, for each call
    among them, its output (``function_call_output`` / ``custom_tool_call_output``).
    A reply with no call ends Codex's turn; the next request then carries
    the user's next message (``follow_ups``, cycled).

    ``effort``: Codex's ``model_reasoning_effort``. The sessions here use
    ``minimal`` by default (the reasoning item stays in the request, the
    model does not think): with a Qwen-style template a new user message
    drops every earlier think block, which is that template's cost, not the
    cache's.
    """

    FOLLOW_UPS = (
        "Now fix it with apply_patch.",
        "Run the ledger tests again.",
        "Does the night report use the same filter?",
    )

    def __init__(
        self,
        *,
        model: str = "gpt-5-codex",
        effort: str = "minimal",
        max_output_tokens: int | None = None,
        temperature: float | None = 0,
    ) -> None:
        self.model = model
        self.effort = effort
        self.max_output_tokens = max_output_tokens
        self.temperature = temperature
        self.input: list[dict[str, Any]] = [
            _message("developer", "input_text", CODEX_DEVELOPER),
            _message("user", "input_text", CODEX_AGENTS_MD),
            _message("user", "input_text", CODEX_ENVIRONMENT),
            _message("user", "input_text", CODEX_TASK),
            *copy.deepcopy(CODEX_RECORDED),
        ]
        self.requests = 0
        self._follow_ups = 0

    def request(
        self, tool_choice: Any = "auto", max_output_tokens: int | None = None
    ) -> dict[str, Any]:
        """The next request's body (``stream: true``, as Codex sends it);
        ``tool_choice`` other than ``"auto"`` is the caller's, not Codex's;
        ``max_output_tokens`` overrides the session's for this request."""
        body: dict[str, Any] = {
            "model": self.model,
            "instructions": CODEX_INSTRUCTIONS,
            "input": copy.deepcopy(self.input),
            "tools": copy.deepcopy(CODEX_TOOLS),
            "tool_choice": tool_choice,
            "parallel_tool_calls": False,
            "reasoning": {"effort": self.effort, "summary": "auto"},
            "store": False,
            "stream": True,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": SESSION_UUID,
        }
        limit = max_output_tokens if max_output_tokens is not None else self.max_output_tokens
        if limit is not None:
            body["max_output_tokens"] = limit
        if self.temperature is not None:
            body["temperature"] = self.temperature
        self.requests += 1
        return body

    def record(self, output: Iterable[Mapping[str, Any]]) -> None:
        called = False
        for item in output:
            resent = resent_item(item)
            if resent is None:
                continue
            self.input.append(resent)
            if resent["type"] == "function_call":
                called = True
                self.input.append(
                    {"type": "function_call_output", "call_id": resent["call_id"],
                     "output": CODEX_EXEC_OUTPUT}
                )  # fmt: skip
            elif resent["type"] == "custom_tool_call":
                called = True
                self.input.append(
                    {"type": "custom_tool_call_output", "call_id": resent["call_id"],
                     "output": CODEX_PATCH_OUTPUT}
                )  # fmt: skip
        if not called:
            text = self.FOLLOW_UPS[self._follow_ups % len(self.FOLLOW_UPS)]
            self._follow_ups += 1
            self.input.append(_message("user", "input_text", text))


def _message(role: str, kind: str, text: str) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


# --- the same conversations as chat completions (for mlx_lm.server) -----------


def _tool_function(tool: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": tool["name"],
            "description": tool.get("description", ""),
            "parameters": tool.get("input_schema") or tool.get("parameters") or {"type": "object"},
        },
    }


def _joined(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(str(b.get("text", "")) for b in content if b.get("type") == "text")


def anthropic_to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Claude Code request as a chat-completions body, as a proxy in front
    of an OpenAI-compatible server (claude-code-router, LiteLLM) sends it:
    the system blocks joined into one system message, ``tool_use`` as
    ``tool_calls``, each ``tool_result`` as a ``tool`` message, text and
    reminders as user messages, a mid-conversation system message as is."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": _joined(body["system"])}]
    for m in body["messages"]:
        content = m["content"]
        if m["role"] == "assistant":
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
            calls = [
                {"id": b["id"], "type": "function",
                 "function": {"name": b["name"], "arguments": json.dumps(b["input"])}}
                for b in blocks
                if b["type"] == "tool_use"
            ]  # fmt: skip
            msg: dict[str, Any] = {"role": "assistant", "content": _joined(blocks)}
            if calls:
                msg["tool_calls"] = calls
            messages.append(msg)
        elif m["role"] == "user" and not isinstance(content, str):
            texts = []
            for b in content:
                if b["type"] == "tool_result":
                    messages.append(
                        {"role": "tool", "tool_call_id": b["tool_use_id"],
                         "content": _joined(b["content"])}
                    )  # fmt: skip
                elif b["type"] == "text":
                    texts.append(b["text"])
            if texts:
                messages.append({"role": "user", "content": "".join(texts)})
        else:
            messages.append({"role": m["role"], "content": _joined(content)})
    return {"messages": messages, "tools": [_tool_function(t) for t in body["tools"]]}


def responses_to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Codex request as a chat-completions body, as Codex's own
    ``wire_api = "chat"`` providers send it: instructions as the system
    message, a developer message as a system message, function calls as
    ``tool_calls``, the freeform ``apply_patch`` as a function with one
    ``input`` string, and the hosted tools left out."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": body["instructions"]}]
    for item in body["input"]:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _joined_items(item["content"])})
        elif kind in ("function_call", "custom_tool_call"):
            arguments = (
                item["arguments"]
                if kind == "function_call"
                else json.dumps({"input": item["input"]})
            )
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": arguments}}  # fmt: skip
            if messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": str(item["output"])}
            )
    tools = []
    for t in body["tools"]:
        if t["type"] == "function":
            tools.append(_tool_function(t))
        elif t["type"] == "custom":
            tools.append(
                _tool_function(
                    {"name": t["name"], "description": t.get("description", ""),
                     "parameters": {"type": "object", "properties": {"input": {"type": "string"}},
                                    "required": ["input"]}}
                )
            )  # fmt: skip
    return {"messages": messages, "tools": tools}


def _joined_items(content: Iterable[Mapping[str, Any]]) -> str:
    return "".join(str(c.get("text", "")) for c in content)


def sse_events(lines: Iterable[str]) -> Iterable[dict[str, Any]]:
    """The JSON ``data:`` payloads of an SSE body, in order."""
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                yield json.loads(data)
