"""Image files a client should not be able to hurt the server with, built
in a few bytes: headers that state enormous sizes, PNG metadata that
inflates to megabytes, files cut short, a WebP that is only its RIFF
header, and extreme aspect ratios. Each comes with a phrase its 400
names. Shared by the image-limit tests, the vision tests and the fuzzer.
"""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image

__all__ = ["HOSTILE", "chunk", "jpeg", "png", "png_claiming", "png_with"]


def chunk(kind: bytes, data: bytes) -> bytes:
    """One PNG chunk: length, type, data, CRC."""
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def png(size: tuple[int, int], mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, 128).save(buf, "PNG")
    return buf.getvalue()


def jpeg(size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise(size, 60).convert("RGB").save(buf, "JPEG")
    return buf.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header states ``width`` x ``height``, with a few bytes of
    pixels: what a decompression bomb's header looks like."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


def png_with(extra: bytes) -> bytes:
    """A small real PNG with ``extra`` chunks after its IHDR (8 + 25 bytes)."""
    raw = png((8, 8))
    return raw[:33] + extra + raw[33:]


# 5 MB of text, about 5 KB as sent.
_FIVE_MB = zlib.compress(b"a" * 5_000_000)

HOSTILE: dict[str, tuple[bytes, str]] = {
    "20000x20000 header": (png_claiming(20_000, 20_000), "20000x20000 pixels, more than"),
    "65535x65535 header": (png_claiming(65_535, 65_535), "65535x65535 pixels, more than"),
    "5 MB zTXt": (png_with(chunk(b"zTXt", b"Comment\x00\x00" + _FIVE_MB)), "metadata"),
    "5 MB iCCP": (png_with(chunk(b"iCCP", b"icc\x00\x00" + _FIVE_MB)), "metadata"),
    "5 MB iTXt": (png_with(chunk(b"iTXt", b"XML\x00\x01\x00en\x00\x00" + _FIVE_MB)), "metadata"),
    "truncated JPEG header": (jpeg((64, 64))[:300], "cut short"),
    "RIFF header only": (b"RIFF\x04\x00\x00\x00WEBP", "not a PNG, JPEG, WebP or GIF"),
    "RIFF and an empty VP8 chunk": (b"RIFF\x14\x00\x00\x00WEBPVP8 d\x00\x00\x00", "cut short"),
    "a GIF frame past its screen": (
        b"GIF89a\x08\x00\x08\x00\x00\x00\x00,\x00\x00\x00\x00\x20\x4e\x20\x4e\x00"
        b"\x02\x02\x44\x01\x00;",
        "more than",
    ),
    "1x100000": (png((1, 100_000)), "1x100000"),
    "100000x1": (png((100_000, 1)), "100000x1"),
}
