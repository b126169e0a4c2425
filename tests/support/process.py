"""The real server process, ``gezel-trio serve``, as a user starts it.

The server prints ``gezel-trio listening on URL`` once the model is loaded
and the socket is bound; ``start_server`` reads that line (no sleeps).
``stop_server`` sends SIGTERM and returns the exit status, which callers
assert is 0: graceful drain is tested every run.

Booting a server costs a model load (seconds for the default model), so
tests that need no flag of their own share one server per model for the
whole session: ``dense_server``, ``hybrid_server``, ``smollm2_server``, each
started with the default flags. A test that needs other flags, or a server
whose state it can reason about alone (a restart, a persist dir, a fault),
starts its own with ``start_server``.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

# Fixed-length generations (as vLLM offers), answering without a think block.
FIXED = {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}


class Server:
    """A server at ``url``: a ``gezel-trio serve`` process (``proc``), or one
    in a thread of the test's process (``tests.support.scripted``)."""

    def __init__(self, url: str, proc: subprocess.Popen[str] | None = None) -> None:
        self.url = url
        self.proc = proc
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    def post(self, body: bytes, content_type: str = "application/json") -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/chat/completions",
            content=body,
            headers={"Content-Type": content_type},
            timeout=60,
        )


def spawn_server(model: Path, *args: str) -> subprocess.Popen[str]:
    """``gezel-trio serve`` on ``model`` and a free port, with ``args``; its
    stdout is the caller's to read (the listening line comes first)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gezel_trio",
            "serve",
            "--model",
            str(model),
            "--port",
            "0",
            "--log-level",
            "WARNING",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def start_server(model: Path, *args: str) -> Server:
    proc = spawn_server(model, *args)
    assert proc.stdout is not None
    for line in proc.stdout:  # ends if the process dies: then the assert below fails
        if line.startswith("gezel-trio listening on "):
            return Server(line.split()[-1], proc)
    proc.kill()
    proc.stdout.close()
    raise AssertionError(f"server exited with {proc.wait()} before listening")


def terminate(proc: subprocess.Popen[str], timeout: float = 30) -> int:
    """SIGTERM, as a user stops the server; its exit status. One still
    running after ``timeout`` seconds is killed (and the wait's error
    raised)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stop_server(server: Server) -> int:
    assert server.proc is not None, "a server of this process stops with its block"
    server.client.close()
    try:
        return terminate(server.proc)
    finally:
        if server.proc.stdout is not None:
            server.proc.stdout.close()


def orphan_exits(parent: list[str], timeout: float) -> bool:
    """Run ``parent``, a program that starts a server, prints the server's
    pid once it listens and then waits on its stdin; kill it; say whether the
    orphaned server exited within ``timeout`` seconds."""
    proc = subprocess.Popen(parent, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdin is not None
    child_pid = int(proc.stdout.readline())
    pidfd = os.pidfd_open(child_pid)  # readable once the server exits
    proc.kill()
    proc.wait()
    proc.stdout.close()
    proc.stdin.close()
    try:
        readable, _, _ = select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    return bool(readable)


def _shared(model: Path) -> Iterator[Server]:
    srv = start_server(model)
    yield srv
    assert stop_server(srv) == 0, "SIGTERM must drain and exit cleanly"


@pytest.fixture(scope="session")
def dense_server(dense_model: Path) -> Iterator[Server]:
    """The dense demo model, default flags, for the whole session."""
    yield from _shared(dense_model)


@pytest.fixture(scope="session")
def hybrid_server(hybrid_model: Path) -> Iterator[Server]:
    """The hybrid demo model, default flags, for the whole session."""
    yield from _shared(hybrid_model)


@pytest.fixture(scope="session")
def smollm2_server(smollm2_model: Path) -> Iterator[Server]:
    """The default model, default flags, for the whole session."""
    yield from _shared(smollm2_model)
