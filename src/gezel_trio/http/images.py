"""Protocol image blocks onto the engine's one image part.

Each protocol finds its own blocks (chat ``image_url`` parts and the
``images`` extension here; Responses ``input_image`` and Anthropic ``image``
blocks in their modules) and maps each onto a ``core.images.ImagePart`` with
``from_data_url`` or ``from_base64``, putting ``{"type": "image"}`` where the
image sits in the message. Only inline images are taken: the server has no
network at run time, so a remote URL is refused with a 400 that says so.
Decoding happens later, on a worker thread (``engine._images``).
"""

from __future__ import annotations

from ..core.errors import InvalidImage, shown
from ..core.images import ImagePart

__all__ = ["SUPPORTED_TYPES", "from_base64", "from_data_url"]

# The media types a request may declare (a GIF is read for its first frame).
SUPPORTED_TYPES = frozenset({"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif"})


def _check_type(media_type: str | None, param: str) -> str | None:
    if media_type is None or media_type == "":
        return None
    media_type = media_type.strip().lower()
    if media_type not in SUPPORTED_TYPES:
        raise InvalidImage(
            f"{param}: unsupported image type {shown(media_type)}; send PNG, JPEG, WebP or GIF",
            param=param,
        )
    return media_type


def from_base64(data: str, param: str, media_type: str | None = None) -> ImagePart:
    """Raw base64 (the ``images`` extension, Anthropic's base64 source)."""
    if not isinstance(data, str) or not data.strip():
        raise InvalidImage(f"{param}: the image is empty", param=param)
    return ImagePart(data, param, _check_type(media_type, param))


def from_data_url(url: str, param: str) -> ImagePart:
    """A ``data:image/...;base64,...`` URL; anything else is refused."""
    head, comma, payload = url.partition(",")
    scheme = head.split(":", 1)[0].strip().lower() if ":" in head else ""
    if scheme in ("http", "https"):
        raise InvalidImage(
            f"{param}: remote image URLs are not fetched (this server has no network "
            "access); send the image inline as a data: URL (data:image/png;base64,...)",
            param=param,
        )
    if scheme != "data" or not comma:
        raise InvalidImage(
            f"{param}: an image URL must be a data: URL (data:image/png;base64,...)",
            param=param,
        )
    spec = head[len("data:") :] if head[:5].lower() == "data:" else head.split(":", 1)[1]
    params = [p.strip() for p in spec.split(";")]
    if "base64" not in (p.lower() for p in params[1:]):
        raise InvalidImage(f"{param}: the data: URL must be base64-encoded", param=param)
    return from_base64(payload, param, params[0] or None)
