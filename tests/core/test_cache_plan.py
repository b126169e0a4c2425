"""Cache planning helpers, alone (no MLX)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gezel_trio.core.cache_plan import (
    common_prefix,
    snapshot_cut,
    snapshot_is_sound,
    split_segments,
)


@given(st.lists(st.integers(0, 3), max_size=2000), st.lists(st.integers(0, 3), max_size=2000))
def test_common_prefix_matches_the_obvious_loop(a: list[int], b: list[int]) -> None:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common_prefix(a, b) == n


def test_segments_split_at_inner_cuts_only() -> None:
    prompt = list(range(10))
    assert split_segments(prompt, 2, [0, 2, 5, 8, 10, 12]) == [[2, 3, 4], [5, 6, 7], [8, 9]]
    assert split_segments(prompt, 0, []) == [prompt]


def test_snapshot_cut_keeps_the_margin_and_must_advance() -> None:
    assert snapshot_cut(100, 0) == 84
    assert snapshot_cut(100, 84) is None
    assert snapshot_cut(10, 0) is None


def test_snapshot_soundness_checks_tokens_and_offsets() -> None:
    prompt = [1, 2, 3, 4, 5]
    assert snapshot_is_sound([1, 2, 3], prompt, 3, [3, None, 3])
    assert not snapshot_is_sound([1, 2, 4], prompt, 3, [3])
    assert not snapshot_is_sound([1, 2, 3], prompt, 3, [2])
    assert not snapshot_is_sound([1, 2], prompt, 3, [3])
