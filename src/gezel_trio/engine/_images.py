"""Images into a vision prompt, on a worker thread.

``prepare_vision`` runs in ``trio.to_thread.run_sync``, never on the Trio
thread and never on the MLX host thread: it reads each ``ImagePart``'s
header (base64, then Pillow) and checks its size and the request's total
against the limits before decoding any, then decodes them one at a time,
hashes their pixels, runs the model's processor (``ImagePreparer``:
resizing, normalising, expanding each image marker to its placeholder
tokens) and returns the request's key prompt with its ``VisionPrompt``.
Every failure is an ``InvalidImage`` (400) naming the part. The vision
tower itself runs later, on the host thread.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import attrs

from ..core.backend import ImagePreparer
from ..core.config import ImageLimits
from ..core.errors import InvalidImage, InvalidRequest
from ..core.images import ImagePart, ImageSpan, VisionPrompt, key_prompt, place_images
from ..core.request import RenderedPrompt

__all__ = [
    "PNG_METADATA_BYTES",
    "ImageLimits",
    "decode_image",
    "decode_images",
    "open_image",
    "prepare_vision",
]

# What Pillow calls the formats the server takes: PNG, JPEG, WebP, GIF.
_FORMATS = {"PNG": "PNG", "JPEG": "JPEG", "WEBP": "WebP", "GIF": "GIF"}

# A PNG's text, ICC and EXIF chunks, decompressed, at most this many bytes
# together. A 5 MB zTXt is 5 KB as sent; Pillow's own bounds (1 MiB a chunk,
# 64 MiB an image) are module-wide settings (PngImagePlugin.MAX_TEXT_CHUNK,
# MAX_TEXT_MEMORY), so the server counts before Pillow reads any. A real ICC
# profile is 0.5-3 KB.
PNG_METADATA_BYTES = 1 << 20
_PNG_METADATA = frozenset({b"tEXt", b"zTXt", b"iTXt", b"iCCP", b"eXIf"})


@attrs.frozen
class Decoded:
    image: Any  # an RGB PIL.Image.Image
    digest: bytes


def _png_metadata_bytes(raw: bytes, most: int) -> int:
    """What a PNG's metadata chunks come to, decompressed, counted up to
    ``most + 1`` (no zlib stream is inflated further): a walk over the
    chunks' lengths, nothing else read. A broken layout is left to Pillow."""
    at, total = 8, 0
    while at + 8 <= len(raw) and total <= most:
        length, kind = struct.unpack_from(">I4s", raw, at)
        start, end = at + 8, min(at + 8 + length, len(raw))
        at = end + 4
        if kind == b"IEND":
            break
        if kind not in _PNG_METADATA:
            continue
        # zTXt and iCCP: keyword, NUL, method, stream; iTXt: keyword, NUL,
        # flag, method, language, NUL, translation, NUL, text.
        nul = raw.find(b"\0", start, end)
        body = nul + 1 if nul >= 0 else end
        if kind in (b"zTXt", b"iCCP"):
            stream = raw[body + 1 : end]
        elif kind == b"iTXt" and raw[body : body + 1] == b"\x01":
            language = raw.find(b"\0", body + 2, end)
            translated = raw.find(b"\0", language + 1, end) if language >= 0 else -1
            stream = raw[translated + 1 : end] if translated >= 0 else b""
        else:
            total += end - start
            continue
        try:
            total += len(zlib.decompressobj().decompress(stream, most - total + 1))
        except zlib.error:
            total += end - start  # Pillow refuses the stream when it reads it
    return total


def _opened(raw: bytes, where: str, pixels: int) -> Any:
    """Pillow's plugin for ``raw``, its header read and no pixels decoded.
    The plugins are called as ``Image.open`` calls them, without its
    decompression-bomb check: that check warns above 89 M pixels and raises
    above 179 M (``Image.MAX_IMAGE_PIXELS``, one setting for the process)
    before the server's own limit could name the part."""
    from PIL import Image

    Image.init()  # registers every plugin once (WebP is not among the first)
    prefix = raw[:16]
    for name, shown in _FORMATS.items():
        factory, accept = Image.OPEN[name]
        taken = accept(prefix) if accept is not None else True
        if not taken or isinstance(taken, str):
            continue
        try:
            return factory(io.BytesIO(raw), "")
        except MemoryError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            # A GIF frame's own size past the screen's: Pillow checks it.
            raise InvalidImage(
                f"{where}: a frame of the {shown} image is more than the {pixels} pixels "
                f"allowed ({exc})",
                param=where,
            ) from exc
        except Exception as exc:
            # Pillow says "Truncated File Read", "could not create decoder
            # object", "not a PNG file", ...: all of them the file's fault.
            raise InvalidImage(
                f"{where}: the {shown} image's header is broken or cut short ({exc})", param=where
            ) from exc
    raise InvalidImage(
        f"{where}: not a PNG, JPEG, WebP or GIF image (or a broken one)", param=where
    )


def open_image(part: ImagePart, limits: ImageLimits) -> Any:
    """One image's bytes opened by Pillow (worker thread), its header read
    and its size checked, its pixels not yet decoded: Pillow reads the size
    from the header and decodes only on ``load``."""
    where = part.param
    # Base64 is 4 characters per 3 bytes: refuse before decoding anything.
    if len(part.data) // 4 * 3 > limits.bytes:
        raise InvalidImage(f"{where}: the image is larger than {limits.bytes} bytes", param=where)
    try:
        raw = base64.b64decode("".join(part.data.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidImage(f"{where}: the image is not valid base64 ({exc})", param=where) from exc
    if not raw:
        raise InvalidImage(f"{where}: the image is empty", param=where)
    if raw.startswith(b"\x89PNG") and _png_metadata_bytes(raw, PNG_METADATA_BYTES) > (
        PNG_METADATA_BYTES
    ):
        raise InvalidImage(
            f"{where}: the PNG's metadata (text, ICC and EXIF chunks) comes to more than "
            f"the {PNG_METADATA_BYTES} bytes allowed, decompressed",
            param=where,
        )
    image = _opened(raw, where, limits.pixels)
    width, height = image.size
    # The header's size, checked before the pixels are decoded.
    if width * height > limits.pixels:
        image.close()
        raise InvalidImage(
            f"{where}: the image is {width}x{height} pixels, more than the {limits.pixels} allowed",
            param=where,
        )
    if width < 1 or height < 1:
        image.close()
        raise InvalidImage(f"{where}: the image has no pixels", param=where)
    if max(width, height) > limits.aspect * min(width, height):
        image.close()
        raise InvalidImage(
            f"{where}: the image is {width}x{height} pixels; its sides may be at most "
            f"{limits.aspect} to 1 (a processor scales the short side up)",
            param=where,
        )
    return image


def _decoded(image: Any, where: str) -> Decoded:
    """The RGB pixels of an opened image and their digest (worker thread)."""
    try:
        image.seek(0)  # an animated GIF or WebP: its first frame
        image.load()
        rgb = image.convert("RGB")
    except MemoryError:
        raise
    except Exception as exc:
        # Pillow's decoders say "image file is truncated", "broken data
        # stream", ... in OSError, SyntaxError, ValueError, EOFError,
        # struct.error, DecompressionBombError (a GIF frame past the screen)
        raise InvalidImage(
            f"{where}: the {_FORMATS.get(image.format, image.format)} image could not be "
            f"decoded ({exc})",
            param=where,
        ) from exc
    finally:
        # The decoded original (palette, RGBA, ...) goes as soon as the RGB
        # copy exists: one image's two buffers at a time, never all of them.
        image.close()
    digest = hashlib.blake2b(
        f"{rgb.width}x{rgb.height}:".encode() + rgb.tobytes(), digest_size=16
    ).digest()
    return Decoded(rgb, digest)


def decode_image(part: ImagePart, limits: ImageLimits) -> Decoded:
    """Decode one image (worker thread). The digest hashes the decoded RGB
    pixels and the size, so the same picture sent as PNG or as lossless
    WebP is the same image to the prompt cache."""
    return _decoded(open_image(part, limits), part.param)


def decode_images(parts: Sequence[ImagePart], limits: ImageLimits) -> list[Decoded]:
    """Every image of a request, decoded (worker thread), after every
    header has been read and checked: the request's pixels together are
    bounded by ``limits.total_pixels``, and nothing is decoded for a request
    that will be refused."""
    opened: list[Any] = []
    total = 0
    try:
        for part in parts:
            image = open_image(part, limits)
            opened.append(image)
            width, height = image.size
            total += width * height
            if total > limits.total_pixels:
                raise InvalidImage(
                    f"{part.param}: with this {width}x{height} image the request's images "
                    f"come to {total} pixels, more than the {limits.total_pixels} allowed "
                    "in one request",
                    param=part.param,
                )
        return [_decoded(image, part.param) for image, part in zip(opened, parts, strict=True)]
    finally:
        for image in opened:
            image.close()  # a no-op for one already decoded


def prepare_vision(
    rendered: RenderedPrompt,
    parts: Sequence[ImagePart],
    preparer: ImagePreparer,
    limits: ImageLimits,
) -> tuple[RenderedPrompt, VisionPrompt]:
    """The key prompt (with boundaries and band end moved past the image
    tokens) and the ``VisionPrompt`` for ``rendered`` and its images
    (worker thread; raises ``InvalidImage`` / ``InvalidRequest``)."""
    if len(parts) > limits.count:
        raise InvalidImage(
            f"{len(parts)} images in one request; at most {limits.count} are allowed",
            param=parts[limits.count].param,
        )
    decoded = decode_images(parts, limits)
    try:
        tokens, features = preparer.prepare(rendered.text, [d.image for d in decoded])
    except Exception as exc:
        raise InvalidRequest(
            f"the model's processor could not prepare these images: {type(exc).__name__}: {exc}",
            param="messages",
        ) from exc
    try:
        placed = place_images(tokens, preparer.image_token, len(decoded))
    except ValueError as exc:
        raise InvalidRequest(
            f"the chat template did not place the {len(decoded)} images of this request ({exc})",
            param="messages",
        ) from exc
    spans = tuple(
        ImageSpan(start, length, d.digest)
        for (start, length), d in zip(placed, decoded, strict=True)
    )
    # Token indices of the render (one marker per image) move by each image's
    # expansion before them.
    markers = [i for i, t in enumerate(rendered.tokens) if t == preparer.image_token]

    def moved(index: int) -> int:
        if len(markers) != len(spans):
            return min(index, spans[0].start)  # cannot map: keep what precedes the images
        return index + sum(s.length - 1 for m, s in zip(markers, spans, strict=True) if m < index)

    key = key_prompt(tokens, spans)
    out = RenderedPrompt(
        key,
        None if rendered.band_end is None else moved(rendered.band_end),
        tuple(sorted({moved(b) for b in rendered.boundaries})),
        rendered.text,
    )
    return out, VisionPrompt(tuple(tokens), spans, features)
