"""Fill-in-the-middle: ``suffix`` on ``/v1/completions`` (the OpenAI SDK)
and llama.cpp's ``/infill``, on the fim demo model (the dense kind with
``<fim_prefix>`` / ``<fim_suffix>`` / ``<fim_middle>``): the prompt is laid
out prefix-suffix-middle with the model's tokens, a prefix that grows
between two keystrokes is read from the prompt cache, and a model without
FIM tokens (the dense kind) is refused with a 400 naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest

from tests.support.process import Server, start_server, stop_server

pytestmark = pytest.mark.slow

PREFIX = "def harbour_ferries(schedule):\n    first = schedule[0]\n"
SUFFIX = "\n    return first, last\n"
TYPED = "    last = sched"


@pytest.fixture(scope="module")
def fim(fim_model: Path) -> Iterator[Server]:
    srv = start_server(fim_model)
    yield srv
    assert stop_server(srv) == 0


def _ids(server: Server, text: str) -> list[int]:
    body = {"prompt": text, "add_special_tokens": False}
    tokens: list[int] = httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()["tokens"]
    return tokens


def _fim_ids(server: Server) -> tuple[int, int, int]:
    pre, suf, mid = (_ids(server, t) for t in ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))
    assert len(pre) == len(suf) == len(mid) == 1
    return pre[0], suf[0], mid[0]


def test_suffix_lays_out_prefix_suffix_middle_with_the_models_tokens(fim: Server) -> None:
    pre, suf, mid = _fim_ids(fim)
    layout = [pre, *_ids(fim, PREFIX), suf, *_ids(fim, SUFFIX), mid]
    kw: dict[str, Any] = dict(model="demo", max_tokens=6, temperature=0)
    filled = fim.client.completions.create(prompt=PREFIX, suffix=SUFFIX, **kw)
    assert filled.usage is not None
    assert filled.usage.prompt_tokens == len(layout)
    # The same tokens sent as ids give the same greedy middle.
    same = fim.client.completions.create(prompt=layout, **kw)
    assert filled.choices[0].text == same.choices[0].text


def test_a_growing_prefix_is_read_from_the_cache_between_keystrokes(fim: Server) -> None:
    _fim_ids(fim)  # the model has them
    prefix = "# the night ferry\n" + PREFIX
    kw: dict[str, Any] = dict(model="demo", max_tokens=2, temperature=0, suffix=SUFFIX)
    fim.client.completions.create(prompt=prefix, **kw)
    typed = fim.client.completions.create(prompt=prefix + TYPED, **kw)
    assert typed.usage is not None
    details = typed.usage.prompt_tokens_details
    assert details is not None
    cached = details.cached_tokens or 0
    # PRE and the previous prefix (its last token may merge with what was typed).
    assert cached >= 1 + len(_ids(fim, prefix)) - 1
    assert cached < typed.usage.prompt_tokens


def test_infill_answers_as_llama_cpp_and_reuses_all_but_the_typed_line(fim: Server) -> None:
    pre, suf, mid = _fim_ids(fim)
    extra = [{"filename": "tides.py", "text": "HIGH_TIDE = 6\n"}]
    body: dict[str, Any] = {
        "input_prefix": PREFIX,
        "input_suffix": SUFFIX,
        "input_extra": extra,
        "prompt": "    la",
        "n_predict": 3,
        "temperature": 0,
    }
    first = httpx.post(f"{fim.url}/infill", json=body, timeout=60).json()
    before = [pre, *_ids(fim, PREFIX), suf, *_ids(fim, SUFFIX), mid]
    # No file separator in this vocabulary: the extra context goes in as text.
    expected = [*_ids(fim, "HIGH_TIDE = 6\n"), *before, *_ids(fim, "    la")]
    assert first["stop"] is True
    assert first["tokens_evaluated"] == len(expected)
    assert first["tokens_predicted"] == 3
    assert first["stop_type"] == "limit"
    assert isinstance(first["content"], str)

    # The next keystroke grows the line after the middle token: everything
    # before it is read from the cache.
    with httpx.stream(
        "POST", f"{fim.url}/infill", json={**body, "prompt": "    las", "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        frames = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    *deltas, last = frames
    assert deltas
    assert all(f["stop"] is False for f in deltas)
    assert last["stop"] is True
    assert last["tokens_cached"] >= len(_ids(fim, "HIGH_TIDE = 6\n")) + len(before)
    assert last["timings"]["prompt_n"] == last["tokens_evaluated"] - last["tokens_cached"]


def test_a_model_without_fim_tokens_is_refused_naming_the_field(dense_server: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="fill-in-the-middle") as caught:
        dense_server.client.completions.create(
            model="demo", prompt=PREFIX, suffix=SUFFIX, max_tokens=2
        )
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["param"] == "suffix"
    r = httpx.post(
        f"{dense_server.url}/infill",
        json={"input_prefix": PREFIX, "input_suffix": SUFFIX},
        timeout=30,
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "input_prefix"
    assert "fill-in-the-middle" in r.json()["error"]["message"]


def test_suffix_with_token_ids_and_a_zero_n_predict_are_400s(fim: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="text prompt") as caught:
        fim.client.completions.create(model="demo", prompt=[1, 2, 3], suffix=SUFFIX, max_tokens=2)
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["param"] == "suffix"
    r = httpx.post(f"{fim.url}/infill", json={"input_prefix": "x", "n_predict": 0}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "n_predict"
