"""Every body and every SSE event is JSON, on the real demo model in process.

JSON has no ``NaN`` and no ``Infinity``; Python's writer emits them, and
JavaScript's and Go's parsers then reject the whole response. Every answer
here is read with a parser that refuses them (``strict``), the way those
clients read it. Three sources of non-finite numbers are covered: tokens a
grammar masked, listed among ``top_logprobs`` as ``-Infinity`` (now -9999.0); sampling
parameters that turn the distribution into ``NaN`` (refused now, each a 400
naming itself, before any model runs: on the scripted engine); and any that
slips through anyway, which the one JSON writer (``http.strict.dump_json``)
raises on instead of sending.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
import trio
from quart_trio import QuartTrio

from gezel_trio.http.sse import frame
from gezel_trio.http.strict import StrictJSONProvider, dump_json
from tests.support.inprocess import served, served_scripted

HANG = 60

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
TOOL = {
    "type": "function",
    "function": {
        "name": "forecast",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
USER = [{"role": "user", "content": "Plan a trip."}]
LOGPROBS = {"logprobs": True, "top_logprobs": 20, "temperature": 0, "max_tokens": 24}


def _refuse(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict(text: str) -> Any:
    """``text`` as a JavaScript or Go client parses it."""
    return json.loads(text, parse_constant=_refuse)


def events(text: str) -> Iterator[Any]:
    """Each SSE event's data, strictly parsed."""
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield strict(line.removeprefix("data: "))


def chat_logprobs(body: Any) -> list[dict[str, Any]]:
    """Every token entry of a chat body or chunk."""
    out: list[dict[str, Any]] = []
    for choice in body.get("choices", []):
        out += (choice.get("logprobs") or {}).get("content") or []
    return out


def responses_logprobs(body: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for item in body.get("output", []):
        for part in item.get("content") or []:
            out += part.get("logprobs") or []
    return out


def assert_finite(entries: list[dict[str, Any]]) -> None:
    assert entries, "no logprobs came back"
    for entry in entries:
        assert math.isfinite(entry["logprob"]), entry
        assert entry["logprob"] >= -9999.0, entry
        for alt in entry["top_logprobs"]:
            assert math.isfinite(alt["logprob"]), entry
        assert len(entry["top_logprobs"]) == 20, entry
    # A grammar step allows few tokens: the masked ones are floored, as vLLM does.
    assert any(alt["logprob"] == -9999.0 for e in entries for alt in e["top_logprobs"])


async def test_constrained_top_logprobs_are_json_with_masked_tokens_floored(
    dense_model: Path,
) -> None:
    with trio.fail_after(HANG):
        async with served(dense_model) as (_, url), httpx.AsyncClient(base_url=url) as client:
            constrained: list[dict[str, Any]] = [
                {
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "trip", "schema": SCHEMA},
                    }
                },
                {
                    "tools": [TOOL],
                    "tool_choice": {"type": "function", "function": {"name": "forecast"}},
                },
                {"tools": [TOOL], "tool_choice": "required"},
            ]
            for extra in constrained:
                body = {"messages": USER, **LOGPROBS, **extra}
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                assert_finite(chat_logprobs(strict(r.text)))
                r = await client.post("/v1/chat/completions", json={**body, "stream": True})
                assert r.status_code == 200, r.text
                assert_finite([e for chunk in events(r.text) for e in chat_logprobs(chunk)])
            body = {
                "input": "Plan a trip.",
                "text": {"format": {"type": "json_schema", "name": "trip", "schema": SCHEMA}},
                "top_logprobs": 20,
                "include": ["message.output_text.logprobs"],
                "temperature": 0,
                "max_output_tokens": 24,
            }
            r = await client.post("/v1/responses", json=body)
            assert r.status_code == 200, r.text
            assert_finite(responses_logprobs(strict(r.text)))
            r = await client.post("/v1/responses", json={**body, "stream": True})
            assert r.status_code == 200, r.text
            done = [e for e in events(r.text) if e["type"] == "response.completed"]
            assert_finite(responses_logprobs(done[0]["response"]))


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        # Positive but small enough that a logit divided by it is +inf.
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 0.001}, "repetition_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"min_p": -0.1}, "min_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"top_k": -2}, "top_k"),
    ],
)
async def test_sampling_values_that_break_the_distribution_are_a_400_naming_them(
    extra: dict[str, Any], param: str
) -> None:
    # Refused before any model runs: on the scripted engine.
    with trio.fail_after(HANG):
        async with served_scripted() as (_, url), httpx.AsyncClient(base_url=url) as client:
            for path, body in (
                ("/v1/chat/completions", {"messages": USER, **LOGPROBS}),
                ("/v1/completions", {"prompt": "Once", "logprobs": 5, "max_tokens": 8}),
            ):
                r = await client.post(path, json={**body, **extra})
                assert r.status_code == 400, (path, r.text)
                assert strict(r.text)["error"]["param"] == param, r.text


async def test_the_extremes_of_each_penalty_range_are_served_as_json(dense_model: Path) -> None:
    """At each bound the distribution stays a distribution: every logprob finite."""
    with trio.fail_after(HANG):
        async with served(dense_model) as (_, url), httpx.AsyncClient(base_url=url) as client:
            for extra in (
                {"repetition_penalty": 0.01},
                {"repetition_penalty": 10},
                {"presence_penalty": -2, "frequency_penalty": -2},
                {"presence_penalty": 2, "frequency_penalty": 2, "logit_bias": {"5": 100}},
            ):
                body = {"messages": USER, **LOGPROBS, "top_logprobs": 3, **extra}
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                entries = chat_logprobs(strict(r.text))
                assert len(entries) == 24
                for entry in entries:
                    assert math.isfinite(entry["logprob"]), (extra, entry)
                    assert len(entry["top_logprobs"]) == 3, (extra, entry)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_the_json_writer_refuses_non_finite_numbers(bad: float) -> None:
    """A NaN that slips through is a server bug raised here, never sent."""
    value = {"choices": [{"logprobs": {"content": [{"logprob": bad}]}}]}
    with pytest.raises(ValueError, match="JSON compliant"):
        dump_json(value)
    with pytest.raises(ValueError, match="JSON compliant"):
        dump_json(value, compact=True)
    with pytest.raises(ValueError, match="JSON compliant"):
        frame(value)
    with pytest.raises(ValueError, match="JSON compliant"):
        StrictJSONProvider(QuartTrio(__name__)).dumps(value)
    assert dump_json({"logprob": -9999.0}, compact=True) == '{"logprob":-9999.0}'
