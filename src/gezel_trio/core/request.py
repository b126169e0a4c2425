"""What a caller asks the engine for, as frozen values.

These are the engine-level request types shared by the HTTP layer, the
embedding API and the backends. They carry token ids, not chat messages:
rendering a conversation into tokens is ``prompt``'s job.
"""

from __future__ import annotations

from typing import Literal

import attrs

from .constraint import Constraint
from .images import VisionPrompt

__all__ = [
    "CacheRequest",
    "GenerationRequest",
    "MessagePin",
    "Pin",
    "Priority",
    "RenderedPrompt",
    "SamplingParams",
]

Priority = Literal["interactive", "background"]


@attrs.frozen
class RenderedPrompt:
    """Prompt tokens, and where the shared band ends in them (the first
    ``band_chars`` characters of the system message), when asked for.
    ``boundaries`` are token indices where a message ends and every later
    turn of the same conversation shares the tokens before it (the end of
    the system turn, the end of the history), for renderers asked to find
    them: models whose caches cannot rewind keep checkpoints there."""

    tokens: tuple[int, ...]
    band_end: int | None = None
    boundaries: tuple[int, ...] = ()
    # The rendered text: a vision model's processor tokenizes it again,
    # expanding each image marker (``core.images``).
    text: str = ""
    # Where each rendered message starts (a token index; the markup before a
    # message's content counts as its own) and its role, so a cache miss can
    # name the message it falls in. Empty where the renderer did not say.
    message_starts: tuple[int, ...] = ()
    message_roles: tuple[str, ...] = ()
    # Where each pinned message asked for (``render(pins=...)``) ends, as a
    # token index, in the order asked; ``None`` where it could not be found.
    pin_ends: tuple[int | None, ...] = ()


@attrs.frozen
class MessagePin:
    """Keep the prompt through the end of message ``message`` (an index into
    the chat messages) cached for ``seconds`` (Anthropic's ``cache_control``
    with its ``ttl``)."""

    message: int
    seconds: float


@attrs.frozen
class Pin:
    """Keep the prompt's first ``end`` tokens cached for ``seconds`` from
    now: a named entry that eviction skips until then; a later request
    with the same prefix refreshes it."""

    end: int
    seconds: float


@attrs.frozen
class SamplingParams:
    """How the next token is chosen. ``temperature`` or ``top_p`` 0 (or
    below 1e-5) is greedy: the most likely token.

    ``seed`` gives the sequence its own random stream, so the same seed
    yields the same text whatever else shares the batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class CacheRequest:
    """How a request uses the prompt cache.

    ``cache_id`` names the session entry to reuse and save; ``prefix_ids``
    (most specific first) are shared entries to fall back on and to seed.
    Without any of this a request still reuses the longest cached prefix of
    any entry. ``band_end`` is the token index where the shared band
    (``stable_prefix_chars``) ends; ``boundaries`` are token indices where a
    message ends (``RenderedPrompt.boundaries``): on models whose caches
    cannot rewind, checkpoints are kept there. ``snapshot_at`` overrides the
    session's snapshot cut (cache warming); ``persist`` writes the saved
    entry to disk at once; ``roster`` fingerprints the tool list the prompt
    was rendered with; ``pins`` keep prefixes for a while (``Pin``).
    Sequences with the same ``prefill_group`` continue
    the same prompt (``n > 1``): the first admitted computes it, the others
    wait for its state at ``len(prompt) - 1`` and seed from it.
    ``message_starts`` and ``message_roles`` are the rendered messages'
    (``RenderedPrompt``), for naming where a cache miss falls. ``salt``
    partitions the content-addressed cache (vLLM's ``cache_salt``): a
    prompt reuses only what prompts of the same salt left, so a tenant's
    ``cached_tokens`` says nothing of another's prompts.
    """

    cache_id: str | None = None
    prefix_ids: tuple[str, ...] = ()
    band_end: int | None = None
    boundaries: tuple[int, ...] = ()
    snapshot_at: int | None = None
    persist: bool = False
    roster: str = ""
    prefill_group: int | None = None
    message_starts: tuple[int, ...] = ()
    message_roles: tuple[str, ...] = ()
    pins: tuple[Pin, ...] = ()
    salt: str = ""


@attrs.frozen
class GenerationRequest:
    """One sequence to generate.

    ``max_tokens`` is already bounded by the context window
    (``core.prepare.check_request`` checks it, once). ``stop`` strings end the
    turn and are not emitted. ``ignore_eos`` and ``min_tokens`` make
    fixed-length generations for benchmarking, as vLLM offers.
    """

    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: Priority = "interactive"
    cache: CacheRequest | None = None
    # Constrained decoding (a grammar), compiled by ``Engine.compile_constraint``.
    constraint: Constraint | None = None
    # Force the end of thinking after this many thinking tokens.
    max_thinking_tokens: int | None = None
    # Report each token's logprob and this many alternatives; None: off.
    top_logprobs: int | None = None
    # False: this sequence is never speculated (``mlx.speculation``).
    speculate: bool = True
    # The images of a vision model's prompt. ``prompt`` is then the
    # cache key (``core.images``): each image's placeholders carry its digest.
    vision: VisionPrompt | None = None
    # The output continues the prompt's text (a raw prompt, legacy
    # completions): its first space is kept, where a chat answer's is trimmed.
    continues_text: bool = False
