"""What the splitter emits: content, and each call's start, argument text and end."""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import Any, TypeAlias

import attrs

__all__ = [
    "CallArgs",
    "CallEnd",
    "CallStart",
    "Content",
    "ToolEvent",
    "collect",
    "new_call_id",
]


@attrs.frozen
class Content:
    """Text outside any tool call."""

    text: str


@attrs.frozen
class CallStart:
    """A tool call began: its position among this output's calls, its id and name."""

    index: int
    id: str
    name: str


@attrs.frozen
class CallArgs:
    """The next piece of call ``index``'s arguments JSON text."""

    index: int
    fragment: str


@attrs.frozen
class CallEnd:
    """Call ``index`` is complete. ``malformed``: its markup broke after it had
    started, and the arguments sent may not parse."""

    index: int
    malformed: bool = False


ToolEvent: TypeAlias = Content | CallStart | CallArgs | CallEnd


def new_call_id() -> str:
    """A fresh id in OpenAI's shape: ``call_`` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


def collect(events: Iterable[ToolEvent]) -> tuple[str, list[dict[str, Any]]]:
    """The content and the OpenAI ``tool_calls`` list that ``events`` add up to,
    for a non-streaming response. Malformed calls are kept, so a streaming and a
    non-streaming client see the same calls."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    args: dict[int, list[str]] = {}
    for event in events:
        match event:
            case Content(text=text):
                content.append(text)
            case CallStart(index=index, id=call_id, name=name):
                calls[index] = {"id": call_id, "type": "function", "function": {"name": name}}
                args[index] = []
            case CallArgs(index=index, fragment=fragment):
                args[index].append(fragment)
            case CallEnd():
                pass
    for index, call in calls.items():
        call["function"]["arguments"] = "".join(args[index])
    return "".join(content), [calls[k] for k in sorted(calls)]
