"""Think-block splitting: reasoning out of content, however the text is cut.

Each test feeds pieces the way the engine does; the property test cuts the
same text at random places and requires the same reasoning and content text
as feeding it whole.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gezel_trio.shaping.reasoning import (
    Content,
    Reasoning,
    ReasoningEvent,
    ReasoningSplitter,
    prompt_opens_thinking,
)


def run(pieces: Iterable[str], *, inside: bool, **markers: str) -> list[ReasoningEvent]:
    s = ReasoningSplitter(**markers, starts_inside=inside)
    events: list[ReasoningEvent] = []
    for piece in pieces:
        events += s.feed(piece)
    return events + s.finish()


def texts(events: list[ReasoningEvent]) -> tuple[str, str]:
    """All reasoning text and all content text."""
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    content = "".join(e.text for e in events if isinstance(e, Content))
    return reasoning, content


def split(pieces: Iterable[str], *, inside: bool) -> tuple[str, str]:
    return texts(run(pieces, inside=inside))


def test_block_opened_by_the_model() -> None:
    text = "<think>\nLet me see.\n\nYes.\n</think>\n\nThe answer is 4."
    assert run([text], inside=False) == [
        Reasoning("Let me see.\n\nYes."),
        Content("The answer is 4."),
    ]


def test_block_opened_by_the_prompt() -> None:
    text = "Let me see.\n</think>\n\nThe answer is 4."
    assert split([text], inside=True) == ("Let me see.", "The answer is 4.")


def test_leading_whitespace_before_the_block_is_layout() -> None:
    assert split(["\n <think>a</think>b"], inside=False) == ("a", "b")


def test_no_block_means_all_content() -> None:
    assert split(["Just an answer.\n"], inside=False) == ("", "Just an answer.\n")
    assert split(["  \n"], inside=False) == ("", "  \n")


def test_a_start_marker_after_the_answer_began_is_content() -> None:
    text = "Use <think> tags like <think>this</think>."
    assert split([text], inside=False) == ("", text)


def test_markers_after_the_block_are_content() -> None:
    assert split(["a</think>b</think><think>c"], inside=True) == ("a", "b</think><think>c")


def test_markers_split_across_pieces_are_held_back() -> None:
    s = ReasoningSplitter(starts_inside=False)
    assert s.feed("<thi") == []
    assert s.feed("nk>\nabc</th") == [Reasoning("abc")]
    assert s.inside
    assert s.feed("ink>") == []
    assert not s.inside
    assert s.feed("\n\nxy") == [Content("xy")]
    assert s.finish() == []


def test_line_breaks_in_reasoning_wait_for_more_reasoning() -> None:
    s = ReasoningSplitter(starts_inside=True)
    assert s.feed("one\n") == [Reasoning("one")]
    assert s.feed("\ntwo") == [Reasoning("\n\ntwo")]
    assert s.feed("\n</think>") == []
    assert s.finish() == []


def test_without_an_end_marker_everything_is_reasoning() -> None:
    assert split(["<think>\nstill thinking\n"], inside=False) == ("still thinking", "")
    assert split(["still thinking </th"], inside=True) == ("still thinking </th", "")


def test_a_lone_partial_start_marker_is_content() -> None:
    assert split([" <thi"], inside=False) == ("", " <thi")
    assert split(["<thi", "s is not it"], inside=False) == ("", "<this is not it")


def test_empty_block() -> None:
    assert split(["<think></think>answer"], inside=False) == ("", "answer")
    assert split(["</think>\n\nanswer"], inside=True) == ("", "answer")


def test_other_markers() -> None:
    events = run(["<|think|>x<|/think|>y"], inside=False, start="<|think|>", end="<|/think|>")
    assert texts(events) == ("x", "y")


def test_inside_tracks_the_block() -> None:
    s = ReasoningSplitter(starts_inside=True)
    assert s.inside
    s.feed("a</think>b")
    assert not s.inside


def test_feed_after_finish_is_an_error() -> None:
    s = ReasoningSplitter(starts_inside=False)
    s.finish()
    assert s.finish() == []
    with pytest.raises(RuntimeError):
        s.feed("x")


def test_empty_markers_are_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        ReasoningSplitter("", "</think>", starts_inside=False)


@pytest.mark.parametrize(
    ("prompt", "opens"),
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("<think>old</think> user text <|im_start|>assistant\n", False),
        ("<think>a</think><|im_start|>assistant\n<think>", True),
        ("<|im_start|>assistant\n", False),
    ],
)
def test_prompt_opens_thinking(prompt: str, opens: bool) -> None:
    assert prompt_opens_thinking(prompt) is opens


PIECES = ["<think>", "</think>", "<thi", "</th", "nk>", "<", "/", ">", "\n", "\n\n", " ", "a", "é"]


@st.composite
def chunkings(draw: st.DrawFn, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=10)))
    return [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), inside=st.booleans())
def test_any_chunking_gives_the_same_text(data: st.DataObject, inside: bool) -> None:
    text = data.draw(st.lists(st.sampled_from(PIECES), max_size=14).map("".join))
    expected = split([text], inside=inside)
    assert split(data.draw(chunkings(text)), inside=inside) == expected
    assert split(text, inside=inside) == expected  # one character at a time


@settings(max_examples=200, deadline=None)
@given(
    reasoning=st.text(st.characters(exclude_characters="<"), max_size=20),
    answer=st.text(st.characters(exclude_characters="<"), max_size=20),
    data=st.data(),
)
def test_the_block_and_the_answer_come_back(
    reasoning: str, answer: str, data: st.DataObject
) -> None:
    text = f"<think>\n{reasoning}\n</think>\n\n{answer}"
    got = split(data.draw(chunkings(text)), inside=False)
    assert got == (reasoning.strip("\r\n"), answer.lstrip("\r\n"))
