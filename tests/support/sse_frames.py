"""A ``Translator`` that names each event, for tests that watch how a
``ChatStream`` groups events into writes; and ``carries_text``, for tests
that wait on a real stream for its first generated text."""

from __future__ import annotations

import json
from typing import Any

from gezel_trio.core.errors import GezelError


class NamedFrames:
    """One SSE frame per event, named by the event's type."""

    def opening(self) -> list[bytes]:
        return [b"data: open\n\n"]

    def render(self, event: Any, chat: Any) -> list[bytes]:
        return [f"data: {type(event).__name__}\n\n".encode()]

    def failure(self, err: GezelError) -> list[bytes]:
        return [b"data: failed\n\n"]


def event_names(write: bytes) -> list[str]:
    """The names of the events one write carries, in order."""
    return [f.removeprefix("data: ") for f in write.decode().split("\n\n") if f]


def carries_text(line: str) -> bool:
    """Whether a chat-completions SSE line carries generated text. The
    stream's opening chunk (``"content": ""``) does not: it goes out when
    the request is submitted, before the engine admits it, so a test that
    stops reading there to act "while the request decodes" may act while
    it is still queued."""
    if not line.startswith("data: {"):
        return False
    choices = json.loads(line[6:])["choices"]
    return bool(choices and choices[0].get("delta", {}).get("content"))
