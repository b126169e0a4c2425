"""Every protocol's opt-out of speculative decoding reaches the sequence:
``speculation: false`` on chat completions, completions, Responses and
Messages, and the seed's ``disable_speculation: true`` on chat; a request
that says nothing speculates (the engine decides where it pays).

In-process over the scripted backend, whose script sees each
``GenerationRequest`` as the backend receives it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from gezel_trio.core.request import GenerationRequest
from gezel_trio.http.app import HttpSettings, create_app
from gezel_trio.testing import ScriptedBackend, open_test_engine

CALLS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/responses", {"input": "hi"}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
]


@pytest.mark.parametrize(("path", "body"), CALLS, ids=[p for p, _ in CALLS])
async def test_speculation_false_opts_out_on_every_protocol(
    path: str, body: dict[str, Any]
) -> None:
    seen: list[bool] = []

    def script(_rid: int, request: GenerationRequest) -> Sequence[int]:
        seen.append(request.speculate)
        return [104, 105][: request.max_tokens]

    async with open_test_engine(ScriptedBackend(script=script)) as t:
        async with create_app(t.engine, HttpSettings()).test_app() as app:
            client = app.test_client()
            base = {"model": "m", "max_tokens": 4, **body}
            if path == "/v1/responses":
                base.pop("max_tokens")
                base["max_output_tokens"] = 4
            for extra in ({}, {"speculation": False}, {"speculation": True}):
                r = await client.post(path, json={**base, **extra})
                assert r.status_code == 200, await r.get_data(as_text=True)
            if path == "/v1/chat/completions":
                r = await client.post(path, json={**base, "disable_speculation": True})
                assert r.status_code == 200
            bad = await client.post(path, json={**base, "speculation": "no"})
            assert bad.status_code == 400
    expected = [True, False, True] + ([False] if path == "/v1/chat/completions" else [])
    assert seen == expected
