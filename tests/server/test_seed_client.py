"""The seed's own client driving gezel-trio: the gezel app's MLX provider, as
``tests/support/seed_client.py`` ports it, against the real server process
(the installed ``gezel_mlx_server.py``, hypercorn, the MLX backend).

Everything the app does is done the app's way: the command line its
``build-provider.ts`` builds (no flag of ours added), readiness by polling
``/health`` while its stdout classifier reads every stdout and stderr line
(prefixed ``[mlx] `` as its supervisor does), request bodies from its
builder (``max_tokens: 16384`` unless a catalog tuning says otherwise, the
cache adapter's ``cache_id``/``prefix_cache_id``, ``tool_grammar`` by model
family, no temperature), an SSE reader that looks only at
``delta.content``, ``delta.tool_calls``, ``usage`` and ``finish_reason`` and
splits ``<think>`` itself, ``/v1/cache/stats`` read as an array by its cache
adapter and reconciled by its session cache controller, and a stop that
sends SIGTERM and SIGKILLs 3 s later.

The models are the tiny demo models, in two shapes a catalog holds: a small
context window (768 tokens, so the app's ``max_tokens: 16384`` must be
clamped to what fits, as on the default model's 8192) with the demo chat
template, whose generation prompt does not leave a think block open by the
client's reading of it; and a template shaped like Qwen 3.5's, whose
generation prompt ends inside ``<think>`` unless thinking is switched off.
Each is the demo model's own files with a rewritten ``config.json`` or
``tokenizer_config.json``. Random weights never write a marker by
themselves, so a think block ends where the request's ``max_thinking_tokens``
closes it (the app sends that from a catalog's ``thinkingBudget``) and a
tool call comes where the app's ``toolChoice: required`` tuning asks for
one.

Two server processes serve the module, plus the restart of the second on
its persist directory and one the test of the app's death spawns. No test
sleeps; waits are on lines, events and the engine's pidfd (the readiness
probe polls ``/health`` every 500 ms because the app does).
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from tests.support import seed_client as app

pytestmark = pytest.mark.slow

CONTEXT = 768  # the small-context model's window
TIMEOUT = 120.0
SYSTEM = "You keep the ledgers of the northern harbour."
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Oslo", "Bergen"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
PLAIN = app.Profile()
QWEN = app.Profile(family="qwen", mlx_grammar=True)


def _variant(
    base: Path, dest: Path, *, context: int | None = None, template: str | None = None
) -> Path:
    """``base``'s files linked into ``dest``, with ``config.json``'s context
    window or ``tokenizer_config.json``'s chat template rewritten."""
    dest.mkdir()
    for item in base.iterdir():
        if item.name not in ("config.json", "tokenizer_config.json"):
            (dest / item.name).symlink_to(item)
    config = json.loads((base / "config.json").read_text())
    if context is not None:
        config["max_position_embeddings"] = context
    (dest / "config.json").write_text(json.dumps(config))
    tokenizer = json.loads((base / "tokenizer_config.json").read_text())
    if template is not None:
        tokenizer["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    return dest


# The demo template's generation prompt, and the same with its branches the
# way Qwen 3.5 orders them: the open block is the default, the template's
# last literal, and what the client's reading of the template looks for.
DEMO_TAIL = """    {%- if enable_thinking is defined and enable_thinking %}
        {{- '<think>\\n' }}
    {%- else %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}"""
QWEN_TAIL = """    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class App:
    """One provider build: its supervisor, classifier, HTTP client (a
    keep-alive pool, as the app's ``fetch`` has), cache adapter and
    controller, and the static facts it read from the model directory."""

    model_dir: Path
    supervisor: app.Supervisor
    provider: app.Provider
    client: httpx.Client
    adapter: app.CacheAdapter
    controller: app.SessionCacheController
    opens_in_reasoning: bool

    @property
    def url(self) -> str:
        return self.supervisor.base_url

    def turn(
        self,
        messages: list[dict[str, Any]],
        session: str | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        tuning: dict[str, Any] | None = None,
        profile: app.Profile = PLAIN,
        grammar: dict[str, str] | None = None,
        on_event: Any = None,
    ) -> app.Turn:
        """One streamed turn the way ``sendAndWaitInner`` sends it."""
        extras = self.adapter.build_request_extras(session) if session else None
        body = app.build_turn_body(
            str(self.model_dir),
            messages,
            tools=tools,
            tuning=tuning,
            profile=profile,
            extras=extras,
        )
        if grammar is not None:
            body["tool_grammar"] = grammar
        return app.run_turn(
            self.client,
            self.url,
            body,
            opens_in_reasoning=self.opens_in_reasoning,
            profile=profile,
            on_event=on_event,
        )

    def mark(self) -> int:
        return len(self.supervisor.lines)

    def lines_since(self, mark: int) -> list[str]:
        return self.supervisor.lines[mark:]


def _start(
    model_dir: Path, persist: Path, *, port: int | None = None, max_concurrency: int = 1
) -> App:
    provider = app.Provider()
    launch = app.Launch(
        model_dir=model_dir,
        port=port or _free_port(),
        cache_budget_mb=1024,
        persist_dir=persist,
        model_fingerprint=app.model_fingerprint(model_dir, "demo-dense-tiny", "1", "2026-01-01"),
        max_concurrency=max_concurrency,
        gpu_memory_limit_mb=8192,
        wired_limit_mb=512,
    )
    supervisor = app.Supervisor(sys.executable, launch, provider.on_stdout_line)
    provider.supervisor = supervisor
    supervisor.start()
    client = httpx.Client(timeout=TIMEOUT)
    adapter = app.CacheAdapter(client, lambda: supervisor.base_url)
    controller = app.SessionCacheController()
    controller.register_adapter(adapter)
    return App(
        model_dir,
        supervisor,
        provider,
        client,
        adapter,
        controller,
        app.template_opens_reasoning(model_dir),
    )


def _stop(a: App) -> app.Stopped:
    try:
        return a.supervisor.stop()
    finally:
        a.client.close()


@pytest.fixture(scope="module")
def small(dense_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    """The small-context demo model, served at the app's ``--max-concurrency 1``."""
    work = tmp_path_factory.mktemp("seed-client-small")
    model = _variant(dense_model, work / "demo-small-context", context=CONTEXT)
    a = _start(model, work / "cache")
    try:
        yield a
    finally:
        stopped = _stop(a)
    assert (stopped.killed, stopped.returncode) == (False, 0), stopped
    assert a.provider.fatal is None, "the app would have torn a healthy engine down"


@pytest.fixture(scope="module")
def thinking_model(dense_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = json.loads((dense_model / "tokenizer_config.json").read_text())
    template: str = config["chat_template"]
    assert DEMO_TAIL in template, "the demo template's generation prompt changed"
    work = tmp_path_factory.mktemp("seed-client-thinking")
    return _variant(
        dense_model, work / "demo-thinking", template=template.replace(DEMO_TAIL, QWEN_TAIL)
    )


@dataclass
class Served:
    """The engine the app holds now: a restart replaces it."""

    app: App


@pytest.fixture(scope="module")
def thinking(thinking_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The Qwen-3.5-shaped template's model (the stop test restarts it)."""
    served = Served(_start(thinking_model, tmp_path_factory.mktemp("seed-client-thinking-cache")))
    try:
        yield served
    finally:
        stopped = _stop(served.app)
    assert (stopped.killed, stopped.returncode) == (False, 0), stopped
    assert served.app.provider.fatal is None


def _keep_alive(port: int) -> socket.socket:
    """A connection that got one whole answer and stays open, idle."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(TIMEOUT)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: keep-alive\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])
    while len(body) < length:
        body += sock.recv(65536)
    return sock


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


MARKERS = ("<think>", "</think>")


# --- start-up


def test_the_apps_command_line_starts_it_and_the_app_reads_it_ready(small: App) -> None:
    published = [p.phase for p in small.provider.published]
    assert published[:3] == ["starting", "loading_model", "ready"], small.supervisor.text()
    # No flag of ours on the command line: the seed profile chose the prefill
    # chunk the app leaves to the server (2048).
    ready = [line for line in small.supervisor.lines if "[batch] engine ready" in line]
    assert len(ready) == 1
    assert "max_concurrency=1" in ready[0]
    assert "prefill_step_size=2048" in ready[0]
    # Not one line, stdout or stderr, that the app reads as an engine death.
    assert [line for line in small.supervisor.lines if app.classify_fatal_line(line)] == []


# --- answers


def test_the_apps_max_tokens_is_clamped_to_the_context_and_answers(small: App) -> None:
    turn = small.turn(_user("Tell me about the harbour."))
    assert turn.status == 200, turn.error_body
    assert turn.done
    assert turn.finish_reason == "length"
    assert turn.usage is not None
    fits = CONTEXT - turn.usage["prompt_tokens"]
    assert fits - 1 <= turn.usage["completion_tokens"] <= fits, turn.usage
    assert turn.visible, "the answer reached the app's content channel"


def test_a_turn_without_a_temperature_is_greedy(small: App) -> None:
    tuning = {"sampling": {"maxTokens": 24}}
    first = small.turn(_user("Name a ship."), tuning=tuning)
    second = small.turn(_user("Name a ship."), tuning=tuning)
    assert first.status == second.status == 200
    assert first.visible
    assert first.visible == second.visible


def test_multi_turn_reuses_the_session_cache_and_the_app_flashes_the_hit(small: App) -> None:
    tuning = {"sampling": {"maxTokens": 16}}
    messages = _user("Which ledger is oldest?")
    first = small.turn(messages, "session-multi", tuning=tuning)
    assert first.status == 200, first.error_body
    assert first.usage is not None
    messages += [
        {"role": "assistant", "content": first.visible},
        {"role": "user", "content": "And the newest?"},
    ]
    mark = small.mark()
    published = len(small.provider.published)
    second = small.turn(messages, "session-multi", tuning=tuning)
    assert second.status == 200, second.error_body
    assert second.usage is not None
    assert second.usage.get("cached_tokens", 0) >= first.usage["prompt_tokens"]
    hit = re.compile(r"\[cache\] hit cache_id=session-multi prior_tokens=(\d+)")
    line = small.supervisor.wait_for_line(hit.search, mark)
    prior = int(hit.search(line)[1])
    assert prior >= first.usage["prompt_tokens"]
    flashed = [p.detail for p in small.provider.published[published:]]
    assert f"Cache hit · reusing {prior:,} tokens" in flashed


# --- reasoning


def test_a_template_that_does_not_open_think_shows_the_answer_live(small: App) -> None:
    assert small.opens_in_reasoning is False
    turn = small.turn(_user("Describe the quay."), tuning={"sampling": {"maxTokens": 16}})
    assert turn.status == 200, turn.error_body
    assert turn.visible
    assert turn.visible == turn.raw_content
    assert turn.reasoning == ""
    assert not any(m in turn.raw_content for m in MARKERS)


def test_a_template_that_opens_think_splits_reasoning_from_the_live_answer(
    thinking: Served,
) -> None:
    assert thinking.app.opens_in_reasoning is True
    tuning = {"sampling": {"maxTokens": 28}, "reasoning": {"thinkingBudget": 8}}
    turn = thinking.app.turn(_user("Count the barrels."), "session-think", tuning=tuning)
    assert turn.status == 200, turn.error_body
    # The think block is in content, as the model wrote it: inside from the
    # first token (the prompt opened it), closed once.
    assert turn.raw_content.count("</think>") == 1, turn.raw_content
    assert "<think>" not in turn.raw_content
    assert turn.reasoning + "</think>" + turn.visible == turn.raw_content
    assert turn.reasoning.strip(), "the reasoning reached the app's reasoning channel"
    assert turn.visible.strip(), "the answer reached the app's content channel, live"
    assert not any(m in turn.visible or m in turn.reasoning for m in MARKERS)


# --- tools


@pytest.mark.parametrize(
    "grammar",
    [None, {"format": "hermes", "mode": "name-only"}],
    ids=["hermes-name-and-params", "hermes-name-only"],
)
def test_a_tool_turn_with_the_apps_tool_grammar_gives_a_call_the_app_parses(
    small: App, grammar: dict[str, str] | None
) -> None:
    tuning = {"sampling": {"maxTokens": 60}, "toolChoice": "required"}
    turn = small.turn(
        _user("What is the weather in Oslo?"),
        "session-tools",
        tools=[WEATHER_TOOL],
        tuning=tuning,
        profile=QWEN,  # tool_grammar {"format": "hermes", "mode": "name-and-params"}
        grammar=grammar,
    )
    assert turn.status == 200, turn.error_body
    assert turn.finish_reason == "tool_calls"
    [call] = turn.tool_calls
    assert call["function"]["name"] == "get_weather"
    assert call["id"]
    assert json.loads(call["function"]["arguments"])["city"] in ("Oslo", "Bergen")
    assert "<tool_call>" not in turn.visible
    assert "</tool_call>" not in turn.visible


def test_name_and_params_keeps_the_call_to_the_tools_declared_parameters(small: App) -> None:
    # The app's tools come from MCP servers, whose schemas rarely close
    # their objects: the grammar's tier 2 is what pins the keys.
    function = {k: v for k, v in WEATHER_TOOL["function"].items() if k != "parameters"}
    closed = WEATHER_TOOL["function"]["parameters"]
    parameters = {k: v for k, v in closed.items() if k != "additionalProperties"}
    open_tool = {"type": "function", "function": {**function, "parameters": parameters}}
    tuning = {"sampling": {"maxTokens": 60}, "toolChoice": "required"}
    turn = small.turn(
        _user("What is the weather in Oslo?"),
        "session-tools-open",
        tools=[open_tool],
        tuning=tuning,
        profile=QWEN,  # tool_grammar {"format": "hermes", "mode": "name-and-params"}
    )
    assert turn.status == 200, turn.error_body
    [call] = turn.tool_calls
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) <= {"city"}, arguments


# --- the cache adapter and controller


def test_the_controller_tracks_the_sessions_the_stats_array_shows(small: App) -> None:
    tuning = {"sampling": {"maxTokens": 8}}
    for session in ("session-a", "session-b"):
        turn = small.turn(_user(f"Open {session}."), session, tuning=tuning)
        assert turn.status == 200, turn.error_body
        small.controller.record_turn("mlx", session, len(SYSTEM) // 4)
    raw = small.client.get(f"{small.url}/v1/cache/stats").json()
    assert isinstance(raw, list), "the adapter reads the stats as an array"
    small.controller.reconcile_provider("mlx")
    tracked = small.controller.sessions("mlx")
    for session in ("session-a", "session-b"):
        entry = tracked[session]
        assert entry.token_count > len(SYSTEM) // 4, "the engine's count replaced the estimate"
        assert entry.bytes > 0
        assert entry.last_used_at > 0
    small.controller.invalidate("session-a")
    small.controller.reconcile_provider("mlx")
    tracked = small.controller.sessions("mlx")
    assert "session-a" not in tracked, "the adapter's DELETE took it off the engine"
    assert "session-b" in tracked


def test_a_warm_prints_the_line_the_app_flashes_and_a_new_session_inherits_the_prefix(
    small: App,
) -> None:
    mark = small.mark()
    published = len(small.provider.published)
    small.adapter.warm("session-warm", [{"role": "system", "content": SYSTEM}])
    warmed = re.compile(r"\[cache\] warmed cache_id=session-warm tokens=(\d+)")
    line = small.supervisor.wait_for_line(warmed.search, mark)
    tokens = int(warmed.search(line)[1])
    assert tokens > 0
    flashed = [p.detail for p in small.provider.published[published:]]
    assert f"Cache warmed · {tokens:,} tokens ready" in flashed
    # prepareForSend: a new session's prefix is warmed (persisted), and its
    # first turn, a miss on its own id, is seeded from the prefix.
    small.adapter.prepare_for_send("session-new", SYSTEM)
    turn = small.turn(_user("First words."), "session-new", tuning={"sampling": {"maxTokens": 4}})
    assert turn.status == 200, turn.error_body
    assert turn.usage is not None
    assert turn.usage.get("cached_tokens", 0) > 0


def test_a_queued_turn_prints_batch_lines_while_it_waits(small: App) -> None:
    # The app's own FIFO gate sends one turn at a time at width 1; the
    # server queues when a turn comes past it (a second app process, or a
    # turn the app abandoned that the engine still runs).
    started = threading.Event()
    results: dict[str, app.Turn] = {}

    def run(session: str, max_tokens: int) -> None:
        results[session] = small.turn(
            _user(f"Recite the {session} ledger."),
            session,
            tuning={"sampling": {"maxTokens": max_tokens}},
            on_event=lambda _e: started.set(),
        )

    mark = small.mark()
    admitted_line = re.compile(r"\[batch\] admitted\b.*\bsession-queued\b")
    first = threading.Thread(target=run, args=("session-running", 300))
    first.start()
    assert started.wait(TIMEOUT)
    second = threading.Thread(target=run, args=("session-queued", 4))
    second.start()
    first.join(TIMEOUT)
    second.join(TIMEOUT)
    assert results["session-running"].status == results["session-queued"].status == 200
    small.supervisor.wait_for_line(admitted_line.search, mark)
    lines = [line.removeprefix("[mlx] ") for line in small.lines_since(mark)]
    batch = [line for line in lines if line.startswith("[batch] ")]
    queued = [
        i
        for i, line in enumerate(batch)
        if re.match(r"\[batch\] (queued|waiting)\b", line) and "session-queued" in line
    ]
    admitted = [
        i
        for i, line in enumerate(batch)
        if re.match(r"\[batch\] admitted\b", line) and "session-queued" in line
    ]
    assert queued, batch
    assert admitted, batch
    assert queued[0] < admitted[0]
    assert not [line for line in lines if app.classify_fatal_line(f"[mlx] {line}")]


# --- stop and restart


def test_a_stop_with_an_idle_keep_alive_connection_is_quick_and_loses_nothing(
    thinking: Served, thinking_model: Path
) -> None:
    served = thinking.app
    tuning = {"sampling": {"maxTokens": 20}, "reasoning": {"thinkingBudget": 6}}
    messages = _user("Which ship came in?")
    first = served.turn(messages, "session-restart", tuning=tuning)
    assert first.status == 200, first.error_body
    assert first.usage is not None
    # The client's pooled connection is idle now; one more, explicitly.
    idle = _keep_alive(served.supervisor.launch.port)
    try:
        stopped = served.supervisor.stop()
        assert stopped.returncode == 0, served.supervisor.text()
        assert not stopped.killed, f"SIGKILL after {app.KILL_AFTER_S} s"
        assert stopped.seconds < app.KILL_AFTER_S
        assert idle.recv(65536) == b"", "the idle connection was closed"
    finally:
        idle.close()
        served.client.close()
    assert served.provider.fatal is None
    # The app restarts the engine on the same port and persist directory.
    launch = served.supervisor.launch
    thinking.app = again = _start(thinking_model, launch.persist_dir, port=launch.port)
    messages += [
        {"role": "assistant", "content": first.visible},
        {"role": "user", "content": "And where from?"},
    ]
    mark = again.mark()
    second = again.turn(messages, "session-restart", tuning=tuning)
    assert second.status == 200, second.error_body
    assert second.usage is not None
    # Nothing was in memory after the restart: these came from disk.
    assert second.usage.get("cached_tokens", 0) > first.usage["prompt_tokens"] // 2
    read = re.compile(r"\[cache\] (disk-)?hit cache_id=session-restart prior_tokens=[1-9]")
    again.supervisor.wait_for_line(read.search, mark)
    again.controller.reconcile_provider("mlx")
    assert "session-restart" in again.controller.sessions("mlx")


# The app as a process: it spawns the engine with its command line, says the
# engine's pid, and waits on it; SIGKILL stands for the app crashing.
APP_PROCESS = """
import subprocess, sys
engine = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(engine.pid, flush=True)
engine.wait()
"""
PARENT_GONE_WITHIN = 15.0


def test_the_engine_exits_when_the_app_dies(small: App, tmp_path: Path) -> None:
    launch = app.Launch(
        model_dir=small.model_dir,
        port=_free_port(),
        cache_budget_mb=1024,
        persist_dir=tmp_path / "cache",
        model_fingerprint=app.model_fingerprint(small.model_dir),
        max_concurrency=1,
        gpu_memory_limit_mb=8192,
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", APP_PROCESS, sys.executable, *app.launch_args(launch)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **app.LAUNCH_ENV},
    )
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    engine = os.pidfd_open(pid)
    try:
        exited = threading.Event()
        app.wait_for_ready(
            f"http://127.0.0.1:{launch.port}",
            lambda: "the engine exited" if select.select([engine], [], [], 0)[0] else None,
            exited,
            TIMEOUT,
        )
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        readable, _, _ = select.select([engine], [], [], PARENT_GONE_WITHIN)
        assert readable, f"the engine outlived the app by {PARENT_GONE_WITHIN} s"
    finally:
        if not select.select([engine], [], [], 0)[0]:
            os.kill(pid, signal.SIGKILL)
        os.close(engine)
        parent.stdout.close()
