"""Engine-to-request events: what arrives on a request's channel.

A request's channel carries liveness notes (``Queued``, ``Parked``,
``Resumed``, prefill ``Progress``), ``Started`` once it is admitted,
``Delta`` values, and then exactly one ``Finished`` or ``Failed``, after
which the engine closes it.
Consumers ``match`` on these classes.
"""

from __future__ import annotations

from typing import Literal

import attrs

from .errors import GezelError

__all__ = [
    "CacheMiss",
    "CacheMissReason",
    "Delta",
    "Event",
    "Failed",
    "FinishReason",
    "Finished",
    "Progress",
    "Started",
    "Usage",
]

FinishReason = Literal["stop", "length"]

CacheMissReason = Literal["cold", "diverged", "checkpoint", "evicted"]
"""Why a prompt reused less than it might have (docs/protocols.md, "Cache misses"):

* ``cold``: nothing in the cache shares even the prompt's first token;
* ``diverged``: a cached sequence holds the prompt's first ``token`` tokens
  and then goes on differently - the prompt changed inside what was cached;
* ``checkpoint``: the cache holds the prompt further than it could be reused:
  a model whose cache cannot rewind restarts only from a saved state, and the
  deepest one lies at ``reused``, before ``token``;
* ``evicted``: an entry dropped for the memory budget had held more of this
  prompt than what is left.
"""


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
class CacheMiss:
    """Where a prompt left the longest prefix the prompt cache held.

    ``token`` is the index of the first prompt token the cache did not hold
    (what it held continued differently, or ended), ``reused`` how many were
    served from it. ``message`` and ``role`` name the rendered message that
    token falls in (counting the system message; ``None`` where the renderer
    did not say). ``common`` is the decoded text of a few tokens before
    ``token``; ``cached`` and ``prompt`` what follows it on each side (a few
    dozen tokens at most; empty where a side has nothing there)."""

    reason: CacheMissReason
    token: int
    reused: int
    message: int | None = None
    role: str | None = None
    common: str = ""
    cached: str = ""
    prompt: str = ""


@attrs.frozen
class Usage:
    """Token counts and rates of one sequence. ``cache_miss`` says where the
    prompt left the cache, ``None`` when it reused all the cache held for it."""

    input_tokens: int
    output_tokens: int
    cached_tokens: int
    prompt_tps: float
    generation_tps: float
    cache_miss: CacheMiss | None = None
    # Prompt tokens this request wrote into pinned cache entries (Anthropic's
    # ``cache_creation``), by how long the pin holds them.
    pinned_5m_tokens: int = 0
    pinned_1h_tokens: int = 0
    # Speculative decoding: tokens proposed for this sequence, and those the
    # model accepted (each accepted one is also an output token).
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@attrs.frozen
class Started:
    """Admitted into the batch: ``usage`` is the prompt's as known then -
    how much of it the prompt cache serves and what it writes into pins -
    with no output yet. Not a liveness note: a busy reader still gets it."""

    usage: Usage


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


Event = Queued | Parked | Resumed | Progress | Started | Delta | Finished | Failed
