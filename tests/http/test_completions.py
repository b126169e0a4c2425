"""Legacy completions, ``/tokenize`` and ``/detokenize``, and ``n > 1`` on
chat and legacy completions, through the real server on the dense
demo model, driven by the official ``openai`` SDK (and plain HTTP for the
routes it has no method for). The refusals and ignored fields, which do not
depend on the model, are checked on the scripted engine's server. The
default model's run of the same SDK calls is in
``tests/clients/test_clients.py``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import openai
import pytest

from tests.support.process import Server
from tests.support.scripted import scripted_server

pytestmark = pytest.mark.slow

FIXED = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(dense_server: Server) -> Server:
    """The session's server on the dense demo model (``tests.support.process``)."""
    return dense_server


@pytest.fixture(scope="module")
def scripted() -> Iterator[Server]:
    """The scripted engine's server: what a request's fields are refused
    for does not depend on the model."""
    with scripted_server() as server:
        yield server


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_a_text_prompt_completes_without_the_chat_template(server: Server) -> None:
    prompt = "Once upon a time"
    r = server.client.completions.create(
        model="demo", prompt=prompt, max_tokens=6, temperature=0, extra_body=FIXED
    )
    (choice,) = r.choices
    assert r.object == "text_completion"
    assert (choice.index, choice.finish_reason) == (0, "length")
    assert choice.text
    tokens = post(server, "/tokenize", {"prompt": prompt}).json()
    assert r.usage is not None
    # The prompt is exactly its tokens: no template around it.
    assert r.usage.prompt_tokens == tokens["count"]
    assert r.usage.completion_tokens == 6
    # Token ids are a prompt too, and give the same greedy text.
    again = server.client.completions.create(
        model="demo", prompt=tokens["tokens"], max_tokens=6, temperature=0, extra_body=FIXED
    )
    assert again.choices[0].text == choice.text
    assert again.usage is not None
    assert again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == tokens["count"] - 1


def test_echo_and_logprobs_give_the_legacy_object(server: Server) -> None:
    prompt = "The sea is"
    r = server.client.completions.create(
        model="demo",
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        echo=True,
        logprobs=2,
        extra_body=FIXED,
    )
    (choice,) = r.choices
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert lp is not None
    assert lp.tokens is not None
    assert lp.token_logprobs is not None
    assert lp.top_logprobs is not None
    assert lp.text_offset is not None
    count = post(server, "/tokenize", {"prompt": prompt}).json()["count"]
    assert len(lp.tokens) == count + 4
    # The echoed prompt's tokens carry no logprob; the generated ones do,
    # with their alternatives (the sampled token always among them).
    assert lp.token_logprobs[:count] == [None] * count
    generated = list(
        zip(lp.tokens[count:], lp.token_logprobs[count:], lp.top_logprobs[count:], strict=True)
    )
    for token, logprob, top in generated:
        assert logprob is not None
        assert logprob <= 0
        assert top is not None
        assert 2 <= len(top) <= 3
        assert top[token] == logprob
    assert lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)


def test_a_streamed_completion_is_text_completion_chunks(server: Server) -> None:
    kw: dict[str, Any] = dict(model="demo", prompt="A list:", max_tokens=8, temperature=0)
    whole = server.client.completions.create(**kw, extra_body=FIXED)
    chunks = list(
        server.client.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}, extra_body=FIXED
        )
    )
    assert all(c.object == "text_completion" for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"
    assert set(finishes[:-1]) == {None}
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8


def test_n_choices_share_the_prompt_and_count_it_once(server: Server) -> None:
    body: dict[str, Any] = dict(
        model="demo", prompt="Three words:", max_tokens=5, temperature=1.0, seed=11, n=3
    )
    r = server.client.completions.create(**body, extra_body=FIXED)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) > 1, "each choice has its own random stream"
    assert r.usage is not None
    assert r.usage.completion_tokens == 15
    count = post(server, "/tokenize", {"prompt": "Three words:"}).json()["count"]
    assert r.usage.prompt_tokens == count
    # Choice i samples with seed + i: choice 0 is what n=1 gives with the seed.
    one = server.client.completions.create(**{**body, "n": 1}, extra_body=FIXED)
    assert one.choices[0].text == texts[0]
    # Streamed, the same choices arrive interleaved, each chunk naming its own.
    chunks = list(server.client.completions.create(**body, stream=True, extra_body=FIXED))
    streamed = ["", "", ""]
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.text
    assert streamed == texts


def prefilled(server: Server) -> float:
    """``/metrics``: prompt tokens the engine computed by prefill."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    (value,) = re.findall(r"^gezel_prompt_tokens_prefilled_total (\S+)$", text, re.M)
    return float(value)


def test_n_choices_prefill_the_prompt_once(server: Server) -> None:
    """For n = 4 the engine computes the prompt once: each sibling computes
    only the prompt's last token (its own logits), seeded from the first."""
    costs = {}
    for n, prompt in ((1, "Zebras graze at dawn, " * 6), (4, "Yaks roam the high hills, " * 6)):
        before = prefilled(server)
        r = server.client.completions.create(
            model="demo", prompt=prompt, max_tokens=2, seed=3, n=n, extra_body=FIXED
        )
        assert len(r.choices) == n
        assert r.usage is not None
        assert r.usage.prompt_tokens_details is not None
        new = r.usage.prompt_tokens - (r.usage.prompt_tokens_details.cached_tokens or 0)
        assert new > r.usage.prompt_tokens // 2, "a fresh prompt"
        costs[n] = (prefilled(server) - before, new)
    assert costs[1][0] == costs[1][1]
    assert costs[4][0] == costs[4][1] + 3


def test_chat_completions_n_greedy_choices_agree(server: Server) -> None:
    kw: dict[str, Any] = dict(
        model="demo",
        messages=[{"role": "user", "content": "Name two colours."}],
        max_tokens=6,
        temperature=0,
        n=2,
        extra_body={**FIXED, "chat_template_kwargs": {"enable_thinking": False}},
    )
    r = server.client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content
    assert r.usage is not None
    assert r.usage.completion_tokens == 12
    contents = ["", ""]
    finishes: list[str | None] = [None, None]
    for c in server.client.chat.completions.create(**kw, stream=True):
        for ch in c.choices:
            contents[ch.index] += ch.delta.content or ""
            finishes[ch.index] = ch.finish_reason or finishes[ch.index]
    assert contents == [r.choices[0].message.content] * 2
    assert finishes == ["length", "length"]


def test_tokenize_and_detokenize(server: Server) -> None:
    text = "Hello, tokens!"
    tok = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"])
    assert tok["max_model_len"] > 0
    back = post(server, "/detokenize", {"tokens": tok["tokens"]}).json()
    assert back["prompt"] == back["content"]
    assert text in back["prompt"]
    # llama.cpp's field names and pieces.
    pieces = post(server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tok["tokens"]
    # Messages are the prompt chat completions would run.
    messages = [{"role": "user", "content": "Hi there"}]
    chat = post(server, "/tokenize", {"messages": messages}).json()
    r = server.client.chat.completions.create(model="demo", messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert r.usage is not None
    assert chat["count"] == r.usage.prompt_tokens


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "x", "n": 5}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 9}, "n"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": [10**9]}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 5}, "n"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "messages"),
        ("/tokenize", {}, None),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    scripted: Server, path: str, body: dict[str, Any], param: str | None
) -> None:
    r = post(scripted, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert error["message"]


def test_an_unknown_field_is_ignored_and_named(scripted: Server) -> None:
    r = post(scripted, "/v1/completions", {"prompt": "x", "max_tokens": 2, "frobnicate": 1})
    assert r.status_code == 200, r.text
    assert r.headers["x-gezel-ignored-fields"] == "frobnicate"


def test_the_sdk_sees_the_400(scripted: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="suffix"):
        scripted.client.completions.create(model="demo", prompt="x", suffix="y")
