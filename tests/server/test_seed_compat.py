"""gezel-trio as a drop-in for the seed sidecar, seen from its supervisor.

The supervisor spawns the seed with its command line and reads stdout line
by line: start-up lines, ``Prefill:`` markers that keep its pre-first-byte
watchdog quiet, and a classifier that reads a bare ``SomeError: message``
line (the last line of a Python traceback) as an engine death and tears the
process down. This module is that supervisor: it starts the real server
process (CLI, hypercorn, MLX backend on a demo model) with every flag the
seed declares, parses stdout with the two regular expressions the seed's
comments describe, drives a long prefill and a contained failure, and checks
the cache endpoints' seed fields.

The one addition to the real server is a fault: the subprocess wraps the
grammar processor of any request whose JSON schema names the property
``explode_on_the_host`` so that it raises on its third call - inside
``BatchGenerator.next()`` on the host thread, as a processor bug would.
Everything else is the product as shipped. Lines are read by a thread with
a deadline per wait; no test sleeps.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
import trio

from gezel_trio.http.app import HttpSettings
from tests.support.inprocess import served
from tests.support.seed import LEAF, PREFILL, STEP, TAGGED, seed_command_line

pytestmark = pytest.mark.slow

# Long enough for the seed's 2048-token minimum on the demo tokenizer.
LONG_TEXT = "The archive keeps every ledger of the northern harbour. " * 115
MARKER_INTERVAL = 0.25
DEADLINE = 120.0

SCRIPT = """
import sys
from gezel_trio import cli
from gezel_trio.mlx import decoding

real = decoding.make_grammar_processor


def make(constraint, *args, **kwargs):
    processor = real(constraint, *args, **kwargs)
    if "explode_on_the_host" not in constraint.grammar:
        return processor
    calls = [0]

    def exploding(tokens, logits):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("the grammar processor broke")
        return processor(tokens, logits)

    return exploding


decoding.make_grammar_processor = make
sys.exit(cli.main(sys.argv[1:]))
"""


class Stdout:
    """Every stdout line with the time it was read, from a reader thread."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        self.lines: list[tuple[float, str]] = []
        self._new: queue.Queue[tuple[float, str] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self._thread.start()
        self._seen = 0

    def _read(self, stream: Iterator[str]) -> None:
        for line in stream:
            self._new.put((time.monotonic(), line.rstrip("\n")))
        self._new.put(None)

    def _pull(self, timeout: float) -> bool:
        try:
            item = self._new.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return False
        if item is None:
            raise AssertionError(f"stdout closed; it said:\n{self.text()}")
        self.lines.append(item)
        return True

    def wait_for(self, match: Callable[[str], object], what: str) -> str:
        """The first line from the last one returned on that ``match``es."""
        deadline = time.monotonic() + DEADLINE
        while True:
            while self._seen < len(self.lines):
                line = self.lines[self._seen][1]
                self._seen += 1
                if match(line):
                    return line
            if not self._pull(deadline - time.monotonic()):
                raise AssertionError(f"no {what} within {DEADLINE} s; stdout:\n{self.text()}")

    def drain(self) -> None:
        """Take what has arrived so far (a reply came, its lines were written first)."""
        while self._pull(0.0):
            pass

    def rest(self) -> None:
        """Everything up to the end of stdout (the process has exited)."""
        self._thread.join(timeout=30)
        while (item := self._new.get_nowait()) is not None:
            self.lines.append(item)

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


@pytest.fixture(scope="module")
def seed_server(
    dense_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, subprocess.Popen[str], Stdout, Path]]:
    work = tmp_path_factory.mktemp("seed")
    stderr = work / "stderr.txt"
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SCRIPT,
                *seed_command_line(dense_model, work),
                # Ours, for a test-sized cadence: the seed's 4 s would need a
                # prefill of many seconds to show two markers.
                "--prefill-marker-interval",
                str(MARKER_INTERVAL),
                "--log-level",
                "WARNING",
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    out = Stdout(proc)
    try:
        line = out.wait_for(lambda s: s.startswith("gezel-trio listening on "), "listening line")
        yield line.split()[-1], proc, out, stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        out.rest()
        bare = [line for _, line in out.lines if LEAF.match(line)]
        assert bare == [], "a supervisor would have killed a healthy server"
        # Nor on stderr, where the logs' tracebacks go (indented there).
        logs = stderr.read_text().splitlines()
        assert "  | RuntimeError: the grammar processor broke" in logs
        assert [line for line in logs if LEAF.match(line)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out._thread.join(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()


def test_the_seed_command_line_starts_it_with_the_seed_start_up_lines(
    seed_server: tuple[str, subprocess.Popen[str], Stdout, Path], dense_model: Path
) -> None:
    _url, proc, out, stderr = seed_server
    startup = [line for _, line in out.lines]
    expected = [
        f"Started server process [{proc.pid}]",
        "Waiting for application startup.",
        f"Loading model from: {dense_model}",
        "Model and processor loaded successfully.",
        re.compile(r"\[batch\] engine ready max_concurrency=2\b.*"),
        "Application startup complete.",
        re.compile(r"Uvicorn running on http://127\.0\.0\.1:\d+ \(Press CTRL\+C to quit\)"),
        re.compile(r"gezel-trio listening on http://127\.0\.0\.1:\d+"),
    ]
    assert len(startup) >= len(expected), startup
    for line, want in zip(startup, expected, strict=False):
        if isinstance(want, str):
            assert line == want
        else:
            assert want.fullmatch(line), line
    notices = stderr.read_text()
    for flag in ("--spec-draft-model", "--vision"):
        assert f"gezel-trio: {flag}" in notices, notices
    # --kv-bits 8 is honoured where it can be: the tiny model's 16-wide
    # heads are narrower than any quantization group.
    assert "kv-bits 8: 4 attention layer(s) stay unquantized" in notices, notices
    assert "--external-ple-dir: not applicable" in notices


def test_a_long_prefill_prints_tagged_markers_at_the_interval(
    seed_server: tuple[str, subprocess.Popen[str], Stdout, Path],
) -> None:
    url, _proc, out, _stderr = seed_server
    out.drain()
    start = len(out.lines)
    with httpx.Client(base_url=url, timeout=DEADLINE) as client:
        long = client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": LONG_TEXT}],
                "max_tokens": 2,
                "cache_id": "long-session",
            },
        )
        short = client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "A short question."}],
                "max_tokens": 2,
                "cache_id": "short-session",
            },
        )
    assert long.status_code == 200, long.text
    assert short.status_code == 200, short.text
    usage = long.json()["usage"]
    to_prefill = usage["input_tokens"] - usage["cached_tokens"]
    assert to_prefill >= 2048, "the prompt must pass the seed's minimum"
    out.drain()
    markers = [(t, PREFILL.match(line)) for t, line in out.lines[start:] if "Prefill" in line]
    assert all(m is not None for _, m in markers), "a marker the supervisor cannot parse"
    parsed = [(t, m) for t, m in markers if m is not None]
    assert {m["cache"] for _, m in parsed} == {"long-session"}, "the short request printed"
    assert len(parsed) >= 2, f"{len(parsed)} markers for a {to_prefill}-token prefill"
    dones = [int(m["done"]) for _, m in parsed]
    assert dones == sorted(set(dones)), "progress must advance between markers"
    for _, m in parsed:
        done, total = int(m["done"]), int(m["total"])
        assert total == to_prefill
        assert 0 < done < total, "a marker only while prefill is really progressing"
        assert int(m["pct"]) == min(99, 100 * done // total)
    # Throttled to the interval: never one per chunk. Read times can only
    # bunch lines, so half the interval leaves room for a busy machine.
    times = [t for t, _ in parsed]
    assert min(b - a for a, b in itertools.pairwise(times)) >= MARKER_INTERVAL / 2
    assert len(parsed) < to_prefill // STEP


def test_a_contained_failure_is_tagged_line_by_line_and_the_server_serves_on(
    seed_server: tuple[str, subprocess.Popen[str], Stdout, Path],
) -> None:
    url, proc, out, _stderr = seed_server
    out.drain()
    start = len(out.lines)
    schema = {
        "type": "object",
        "properties": {"explode_on_the_host": {"type": "string"}},
        "required": ["explode_on_the_host"],
    }
    with httpx.Client(base_url=url, timeout=DEADLINE) as client:
        bad = client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Fill the form."}],
                "max_tokens": 12,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "form", "schema": schema},
                },
            },
        )
        assert bad.status_code == 500, bad.text
        assert bad.json()["error"]["code"] == "request_failed"
        assert "the grammar processor broke" in bad.json()["error"]["message"]
        leaf = out.wait_for(
            lambda s: s == "[batch] | RuntimeError: the grammar processor broke", "tagged leaf"
        )
        assert leaf
        after = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Still there?"}], "max_tokens": 3},
        )
        assert after.status_code == 200, after.text
        assert client.get("/health").json()["status"] == "ok"
    assert proc.poll() is None
    out.drain()
    failure = [line for _, line in out.lines[start:] if "Prefill" not in line]
    assert failure[0].startswith("[batch] request ")
    assert "failed alone" in failure[0]
    assert failure[1] == "[batch] | Traceback (most recent call last):"
    assert all(TAGGED.match(line) for line in failure[1:]), failure
    assert not [line for line in failure if LEAF.match(line)]


def test_the_cache_endpoints_carry_the_seed_fields(
    seed_server: tuple[str, subprocess.Popen[str], Stdout, Path],
) -> None:
    url, _proc, _out, _stderr = seed_server
    with httpx.Client(base_url=url, timeout=DEADLINE) as client:
        warm = client.post(
            "/v1/cache/warm",
            json={
                "model": "whatever-the-supervisor-calls-it",
                "cache_id": "warm-session",
                "messages": [{"role": "system", "content": "You keep the harbour ledgers."}],
                "persist": True,
            },
        )
        assert warm.status_code == 200, warm.text
        body = warm.json()
        assert (body["warmed"], body["persisted"]) == (True, True)
        assert body["token_count"] > 0
        before = time.time()
        client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Hello."}],
                "max_tokens": 2,
                "cache_id": "stats-session",
            },
        )
        entries = {e["cache_id"]: e for e in client.get("/v1/cache/stats").json()["data"]}
        for name in ("warm-session", "stats-session"):
            entry = entries[name]
            assert isinstance(entry["token_count"], int)
            assert entry["token_count"] > 0
            assert entry["token_count"] == entry["tokens"]
            assert isinstance(entry["est_bytes"], int)
            assert entry["est_bytes"] > 0
            assert isinstance(entry["last_used_ts"], float)
        assert entries["warm-session"]["token_count"] == body["token_count"]
        assert entries["stats-session"]["last_used_ts"] >= before - 1
        gone = client.delete("/v1/cache/never-was")
        assert gone.status_code == 200
        assert json.loads(gone.text)["evicted"] is False
        dropped = client.delete("/v1/cache/stats-session")
        assert dropped.json()["evicted"] is True


async def _tool_call_chunks(model: Path, stream_tool_calls: bool) -> list[dict[str, Any]]:
    """The streamed chunks of one forced tool call, greedy."""
    weather = {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Oslo", "Bergen"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    body = {
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}],
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 60,
        "stream": True,
    }
    settings = HttpSettings(stream_tool_calls=stream_tool_calls)
    chunks = []
    with trio.fail_after(DEADLINE):
        async with (
            served(model, settings) as (_engine, url),
            httpx.AsyncClient(base_url=url, timeout=DEADLINE) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


async def test_stream_tool_calls_off_sends_each_call_whole_at_the_end(dense_model: Path) -> None:
    streamed = await _tool_call_chunks(dense_model, True)
    whole = await _tool_call_chunks(dense_model, False)

    def calls(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("tool_calls")]

    assert len(calls(streamed)) > 1, "on: the arguments arrive in pieces"
    [call_chunk] = calls(whole)
    assert whole.index(call_chunk) == len(whole) - 2, "off: the call comes just before the end"
    assert whole[-1]["choices"][0]["finish_reason"] == "tool_calls"
    [call] = call_chunk["choices"][0]["delta"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert call["id"].startswith("call_")
    pieces = "".join(
        c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] for c in calls(streamed)
    )
    assert call["function"]["arguments"] == pieces
    assert json.loads(call["function"]["arguments"])["city"] in ("Oslo", "Bergen")
