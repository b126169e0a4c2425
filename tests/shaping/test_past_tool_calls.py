"""``--drop-past-tool-calls``, the seed's history rule: for a template that
renders a tool result without its call (the demo models' Hermes/Qwen-style
one), the history's assistant tool calls are left out of the prompt and
their results stay; a template that pairs each result with its call (Gemma
style) keeps them. Rendered with the demo model's tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gezel_trio.shaping.prompt import ChatTemplateRenderer

# Gemma's shape: a tool result is rendered only as the answer to a call.
PAIRING = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.index0 > 0 and messages[loop.index0 - 1].tool_calls %}"
    "{{- '<result>' + m.content + '</result>' }}"
    "{%- endif %}"
    "{%- else %}"
    "{{- '<' + m.role + '>' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{{- '<call>' + c.function.name + '</call>' }}{%- endfor %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<assistant>' }}{%- endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


def call(i: int) -> dict[str, Any]:
    return {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "read_file", "arguments": f'{{"path": "file{i}.txt"}}'},
    }


HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Read two files."},
    {"role": "assistant", "content": None, "tool_calls": [call(1)]},
    {"role": "tool", "tool_call_id": "call_1", "content": "RESULT-ONE"},
    {"role": "assistant", "content": "Now the second.", "tool_calls": [call(2)]},
    {"role": "tool", "tool_call_id": "call_2", "content": "RESULT-TWO"},
]


def _tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def render(renderer: ChatTemplateRenderer, override: str | None = None) -> str:
    return renderer.render(
        HISTORY, tools=TOOLS, template_kwargs={}, template_override=override
    ).text


def test_the_hermes_style_history_loses_its_calls_and_keeps_the_results(
    dense_model: Path,
) -> None:
    tokenizer = _tokenizer(dense_model)
    kept = render(ChatTemplateRenderer(tokenizer))
    dropped = render(ChatTemplateRenderer(tokenizer, drop_past_tool_calls=True))
    for path in ("file1.txt", "file2.txt"):
        assert path in kept  # the standard rendering
        assert path not in dropped
    assert kept.count("<tool_call>\n{") - dropped.count("<tool_call>\n{") == 2
    for text in ("RESULT-ONE", "RESULT-TWO", "Now the second.", "<tool_response>"):
        assert text in dropped
    # The tools stay offered: only the history's calls went.
    assert "# Tools" in dropped
    assert dropped.count("read_file") == kept.count("read_file") - 2


def test_a_pairing_template_keeps_its_calls(dense_model: Path) -> None:
    renderer = ChatTemplateRenderer(_tokenizer(dense_model), drop_past_tool_calls=True)
    text = render(renderer, PAIRING)
    assert text.count("<call>read_file</call>") == 2
    assert "<result>RESULT-ONE</result>" in text


@pytest.mark.parametrize("drop", [False, True])
def test_a_history_without_calls_renders_the_same_either_way(dense_model: Path, drop: bool) -> None:
    tokenizer = _tokenizer(dense_model)
    plain = [HISTORY[0], HISTORY[1], {"role": "assistant", "content": "Done."}]
    renderer = ChatTemplateRenderer(tokenizer, drop_past_tool_calls=drop)
    got = renderer.render(plain, tools=TOOLS, template_kwargs={}, template_override=None)
    want = ChatTemplateRenderer(tokenizer).render(
        plain, tools=TOOLS, template_kwargs={}, template_override=None
    )
    assert got.tokens == want.tokens
