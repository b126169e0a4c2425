"""The pixels one request's images may decode to, and that none is decoded
for a request that will be refused.

A 16-megapixel PNG of one colour is a few kilobytes as sent and 48 MB as
RGB; eight of them were ~580 MB at once. Every image's header (where Pillow
reads the size without decoding) is checked, against the per-image limit
and the request's running total, before any pixel is decoded. Decoding is
counted by wrapping Pillow's ``ImageFile.load``.
"""

from __future__ import annotations

import base64
import io
import zlib
from collections.abc import Sequence
from typing import Any

import pytest
from PIL import Image, ImageFile

from gezel_trio.core.config import EngineConfig
from gezel_trio.core.errors import InvalidImage
from gezel_trio.core.images import ImagePart
from gezel_trio.core.request import RenderedPrompt
from gezel_trio.engine import _images
from gezel_trio.engine._images import ImageLimits, prepare_vision
from tests.support import hostile_images
from tests.support.hostile_images import HOSTILE, chunk, jpeg, png_claiming, png_with

MARKER = 7


def png(size: tuple[int, int], mode: str = "L") -> str:
    buf = io.BytesIO()
    Image.new(mode, size, 128).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def parts(data: Sequence[str]) -> list[ImagePart]:
    return [ImagePart(d, f"messages[0].content[{i}].image_url.url") for i, d in enumerate(data)]


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The size of every image Pillow decodes, in order (``load`` runs
    again on an image already loaded: counted once)."""
    seen: list[tuple[int, int]] = []
    loaded: list[ImageFile.ImageFile] = []
    original = ImageFile.ImageFile.load

    def counted(self: ImageFile.ImageFile) -> Any:
        if not any(im is self for im in loaded):
            loaded.append(self)
            seen.append(self.size)
        return original(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counted)
    return seen


class NeverCalled:
    image_token = MARKER

    def prepare(self, text: str, images: Sequence[Any]) -> tuple[tuple[int, ...], Any]:
        raise AssertionError("the processor ran for a refused request")


class Counting:
    image_token = MARKER

    def __init__(self) -> None:
        self.images: list[Any] = []

    def prepare(self, text: str, images: Sequence[Any]) -> tuple[tuple[int, ...], Any]:
        self.images = list(images)
        return (1, *[MARKER] * (2 * len(images)), 2), None


def rendered(count: int) -> RenderedPrompt:
    return RenderedPrompt((1, *[MARKER] * count, 2), text="<image>" * count)


def test_eight_16_megapixel_pngs_are_refused_before_any_is_decoded(
    loads: list[tuple[int, int]],
) -> None:
    big = png((4000, 4000))
    assert len(big) < 100_000  # tiny as sent
    limits = EngineConfig().images
    assert limits.pixels == 16_000_000  # each one alone is allowed
    with pytest.raises(InvalidImage) as err:
        prepare_vision(rendered(8), parts([big] * 8), NeverCalled(), limits)
    # The third takes the request past its 32 M pixels; nothing was decoded.
    assert err.value.param == "messages[0].content[2].image_url.url"
    assert "48000000 pixels" in str(err.value)
    assert "32000000 allowed in one request" in str(err.value)
    assert loads == []


def test_an_image_over_its_own_limit_is_refused_before_the_others_decode(
    loads: list[tuple[int, int]],
) -> None:
    limits = ImageLimits(count=8, bytes=1 << 20, pixels=10_000, total_pixels=1_000_000)
    with pytest.raises(InvalidImage) as err:
        _images.decode_images(parts([png((50, 50)), png((200, 200))]), limits)
    assert err.value.param == "messages[0].content[1].image_url.url"
    assert "200x200 pixels, more than the 10000 allowed" in str(err.value)
    assert loads == []


def test_images_within_the_total_are_all_decoded(
    loads: list[tuple[int, int]],
) -> None:
    limits = ImageLimits(count=8, bytes=1 << 20, pixels=10_000, total_pixels=25_000)
    preparer = Counting()
    data = [png((100, 100), "P"), png((60, 50), "RGBA"), png((40, 40))]
    _, vision = prepare_vision(rendered(3), parts(data), preparer, limits)
    assert loads == [(100, 100), (60, 50), (40, 40)]
    assert [im.mode for im in preparer.images] == ["RGB"] * 3
    assert len(vision.spans) == 3


def test_the_request_total_is_a_flag() -> None:
    from gezel_trio import cli

    args = cli._parser().parse_args(
        ["serve", "--model", "m", "--max-request-image-pixels", "5000000"]
    )
    config = cli._from_flags(EngineConfig, args)
    assert config.images.total_pixels == 5_000_000


# --- hostile files: each is a 400 naming the part, read from the header -------


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_image_is_refused_naming_the_part_before_its_pixels_decode(
    name: str, loads: list[tuple[int, int]]
) -> None:
    raw, says = HOSTILE[name]
    limits = EngineConfig().images
    where = "messages[0].content[1].image_url"
    with pytest.raises(InvalidImage) as err:
        _images.decode_images([ImagePart(base64.b64encode(raw).decode(), where)], limits)
    assert err.value.param == where
    assert str(err.value).startswith(f"{where}: ")
    assert says in str(err.value)
    assert loads == [], "pixels were decoded for an image refused from its header"


def test_the_limits_are_named_in_the_refusal() -> None:
    limits = EngineConfig().images
    assert limits.aspect == 20

    def refusal(raw: bytes) -> str:
        with pytest.raises(InvalidImage) as err:
            _images.decode_images([ImagePart(base64.b64encode(raw).decode(), "p")], limits)
        return str(err.value)

    assert "the 16000000 allowed" in refusal(png_claiming(20_000, 20_000))
    assert "at most 20 to 1" in refusal(hostile_images.png((1, 100_000)))
    assert "1048576 bytes" in refusal(HOSTILE["5 MB zTXt"][0])


def test_a_long_image_within_the_ratio_is_decoded() -> None:
    limits = EngineConfig().images
    part = ImagePart(png((20, 400)), "p")
    [decoded] = _images.decode_images([part], limits)
    assert decoded.image.size == (20, 400)


def test_an_icc_profile_of_a_few_kilobytes_is_taken() -> None:
    """An ICC profile of a few kilobytes (a real one is 0.5-3 KB) is fine."""
    profile = chunk(b"iCCP", b"icc\x00\x00" + zlib.compress(b"p" * 3_000))
    raw = png_with(profile)
    [decoded] = _images.decode_images(
        [ImagePart(base64.b64encode(raw).decode(), "p")], EngineConfig().images
    )
    assert decoded.image.size == (8, 8)


def test_a_truncated_image_is_a_400_even_with_its_header_intact() -> None:
    from PIL import ImageFile

    assert ImageFile.LOAD_TRUNCATED_IMAGES is False  # nothing the server imports sets it
    whole = jpeg((256, 256))
    with pytest.raises(InvalidImage) as err:
        _images.decode_images(
            [ImagePart(base64.b64encode(whole[: len(whole) // 2]).decode(), "p")],
            EngineConfig().images,
        )
    assert "could not be decoded" in str(err.value)
