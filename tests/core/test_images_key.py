"""The image-keyed prompt (``core.images``): pure functions, no model."""

from __future__ import annotations

import pytest

from gezel_trio.core.images import ImageSpan, image_key, key_prompt, place_images

IMG = 9


def test_runs_map_to_images_in_order() -> None:
    tokens = [1, IMG, IMG, IMG, 2, 3, IMG, IMG, IMG, 4]
    assert place_images(tokens, IMG, 2) == [(1, 3), (6, 3)]


def test_adjacent_images_of_one_size_split_one_run() -> None:
    tokens = [1, *[IMG] * 6, 2]
    assert place_images(tokens, IMG, 2) == [(1, 3), (4, 3)]
    assert place_images(tokens, IMG, 3) == [(1, 2), (3, 2), (5, 2)]


def test_runs_that_cannot_be_the_images_are_refused() -> None:
    with pytest.raises(ValueError, match="runs"):
        place_images([1, IMG, IMG, 2, IMG, 3], IMG, 2 + 2)
    with pytest.raises(ValueError, match="runs"):
        place_images([1, 2, 3], IMG, 1)


def test_the_key_carries_the_digest_at_the_image_and_nothing_else() -> None:
    model = (1, 2, IMG, IMG, IMG, 3, 4)
    a = key_prompt(model, [ImageSpan(2, 3, b"a" * 16)])
    b = key_prompt(model, [ImageSpan(2, 3, b"b" * 16)])
    assert a[:2] == b[:2] == (1, 2)
    assert a[5:] == b[5:] == (3, 4)
    # Different pictures part at the image's first placeholder.
    assert a[2] != b[2]
    assert all(t < 0 for t in a[2:5])
    assert len(set(a[2:5])) == 3
    assert key_prompt(model, [ImageSpan(2, 3, b"a" * 16)]) == a


def test_image_keys_are_never_token_ids() -> None:
    for digest in (b"\x00" * 16, b"\xff" * 16, bytes(range(16))):
        assert all(t < 0 for t in image_key(digest, 1000))
