"""The real server process on each demo model, driven by the official
``openai`` SDK - what a user of the sidecar actually runs.

The server prints ``gezel-trio listening on URL`` once the model is loaded
and the socket is bound; the fixture reads that line (no sleeps). Teardown
sends SIGTERM and asserts a clean exit: graceful drain is tested every run.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from tests.support.process import FIXED, Server, start_server, stop_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def server(request: pytest.FixtureRequest) -> Server:
    """The session's server on each demo model (``tests.support.process``)."""
    server: Server = request.getfixturevalue(f"{request.param}_server")
    return server


MSG: list[Any] = [{"role": "user", "content": "Write a few words."}]


def test_non_streaming_completion(server: Server) -> None:
    r = server.client.chat.completions.create(
        model="demo", messages=MSG, max_tokens=8, temperature=0, extra_body=FIXED
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.message.content
    assert r.usage is not None
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens > 0
    raw = r.usage.model_dump()
    for key in ("input_tokens", "output_tokens", "cached_tokens", "prompt_tps", "generation_tps"):
        assert key in raw


def test_streaming_matches_non_streaming_and_carries_usage(server: Server) -> None:
    kw: dict[str, Any] = dict(model="demo", messages=MSG, max_tokens=10, temperature=0)
    whole = server.client.chat.completions.create(**kw, extra_body=FIXED)
    chunks = list(
        server.client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}, extra_body=FIXED
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"
    assert all(f is None for f in finishes[:-1])
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert content_chunks
    assert all(c.usage is not None for c in content_chunks)
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10


def test_stop_string_is_not_emitted(server: Server) -> None:
    kw: dict[str, Any] = dict(model="demo", messages=MSG, max_tokens=24, temperature=0)
    full = server.client.chat.completions.create(**kw, extra_body=FIXED).choices[0].message.content
    assert full is not None
    words = full.split()
    stop = words[len(words) // 2]
    r = server.client.chat.completions.create(**kw, stop=[stop], extra_body=FIXED)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[: full.index(stop)]


def test_same_seed_same_text(server: Server) -> None:
    kw: dict[str, Any] = dict(
        model="demo", messages=MSG, max_tokens=12, temperature=0.9, extra_body=FIXED
    )
    a = server.client.chat.completions.create(**kw, seed=1234).choices[0].message.content
    b = server.client.chat.completions.create(**kw, seed=1234).choices[0].message.content
    c = server.client.chat.completions.create(**kw, seed=99).choices[0].message.content
    assert a == b
    assert a != c


def test_concurrent_streams_all_complete(server: Server) -> None:
    lengths = [5, 17, 9, 23, 12, 7]

    def run(n: int) -> tuple[int, str | None]:
        stream = server.client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": f"Stream number {n}."}],
            max_tokens=n,
            temperature=0.7,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=FIXED,
        )
        chunks = list(stream)
        usage = chunks[-1].usage
        assert usage is not None
        finish = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)
        return usage.completion_tokens, finish

    with ThreadPoolExecutor(len(lengths)) as pool:
        results = list(pool.map(run, lengths))
    assert results == [(n, "length") for n in lengths]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b'{"messages": "hello"}', "messages"),
        (b'{"messages": []}', "messages"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', "messages[0].role"),
        (b'{"messages": [{"role": "user", "content": "x"}], "top_p": 7}', "top_p"),
        # Beyond the context window (32768 on the demo models): a max_tokens
        # is cut to fit (tests/server/test_seed_launch.py), a prompt is refused.
        pytest.param(
            json.dumps({"messages": [{"role": "user", "content": "x " * 40_000}]}).encode(),
            "messages",
            id="a-prompt-beyond-the-context",
        ),
        (b"[1, 2, 3]", None),
    ],
)
def test_malformed_requests_get_400_and_the_server_keeps_serving(
    server: Server, body: bytes, param: str | None
) -> None:
    r = server.post(body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["message"]
    assert err["param"] == param
    ok = server.client.chat.completions.create(model="demo", messages=MSG, max_tokens=2)
    assert ok.choices[0].message.content is not None


def test_non_json_content_type_is_refused(server: Server) -> None:
    body = json.dumps({"messages": MSG}).encode()
    assert server.post(body, content_type="text/plain").status_code == 415


def test_metrics_count_what_was_served(server: Server) -> None:
    before = _metric(server, "gezel_generation_tokens_total")
    ttfts = _metric(server, "gezel_time_to_first_token_seconds_count")
    lengths = _metric(server, 'gezel_requests_total{error="",outcome="length"}', missing=0.0)
    server.client.chat.completions.create(
        model="demo", messages=MSG, max_tokens=3, extra_body=FIXED
    )
    assert _metric(server, "gezel_generation_tokens_total") == before + 3
    assert _metric(server, "gezel_time_to_first_token_seconds_count") == ttfts + 1
    assert _metric(server, 'gezel_requests_total{error="",outcome="length"}') == lengths + 1
    assert _metric(server, "gezel_num_requests_running") == 0
    assert _metric(server, "gezel_mlx_active_memory_bytes") > 0


def _metric(server: Server, name: str, missing: float | None = None) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    if missing is not None:
        return missing
    raise AssertionError(f"{name} missing from /metrics")


def test_models_and_health(server: Server) -> None:
    models = server.client.models.list()
    assert len(models.data) == 1
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    assert health["status"] == "ok"
    assert health["model"] == models.data[0].id


def test_tools_and_thinking_switch_render(server: Server) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages: list[Any] = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rainy"},
    ]
    usages = []
    for thinking in (True, False):
        r = server.client.chat.completions.create(
            model="demo",
            messages=messages,
            tools=tools,
            max_tokens=2,
            extra_body={"chat_template_kwargs": {"enable_thinking": thinking}},
        )
        assert r.usage is not None
        usages.append(r.usage.prompt_tokens)
    bare = server.client.chat.completions.create(model="demo", messages=messages[:1], max_tokens=2)
    assert bare.usage is not None
    # The tool roster and the tool turn are in the prompt; the empty think
    # block is added only when thinking is off.
    assert usages[0] > bare.usage.prompt_tokens + 20
    assert usages[1] > usages[0]


def test_sigterm_flushes_and_a_restart_is_a_disk_hit(dense_model: Path, tmp_path: Path) -> None:
    persist = ["--persist-dir", str(tmp_path)]
    messages: list[Any] = [
        {"role": "system", "content": "You keep the ledger of the harbour. " * 8},
        {"role": "user", "content": "How many ships came in?"},
    ]
    body = {"cache_id": "ledger"}
    first = start_server(dense_model, *persist)
    try:
        r1 = first.client.chat.completions.create(
            model="demo", messages=messages, max_tokens=4, extra_body=body
        )
    finally:
        assert stop_server(first) == 0
    assert r1.usage is not None
    second = start_server(dense_model, *persist)
    try:
        r2 = second.client.chat.completions.create(
            model="demo", messages=messages, max_tokens=4, extra_body=body
        )
        stats = httpx.get(f"{second.url}/v1/cache/stats", timeout=10).json()["data"]
    finally:
        assert stop_server(second) == 0
    assert r2.usage is not None
    assert r2.usage.model_dump()["cached_tokens"] == r1.usage.prompt_tokens - 1
    assert [e["cache_id"] for e in stats] == ["ledger"]


PARENT = """
import subprocess, sys
child = subprocess.Popen(
    [sys.executable, "-m", "gezel_trio", "serve", "--model", sys.argv[1], "--port", "0",
     "--log-level", "WARNING", "--exit-with-parent"],
    stdout=subprocess.PIPE, text=True,
)
for line in child.stdout:
    if line.startswith("gezel-trio listening on "):
        print(child.pid, flush=True)
        break
sys.stdin.read()  # until killed
"""


def test_exit_with_parent_drains_when_the_parent_dies(dense_model: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(dense_model)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    # A pidfd becomes readable when the process exits: an event to wait on,
    # for a process that is not our child.
    pidfd = os.pidfd_open(child_pid)
    parent.kill()  # SIGKILL: the parent gets no chance to clean up
    parent.wait()
    parent.stdout.close()
    assert parent.stdin is not None
    parent.stdin.close()
    # The kernel sends the server SIGTERM; it drains and exits on its own.
    try:
        readable, _, _ = select.select([pidfd], [], [], 60)
    finally:
        os.close(pidfd)
    assert readable, "the server outlived its parent"
