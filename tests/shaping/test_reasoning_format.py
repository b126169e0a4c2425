"""``--reasoning-format none``: the think block stays in the answer text as
the model wrote it, and a client that reads only that text and splits
``<think>`` itself (the seed's) sees the answer live.

``ThinkPassthrough`` is checked to give back its input byte for byte however
the text is cut; the shaper is fed the way the engine feeds it, and its
``TextDelta`` values are read through the client's own splitting
(``StreamingReasoningSplit`` of ``tests/support/seed_client.py``), once for
a template that opens the block in the prompt and once for a model that
opens it itself.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable

from hypothesis import given, settings
from hypothesis import strategies as st

from gezel_trio.core.model import ModelInfo
from gezel_trio.shaping.reasoning import Content, Reasoning, ThinkPassthrough
from gezel_trio.shaping.shaper import (
    ReasoningDelta,
    ShapedEvent,
    Shaper,
    TextDelta,
    ToolCallDelta,
    ToolCallDone,
)
from tests.support.seed_client import StreamingReasoningSplit

THINK, END_THINK = 7, 8  # the think markers' token ids in these prompts
INFO = ModelInfo(
    model_id="t",
    context_length=4096,
    eos_ids=frozenset({1}),
    framing_markers=(),
    trimmable=True,
    think_ids=(THINK, END_THINK),
    think_markers=("<think>", "</think>"),
    tool_format="hermes",
)
OPENS = (20, 21, THINK)  # a prompt whose template opened the block
CLOSED = (20, 21, THINK, 30, END_THINK, 31)  # one whose block is closed already
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'


def passthrough(pieces: Iterable[str], *, inside: bool) -> list[Reasoning | Content]:
    s = ThinkPassthrough(starts_inside=inside)
    out: list[Reasoning | Content] = []
    for piece in pieces:
        out += s.feed(piece)
    return out + s.finish()


def kinds(events: list[Reasoning | Content]) -> tuple[str, str]:
    return (
        "".join(e.text for e in events if isinstance(e, Reasoning)),
        "".join(e.text for e in events if isinstance(e, Content)),
    )


def test_passthrough_marks_the_block_without_editing_it() -> None:
    text = "\n<think>\nLet me see.\n</think>\n\nThe answer is 4."
    assert kinds(passthrough([text], inside=False)) == (
        "\n<think>\nLet me see.\n</think>",
        "\n\nThe answer is 4.",
    )
    assert kinds(passthrough(["Let me see.\n</think>\n\nFour."], inside=True)) == (
        "Let me see.\n</think>",
        "\n\nFour.",
    )
    # The rules are the splitter's: a marker after the answer began is content.
    assert kinds(passthrough(["Use <think> tags."], inside=False)) == ("", "Use <think> tags.")
    # A block never closed is all reasoning; output that is only a partial marker, content.
    assert kinds(passthrough(["<think>still going</thi"], inside=False)) == (
        "<think>still going</thi",
        "",
    )
    assert kinds(passthrough([" <thi"], inside=False)) == ("", " <thi")


@settings(max_examples=300, deadline=None)
@given(
    text=st.sampled_from(
        [
            "<think>\na</think>\n\nb<think>c</think>",
            "  <think>x</thinkk></think>y",
            "a</think>b",
            "<thin",
            "plain answer",
            "\n\n<think></think>",
        ]
    ),
    inside=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
)
def test_any_cutting_gives_the_same_text_back(text: str, inside: bool, cuts: list[int]) -> None:
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    events = passthrough(pieces, inside=inside)
    assert "".join(e.text for e in events) == text
    assert kinds(events) == kinds(passthrough([text], inside=inside))


def shape(
    pieces: Iterable[str], prompt: tuple[int, ...], *, fmt: str = "none", tools: bool = True
) -> tuple[Shaper, list[list[ShapedEvent]]]:
    """Per piece fed, the events it gave (the last entry: ``finish``)."""
    shaper = Shaper(INFO, prompt, tools=tools, reasoning_format=fmt)  # type: ignore[arg-type]
    steps = [shaper.feed(p) for p in pieces]
    return shaper, [*steps, shaper.finish()]


def read_like_the_client(
    steps: list[list[ShapedEvent]], *, opens: bool
) -> tuple[list[str], str, str]:
    """What the seed's client shows: the visible text released at each step
    (the last entry: its flush), the whole answer and the whole reasoning."""
    split = StreamingReasoningSplit(opens_in_reasoning=opens)
    live: list[str] = []
    reasoning = ""
    for events in steps:
        content = "".join(e.text for e in events if isinstance(e, TextDelta))
        part = split.push(content)
        live.append(part.visible)
        reasoning += part.reasoning
    end = split.flush()
    live.append(end.visible)
    return live, "".join(live), reasoning + end.reasoning


PIECES_OPENED = ["Let me ", "see.\n</th", "ink>\n\nThe answer", " is 4."]
PIECES_OWN = ["<thi", "nk>\nLet me see.\n</think>", "\n\nThe answer", " is 4."]


def test_a_template_that_opens_the_block_reaches_the_client_live() -> None:
    shaper, steps = shape(PIECES_OPENED, OPENS)
    assert not any(isinstance(e, ReasoningDelta) for s in steps for e in s)
    # The prompt's <think> is not repeated: the text is what the model wrote.
    assert "".join(shaper.content) == "".join(PIECES_OPENED)
    live, answer, reasoning = read_like_the_client(steps, opens=True)
    assert reasoning == "Let me see.\n"
    assert answer.strip() == "The answer is 4."
    # Live: the answer streams as it is generated, not at the end.
    assert live[2].strip() == "The answer"
    assert live[3] == " is 4."


def test_a_model_that_opens_the_block_itself_reaches_the_client_live() -> None:
    shaper, steps = shape(PIECES_OWN, CLOSED)
    assert "".join(shaper.content) == "".join(PIECES_OWN)
    live, answer, reasoning = read_like_the_client(steps, opens=False)
    assert reasoning == "\nLet me see.\n"
    assert answer.strip() == "The answer is 4."
    assert live[3] == " is 4."


def test_auto_splits_the_same_text_for_comparison() -> None:
    # Today's split: the client reading only content would see the answer
    # but never a close marker - with an opening template it would hold
    # everything as reasoning, which is why the seed profile sends 'none'.
    shaper, steps = shape(PIECES_OPENED, OPENS, fmt="auto")
    assert "".join(shaper.reasoning) == "Let me see."
    _live, answer, reasoning = read_like_the_client(steps, opens=True)
    assert answer == ""
    assert reasoning == "The answer is 4."


def test_tool_calls_are_parsed_after_the_block_and_not_inside_it() -> None:
    text = f"I could write {CALL[:11]} here.\n</think>\n\nChecking.\n{CALL}"
    shaper, steps = shape([text[i : i + 5] for i in range(0, len(text), 5)], OPENS)
    events = [e for s in steps for e in s]
    (done,) = [e for e in events if isinstance(e, ToolCallDone)]
    assert done.complete
    assert done.name == "get_time"
    assert json.loads(done.arguments) == {"city": "Oslo"}
    assert any(isinstance(e, ToolCallDelta) and e.name == "get_time" for e in events)
    content = "".join(shaper.content)
    assert content.startswith("I could write <tool_call> here.\n</think>")
    assert CALL not in content
    assert content.rstrip().endswith("Checking.")
    assert shaper.finish_reason("stop") == "tool_calls"
    msg = shaper.message()
    assert "reasoning_content" not in msg
    assert msg["content"] == content
    assert msg["tool_calls"][0]["function"]["name"] == "get_time"
    # What the client sends back next turn: the answer, the block split off.
    history = shaper.history_message()
    assert history["content"].strip() == "Checking."
    assert history["tool_calls"] == msg["tool_calls"]


def test_without_tools_the_answer_text_is_verbatim() -> None:
    text = "<think>a</think>\n\n<tool_call>{}</tool_call>"
    shaper, _ = shape([text], CLOSED, tools=False)
    assert shaper.message() == {"role": "assistant", "content": text}
    assert shaper.history_message() == {"role": "assistant", "content": "<tool_call>{}</tool_call>"}
