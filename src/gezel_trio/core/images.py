"""Images in a prompt, as pure values: what a protocol hands the engine, and
how a prompt's cache key carries each image's identity.

A protocol maps its own image block (chat ``image_url``, the ``images``
extension, Responses ``input_image``, Anthropic ``image``) onto one
``ImagePart`` and puts ``{"type": "image"}`` where the image sits in the
message's content; the engine decodes the parts on a worker thread.

**The cache key.** A vision model's processor expands each image into a run
of identical placeholder tokens, so two prompts with different pictures have
the same token ids. The prompt cache is addressed by token ids
(``cache_store``), so the engine's prompt is not the model's token ids but
its *key*: the same ids, except that the ``i``-th placeholder of an image
becomes ``-(1 + (base + i) mod 2**62)``, where ``base`` comes from the
image's digest (a hash of its decoded pixels). Negative ids are never real
tokens, so a text prompt never matches an image; two prompts share a key
exactly as far as their text and their images agree, so reuse stops at the
first image that differs and never past it. The backend swaps the model's
ids back in (``VisionPrompt.model_tokens``) before anything reaches the
model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

__all__ = [
    "ImagePart",
    "ImageSpan",
    "VisionPrompt",
    "image_key",
    "key_prompt",
    "place_images",
]

_KEY_MOD = 1 << 62


@attrs.frozen
class ImagePart:
    """One image as a protocol received it: base64 text (``data``), the
    media type it was declared as (``None``: not declared), and ``param``,
    the request field it came from, for errors."""

    data: str = attrs.field(repr=lambda d: f"<{len(d)} base64 chars>")
    param: str
    media_type: str | None = None


@attrs.frozen
class ImageSpan:
    """One image's run of placeholder tokens: ``[start, start + length)``
    of the prompt, and the ``digest`` of its decoded pixels."""

    start: int
    length: int
    digest: bytes

    @property
    def end(self) -> int:
        return self.start + self.length


@attrs.frozen
class VisionPrompt:
    """What a vision model needs beyond the key prompt: its own token ids
    (``model_tokens``, as long as the prompt), where each image sits, and
    ``features``, the processor's output for the images (opaque here; the
    MLX backend reads it on the host thread)."""

    model_tokens: tuple[int, ...]
    spans: tuple[ImageSpan, ...]
    features: Any = attrs.field(eq=False, repr=False)

    @property
    def end(self) -> int:
        """Where the last image ends: tokens from here on are plain text."""
        return self.spans[-1].end if self.spans else 0


def image_key(digest: bytes, length: int) -> tuple[int, ...]:
    """The key ids of an image's ``length`` placeholders (all negative)."""
    base = int.from_bytes(digest[:8], "big")
    return tuple(-(1 + (base + i) % _KEY_MOD) for i in range(length))


def place_images(tokens: Sequence[int], image_token: int, count: int) -> list[tuple[int, int]]:
    """The ``(start, length)`` of each of ``count`` images in ``tokens``,
    the model's ids with each image expanded to a run of ``image_token``.

    Runs map to images in order. Two images side by side make one run; it
    is then split evenly, which is right for the fixed-resolution models
    that expand every image to the same number of tokens (LLaVA). Raises
    ``ValueError`` when the runs cannot be matched to the images.
    """
    runs: list[list[int]] = []
    i = 0
    while i < len(tokens):
        if tokens[i] == image_token:
            j = i
            while j < len(tokens) and tokens[j] == image_token:
                j += 1
            runs.append([i, j - i])
            i = j
        else:
            i += 1
    if len(runs) == count:
        return [(s, n) for s, n in runs]
    total = sum(n for _, n in runs)
    if count == 0 or total == 0 or total % count:
        raise ValueError(f"{len(runs)} runs of image tokens for {count} images")
    each = total // count
    out: list[tuple[int, int]] = []
    for start, n in runs:
        if n % each:
            raise ValueError(f"an image-token run of {n} is not a multiple of {each}")
        out += [(start + k * each, each) for k in range(n // each)]
    return out


def key_prompt(model_tokens: Sequence[int], spans: Sequence[ImageSpan]) -> tuple[int, ...]:
    """The prompt the engine and its cache see: ``model_tokens`` with each
    span's placeholders replaced by its image's key ids."""
    key = list(model_tokens)
    for span in spans:
        key[span.start : span.end] = image_key(span.digest, span.length)
    return tuple(key)
