"""A scripted backend with the engine's exact Backend protocol and no MLX.

Tokens are characters: the renderer writes ``role: content`` lines and
encodes each character as its code point; the detokenizer decodes them back.
What a sequence generates comes from its ``script`` (by default the prompt's
characters, cycled), so tests know every token in advance. Prefill advances
``prefill_step`` tokens per step and honours segment boundaries exactly as
mlx-lm's ``BatchGenerator`` does; decode emits one token per sequence per
step. A cache state is a ``ScriptedState``: the tokens it holds and whether it
can rewind, so both trimmable and untrimmable models can be scripted. Its
blocks are the token tuples themselves, so assembling a seed from the prompt
cache's blocks checks that the blocks hold exactly the seed's tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from ..core.backend import (
    Admission,
    BackendFigures,
    Captured,
    Detokenizer,
    MemoryFigures,
    PrefillOut,
    StepOutput,
    TokenOut,
)
from ..core.errors import InvalidRequest
from ..core.model import KvFootprint, ModelInfo
from ..core.request import GenerationRequest, Priority, RenderedPrompt

__all__ = ["EOS", "ScriptedBackend", "ScriptedState", "StepFailure"]

EOS = 3  # a control character: never produced by rendering text


class StepFailure(RuntimeError):
    """Raised by a scripted step to simulate an MLX failure."""


@attrs.frozen
class ScriptedState:
    tokens: tuple[int, ...]
    trimmable: bool


class _CharDetokenizer:
    def __init__(self) -> None:
        self._segment = ""

    def reset(self) -> None:
        self._segment = ""

    def add_token(self, token: int) -> None:
        self._segment = chr(token)

    def finalize(self) -> None:
        pass

    @property
    def last_segment(self) -> str:
        out, self._segment = self._segment, ""
        return out


class CharRenderer:
    """``role: content`` lines, one token per character."""

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
        text = ""
        if tools:
            text += "tools: " + json.dumps(list(tools), sort_keys=True) + "\n"
        band_end = None
        boundaries = []
        starts = []
        message_ends = []
        for i, m in enumerate(messages):
            starts.append(len(text))
            content = str(m.get("content") or "")
            if band_chars and band_end is None and m.get("role") == "system":
                band_end = len(text) + len(f"{m['role']}: ") + min(band_chars, len(content))
            if i and m.get("role") != "system" and messages[i - 1].get("role") == "system":
                boundaries.append(len(text))  # where the system turn ends
            text += f"{m['role']}: {content}\n"
            message_ends.append(len(text))
        boundaries.append(len(text))  # where the history ends
        text += "assistant:"
        if any(ord(c) < 32 and c != "\n" for c in text):
            raise InvalidRequest("control characters are not renderable", param="messages")
        pin_ends = tuple(message_ends[i] if 0 <= i < len(messages) else None for i in pins)
        return RenderedPrompt(
            tuple(ord(c) for c in text),
            band_end,
            tuple(boundaries),
            pin_ends=pin_ends,
            message_starts=tuple(starts),
            message_roles=tuple(str(m.get("role") or "") for m in messages),
        )

    def encode(self, text: str, *, add_special_tokens: bool) -> tuple[int, ...]:
        return tuple(ord(c) for c in text)

    def decode(self, tokens: Sequence[int]) -> str:
        return "".join(chr(t) for t in tokens)


@attrs.define
class _Seq:
    rid: int
    request: GenerationRequest
    segments: list[list[int]]
    held: list[int]
    total: int
    script: list[int]
    done: int = 0
    generated: int = 0
    decoding: bool = False


Script = Callable[[int, GenerationRequest], Sequence[int]]


def _echo(_rid: int, request: GenerationRequest) -> Sequence[int]:
    text = [t for t in request.prompt if 97 <= t <= 122] or [120]
    return [text[i % len(text)] for i in range(request.max_tokens)]


class ScriptedBackend:
    """``backend.Backend`` without MLX; see the module docstring.

    ``fail_at`` makes the ``n``-th call to ``step`` (1-based) raise
    ``StepFailure``, as an MLX error would. ``poison(request)`` marks
    requests whose own sampler "raises" at their first decode step (reported
    in ``StepOutput.failed``, as the MLX backend's guarded samplers do).
    ``crash_at`` makes the host's own code fail after that many steps
    (``memory_in_use`` raises), as a bug outside every boundary would.
    ``kv_per_token`` and ``kv_room`` give the model a KV footprint and a
    room for it: a step whose lane's KV (its count of sequences times the
    longest prompt plus ``max_tokens``, as a padded batch holds it) is over
    the room raises ``StepFailure``, as running out of memory would. Each
    step leaves ``buffer_growth`` bytes in a simulated buffer cache that
    ``reclaim`` empties.
    """

    def __init__(
        self,
        *,
        trimmable: bool = True,
        prefill_step: int = 8,
        script: Script = _echo,
        context_length: int = 4096,
        fail_at: Sequence[int] = (),
        poison: Callable[[GenerationRequest], bool] | None = None,
        crash_at: int | None = None,
        kv_per_token: int = 0,
        kv_room: int = 0,
        buffer_growth: int = 0,
    ) -> None:
        self.trimmable = trimmable
        self.prefill_step = prefill_step
        self.script = script
        self.steps = 0
        self.fail_at = set(fail_at)
        self.poison = poison
        self.crash_at = crash_at
        self.closed = False
        # What ``memory_in_use`` reports; tests set it to simulate pressure.
        self.memory_bytes = 0
        self.reclaims = 0
        self.kv_per_token = kv_per_token
        self.kv_room = kv_room
        self.buffer_growth = buffer_growth
        self.buffer_bytes = 0
        self.peak_bytes = 0
        self._seqs: dict[int, _Seq] = {}
        self._info = ModelInfo(
            model_id="scripted",
            context_length=context_length,
            eos_ids=frozenset({EOS}),
            framing_markers=(),
            trimmable=trimmable,
            fingerprint="scripted-" + ("trim" if trimmable else "notrim"),
            vocab_size=0x110000,  # a token is a code point
            kv=KvFootprint(kv_per_token) if kv_per_token else None,
            kv_room=kv_room,
        )
        self._renderer = CharRenderer()

    # --- Backend protocol ---------------------------------------------------

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def renderer(self) -> CharRenderer:
        return self._renderer

    @property
    def running(self) -> tuple[int, ...]:
        return tuple(self._seqs)

    def detokenizer(self, keep_leading_space: bool = False) -> Detokenizer:
        return _CharDetokenizer()

    def decode(self, tokens: Sequence[int]) -> str:
        return "".join(chr(t) for t in tokens)

    @property
    def compiler(self) -> None:
        return None  # no grammar support: constrained requests are refused

    @property
    def images(self) -> None:
        return None  # a text-only model

    def token_text(self, token: int) -> str:
        return chr(token)

    def insert(self, admissions: Sequence[Admission]) -> dict[int, Exception]:
        failed: dict[int, Exception] = {}
        for a in admissions:
            if a.request.constraint is not None:
                failed[a.rid] = InvalidRequest("the scripted backend has no grammar support")
                continue
            segments = [list(s) for s in a.segments if s]
            held = list(a.seed_tokens)
            if a.seed_state is not None:
                assert tuple(a.seed_state.tokens) == a.seed_tokens, "seed state and tokens differ"
            self._seqs[a.rid] = _Seq(
                a.rid,
                a.request,
                segments,
                held,
                total=sum(len(s) for s in segments),
                script=list(self.script(a.rid, a.request)),
            )
        return failed

    def remove(self, rids: Sequence[int]) -> dict[int, Captured]:
        out = {}
        for rid in rids:
            seq = self._seqs.pop(rid, None)
            if seq is not None:
                out[rid] = self._captured(seq)
        return out

    def capture(self, rid: int) -> Captured | None:
        seq = self._seqs.get(rid)
        return None if seq is None else self._captured(seq)

    def step(self, lane: Priority) -> StepOutput:
        self.steps += 1
        if self.steps in self.fail_at:
            raise StepFailure(f"scripted failure at step {self.steps}")
        lengths = [
            len(s.request.prompt) + s.request.max_tokens
            for s in self._seqs.values()
            if s.request.priority == lane
        ]
        if self.kv_per_token and lengths:
            need = len(lengths) * max(lengths) * self.kv_per_token
            if need > self.kv_room:
                raise StepFailure(f"out of memory: {need} bytes of KV, room for {self.kv_room}")
        self.buffer_bytes += self.buffer_growth
        prefill: list[PrefillOut] = []
        tokens: list[TokenOut] = []
        failed: list[tuple[int, Exception]] = []
        for seq in list(self._seqs.values()):
            if seq.request.priority != lane:
                continue  # the other lane is parked, or idle
            if seq.decoding:
                if self.poison is not None and self.poison(seq.request):
                    failed.append((seq.rid, StepFailure(f"poisoned sampler of {seq.rid}")))
                tokens.append(self._decode(seq))
            else:
                prefill.extend(self._prefill(seq))
        return StepOutput(tuple(prefill), tuple(tokens), tuple(failed))

    def memory_in_use(self) -> int:
        if self.crash_at is not None and self.steps >= self.crash_at:
            raise StepFailure(f"the host's own code failed after step {self.steps}")
        return self.memory_bytes

    def reclaim(self) -> None:
        self.reclaims += 1
        self.buffer_bytes = 0

    def figures(self) -> BackendFigures:
        # It never speculates, and runs in one process (no ranks).
        self.peak_bytes = max(self.peak_bytes, self.memory_bytes)
        memory = MemoryFigures(
            active=self.memory_bytes,
            peak=self.peak_bytes,
            cache=self.buffer_bytes,
            cache_limit=1 << 30,
        )
        return BackendFigures(memory=memory)

    def reset(self, lane: Priority) -> None:
        for rid in [r for r, seq in self._seqs.items() if seq.request.priority == lane]:
            del self._seqs[rid]

    def close(self) -> None:
        self.closed = True

    # --- cache operations ---------------------------------------------------

    @property
    def states(self) -> ScriptedBackend:
        """Its own state codec: the states are token tuples."""
        return self

    def state_offsets(self, state: Any) -> list[int | None]:
        return [len(state.tokens) if state.trimmable else None]

    def state_blocks(self, state: Any, ranges: Sequence[tuple[int, int]]) -> list[tuple[Any, int]]:
        return [(tuple(state.tokens[s:e]), 16 * (e - s)) for s, e in ranges]

    def state_rest(self, state: Any) -> tuple[Any, int]:
        # An untrimmable model's recurrent state: one fixed-size value.
        return (None, 0) if self.trimmable else (ScriptedState(tuple(state.tokens), False), 64)

    def join_state(self, blocks: Sequence[Any], length: int, rest: Any) -> Any:
        tokens = tuple(t for block in blocks for t in block)[:length]
        if len(tokens) != length:
            raise ValueError(f"blocks hold {len(tokens)} tokens, {length} asked")
        if rest is not None and rest.tokens != tokens:
            raise ValueError("the rest state holds other tokens than the blocks")
        return ScriptedState(tokens, self.trimmable)

    def dump_state(self, state: Any, metadata: dict[str, str], path: Path) -> None:
        data = {"tokens": list(state.tokens), "trimmable": state.trimmable, "meta": metadata}
        path.write_text(json.dumps(data))

    def forget_state(self, path: Path) -> None:
        pass

    def load_state(self, payload: bytes, path: Path) -> tuple[Any, dict[str, str]]:
        data = json.loads(payload)
        return ScriptedState(tuple(data["tokens"]), bool(data["trimmable"])), dict(data["meta"])

    # --- internals ----------------------------------------------------------

    def _captured(self, seq: _Seq) -> Captured:
        held = tuple(seq.held)
        return Captured(ScriptedState(held, self.trimmable), held)

    def _prefill(self, seq: _Seq) -> list[PrefillOut]:
        # Like BatchGenerator, the prompt's last token is fed by the first
        # decode step, not by prefill.
        segment = seq.segments[0]
        last_segment = len(seq.segments) == 1
        room = len(segment) - (1 if last_segment else 0)
        n = min(self.prefill_step, room)
        seq.held += segment[:n]
        del segment[:n]
        seq.done += n
        end = not segment or (last_segment and len(segment) == 1)
        if not segment:
            seq.segments.pop(0)
        if last_segment and len(segment) == 1:
            seq.decoding = True
            return [PrefillOut(seq.rid, seq.done, seq.total, False)] if n else []
        return [PrefillOut(seq.rid, seq.done, seq.total, end)] if n else []

    def _decode(self, seq: _Seq) -> TokenOut:
        if seq.segments:  # feed the prompt's last token
            seq.held += seq.segments.pop(0)
            seq.done = seq.total
        token = seq.script[seq.generated] if seq.generated < len(seq.script) else 120
        seq.generated += 1
        seq.held.append(token)
        finish = None
        if token == EOS and not seq.request.ignore_eos and seq.generated > seq.request.min_tokens:
            finish = "stop"
        elif seq.generated >= seq.request.max_tokens:
            finish = "length"
        if finish is None:
            return TokenOut(seq.rid, token, None)
        del self._seqs[seq.rid]
        cap = self._captured(seq)
        return TokenOut(seq.rid, token, finish, cap.state, cap.tokens)  # type: ignore[arg-type]
