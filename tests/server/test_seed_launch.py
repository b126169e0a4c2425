"""The seed sidecar's two launch forms, as the gezel app spawns them.

The app runs ``<venv python> <bundle>/providers/mlx/python/gezel_mlx_server.py``
with the flags its ``build-provider.ts`` builds (``APP_FLAGS`` below, with a
free port instead of one it picked) and the offline environment it sets. Here
that file is ours, the installed ``gezel_trio/_seed/gezel_mlx_server.py``;
the other form is ``python -m gezel_trio`` with the same flags and no
subcommand. Both are real server processes on a copy of the tiny dense demo
model whose context window is 256 tokens, so the app's ``max_tokens: 16384``
on every turn runs to the window's end in a fraction of a second. Each form
must select the seed profile by itself: the stats as an array, greedy without
a temperature.

stdout is read by a thread (the listening line sets an event: no sleeps).
"""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from gezel_trio import cli
from tests.support.models import with_context
from tests.support.process import terminate

pytestmark = pytest.mark.slow

CONTEXT = 256
DEADLINE = 120.0
# The environment build-provider.ts gives the engine: offline, no telemetry.
APP_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [{"role": "user", "content": "Tell me about the harbour in the morning."}]


def app_flags(model: Path, work: Path) -> list[str]:
    """What build-provider.ts passes after the script's path, without the
    flags it adds only when its user sets them (``--prefill-step-size``,
    ``--stream-tool-calls``, the KV-quantization flags)."""
    return [
        "--model", str(model),
        "--host", "127.0.0.1",
        "--port", "0",
        "--cache-budget-mb", "1024",
        "--persist-dir", str(work / "engines" / "mlx" / "cache"),
        "--model-fingerprint", "0123456789abcdef01234567",
        "--disk-cache-budget-mb", "8192",
        "--max-concurrency", "2",
        "--gpu-memory-limit-mb", "8192",
        "--wired-limit-mb", "2048",
    ]  # fmt: skip


class Launched:
    """A server process started with ``argv``; its stdout read by a thread."""

    def __init__(self, argv: list[str], work: Path) -> None:
        self.stderr_path = work / "stderr.txt"
        with self.stderr_path.open("w") as err:
            self.proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env={**os.environ, **APP_ENV, "PYTHONUNBUFFERED": "1"},
            )
        self.lines: list[str] = []
        self.url: str | None = None
        self._listening = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        ready = self._listening.wait(DEADLINE)
        if self.url is None:
            self.stop()
            raise AssertionError(f"not listening (ready={ready}); stderr:\n{self.stderr()}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("gezel-trio listening on "):
                self.url = line.split()[-1]
                self._listening.set()
        self._listening.set()  # stdout closed: the process is gone

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def stop(self) -> int:
        """SIGTERM, as the app stops its engine; the exit status."""
        try:
            return terminate(self.proc)
        finally:
            self._reader.join(timeout=30)
            assert self.proc.stdout is not None
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def short_model(dense_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_context(dense_model, tmp_path_factory.mktemp("short") / "model", CONTEXT)


@pytest.fixture(scope="module")
def seed_script(short_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    """``python gezel_mlx_server.py <the app's flags>``, for the module."""
    work = tmp_path_factory.mktemp("app-home")
    server = Launched(
        [sys.executable, str(cli.seed_server_path()), *app_flags(short_model, work)], work
    )
    yield server
    assert server.stop() == 0, server.stderr()


def _stream(url: str, body: dict[str, Any]) -> tuple[str, str | None, dict[str, Any]]:
    """The text of a streamed chat as the app reads it (``delta.content``),
    its finish reason and its usage."""
    text, finish, usage = "", None, {}
    with httpx.Client(base_url=url, timeout=DEADLINE) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    text += choice["delta"].get("content") or ""
                    finish = choice.get("finish_reason") or finish
    return text, finish, usage


def test_the_seed_script_serves_the_apps_turn_to_the_contexts_end(
    seed_script: Launched, short_model: Path
) -> None:
    assert "gezel-trio: profile seed" in seed_script.stderr()
    assert seed_script.url is not None
    # The app's request body: the model directory as the model, a stream,
    # max_tokens 16384 on a 256-token window.
    body = {"model": str(short_model), "messages": ASK, "stream": True, "max_tokens": 16_384}
    text, finish, usage = _stream(seed_script.url, {**body, **NO_THINK})
    assert finish == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT
    assert text


def test_the_seed_script_samples_greedily_without_a_temperature(seed_script: Launched) -> None:
    assert seed_script.url is not None
    body = {"messages": ASK, "max_tokens": 24, "ignore_eos": True, **NO_THINK}
    with httpx.Client(base_url=seed_script.url, timeout=DEADLINE) as client:
        unnamed = [
            client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
            for _ in range(2)
        ]
        greedy = client.post("/v1/chat/completions", json={**body, "temperature": 0}).json()
    # Sampled at 1.0, 24 tokens of a 2173-token vocabulary would not repeat.
    assert unnamed[0] == unnamed[1] == greedy["choices"][0]["message"]


def test_the_seed_script_answers_cache_stats_as_the_seeds_array(seed_script: Launched) -> None:
    assert seed_script.url is not None
    with httpx.Client(base_url=seed_script.url, timeout=DEADLINE) as client:
        for cache_id in ("session-a", None):
            named = {"cache_id": cache_id} if cache_id else {}
            r = client.post(
                "/v1/chat/completions",
                json={"messages": ASK, "max_tokens": 2, **named, **NO_THINK},
            )
            assert r.status_code == 200, r.text
        stats = client.get("/v1/cache/stats").json()
    # What cache-adapter.ts reportUsage reads: an array of the named entries.
    assert isinstance(stats, list)
    entries = {e["cache_id"]: e for e in stats}
    assert "session-a" in entries
    assert not [cid for cid in entries if cid.startswith("anon:")], "anonymous entries listed"
    entry = entries["session-a"]
    assert isinstance(entry["token_count"], int)
    assert entry["token_count"] > 0
    assert isinstance(entry["est_bytes"], int)
    assert entry["est_bytes"] > 0
    assert isinstance(entry["last_used_ts"], float)


def test_python_m_gezel_trio_with_the_apps_flags_is_a_seed_launch(
    short_model: Path, tmp_path: Path
) -> None:
    server = Launched(
        [sys.executable, "-m", "gezel_trio", *app_flags(short_model, tmp_path)], tmp_path
    )
    try:
        assert "gezel-trio: profile seed" in server.stderr()
        assert server.url is not None
        body = {"messages": ASK, "stream": True, "max_tokens": 16_384, "cache_id": "s", **NO_THINK}
        _, finish, usage = _stream(server.url, body)
        assert finish == "length"
        assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT
        stats = httpx.get(f"{server.url}/v1/cache/stats", timeout=DEADLINE).json()
        assert [e["cache_id"] for e in stats] == ["s"]
    finally:
        assert server.stop() == 0, server.stderr()


def _run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=DEADLINE, cwd=cwd
    )


def test_each_launch_form_has_its_help_and_the_script_is_installed(tmp_path: Path) -> None:
    script = cli.seed_server_path()
    installed = importlib.resources.files("gezel_trio") / "_seed" / "gezel_mlx_server.py"
    assert installed.is_file()
    assert Path(str(installed)).resolve() == script
    shown = _run("-m", "gezel_trio", "seed-server-path")
    assert (shown.returncode, shown.stdout.strip()) == (0, str(script))

    # The script in the app's bundle sits beside the seed's own helper
    # modules: one named like a module gezel-trio imports must not be used.
    bundle = tmp_path / "providers" / "mlx" / "python"
    bundle.mkdir(parents=True)
    shutil.copy(script, bundle / "gezel_mlx_server.py")
    (bundle / "trio.py").write_text("raise ImportError('the bundle shadowed trio')\n")
    # The script's directory is dropped from sys.path (``python -m`` puts
    # the working directory there instead: run it from elsewhere).
    for argv, cwd in (
        ([str(bundle / "gezel_mlx_server.py"), "--help"], bundle),
        (["-m", "gezel_trio", "--model", "m", "--help"], tmp_path),
    ):
        done = _run(*argv, cwd=cwd)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("usage: gezel-trio serve")
        assert "--cache-budget-mb" in done.stdout
        assert "(default: seed)" in " ".join(done.stdout.split())

    top = _run("-m", "gezel_trio", "--help")
    assert top.returncode == 0, top.stderr
    assert "seed-server-path" in top.stdout
    assert "no subcommand" in top.stdout
