"""The fields an existing router adds to what it forwards: ``vllm-router``
sends SGLang's per-request fields on every chat and completions request
(recorded from vllm-router 0.1.17 below), and its kv_aware policy one on
the ``/tokenize`` that asks for a chat request's tokens. At those values
they are what this server does, and are accepted; any other value is
refused by name, saying what this server does instead. They are declared
fields, not ignored ones: a value other than the one served would change
the answer (``no_stop_trim: true`` keeps the stop string), so it is a 400
rather than silently dropped, and ``--strict-fields`` accepts them as well.

In-process over the scripted backend."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from gezel_trio.core.request import GenerationRequest
from gezel_trio.http.app import HttpSettings, create_app
from gezel_trio.testing import ScriptedBackend, open_test_engine

# What vllm-router 0.1.17 forwarded for a plain request (captured from its
# outgoing body): the client's fields, then its own.
ROUTED_CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": False,
    "max_tokens": 4,
    "logprobs": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}
ROUTED_COMPLETION = {
    "model": "m",
    "prompt": "hi",
    "max_tokens": 4,
    "stream": False,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}
# What vllm-router 0.1.17's kv_aware policy asks each worker for a chat
# request's tokens (after /v1/chat/completions/render, which is not served
# here): docs/scale-out.md, "KV events".
ROUTED_TOKENIZE = {
    "model": "m",
    "continue_final_message": False,
    "messages": [{"role": "user", "content": "hi"}],
}


def _script(_rid: int, request: GenerationRequest) -> Sequence[int]:
    return [104, 105][: request.max_tokens]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", ROUTED_CHAT),
        ("/v1/completions", ROUTED_COMPLETION),
        ("/tokenize", ROUTED_TOKENIZE),
    ],
)
@pytest.mark.parametrize("strict", [False, True])
async def test_a_routed_request_is_answered(path: str, body: dict[str, Any], strict: bool) -> None:
    async with open_test_engine(ScriptedBackend(script=_script)) as t:
        async with create_app(t.engine, HttpSettings(strict_fields=strict)).test_app() as app:
            r = await app.test_client().post(path, json=body)
            assert r.status_code == 200, await r.get_data(as_text=True)
            # Declared, so not named among the ignored.
            assert "x-gezel-ignored-fields" not in r.headers


@pytest.mark.parametrize(
    ("path", "body", "field", "value"),
    [
        ("/v1/chat/completions", ROUTED_CHAT, "no_stop_trim", True),
        ("/v1/chat/completions", ROUTED_CHAT, "continue_final_message", True),
        ("/v1/chat/completions", ROUTED_CHAT, "include_reasoning", False),
        ("/v1/chat/completions", ROUTED_CHAT, "return_hidden_states", True),
        ("/v1/completions", ROUTED_COMPLETION, "skip_special_tokens", False),
        ("/tokenize", ROUTED_TOKENIZE, "continue_final_message", True),
    ],
)
async def test_another_value_is_refused_by_name(
    path: str, body: dict[str, Any], field: str, value: bool
) -> None:
    async with open_test_engine(ScriptedBackend(script=_script)) as t:
        async with create_app(t.engine, HttpSettings()).test_app() as app:
            r = await app.test_client().post(path, json={**body, field: value})
            assert r.status_code == 400
            error = (await r.get_json())["error"]
            assert error["param"] == field
            assert f"{field}: only" in error["message"]
