"""Memory on the real server (hypercorn, the MLX backend, the tiny dense
demo model): a prompt whose KV the memory limit cannot hold is a 400 naming
the sizes on every protocol, and ``/metrics`` shows every kind of memory the
process holds.

The tiny dense model keeps 1,024 bytes of KV per token (4 layers, 2 KV
heads of 16 float32 values, keys and values) beside 1.6 MiB of weights, so
``--memory-limit-mb 2`` leaves room for about 380 tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from gezel_trio import Engine
from tests.support.inprocess import served

HANG = 120
LONG = "harbour " * 600  # ~600 tokens: more KV than the room
ASKS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 4}),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 4}),
    ("/v1/responses", {"input": LONG, "max_output_tokens": 16}),
    (
        "/v1/messages",
        {"model": "demo", "messages": [{"role": "user", "content": LONG}], "max_tokens": 4},
    ),
]


def _error(body: dict[str, Any]) -> dict[str, Any]:
    error: dict[str, Any] = body["error"]
    return error


async def test_a_prompt_whose_kv_cannot_fit_is_a_400_on_every_protocol(dense_model: Path) -> None:
    with trio.fail_after(HANG):
        async with (
            served(dense_model, memory_limit_mb=2) as (engine, url),
            httpx.AsyncClient(base_url=url, timeout=HANG) as client,
        ):
            kv = engine.info.kv
            assert kv is not None
            assert kv.per_token == 1024
            assert 0 < engine.info.kv_room < 2 * 2**20
            for path, body in ASKS:
                r = await client.post(path, json=body)
                assert r.status_code == 400, (path, r.text)
                message = _error(r.json())["message"]
                assert "of KV for" in message, path
                assert "the memory limit leaves" in message, path
            # What fits still runs, and the engine is as healthy as before.
            r = await client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            )
            assert r.status_code == 200, r.text
            assert (await client.get("/health")).json()["status"] == "ok"


def _gauges(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            what = sample.labels.get("what")
            out[f"{sample.name}:{what}" if what else sample.name] = sample.value
    return out


def _scraped(engine: Engine) -> dict[str, float]:
    return _gauges(engine.metrics.exposition().decode())


async def test_metrics_show_every_kind_of_memory(dense_model: Path) -> None:
    with trio.fail_after(HANG):
        async with (
            served(dense_model) as (engine, url),
            httpx.AsyncClient(base_url=url, timeout=HANG) as client,
        ):
            before = _gauges((await client.get("/metrics")).text)
            # No --memory-limit-mb: the buffer cache is capped all the same
            # (the seed's 1 GB, or MLX's own where smaller: 32 MB on the CPU).
            assert 0 < before["gezel_mlx_cache_limit_bytes"] <= 2**30
            assert before["gezel_process_resident_memory_bytes"] > 50 * 2**20
            assert before["gezel_mlx_active_memory_bytes"] > 0
            assert before["gezel_bookkeeping:stored_response_bytes"] == 0
            assert "gezel_bookkeeping:template_probe_entries" in before
            assert "gezel_bookkeeping:schema_check_chars" in before
            assert before["gezel_bookkeeping:seeded_prefix_ids"] == 0
            r = await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 8})
            assert r.status_code == 200, r.text
            # The engine goes idle after the turn and gives the buffer cache
            # back; the figures arrive at the exchange after the trim.
            await engine.wait_until(lambda _: _scraped(engine)["gezel_mlx_cache_memory_bytes"] == 0)
            after = _gauges((await client.get("/metrics")).text)
            assert after["gezel_mlx_cache_memory_bytes"] == 0
            assert after["gezel_bookkeeping:stored_response_bytes"] > 0
            assert after["gezel_mlx_peak_memory_bytes"] >= after["gezel_mlx_active_memory_bytes"]
            assert after["gezel_mlx_peak_memory_bytes"] > before["gezel_mlx_active_memory_bytes"]
            assert after["gezel_cache_bytes"] > 0  # the turn's KV, kept in the prompt cache


pytestmark = pytest.mark.trio
