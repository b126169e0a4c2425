"""One request's text and usage, read from an engine's handle."""

from __future__ import annotations

from typing import Any

from gezel_trio import Delta, Failed, Finished, GenerationRequest, Usage


async def text_and_usage(engine: Any, request: GenerationRequest) -> tuple[str, Usage]:
    """Submit ``request``; its text, and the usage its ``Finished`` carries.
    A ``Failed`` (or no terminal event) fails the test."""
    parts: list[str] = []
    with engine.submit_nowait(request) as h:
        async for _, event in h:
            if isinstance(event, Delta):
                parts.append(event.text)
            if isinstance(event, Failed):
                raise AssertionError(event.error)
            if isinstance(event, Finished):
                return "".join(parts), event.usage
    raise AssertionError("no terminal event")
