"""Grammar-constrained decoding on the engine's host thread.

``grammar.build_constraint`` compiles a request's constraint on the HTTP
side; here it becomes an mlx-lm logits processor that masks every token the
grammar does not allow. Two pieces:

* ``GrammarTokenizer``: the llguidance view of the model's tokenizer. Building
  it walks the whole vocabulary (about 1 s for a 150k-token vocabulary, 30 ms
  for the demo's 2k), so the backend builds one and keeps it; it is immutable
  and may be shared with other threads (its ``llg`` is what
  ``build_constraint(llg_tokenizer=...)`` takes for a complete check).
* ``GrammarProcessor``: one per constrained sequence, stateful, made by
  ``make_grammar_processor``. mlx-lm's ``BatchGenerator`` calls it once per
  decode step with the sequence's token context and its ``(1, V)`` logits.
  Sequences in one batch each get their own processor (or none), so mixing
  constrained and free sequences needs nothing special.

What the processor sees: on the first call the context ends with the last
*prompt* token, so nothing is consumed; on every later call its last element
is the token sampled at the previous step, which is fed to the matcher before
the next mask is computed. That is why a processor must not be reused across
sequences, and why a resumed sequence (re-inserted with its generated tokens
appended to the prompt) gets a fresh processor with ``generated=`` replayed.

The mask covers the tokenizer's ids; logits columns beyond them (a padded
vocabulary, common in real checkpoints) are always masked, and tokenizer ids
beyond the logits width cannot be sampled anyway. Once the grammar is
complete only EOS is allowed, which ends the sequence through the engine's
EOS stop. A processor never raises into the engine: if the matcher fails
mid-stream (a resource limit; a token the mask should not have allowed) it
logs, records ``error``, and forces EOS. Building a processor does raise
``InvalidRequest`` when the model cannot serve the grammar (a missing special
token, lexer limits against this vocabulary): that fails one request before
it is inserted.

Order matters when the backend chains processors: this one must come after
any that raise logits (``logit_bias``) so a bias cannot revive a masked
token, and a "hold EOS for ``min_tokens``" processor must not run after it
once the grammar is complete, or every logit would be ``-inf``.

Forced output completes: with ``budget`` (the sequence's
``max_tokens``), once the tokens left fall to ``closing_reserve(budget)``
the processor steers to the shortest valid end instead of masking only:
among the tokens the grammar allows it picks the first of a short list of
closing tokens (``"}``, ``}``, ``"``, ``0``, ``null``...; see
``CLOSERS``), so an open string closes, an object with no required keys
left closes, a required value becomes its shortest form; where none of
them is allowed (a key the schema names, an enum value) the model chooses
among the allowed tokens as usual. A forced tool call or JSON answer then
completes within its budget even on a random-weight model; if it still
cannot, the sequence ends by ``length`` and the shaper reports ``length``,
never a call over unparseable arguments.

Thinking: with ``start_after_token`` (``</think>``'s id) the
processor leaves the think block free until that token has been generated,
but for the end of the turn: the forced output follows the block, so the
turn may not end inside it (sampled from a random-weight model, 3 turns in
300 ended there, with no call). The thinking budget closes a block the model
does not. The grammar then applies to what follows the tag, and the tag
itself is not fed to the matcher.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from copy import copy
from typing import Any, Final, cast

import llguidance
import mlx.core as mx
import numpy as np

from ..core.constraint import Constraint
from ..core.errors import InvalidRequest
from ..shaping.grammar import parser_limits

__all__ = [
    "CLOSERS",
    "GrammarProcessor",
    "GrammarTokenizer",
    "closing_reserve",
    "make_grammar_processor",
]

logger = logging.getLogger(__name__)

# Texts whose single token ends a JSON structure soonest, best first, inside
# a string and outside one: close what is open, else give a required value its
# shortest form (a string opens, then closes at once). Only those the grammar
# allows at a step are candidates; a "," (another element) never is.
CLOSERS: Final = {
    True: ('"}', '"]', '"'),
    False: ("}}", "}", "]}", "]", "0", "null", "false", "true", "{}", "[]", '"'),
}


def closing_reserve(budget: int) -> int:
    """Tokens kept to close a forced structure, and one for the end of turn:
    the shortest ending of a call is a few tokens per open level, a required
    key and value about seven; a third of the budget, between 8 and 32,
    covers both (on the demo models a 40-token JSON answer used 10)."""
    return max(8, min(32, budget // 3)) + 1


# The request field a constraint came from, for errors found on this side.
_PARAM_OF_KIND: Final = {
    "json_object": "response_format",
    "json_schema": "response_format",
    "json_or_tool_call": "response_format",
    "tool_call": "tool_choice",
    "tool_name": "tool_grammar",
}


class GrammarTokenizer:
    """llguidance's tokenizer for one model, built once per backend.

    ``hf_tokenizer`` is the Hugging Face fast tokenizer (for mlx-lm's
    ``TokenizerWrapper`` that is ``wrapper._tokenizer``). ``eos_ids`` are
    the ids that end a turn; the grammar allows them where it may end.
    """

    def __init__(self, hf_tokenizer: Any, *, eos_ids: Iterable[int]) -> None:
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError("constrained decoding needs a fast (Rust-backed) tokenizer")
        self.eos_ids: tuple[int, ...] = tuple(sorted(set(eos_ids)))
        if not self.eos_ids:
            raise ValueError("constrained decoding needs at least one EOS id")
        # What llguidance.hf.from_tokenizer does, without its isinstance
        # gate: serialise the Rust tokenizer, minus padding and truncation.
        backend = copy(backend)
        backend.no_padding()
        backend.no_truncation()
        self.llg: Any = llguidance.LLTokenizer(backend.to_str(), eos_token=list(self.eos_ids))
        self.vocab_size: int = int(self.llg.vocab_size)
        # The closers this vocabulary spells as one token, in CLOSERS order.
        self.closers: dict[bool, tuple[int, ...]] = {
            inside: tuple(
                dict.fromkeys(
                    t[0] for t in (self.llg.tokenize_str(x) for x in texts) if len(t) == 1
                )
            )
            for inside, texts in CLOSERS.items()
        }
        added = hf_tokenizer.get_added_vocab() if hasattr(hf_tokenizer, "get_added_vocab") else {}
        self._added_tokens: frozenset[str] = frozenset(added)

    def added_tokens_in(self, texts: Iterable[str]) -> tuple[str, ...]:
        """The added tokens spelled inside ``texts`` (say ``<|channel>`` in
        Gemma 4's ``<|channel>thought``), in order of appearance."""
        found: list[str] = []
        for text in texts:
            at = sorted((text.find(t), t) for t in self._added_tokens if t in text)
            found += [t for _, t in at if t not in found]
        return tuple(found)

    def closing_sequences(self, texts: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """``Constraint.closing_texts`` as token ids, special tokens parsed."""
        return tuple(tuple(self.llg.tokenize_str(t, parse_special=True)) for t in texts)

    def matcher(self, constraint: Constraint) -> Any:
        """A fresh ``llguidance.LLMatcher`` for ``constraint``.

        Raises ``InvalidRequest`` when this tokenizer cannot serve it.
        """
        param = _PARAM_OF_KIND.get(constraint.kind, "response_format")
        missing = [t for t in constraint.special_tokens if t not in self._added_tokens]
        if missing:
            raise InvalidRequest(
                f"this model's tokenizer has no {', '.join(missing)} token, which its "
                "template's tool-call markup needs",
                param=param,
            )
        # log_level 0: llguidance would print warnings to stderr; errors are
        # read back with get_error() and logged here instead.
        m = llguidance.LLMatcher(self.llg, constraint.grammar, limits=parser_limits(), log_level=0)
        if m.is_error():
            raise InvalidRequest(f"{param}: {m.get_error()}", param=param)
        return m


class GrammarProcessor:
    """An mlx-lm logits processor enforcing one grammar on one sequence.

    Call it as ``processor(tokens, logits)``; see the module docstring for
    the calling convention. ``mask_seconds`` holds the time each masked step
    spent computing and applying its mask; ``error`` is set, and EOS forced,
    if the matcher failed mid-stream.
    """

    def __init__(
        self,
        matcher: Any,
        *,
        tokenizer_vocab: int,
        vocab_width: int,
        eos_ids: Sequence[int],
        start_after_token: int | None = None,
        budget: int | None = None,
        closers: dict[bool, tuple[int, ...]] | None = None,
        token_bytes: Any = None,
        closing_sequences: Sequence[Sequence[int]] = (),
    ) -> None:
        if not eos_ids:
            raise ValueError("eos_ids must not be empty")
        self._matcher = matcher
        # Steering to the shortest ending starts when this many tokens are left.
        self._close_at = None if budget is None else budget - closing_reserve(budget)
        self._closers = closers or {True: (), False: ()}
        # The markup's own endings (``Constraint.closing_texts``), and what is
        # left of the one being written.
        self._sequences = tuple(tuple(q) for q in closing_sequences if q)
        self._pending: list[int] = []
        # Whether the text so far ends inside a JSON string (quotes and
        # escapes of the consumed tokens), which decides what closes it.
        self._token_bytes = token_bytes
        self._in_string = False
        self._escaped = False
        self.closing = False
        self._tokenizer_vocab = tokenizer_vocab
        self._eos_ids = tuple(eos_ids)
        self._start_after = start_after_token
        self._active = start_after_token is None
        self._calls = 0
        # On a CPU device the forward pass and llguidance share the cores:
        # nothing to overlap, and on the 2-core test host it only added
        # contention (mask p99 0.4 ms without, 0.5-1.5 ms with).
        self._overlap = mx.default_device().type == mx.DeviceType.gpu
        self._width = 0
        self._allowed = np.zeros(0, dtype=np.bool_)
        self._eos_only: mx.array = mx.array(np.zeros(0, dtype=np.bool_))
        self._resize(vocab_width)
        self.error: str | None = None
        self.mask_seconds: list[float] = []

    @property
    def active(self) -> bool:
        """Whether masking has started (always, unless waiting for a start token)."""
        return self._active

    @property
    def finished(self) -> bool:
        """The grammar is complete (or failed): only EOS is allowed now."""
        return self.error is not None or bool(self._matcher.is_stopped())

    def advance(self, token: int) -> None:
        """Feed one generated token (done by ``__call__``; public for replay)."""
        if not self._active:
            if token == self._start_after:
                self._active = True
            return
        if self.error is not None or (token in self._eos_ids and self._matcher.is_stopped()):
            return
        try:
            ok = self._matcher.consume_token(token)
        except Exception as exc:  # API-level misuse, e.g. an id past the vocabulary
            self._fail(f"token {token} could not be consumed: {exc}")
            return
        if self._pending:
            if token == self._pending[0]:
                self._pending.pop(0)
            else:
                self._pending.clear()
        if not ok:
            self._fail(f"token {token} was rejected: {self._matcher.get_error()}")
        elif self._close_at is not None and self._token_bytes is not None:
            self._track_strings(self._token_bytes([token]))

    def _track_strings(self, text: bytes) -> None:
        for byte in text:
            if self._escaped:
                self._escaped = False
            elif byte == 0x5C and self._in_string:  # backslash
                self._escaped = True
            elif byte == 0x22:  # quote
                self._in_string = not self._in_string

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._calls > 0:
            # The previous step's sampled token (see the module docstring).
            self.advance(cast(int, tokens[-1].item()))
        self._calls += 1
        if logits.shape[-1] != self._width:
            self._resize(logits.shape[-1])
        if not self._active:
            return mx.where(self._not_eos, logits, mx.array(-mx.inf, dtype=logits.dtype))
        if self._overlap:
            # Start the forward pass on the GPU so it overlaps the mask work.
            mx.async_eval(logits)  # type: ignore[no-untyped-call]  # unannotated in mlx's stub
        start = time.perf_counter()
        allowed = self._mask()
        if self._close_at is not None and self._calls > self._close_at and not self.finished:
            allowed = self._closing(allowed)
        out = mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))
        self.mask_seconds.append(time.perf_counter() - start)
        return out

    def _mask(self) -> mx.array:
        if self.error is None and not self._matcher.is_stopped():
            try:
                raw = self._matcher.compute_bitmask()
            except Exception as exc:  # never into the engine: end this sequence only
                self._fail(f"mask computation raised {type(exc).__name__}: {exc}")
                return self._eos_only
            bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
            if not self._matcher.is_error():
                n = min(self._width, self._tokenizer_vocab)
                self._allowed[:n] = bits[:n]
                if self._allowed.any():
                    return mx.array(self._allowed)
                self._fail("the grammar allows no token")
            else:
                self._fail(self._matcher.get_error())
        return self._eos_only

    def _closing(self, allowed: mx.array) -> mx.array:
        """The next token of a markup ending the grammar allows whole, else
        the first closer the grammar allows now, alone; else ``allowed``."""
        self.closing = True
        if not self._in_string:
            if not (self._pending and self._allowed_token(self._pending[0])):
                self._pending = next(
                    (
                        list(q)
                        for q in self._sequences
                        if self._matcher.validate_tokens(list(q)) == len(q)
                    ),
                    [],
                )
            if self._pending:
                return self._only(self._pending[0])
        for token in self._closers[self._in_string]:
            if self._allowed_token(token):
                return self._only(token)
        return allowed

    def _allowed_token(self, token: int) -> bool:
        return token < self._width and bool(self._allowed[token])

    def _only(self, token: int) -> mx.array:
        only = np.zeros(self._width, dtype=np.bool_)
        only[token] = True
        return mx.array(only)

    def _resize(self, width: int) -> None:
        # Columns past the tokenizer stay False forever: a padded vocabulary.
        self._width = width
        self._allowed = np.zeros(width, dtype=np.bool_)
        eos = np.zeros(width, dtype=np.bool_)
        eos[[e for e in self._eos_ids if e < width]] = True
        self._eos_only = mx.array(eos)
        self._not_eos = mx.array(~eos)

    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = message
            logger.warning("grammar matcher failed; forcing EOS: %s", message[:500])


def make_grammar_processor(
    constraint: Constraint,
    llg_tokenizer: GrammarTokenizer,
    *,
    vocab_width: int,
    eos_ids: Iterable[int] | None = None,
    start_after_token: int | None = None,
    generated: Sequence[int] = (),
    budget: int | None = None,
) -> GrammarProcessor:
    """A fresh ``GrammarProcessor`` for one sequence (an mlx-lm logits processor).

    ``vocab_width`` is the model's logits width (it may exceed the
    tokenizer). ``eos_ids`` default to the tokenizer's. ``start_after_token``
    defers masking until that token is generated (``</think>``).
    ``generated`` replays tokens already produced, for a sequence resumed
    from a snapshot. ``budget`` (the sequence's ``max_tokens``) turns on
    steering to the shortest valid ending near it. Raises ``InvalidRequest``
    if this model cannot serve the constraint; the returned processor itself
    never raises for model output.
    """
    eos = tuple(eos_ids) if eos_ids is not None else llg_tokenizer.eos_ids
    processor = GrammarProcessor(
        llg_tokenizer.matcher(constraint),
        tokenizer_vocab=llg_tokenizer.vocab_size,
        vocab_width=vocab_width,
        eos_ids=eos,
        start_after_token=start_after_token,
        budget=budget,
        closers=llg_tokenizer.closers,
        token_bytes=llg_tokenizer.llg.decode_bytes,
        closing_sequences=llg_tokenizer.closing_sequences(constraint.closing_texts),
    )
    for token in generated:
        processor.advance(token)
    return processor
