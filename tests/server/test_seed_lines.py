"""The seed's ``[cache]`` and ``[batch]`` stdout lines from the real server
process (CLI, hypercorn, MLX backend on the dense demo model), read with the
seed client's own regular expressions: a second turn of a cache id prints
``[cache] hit`` with the tokens it reused, and a request queued behind
another (``--max-concurrency 1``) prints ``[batch] waiting`` at once and
``[batch] admitted`` when it starts, and a warm prints ``[cache] warmed``
with its tokens. Lines are read by a thread; every wait
is for a line or a reply, with a deadline; no test sleeps."""

from __future__ import annotations

import queue
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from tests.support.process import FIXED, spawn_server
from tests.support.seed import CACHE_HIT, CACHE_WARMED, LEAF, QUEUE

pytestmark = pytest.mark.slow

DEADLINE = 120.0


class _Lines:
    """stdout, line by line, from a reader thread."""

    def __init__(self, stream: Iterator[str]) -> None:
        self.seen: list[str] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: Iterator[str]) -> None:
        for line in stream:
            self._new.put(line.rstrip("\n"))
        self._new.put(None)

    def wait_for(self, match: Callable[[str], object], what: str) -> str:
        deadline = time.monotonic() + DEADLINE
        while True:
            try:
                line = self._new.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {what}; stdout:\n" + "\n".join(self.seen)) from None
            if line is None:
                raise AssertionError(f"stdout closed before {what}:\n" + "\n".join(self.seen))
            self.seen.append(line)
            if match(line):
                return line


@pytest.fixture(scope="module")
def server(dense_model: Path) -> Iterator[tuple[str, _Lines]]:
    proc = spawn_server(dense_model, "--max-concurrency", "1")
    assert proc.stdout is not None
    lines = _Lines(proc.stdout)
    try:
        ready = lines.wait_for(lambda s: s.startswith("gezel-trio listening on "), "listening")
        yield ready.split()[-1], lines
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert [line for line in lines.seen if LEAF.match(line)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def _turn(client: httpx.Client, messages: list[dict[str, Any]], **body: Any) -> dict[str, Any]:
    reply = client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 8, **FIXED, **body}
    )
    assert reply.status_code == 200, reply.text
    out: dict[str, Any] = reply.json()
    return out


def test_a_second_turn_of_a_cache_id_prints_the_hit_with_the_tokens_it_reused(
    server: tuple[str, _Lines],
) -> None:
    url, lines = server
    mine = re.compile(r"\[cache\] (?:\S+-)?hit cache_id=harbour-session ")
    ask = [{"role": "user", "content": "Name three harbours of the north."}]
    with httpx.Client(base_url=url, timeout=DEADLINE) as client:
        first = _turn(client, ask, cache_id="harbour-session")
        assert first["usage"]["cached_tokens"] == 0
        history = [
            *ask,
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And one more?"},
        ]
        second = _turn(client, history, cache_id="harbour-session")
    reused = second["usage"]["cached_tokens"]
    assert reused > 0
    line = lines.wait_for(mine.search, "the second turn's hit line")
    hit = CACHE_HIT.search(line)
    assert hit is not None, line
    assert int(hit[1]) == reused
    assert line == f"[cache] hit cache_id=harbour-session prior_tokens={reused}"
    # The first turn reused nothing and printed nothing: this line is the second's.
    assert [s for s in lines.seen if mine.search(s)] == [line]


def test_a_queued_request_prints_waiting_then_admitted(server: tuple[str, _Lines]) -> None:
    url, lines = server
    ask = [{"role": "user", "content": "Tell the whole story of the harbour."}]
    queued: dict[str, Any] = {}

    def second() -> None:
        with httpx.Client(base_url=url, timeout=DEADLINE) as client:
            queued.update(_turn(client, [{"role": "user", "content": "Hi."}], cache_id="later"))

    with (
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
        client.stream(
            "POST",
            "/v1/chat/completions",
            json={"messages": ask, "max_tokens": 4000, "stream": True, "cache_id": "busy", **FIXED},
        ) as busy,
    ):
        assert busy.status_code == 200
        chunks = busy.iter_lines()
        next(line for line in chunks if line.startswith("data: {"))  # it is running
        waiter = threading.Thread(target=second)
        waiter.start()
        waiting = lines.wait_for(
            lambda s: (m := QUEUE.search(s)) is not None and m[2] == "later", "a waiting line"
        )
        # Leaving the stream withdraws the running request; the queued one starts.
    assert waiting == "[batch] waiting cache=later ahead=0 behind=busy"
    admitted = lines.wait_for(lambda s: s.startswith("[batch] admitted cache=later "), "admitted")
    assert re.fullmatch(r"\[batch\] admitted cache=later waited=\d+\.\ds", admitted), admitted
    waiter.join(timeout=DEADLINE)
    assert queued["choices"][0]["finish_reason"] == "length"


def test_a_warm_prints_the_warmed_line_with_its_tokens(server: tuple[str, _Lines]) -> None:
    url, lines = server
    with httpx.Client(base_url=url, timeout=DEADLINE) as client:
        warm = client.post(
            "/v1/cache/warm",
            json={
                "cache_id": "warm-harbour",
                "messages": [{"role": "system", "content": "You keep the harbour ledgers."}],
            },
        )
    assert warm.status_code == 200, warm.text
    tokens = warm.json()["token_count"]
    line = lines.wait_for(lambda s: "warmed cache_id=warm-harbour " in s, "the warmed line")
    warmed = CACHE_WARMED.search(line)
    assert warmed is not None, line
    assert int(warmed[1]) == tokens
    assert line == f"[cache] warmed cache_id=warm-harbour tokens={tokens} (prior=0, persist=False)"
