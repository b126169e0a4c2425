"""Engine-to-request events: what arrives on a request's channel.

A request's channel carries liveness notes (``Queued``, ``Parked``,
``Resumed``, prefill ``Progress``), ``Delta`` values, and then exactly one
``Finished`` or ``Failed``, after which the engine closes it.
Consumers ``match`` on these classes.
"""

from __future__ import annotations

from typing import Literal

import attrs

from .errors import GezelError

__all__ = ["Delta", "Event", "Failed", "FinishReason", "Finished", "Progress", "Usage"]

FinishReason = Literal["stop", "length"]


@attrs.frozen
class Queued:
    """Waiting for a slot: ``position`` requests are ahead (0: next)."""

    position: int


@attrs.frozen
class Parked:
    """This background request's wave stopped stepping for interactive work;
    its state is kept and it resumes exactly where it stopped."""


@attrs.frozen
class Resumed:
    """The parked wave is stepping again."""


@attrs.frozen
class Progress:
    """Prompt processing advanced: ``done`` of ``total`` prompt tokens."""

    done: int
    total: int


@attrs.frozen
class TokenLogprob:
    """A generated token's text and logprob, and the ``top`` alternatives."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@attrs.frozen
class Usage:
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    prompt_tps: float
    generation_tps: float
    # Prompt tokens this request wrote into pinned cache entries (Anthropic's
    # ``cache_creation``), by how long the pin holds them.
    pinned_5m_tokens: int = 0
    pinned_1h_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@attrs.frozen
class Delta:
    """Newly generated text, the token ids behind it, and the usage so far.
    ``text`` may be empty while a possible stop string is held back."""

    text: str
    tokens: tuple[int, ...]
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] = ()


@attrs.frozen
class Finished:
    """The sequence ended: ``reason`` ``stop`` (end of sequence or a stop
    string: ``stop_sequence`` names the string) or ``length``."""

    reason: FinishReason
    usage: Usage
    stop_sequence: str | None = None


@attrs.frozen
class Failed:
    error: GezelError


Event = Queued | Parked | Resumed | Progress | Delta | Finished | Failed
