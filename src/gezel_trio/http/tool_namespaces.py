"""Responses ``namespace`` tools: a group of function and custom tools under
one name, as Codex sends its MCP servers' tools (``{"type": "namespace",
"name": "mcp__docs__", "description": ..., "tools": [...]}``).

A chat template knows no groups, so each tool inside is shown to the model
under one flat name (``flat_name``), and the model's call of it is reported
back as the client wrote the tool: ``name`` the inner tool's, ``namespace``
the group's (the ``function_call`` / ``custom_tool_call`` item fields Codex
routes by). The flat name depends on the two names only, never on the rest
of the request, so a re-sent call renders as it was generated and the prompt
cache keeps serving it.
"""

from __future__ import annotations

from typing import Final

__all__ = ["DEFAULT_NAMESPACE", "flat_name"]

# Codex's namespace for its top-level tools: a tool in it is shown under its
# own name (Codex routes a call with it or without it alike).
DEFAULT_NAMESPACE: Final = "functions"

# Joins a namespace that does not end in a separator to its tool's name.
_JOIN: Final = "__"


def flat_name(namespace: str | None, name: str) -> str:
    """The name the model sees for ``name`` in ``namespace``.

    A namespace that ends in ``_`` or ``-`` is a prefix as it stands: Codex's
    MCP namespaces (``mcp__docs__``) then give the ``mcp__docs__search``
    names its earlier releases sent and models have seen. Any other one is
    joined with ``__``."""
    if not namespace or namespace == DEFAULT_NAMESPACE:
        return name
    if namespace.endswith(("_", "-")):
        return namespace + name
    return namespace + _JOIN + name
