"""The contract between the engine's host thread and a model backend.

``MlxBackend`` implements it with mlx-lm's ``BatchGenerator``; the scripted
backend in ``gezel_trio.testing`` implements it without MLX. Every method is
called on the engine's one host thread, never concurrently, so a backend may
keep thread-bound state (MLX streams) without locks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import attrs

from .errors import EngineFailure
from .figures import BackendFigures, MemoryFigures, RankStep, SpecFigures
from .model import ModelInfo
from .request import GenerationRequest, Priority, RenderedPrompt

__all__ = [
    "Admission",
    "Backend",
    "BackendFigures",
    "Captured",
    "ConstraintCompiler",
    "Detokenizer",
    "ImagePreparer",
    "MemoryFigures",
    "PrefillOut",
    "PromptRenderer",
    "RankStep",
    "SpecFigures",
    "StateBlocks",
    "StateCodec",
    "StateFiles",
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
    """Turns a conversation into prompt token ids, and text into tokens and
    back (pure Python, any thread)."""

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None,
        template_kwargs: dict[str, Any],
        template_override: str | None,
        band_chars: int | None = None,
        pins: Sequence[int] = (),
        replies: Any = None,
    ) -> RenderedPrompt:
        """``pins`` are indices into ``messages``: where each one ends in the
        prompt is ``RenderedPrompt.pin_ends`` (a renderer that cannot tell
        leaves it empty). ``replies`` (a ``shaping.replies.ReplyLedger``):
        the replies this server generated, whose ids a renderer may reuse for
        the turns of ``messages`` that carry them; a renderer may ignore it."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool) -> tuple[int, ...]:
        """Raw text as token ids, no chat template (legacy completions, /tokenize)."""
        ...

    def decode(self, tokens: Sequence[int]) -> str:
        """Token ids (inside the vocabulary) as text."""
        ...


@attrs.frozen
class Admission:
    """A sequence to start: ``segments`` are the prompt tokens still to
    prefill (split where snapshots are wanted), on top of ``seed_state``,
    an opaque cache state holding exactly ``seed_tokens`` (``None``: fresh)."""

    rid: int
    request: GenerationRequest
    segments: tuple[tuple[int, ...], ...]
    seed_state: Any = None
    seed_tokens: tuple[int, ...] = ()


@attrs.frozen
class PrefillOut:
    """Prefill progress: ``done`` of ``total`` tokens still to prefill at
    admission. ``segment_end`` marks the end of an admitted segment, where the
    sequence's state may be captured."""

    rid: int
    done: int
    total: int
    segment_end: bool = False


@attrs.frozen
class TokenOut:
    """One generated token. ``finish`` is set on a sequence's last token; for
    ``"stop"`` that token is the end-of-sequence token itself. A finishing
    token carries the sequence's final cache ``state`` and the ``state_tokens``
    it holds."""

    rid: int
    token: int
    finish: Literal["stop", "length"] | None
    state: Any = None
    state_tokens: tuple[int, ...] = ()
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    # Speculation in this step, on the sequence's first token of the step:
    # the tokens proposed for it and how many the model accepted.
    drafted: int = 0
    accepted: int = 0


@attrs.frozen
class Captured:
    """A sequence's cache state and exactly the tokens it holds."""

    state: Any
    tokens: tuple[int, ...]


@attrs.frozen
class StepOutput:
    """One step's results. ``failed`` names sequences whose own code (a
    sampler, a logits processor) raised during the step: the backend gave
    them a harmless value so the batch could finish the step, and the host
    fails and removes them before the next one."""

    prefill: tuple[PrefillOut, ...] = ()
    tokens: tuple[TokenOut, ...] = ()
    failed: tuple[tuple[int, Exception], ...] = ()


class ImagePreparer(Protocol):
    """A vision model's processor: tokenizes a rendered prompt with each
    image marker expanded to the image's placeholder tokens, and turns the
    decoded images into the model's input features. Runs on a worker thread
    (image resizing and normalising are CPU work); the features are only
    computed with on the host thread."""

    @property
    def image_token(self) -> int:
        """The placeholder token id an image expands to."""
        ...

    def prepare(self, text: str, images: Sequence[Any]) -> tuple[tuple[int, ...], Any]:
        """``(token ids, features)`` for ``text`` and its RGB ``images``."""
        ...


class ConstraintCompiler(Protocol):
    """Compiles a request's grammar (pure Python and llguidance, any thread)."""

    def compile(
        self,
        *,
        response_format: Any,
        tools: Any,
        tool_choice: Any,
        tool_grammar: Any,
        custom_tools: Any = None,
    ) -> Any: ...


class StateBlocks(Protocol):
    """A state holds exactly the tokens it was captured with. Its
    *blockable* layers (plain attention KV, which grows by appending) can be
    cut into token blocks that the prompt cache shares between entries; the
    other layers (linear attention, sliding windows) are its "rest", kept
    whole."""

    def state_offsets(self, state: Any) -> list[int | None]:
        """Each layer's token position, ``None`` for layers that keep none."""
        ...

    def state_blocks(self, state: Any, ranges: Sequence[tuple[int, int]]) -> list[tuple[Any, int]]:
        """Copies of the blockable layers for each token range ``[start, end)``
        of ``state``, with their sizes in bytes; independent of ``state``."""
        ...

    def state_rest(self, state: Any) -> tuple[Any, int]:
        """A copy of the layers that cannot be cut into blocks, and its size;
        ``(None, 0)`` when every layer is blockable (``ModelInfo.trimmable``)."""
        ...

    def join_state(self, blocks: Sequence[Any], length: int, rest: Any) -> Any:
        """A state holding the first ``length`` tokens of consecutive
        ``blocks`` (the last may be cut), with ``rest`` for the other layers
        (which must hold exactly ``length`` tokens). Stored blocks and rest
        are never modified."""
        ...


class StateFiles(Protocol):
    """One state (de)serialized. ``metadata`` names the entry's file
    (``gezel_file``, its name without the suffix): a codec that keeps more
    than the payload (a group's other ranks keep their shards of each
    state) names its own files after it. ``path`` is the temp file to
    write, or the sealed file the payload was read from (``host.persist``)."""

    def dump_state(self, state: Any, metadata: dict[str, str], path: Path) -> None: ...

    def load_state(self, payload: bytes, path: Path) -> tuple[Any, dict[str, str]]: ...

    def forget_state(self, path: Path) -> None:
        """``path``, a file ``dump_state`` wrote, was removed: anything kept
        beside it goes too (``host.persist.DiskCache``)."""
        ...


class StateCodec(StateBlocks, StateFiles, Protocol):
    """A backend's operations on its opaque cache states."""


@runtime_checkable
class FailsFromAfar(Protocol):
    """A backend that can learn, on a thread of its own, that it will never
    step again (a lost rank of an ``mlx.launch`` group) while the host
    thread is blocked in it: ``on_failure`` gives it the engine's way to
    fail every request at once (thread-safe, returns at once)."""

    def on_failure(self, report: Callable[[EngineFailure], None]) -> None: ...


class Backend(Protocol):
    @property
    def info(self) -> ModelInfo: ...

    @property
    def renderer(self) -> PromptRenderer: ...

    @property
    def compiler(self) -> ConstraintCompiler | None:
        """``None`` when this backend cannot constrain decoding."""
        ...

    @property
    def images(self) -> ImagePreparer | None:
        """``None`` unless the model takes images."""
        ...

    def token_text(self, token: int) -> str:
        """One token's text, for logprobs."""
        ...

    def detokenizer(self, keep_leading_space: bool = False) -> Detokenizer:
        """A fresh streaming detokenizer for one sequence. Without
        ``keep_leading_space`` it may trim the text's first space (a chat
        answer); with it, the text is exactly what the tokens decode to
        after the prompt (a raw prompt's continuation)."""
        ...

    def insert(self, admissions: Sequence[Admission]) -> dict[int, Exception]:
        """Queue sequences into the batch; they prefill on later steps.
        Returns the admissions refused (for example a grammar this model's
        tokenizer cannot serve), which were not inserted."""
        ...

    def remove(self, rids: Sequence[int]) -> dict[int, Captured]:
        """Drop sequences wherever they are (waiting, prefilling, decoding);
        returns each one's state at that moment, for cancellation saves."""
        ...

    def capture(self, rid: int) -> Captured | None:
        """The sequence's current state, copied (valid between steps)."""
        ...

    @property
    def states(self) -> StateCodec:
        """What this backend's opaque cache states are cut into, joined
        from, written as and read from."""
        ...

    def step(self, lane: Priority) -> StepOutput:
        """Advance every sequence of ``lane`` by one prefill chunk or one
        token; sequences of the other lane do not move (they may be parked)."""
        ...

    def memory_in_use(self) -> int:
        """Bytes of live accelerator memory (for the memory ceiling, --memory-limit-mb)."""
        ...

    def reclaim(self) -> None:
        """Return cached buffers to the system (between turns, under pressure)."""
        ...

    def figures(self) -> BackendFigures:
        """What the backend measured so far, for ``/metrics`` and ``/health``
        (once per step)."""
        ...

    def reset(self, lane: Priority) -> None:
        """Forget every sequence of ``lane`` (after its step failed and left
        the batch unknown); the other lane is untouched."""
        ...

    def close(self) -> None: ...
