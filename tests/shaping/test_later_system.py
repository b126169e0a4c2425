"""A system message in the middle of a conversation renders where it stands:
as the template renders it when the template keeps it in place (both demo
models and SmolLM2 do), else as a user-side reminder at the same place, so
everything before it renders exactly as the previous turn did."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gezel_trio.shaping.prompt import ChatTemplateRenderer, later_system_as_reminders

# The shape of Qwen's templates: a system message anywhere but first raises.
FIRST_ONLY = (
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and not loop.first %}"
    "{{- raise_exception('System message must be at the beginning.') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# A template that drops every system message but the first.
DROPS = FIRST_ONLY.replace(
    "{{- raise_exception('System message must be at the beginning.') }}", ""
).replace("{%- endif %}{{- '<|im_start|>'", "{%- else %}{{- '<|im_start|>'", 1)
DROPS = DROPS.replace("'<|im_end|>\\n' }}", "'<|im_end|>\\n' }}{%- endif %}", 1)

HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "List the files."},
    {"role": "assistant", "content": "src, tests, docs."},
]
REMINDER = {"role": "system", "content": "The user changed README.md."}
NEXT = {"role": "user", "content": "Read it."}


def _tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def test_a_reminder_opens_the_next_user_turn() -> None:
    out = later_system_as_reminders([*HISTORY, REMINDER, NEXT])
    assert out[:3] == HISTORY
    assert out[3] == {
        "role": "user",
        "content": "<system-reminder>\nThe user changed README.md.\n</system-reminder>\n\nRead it.",
    }
    assert len(out) == 4


def test_a_reminder_with_no_user_turn_after_it() -> None:
    # After an assistant turn, at the end: a user message of its own.
    out = later_system_as_reminders([*HISTORY, REMINDER])
    assert out[-1]["role"] == "user"
    assert "README.md" in out[-1]["content"]
    # After a user turn, before a tool result: it closes that user turn.
    convo = [*HISTORY[:2], REMINDER, {"role": "assistant", "content": "ok"}]
    out = later_system_as_reminders(convo)
    assert out[1]["content"].startswith("List the files.\n\n<system-reminder>")
    assert [m["role"] for m in out] == ["system", "user", "assistant"]


def test_leading_system_messages_stay() -> None:
    convo = [HISTORY[0], {"role": "developer", "content": "Be brief."}, *HISTORY[1:]]
    assert later_system_as_reminders(convo) == convo


@pytest.mark.parametrize("template", [FIRST_ONLY, DROPS], ids=["raises", "drops"])
def test_templates_that_allow_system_only_first_get_a_reminder(
    dense_model: Path, template: str
) -> None:
    renderer = ChatTemplateRenderer(_tokenizer(dense_model))

    def text(messages: list[dict[str, Any]], gen: bool = True) -> str:
        r = renderer.render(messages, tools=None, template_kwargs={}, template_override=template)
        return r.text

    before = text([*HISTORY, {"role": "user", "content": "x"}])
    after = text([*HISTORY, REMINDER, NEXT])
    assert "The user changed README.md." in after
    shared = before[: before.index("<|im_start|>user\nx")]
    # Everything up to the reminder's turn renders as the previous turn did.
    assert after.startswith(shared + "<|im_start|>user\n<system-reminder>")


@pytest.mark.parametrize("which", ["dense", "hybrid", "smollm2"])
def test_demo_and_default_templates_render_it_in_place(
    which: str, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(f"{which}_model")
    renderer = ChatTemplateRenderer(_tokenizer(path))
    r = renderer.render(
        [*HISTORY, REMINDER, NEXT], tools=None, template_kwargs={}, template_override=None
    )
    assert "<|im_start|>system\nThe user changed README.md.<|im_end|>" in r.text
    assert "<system-reminder>" not in r.text
