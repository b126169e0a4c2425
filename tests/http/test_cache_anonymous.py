"""The prompt cache for clients that know nothing of it.

Every request here is what a standard client sends: the official ``openai``
SDK's chat completions with no gezel field (no ``cache_id``, no prefix ids),
or, to leave at an exact point of a prefill, a bare HTTP stream reading the
server's SSE comments. The server is the real hypercorn app over the real
MLX engine, in this Trio run so a test can wait on the engine's own state
(never on a sleep); the SDK runs in a worker thread, as a program would.
Both demo models: the dense one, whose KV any prefix of can seed, and the
hybrid one, whose linear-attention state only checkpoints can.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from gezel_trio import Engine
from gezel_trio.core.cache_plan import SNAPSHOT_MARGIN
from tests.support.inprocess import raw_stream, served

pytestmark = pytest.mark.slow

HANG = 180
PREFILL = re.compile(rb": prefill (\d+)/(\d+)")
SYSTEM = (
    "You are the harbour master's assistant. You keep the berth ledger, answer "
    "questions about tides, ships and cargo, and you always name the berth. "
) * 6


@pytest.fixture(params=["dense", "hybrid"])
def model(request: pytest.FixtureRequest, dense_model: Path, hybrid_model: Path) -> Path:
    return dense_model if request.param == "dense" else hybrid_model


class Client:
    """The sync OpenAI SDK in a worker thread, against the served app."""

    def __init__(self, url: str) -> None:
        self.sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    async def chat(self, messages: list[dict[str, Any]], max_tokens: int = 6) -> Any:
        return await trio.to_thread.run_sync(
            lambda: self.sdk.chat.completions.create(
                model="demo", messages=messages, max_tokens=max_tokens, temperature=0
            )
        )

    async def leave_after(self, messages: list[dict[str, Any]], chunks: int) -> None:
        """Stream, read ``chunks`` content chunks, then close: the client left."""

        def run() -> None:
            stream = self.sdk.chat.completions.create(
                model="demo", messages=messages, max_tokens=2000, temperature=0, stream=True
            )
            seen = 0
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    seen += 1
                    if seen >= chunks:
                        break
            stream.close()

        await trio.to_thread.run_sync(run)


@asynccontextmanager
async def server(model: Path, **engine_kw: Any) -> AsyncIterator[tuple[Engine, Client, str]]:
    async with served(model, **engine_kw) as (engine, url):
        client = Client(url)
        try:
            yield engine, client, url
        finally:
            client.sdk.close()


async def settled(engine: Engine, done: Callable[[], bool]) -> None:
    """Wait until nothing is live and ``done()`` holds in the published view."""
    with trio.fail_after(HANG):
        await engine.wait_until(lambda s: s.live == 0 and done())


def convo(user: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


USERS = [
    "Which berth has the Aurora?",
    "When is high tide tomorrow?",
    "List the cargo of the Nordlys.",
    "Who signed the ledger last night?",
]


async def test_interleaved_conversations_each_reuse_their_own_turn(model: Path) -> None:
    """mlx_lm.server's scenario: conversations interleaved turn by turn, no
    ids. Each next turn is served from its own previous turn, however many
    other conversations ran in between."""
    with trio.fail_after(HANG):
        async with server(model) as (engine, client, _):
            histories = [convo(u) for u in USERS]
            previous = [0] * len(USERS)
            for turn in range(3):
                for i, messages in enumerate(histories):
                    reply = await client.chat(messages)
                    usage = reply.usage
                    if turn == 0 and i > 0:
                        # A first turn shares the system prompt with the others.
                        assert usage.prompt_tokens_details.cached_tokens > 100
                    if turn > 0:
                        cached = usage.prompt_tokens_details.cached_tokens
                        assert cached >= previous[i] - SNAPSHOT_MARGIN, (turn, i, usage)
                    previous[i] = usage.prompt_tokens
                    messages += [
                        {"role": "assistant", "content": reply.choices[0].message.content or ""},
                        {"role": "user", "content": f"And after that, question {turn}?"},
                    ]
            totals = engine.cache_totals
            assert totals.named == 0
            assert totals.hits == totals.lookups - 1  # only the very first was a miss


async def test_retry_after_the_client_left_during_decode(model: Path) -> None:
    messages = convo("Tell me everything about the harbour, berth by berth.")
    async with server(model) as (engine, client, _):
        await client.leave_after(messages, chunks=3)
        await settled(engine, lambda: engine.cache_totals.entries > 0)
        retry = await client.chat(messages)
        # All but the last prompt token: the decode state (dense), or the
        # checkpoint kept before the last token for exactly this (hybrid).
        assert retry.usage.prompt_tokens_details.cached_tokens == retry.usage.prompt_tokens - 1


async def test_retry_after_the_client_left_at_40_percent_of_a_long_prefill(model: Path) -> None:
    messages = convo("Read the whole ledger back to me. " * 60)
    step = 64
    async with server(model, prefill_step_size=step) as (engine, client, url):
        body = {"messages": messages, "max_tokens": 8, "stream": True}
        left_at, buf = 0, b""
        with trio.fail_after(HANG):
            async with raw_stream(url, body) as stream:  # a bare HTTP client
                while not left_at:
                    data = await stream.receive_some()
                    assert data, "the stream ended before 40% of the prefill"
                    buf += data
                    for done, total in PREFILL.findall(buf):
                        assert int(total) > 10 * step, "a long prefill"
                        if int(done) >= 0.4 * int(total):
                            left_at = int(done)
            # Leaving the block closed the connection.
        # The cancellation save shows in the view published after it.
        await settled(engine, lambda: any(e.tokens >= left_at for e in engine.cache_view))
        kept = max(e.tokens for e in engine.cache_view)
        retry = await client.chat(messages)
        # Everything prefilled before leaving is kept (the engine may have
        # run a few more chunks before it heard of the disconnect, never the
        # whole prefill), and the retry starts from it.
        assert left_at <= kept < 0.9 * retry.usage.prompt_tokens
        assert retry.usage.prompt_tokens_details.cached_tokens == kept


async def test_a_restart_through_the_persist_dir_keeps_anonymous_turns(
    model: Path, tmp_path: Path
) -> None:
    messages = convo("Which berth has the Aurora?")
    with trio.fail_after(HANG):
        async with server(model, persist_dir=tmp_path) as (_, client, _url):
            first = await client.chat(messages)
        # Leaving the block shut the engine down, which flushed to disk.
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "And the Nordlys?"},
        ]
        async with server(model, persist_dir=tmp_path) as (engine, client, _url):
            # The store's first view, published at the engine's first step, lists the disk.
            await settled(engine, lambda: engine.cache_totals.disk_entries > 0)
            second = await client.chat(messages)
            cached = second.usage.prompt_tokens_details.cached_tokens
            assert cached >= first.usage.prompt_tokens - SNAPSHOT_MARGIN


async def test_eviction_under_a_small_budget_never_takes_a_pinned_entry(dense_model: Path) -> None:
    # The tiny dense model holds 1 KiB of KV a token: 2 MiB is 2048 tokens,
    # less than the held conversation and five others of ~400 tokens.
    async with server(dense_model, cache_budget_mb=2) as (engine, client, _):
        held = convo("Keep this one: " + "the tide table for the week. " * 20)
        await client.chat(held)
        await settled(engine, lambda: engine.cache_totals.entries > 0)
        held_tokens = max(e.tokens for e in engine.cache_view)
        held += [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": "More."}]
        streaming, others_done = trio.Event(), threading.Event()

        def long_turn() -> None:
            """A long turn of the held conversation: its seed entry is pinned
            until the client leaves, after the others ran."""
            stream = client.sdk.chat.completions.create(
                model="demo", messages=held, max_tokens=20_000, temperature=0, stream=True
            )
            for n, _ in enumerate(stream):
                if n == 2:
                    trio.from_thread.run_sync(streaming.set)
                if others_done.is_set():
                    break
            stream.close()

        with trio.fail_after(HANG):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.to_thread.run_sync, long_turn)
                await streaming.wait()
                for i in range(5):  # other conversations push the store over budget
                    await client.chat(
                        [{"role": "user", "content": f"Unrelated question {i}: " + "words " * 400}]
                    )
                    pinned = [e for e in engine.cache_view if e.pinned]
                    assert [e.tokens for e in pinned] == [held_tokens]
                assert engine.cache_totals.evictions > 0
                others_done.set()
        await settled(engine, lambda: not any(e.pinned for e in engine.cache_view))
        totals = engine.cache_totals
        assert totals.bytes <= totals.budget_bytes * 1.25


async def test_a_shared_system_prompt_is_stored_once(dense_model: Path) -> None:
    config = json.loads((dense_model / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    # keys and values, every layer, float32
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    async with server(dense_model) as (engine, client, _):
        shared = []
        for user in USERS:
            reply = await client.chat(convo(user))
            shared.append(reply.usage.prompt_tokens_details.cached_tokens)
        await settled(engine, lambda: engine.cache_totals.entries == len(USERS))
        totals = engine.cache_totals
        held = sum(e.tokens for e in engine.cache_view)
        assert min(shared[1:]) > 100  # each later conversation shares the system prompt
        unique = held - sum(shared)
        # Stored once: the bytes held are the union of the four conversations,
        # plus at most one block's worth (63 tokens) per divergence.
        assert unique * per_token <= totals.bytes <= (unique + 3 * 63) * per_token
        assert totals.logical_bytes >= held * per_token
        assert totals.logical_bytes - totals.bytes >= 3 * 100 * per_token


async def test_an_anonymous_entry_listed_in_stats_can_be_deleted_by_its_id(
    dense_model: Path, tmp_path: Path
) -> None:
    """Stats lists an unnamed entry under an ``anon:`` id; DELETE with that
    id frees it from memory and disk, and the same request then finds
    nothing to reuse."""
    import httpx2 as httpx

    messages = convo("Which berth has the Aurora?")
    with trio.fail_after(HANG):
        async with server(dense_model, persist_dir=tmp_path) as (_engine, client, url):
            first = await client.chat(messages)
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                assert (await http.post("/admin/flush?settle_ms=5000")).json()["flushed"] > 0
                stats = (await http.get("/v1/cache/stats")).json()
                ids = [e["cache_id"] for e in stats["data"] if e["cache_id"].startswith("anon:")]
                assert ids, stats
                deleted = [(await http.delete(f"/v1/cache/{i}")).json() for i in ids]
                after = (await http.get("/v1/cache/stats")).json()
            again = await client.chat(messages)
    assert all(d["evicted"] and d["memory"] for d in deleted), deleted
    assert any(d["disk"] for d in deleted), deleted
    assert not [e for e in after["data"] if e["cache_id"] in ids]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 0
