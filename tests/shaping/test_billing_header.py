"""Claude Code's billing line is taken out of system and developer content,
whichever block or line it is on, and nothing else is touched."""

from __future__ import annotations

from typing import Any

from gezel_trio.shaping.billing_header import drop_billing_header

HEADER = "x-anthropic-billing-header: cc_version=2.1.37.abc; cc_entrypoint=cli; cch=1f2e3;"
PREV = (
    "x-anthropic-billing-header: cc_version=2.1.177.01c; cc_entrypoint=sdk-cli; "
    "cch=0aaa9; cc_prev_req=req_011CXyz;"
)


def _system(content: Any) -> list[dict[str, Any]]:
    return [{"role": "system", "content": content}, {"role": "user", "content": "hi"}]


def test_a_header_paragraph_goes_with_its_separator() -> None:
    out, dropped = drop_billing_header(_system(f"{HEADER}\n\nYou are Claude Code."))
    assert out[0] == {"role": "system", "content": "You are Claude Code."}
    assert dropped == [HEADER]


def test_the_header_as_the_first_line_of_a_block() -> None:
    out, _ = drop_billing_header(_system(f"{HEADER}\nYou are Claude Code.\nBe brief."))
    assert out[0]["content"] == "You are Claude Code.\nBe brief."


def test_the_newer_variant_on_a_later_line() -> None:
    text = f"You are Claude Code.\n{PREV}\nBe brief."
    out, dropped = drop_billing_header(_system(text))
    assert out[0]["content"] == "You are Claude Code.\nBe brief."
    assert dropped == [PREV]


def test_attributes_continued_on_the_next_line_go_with_the_header() -> None:
    # The newer variant as recorded by proxies: the previous request's id and
    # the prompt's id on a line of their own under the header.
    more = "cc_prev_req=req_011Cabc123; cc_prompt_id=9f8e7d6c-1a2b;"
    text = f"{HEADER}\n{more}\n\nYou are Claude Code.\ncc_note=1; is an instruction here"
    out, dropped = drop_billing_header(_system(text))
    assert out[0]["content"] == "You are Claude Code.\ncc_note=1; is an instruction here"
    assert dropped == [HEADER, more]


def test_hashes_that_differ_render_the_same() -> None:
    a, _ = drop_billing_header(_system(f"{HEADER}\n\nSame prompt."))
    b, _ = drop_billing_header(_system(f"{PREV}\n\nSame prompt."))
    assert a == b


def test_a_text_block_left_empty_is_dropped() -> None:
    blocks = [
        {"type": "text", "text": HEADER},
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
    ]
    out, dropped = drop_billing_header(_system(blocks))
    assert out[0]["content"] == [blocks[1]]
    assert dropped == [HEADER]


def test_a_system_message_left_empty_is_dropped() -> None:
    messages = [{"role": "developer", "content": HEADER}, {"role": "user", "content": "hi"}]
    out, _ = drop_billing_header(messages)
    assert out == [{"role": "user", "content": "hi"}]


def test_user_and_assistant_text_is_never_touched() -> None:
    messages = [
        {"role": "user", "content": f"why does {HEADER} appear?"},
        {"role": "assistant", "content": HEADER},
    ]
    out, dropped = drop_billing_header(messages)
    assert out == messages
    assert dropped == []


def test_a_prompt_without_the_line_is_unchanged() -> None:
    messages = _system("You are Claude Code. Do not send x-anthropic-billing-header lines.")
    out, dropped = drop_billing_header(messages)
    assert out == messages
    assert dropped == []
