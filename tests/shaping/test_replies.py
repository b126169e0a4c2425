"""The reply ledger and the splice: a re-sent history spells this server's
replies with the ids it generated.

The renderer runs on the dense demo model's real tokenizer and chat template
(Qwen-style: the generation prompt holds an empty think block that the
history drops), and the generated reply starts with a space the stream
trimmed: the two layout changes the splice undoes."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from gezel_trio.http.openai_responses import _restore_sealed
from gezel_trio.http.responses_wire import structure_items
from gezel_trio.shaping.prompt import ChatTemplateRenderer
from gezel_trio.shaping.replies import (
    GeneratedReply,
    ReplyLedger,
    ReplySeal,
    dump_ledger,
    load_ledger,
    reply_key,
)

SYSTEM = {"role": "system", "content": "You are terse."}
ASK = {"role": "user", "content": "Name a harbour."}
NEXT = {"role": "user", "content": "And another?"}
THINK = ("<think>", "</think>")


@pytest.fixture(scope="module")
def tokenizer(dense_model: Path) -> Any:
    """The tokenizer as the MLX backend holds it (mlx-lm's wrapper)."""
    from mlx_lm.tokenizer_utils import load

    return load(dense_model)


def _render(
    renderer: ChatTemplateRenderer,
    messages: list[dict[str, Any]],
    template_kwargs_on: bool = False,
    **kw: Any,
) -> Any:
    kwargs = {"enable_thinking": True} if template_kwargs_on else {}
    return renderer.render(
        messages, tools=None, template_kwargs=kwargs, template_override=None, **kw
    )


def _generated(tokenizer: Any, text: str) -> tuple[int, ...]:
    """What the model would have generated for ``text``: its ids, then the
    end-of-turn token."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return (*ids, tokenizer.convert_tokens_to_ids("<|im_end|>"))


def test_a_generated_reply_is_spliced_as_generated(tokenizer: Any) -> None:
    renderer = ChatTemplateRenderer(tokenizer)
    ledger = ReplyLedger(10_000, THINK)
    first = _render(renderer, [SYSTEM, ASK], replies=ledger)
    assert first.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    generated = _generated(tokenizer, " Rotterdam, by the quay")
    shown = {"role": "assistant", "content": "Rotterdam, by the quay"}  # first space trimmed
    ledger.record(shown, first.tokens, generated)

    history = [SYSTEM, ASK, shown, NEXT]
    plain = _render(renderer, history)
    spliced = _render(renderer, history, replies=ledger)
    # The template drops the empty think block and the space is gone:
    # the plain rendering leaves the previous prompt before the reply.
    assert plain.tokens[: len(first.tokens)] != first.tokens
    # Spliced, the prompt is the previous prompt, the reply's ids, and the new turn.
    head = first.tokens + generated
    assert spliced.tokens[: len(head)] == head
    assert spliced.text.startswith(first.text + " Rotterdam, by the quay<|im_end|>")
    tail = tokenizer.encode(plain.text[plain.text.index("<|im_end|>\n<|im_start|>user\nAnd") :])
    # The rest is tokenized as the template wrote it.
    assert spliced.tokens[len(head) :] == tuple(tail[1:])


def test_a_reply_the_history_does_not_show_as_generated_is_left_alone(tokenizer: Any) -> None:
    renderer = ChatTemplateRenderer(tokenizer)
    ledger = ReplyLedger(10_000, THINK)
    shown = {"role": "assistant", "content": "Rotterdam"}
    history = [SYSTEM, ASK, shown, NEXT]
    # Ids that spell another text than the turn shows.
    first = _render(renderer, [SYSTEM, ASK])
    ledger.record(shown, first.tokens, _generated(tokenizer, " Oslo"))
    assert _render(renderer, history, replies=ledger) == _render(renderer, history)
    # A reply written inside a think block, whose reasoning the template
    # drops from old turns: the turn is not what was generated.
    thinking = _render(renderer, [SYSTEM, ASK], template_kwargs_on=True)
    ledger = ReplyLedger(10_000, THINK)
    ledger.record(shown, thinking.tokens, _generated(tokenizer, "hmm\n</think>\n\nRotterdam"))
    assert _render(renderer, history, replies=ledger) == _render(renderer, history)


def test_the_key_is_what_every_protocol_sends_back() -> None:
    as_chat = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1, "b": [2]}'}}],
    }
    as_messages = {
        "role": "assistant",
        "content": "",
        "reasoning_content": "dropped by clients at will",
        "tool_calls": [
            {"id": "toolu_1", "function": {"name": "f", "arguments": {"b": [2], "a": 1}}}
        ],
    }
    assert reply_key(as_chat) == reply_key(as_messages)
    assert reply_key({"content": "a"}) != reply_key({"content": "a "})


def test_the_ledger_is_bounded_by_the_ids_it_holds() -> None:
    ledger = ReplyLedger(100)
    for i in range(10):
        ledger.record({"content": str(i)}, (1, 2), tuple(range(20)))
    assert len(ledger) == 4  # 4 x (2 + 20) ids fit in 100
    assert ledger.get({"content": "9"})
    assert not ledger.get({"content": "0"})
    same = {"content": "same"}
    for tail in range(6):  # one text after six prompts: the latest four kept
        ledger.record(same, (tail,), (7,))
    assert [r.tail for r in ledger.get(same)] == [(5,), (4,), (3,), (2,)]


def test_a_sealed_reply_opens_only_here_and_only_for_its_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reply = GeneratedReply((1, 2, 3), (70000, 5, 2))
    seal = ReplySeal(b"k" * 32, "model-a")
    blob = seal.seal(reply)
    assert seal.open(blob) == reply
    caplog.set_level(logging.INFO, "gezel_trio.prompt")
    mid = len(blob) // 2
    flipped = blob[:mid] + ("A" if blob[mid] != "A" else "B") + blob[mid + 1 :]
    assert seal.open(flipped) is None
    assert ReplySeal(b"x" * 32, "model-a").open(blob) is None  # another server's key
    assert ReplySeal(b"k" * 32, "model-b").open(blob) is None  # another model
    assert seal.open("not a blob at all") is None
    assert seal.open("") is None
    messages = [r.getMessage() for r in caplog.records]
    assert sum("ignored" in m for m in messages) == 5


def test_a_sealed_reasoning_item_restores_its_turn() -> None:
    seal = ReplySeal(b"k" * 32, "m")
    ledger = ReplyLedger(1000, seal=seal)
    reply = GeneratedReply((9,), (4, 5, 6))
    items = structure_items(
        [
            {"type": "message", "role": "user", "content": "hi"},
            {"type": "reasoning", "summary": [], "encrypted_content": seal.seal(reply)},
            {"type": "message", "role": "assistant", "content": "hello"},
            {"type": "reasoning", "summary": [], "encrypted_content": "tampered"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "message", "role": "user", "content": "again"},
        ]
    )
    from gezel_trio.http.openai_responses import items_to_messages

    messages = items_to_messages(items)
    _restore_sealed(ledger, items, messages)
    (assistant,) = [m for m in messages if m["role"] == "assistant"]
    assert ledger.get(assistant) == (reply,)
    assert len(ledger) == 1


def test_the_ledger_outlives_a_restart_in_the_persist_dir(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = ReplyLedger(1000)
    ledger.record({"content": "a"}, (1, 2), (3, 70000))
    ledger.record({"content": "a"}, (9,), (3,))
    ledger.record({"content": "b"}, (), (5,))
    path = tmp_path / "replies.bin"
    dump_ledger(ledger, path)
    again = ReplyLedger(1000)
    assert load_ledger(again, path) == 3
    assert again.get({"content": "a"}) == ledger.get({"content": "a"})
    assert again.get({"content": "b"}) == ledger.get({"content": "b"})
    path.write_bytes(path.read_bytes()[:-4])
    assert load_ledger(ReplyLedger(1000), path) == 0
    assert "not a reply ledger" in caplog.text
    assert load_ledger(ReplyLedger(1000), tmp_path / "missing.bin") == 0


def test_a_sealed_history_opens_only_here_and_only_as_a_history() -> None:
    items = [{"role": "user", "content": "héllo"}, {"type": "function_call_output", "output": "x"}]
    seal = ReplySeal(b"k" * 32, "model-a")
    blob = seal.seal_history(items)
    assert blob.startswith("h1.")
    size = len(json.dumps(items, ensure_ascii=False, separators=(",", ":")).encode())
    assert seal.open_history(blob, 1 << 20) == (items, size)
    # Not bound to the model: a history renders under any.
    assert ReplySeal(b"k" * 32, "model-b").open_history(blob, 1 << 20) == (items, size)
    mid = len(blob) // 2
    flipped = blob[:mid] + ("A" if blob[mid] != "A" else "B") + blob[mid + 1 :]
    reply_blob = seal.seal(GeneratedReply((1,), (2,)))
    relabelled = "h1." + reply_blob.partition(".")[2]
    for bad in (flipped, relabelled, reply_blob, "h1.", "", "not a blob"):
        with pytest.raises(ValueError, match="not sealed by this server"):
            seal.open_history(bad, 1 << 20)
    with pytest.raises(ValueError, match="not sealed by this server"):
        ReplySeal(b"x" * 32, "model-a").open_history(blob, 1 << 20)  # another server's key
    # A history sealed as a reply's blob is no reply either.
    assert seal.open("g1." + blob.partition(".")[2]) is None
    with pytest.raises(ValueError, match="more than 10 bytes"):
        seal.open_history(blob, 10)
    with pytest.raises(ValueError, match=f"{size} bytes of JSON, over 10"):
        seal.seal_history(items, 10)
