"""A ``Translator`` that names each event, for tests that watch how a
``ChatStream`` groups events into writes."""

from __future__ import annotations

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
