"""Fill-in-the-middle prompts: ``suffix`` on ``/v1/completions`` and
llama.cpp's ``POST /infill``.

A prompt is built from the model's own FIM tokens, found in its vocabulary
(each spelling must encode to one token that decodes back to itself):
StarCoder's and SmolLM's ``<fim_prefix>`` / ``<fim_suffix>`` /
``<fim_middle>``, Qwen's and CodeGemma's ``<|fim_prefix|>`` ..., CodeLlama's
``<PRE>`` / ``<SUF>`` / ``<MID>``, DeepSeek Coder's ``fim▁begin`` ...;
a model with none is refused with a 400 that says so.

The layout is prefix-suffix-middle (PSM, the order every family is trained
on), as llama.cpp lays it out::

    [extra context] PRE prefix SUF suffix MID [prompt]

Between two keystrokes an editor's prefix grows at its end: the prompt cache
holds everything before the typed text (the extra context, ``PRE`` and the
previous prefix), and only the rest is computed. With ``/infill``'s
``prompt`` (the current line before the cursor, after ``MID``) the whole
prefix and suffix are reused while the line grows. Suffix-first (SPM) would
reuse the suffix too, but only some families were trained on it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import attrs

from ..core.errors import InvalidRequest
from ..engine import Engine

__all__ = ["FimTokens", "fim_prompt", "fim_tokens"]

# Each family's (prefix, suffix, middle) spellings, and its file separator
# for extra context (None: the context goes in as plain text).
_FAMILIES: tuple[tuple[tuple[str, str, str], str | None], ...] = (
    (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), "<file_sep>"),
    (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), "<|file_sep|>"),
    (("<PRE>", "<SUF>", "<MID>"), None),
    (("▁<PRE>", "▁<SUF>", "▁<MID>"), None),
    (("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"), None),
)


@attrs.frozen
class FimTokens:
    """The model's FIM token ids, and its file separator's (``None``: none)."""

    prefix: int
    suffix: int
    middle: int
    file_sep: int | None = None
    names: tuple[str, str, str] = ("", "", "")


# Found once per engine: the vocabulary does not change while it serves.
_FOUND: weakref.WeakKeyDictionary[Engine, FimTokens | None] = weakref.WeakKeyDictionary()


async def _one_token(engine: Engine, text: str) -> int | None:
    """The id of the single token ``text`` is in the vocabulary, if it is one."""
    ids = await engine.tokenize(text, add_special_tokens=False)
    if len(ids) != 1:
        return None
    (shown,) = await engine.token_texts(ids)
    return ids[0] if shown.strip() == text.replace("▁", " ").strip() else None


async def fim_tokens(engine: Engine) -> FimTokens | None:
    """The model's FIM tokens (``None``: its vocabulary has none)."""
    if engine in _FOUND:
        return _FOUND[engine]
    found: FimTokens | None = None
    for names, sep in _FAMILIES:
        ids = [await _one_token(engine, name) for name in names]
        if all(i is not None for i in ids):
            pre, suf, mid = (int(i) for i in ids if i is not None)
            sep_id = await _one_token(engine, sep) if sep is not None else None
            found = FimTokens(pre, suf, mid, sep_id, names)
            break
    _FOUND[engine] = found
    return found


async def fim_prompt(
    engine: Engine,
    prefix: str,
    suffix: str,
    *,
    param: str,
    extra: Sequence[tuple[str, str]] = (),
    middle: str = "",
) -> list[int]:
    """The token ids of a fill-in-the-middle prompt: ``extra`` context
    (``(filename, text)`` chunks), then ``PRE prefix SUF suffix MID
    middle``. Raises ``InvalidRequest`` naming ``param`` when the model has
    no FIM tokens."""
    fim = await fim_tokens(engine)
    if fim is None:
        raise InvalidRequest(
            f"{param}: this model has no fill-in-the-middle tokens in its vocabulary "
            "(such as <fim_prefix>, <|fim_prefix|> or <PRE>)",
            param=param,
        )

    async def text(value: str) -> list[int]:
        return list(await engine.tokenize(value, add_special_tokens=False)) if value else []

    # The model's own leading tokens (a BOS where it adds one).
    tokens = list(await engine.tokenize("", add_special_tokens=True))
    for filename, body in extra:
        if fim.file_sep is not None:
            tokens += [fim.file_sep, *await text(f"{filename}\n{body}")]
        else:
            tokens += await text(body)
    tokens += [fim.prefix, *await text(prefix), fim.suffix, *await text(suffix), fim.middle]
    tokens += await text(middle)
    return tokens
