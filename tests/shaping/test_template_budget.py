"""A request's own chat template renders under a time and output budget.

``chat_template_override`` is client code: a 116-byte ``{{ 'x' * 20000000 }}``
rendered for 33 s and 3.1 GB, and nested loops kept a worker thread busy
after the client left. Each bomb here is refused as an ``InvalidRequest``
naming ``chat_template_override``, with the bound that stopped it in the
message; the renders run on a worker thread under ``trio.fail_after`` only
as a guard against a hang (nothing is timed). A template that is not a bomb
renders exactly as transformers renders it. Rendered with the demo model's
tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from gezel_trio.core.errors import InvalidRequest
from gezel_trio.shaping import prompt
from gezel_trio.shaping.prompt import ChatTemplateRenderer
from gezel_trio.shaping.template_budget import BoundedTemplates, TemplateBudget

USER = [{"role": "user", "content": "hello"}]
GUARD_S = 120  # a hang guard, far past any budget below


def _tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@pytest.fixture(scope="module")
def tokenizer(dense_model: Path) -> Any:
    return _tokenizer(dense_model)


def refused(renderer: ChatTemplateRenderer, template: str) -> InvalidRequest:
    """Render ``template`` on a worker thread; the ``InvalidRequest`` it raises."""

    def attempt() -> None:
        renderer.render(USER, tools=None, template_kwargs={}, template_override=template)

    async def guarded() -> None:
        with trio.fail_after(GUARD_S):
            await trio.to_thread.run_sync(attempt, abandon_on_cancel=True)

    with pytest.raises(InvalidRequest) as caught:
        trio.run(guarded)
    assert caught.value.param == "chat_template_override"
    return caught.value


SIZE_BOMBS = [
    "{{ 'x' * 20000000 }}",
    "{{ ['x'] * 20000000 }}",
    "{{ 'x' * 3000000 + 'y' * 3000000 }}",
    "{% set ns = namespace(s='xx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s }}",
    "{% macro grow(s, n) %}{{ grow(s ~ s, n - 1) if n else s }}{% endmacro %}{{ grow('x', 40) }}",
    "{{ ('x' * 1000000).join(range(100000)|map('string')) }}",
    "{{ range(100000)|map('string')|join('x' * 1000000) }}",
    "{{ ('x' * 1000000)|replace('x', 'yyyyyyyyyy') }}",
    "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
]


@pytest.mark.parametrize("template", SIZE_BOMBS)
def test_a_template_that_builds_too_much_is_refused_by_the_size_bound(
    tokenizer: Any, template: str
) -> None:
    error = refused(ChatTemplateRenderer(tokenizer), template)
    assert "more than 4000000 characters" in str(error)


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'x'|center(999999999) }}",
        "{{ 'x'.ljust(999999999) }}",
        "{{ '%999999999s' % 'x' }}",
        "{{ '{:>999999999}'.format('x') }}",
        "{{ 'x'|indent(999999999, true) }}",
    ],
)
def test_a_width_of_millions_is_refused_before_it_is_built(tokenizer: Any, template: str) -> None:
    error = refused(ChatTemplateRenderer(tokenizer), template)
    assert "size of more than" in str(error) or "width of millions" in str(error)


@pytest.mark.parametrize(
    "template",
    [
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
        "{% for a in range(100000) %}{% for b in range(100000) %}{% if a == b %}{% endif %}"
        "{% endfor %}{% endfor %}x",
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
        "{{ f(60) }}",
        "{% for m in messages * 1000 %}{% for a in range(100000) %}{% endfor %}{% endfor %}",
    ],
)
def test_a_template_that_runs_on_is_stopped_by_its_deadline(tokenizer: Any, template: str) -> None:
    renderer = ChatTemplateRenderer(tokenizer, template_budget=TemplateBudget(seconds=0.2))
    error = refused(renderer, template)
    assert "time budget" in str(error)


def test_the_model_template_as_an_override_renders_as_transformers_renders_it(
    tokenizer: Any,
) -> None:
    """The bounded sandbox renders the demo model's own (Qwen-style) template,
    with tools, a tool round and a later system message, to the same tokens."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Read a file."},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should read it.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "a.txt"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "CONTENTS"},
        {"role": "user", "content": "Thanks."},
    ]
    for kwargs in ({}, {"enable_thinking": False}):
        own = ChatTemplateRenderer(tokenizer).render(
            messages, tools=tools, template_kwargs=kwargs, template_override=None
        )
        overridden = ChatTemplateRenderer(tokenizer).render(
            messages,
            tools=tools,
            template_kwargs=kwargs,
            template_override=tokenizer.chat_template,
        )
        assert overridden.text == own.text
        assert overridden.tokens == own.tokens


def test_a_template_under_the_budget_still_fails_as_a_template(tokenizer: Any) -> None:
    """A template error is still the messages' 400, not the budget's."""
    with pytest.raises(InvalidRequest) as caught:
        ChatTemplateRenderer(tokenizer).render(
            USER,
            tools=None,
            template_kwargs={},
            template_override="{{ raise_exception('no such role') }}",
        )
    assert caught.value.param == "messages"
    assert "no such role" in str(caught.value)


def test_distinct_overrides_keep_bounded_probe_answers(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every distinct override used to be kept whole by each probe; the
    answers are now kept by digest in an LRU of ``MAX`` entries."""
    monkeypatch.setattr(prompt._ProbeMemo, "MAX", 8)
    renderer = ChatTemplateRenderer(tokenizer)
    history = [*USER, {"role": "assistant", "content": "hi"}, {"role": "system", "content": "s"}]
    for i in range(30):
        loop = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        template = loop + "#" * 2000 + str(i)
        renderer.render(history, tools=None, template_kwargs={}, template_override=template)
    for memo in (renderer._needs_linkage, renderer._system_in_place):
        assert len(memo) == 8


def test_compiled_overrides_are_bounded_by_their_bytes() -> None:
    templates = BoundedTemplates(TemplateBudget(), max_bytes=10_000)
    for i in range(40):
        templates.compile("{{ messages|length }}" + "#" * 1000 + str(i))
    assert templates.held_bytes() <= 10_000
