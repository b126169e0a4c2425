"""The contract between the engine's host thread and a model backend.

``MlxBackend`` implements it with mlx-lm's ``BatchGenerator``; the scripted
backend in ``gezel_trio.testing`` implements it without MLX. Every method is
called on the engine's one host thread, never concurrently, so a backend may
keep thread-bound state (MLX streams) without locks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

import attrs

from .request import GenerationRequest

__all__ = [
    "Admission",
    "Backend",
    "Detokenizer",
    "ModelInfo",
    "PrefillOut",
    "PromptRenderer",
    "StepOutput",
    "TokenOut",
]


class Detokenizer(Protocol):
    """mlx-lm's streaming detokenizer interface."""

    def reset(self) -> None: ...
    def add_token(self, token: int) -> None: ...
    def finalize(self) -> None: ...
    @property
    def last_segment(self) -> str: ...


class PromptRenderer(Protocol):
    """Turns a conversation into prompt token ids (pure Python, any thread)."""

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None,
        template_kwargs: dict[str, Any],
        template_override: str | None,
    ) -> list[int]: ...


@attrs.frozen
class ModelInfo:
    model_id: str
    context_length: int
    eos_ids: frozenset[int]
    framing_markers: tuple[str, ...]
    # False when some cache layer cannot rewind (linear attention, rotating KV).
    trimmable: bool
    # Whether sequences may join a batch that is already decoding.
    continuous_batching: bool = True


@attrs.frozen
class Admission:
    rid: int
    request: GenerationRequest


@attrs.frozen
class PrefillOut:
    rid: int
    done: int
    total: int


@attrs.frozen
class TokenOut:
    """One generated token. ``finish`` is set on a sequence's last token; for
    ``"stop"`` that token is the end-of-sequence token itself."""

    rid: int
    token: int
    finish: Literal["stop", "length"] | None


@attrs.frozen
class StepOutput:
    prefill: tuple[PrefillOut, ...] = ()
    tokens: tuple[TokenOut, ...] = ()


class Backend(Protocol):
    @property
    def info(self) -> ModelInfo: ...

    @property
    def renderer(self) -> PromptRenderer: ...

    def detokenizer(self) -> Detokenizer:
        """A fresh streaming detokenizer for one sequence."""
        ...

    def insert(self, admissions: Sequence[Admission]) -> None:
        """Queue sequences into the batch; they prefill on later steps."""
        ...

    def remove(self, rids: Sequence[int]) -> None:
        """Drop sequences wherever they are (waiting, prefilling, decoding)."""
        ...

    def step(self) -> StepOutput:
        """Advance every sequence by one prefill chunk or one token."""
        ...

    def reset(self) -> None:
        """Forget every sequence (after a failed step left the batch unknown)."""
        ...

    def close(self) -> None: ...
