"""Stop strings and framing-marker scrubbing on streamed text."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gezel_trio.shaping.text import TextFilter

MARKERS = ("<|im_end|>", "<|endoftext|>")


def run(pieces: list[str], stops: tuple[str, ...] = ()) -> tuple[str, bool]:
    f = TextFilter(stops, MARKERS)
    out = "".join(f.feed(p) for p in pieces)
    stopped = f.stopped
    return out + f.flush(), stopped


def test_stop_string_ends_text_and_is_not_emitted() -> None:
    assert run(["hello wor", "ld and more"], ("world",)) == ("hello ", True)


def test_partial_stop_is_held_back_then_released() -> None:
    f = TextFilter(("STOP",), ())
    assert f.feed("abc ST") == "abc "
    assert f.feed("ART") == "START"
    assert not f.stopped


def test_framing_markers_are_scrubbed_even_when_split() -> None:
    assert run(["a<|im_", "end|>b", "<|endoftext|>"]) == ("ab", False)


def test_tool_call_markers_are_kept() -> None:
    assert run(["<tool_call>{}</tool_call>"]) == ("<tool_call>{}</tool_call>", False)


def test_earliest_of_several_stops_wins() -> None:
    assert run(["one two three"], ("three", "two")) == ("one ", True)


def test_the_matched_stop_is_named() -> None:
    f = TextFilter(("three", "tw", "two"), MARKERS)
    assert f.feed("one t") == "one "
    assert f.matched is None
    assert f.feed("wo three") == ""
    assert (f.stopped, f.matched) == (True, "tw")  # earliest; then request order


def test_nothing_is_emitted_after_a_stop() -> None:
    f = TextFilter(("x",), ())
    assert f.feed("axb") == "a"
    assert f.feed("more") == ""
    assert f.flush() == ""


alphabet = st.sampled_from(list("ab <|>imendSTOP"))


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text(alphabet, max_size=8), max_size=12), st.data())
def test_any_chunking_gives_the_same_text(pieces: list[str], data: st.DataObject) -> None:
    whole = "".join(pieces)
    stops = ("STOP", "ba")
    expected = run([whole], stops)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(whole)), max_size=10)))
    chunks, last = [], 0
    for c in cuts:
        chunks.append(whole[last:c])
        last = c
    chunks.append(whole[last:])
    assert run(chunks, stops) == expected


def test_a_stop_split_by_a_marker_still_stops() -> None:
    assert run(["b<|im_", "end|>a"], ("ba",)) == run(["b<|im_end|>a"], ("ba",)) == ("", True)
