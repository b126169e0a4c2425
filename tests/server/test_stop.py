"""Stopping the real server as the seed's client does: SIGTERM, then SIGKILL
3 s later. Idle keep-alive connections close at once while an in-flight
stream drains, and one still running when the drain ends gets an error
frame; with write-behind every dirty cache entry is on disk when the
process exits, so a restart on the same persist dir reads them; the seed
profile runs the parent-death watchdog and refuses to start as an orphan."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from tests.support.process import FIXED, Server, orphan_exits, start_server, stop_server
from tests.support.sse_frames import carries_text

pytestmark = pytest.mark.slow

# The seed's client: SIGKILL this long after SIGTERM (its supervisor's killGracefully).
KILL_AFTER = 3.0


def _seed_launch(model: Path, *args: str, stderr: Any = subprocess.DEVNULL) -> Server:
    """``gezel-trio`` with flags and no subcommand, as the seed's supervisor
    starts its sidecar: the seed profile."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gezel_trio", "--model", str(model), "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("gezel-trio listening on "):
            return Server(line.split()[-1], proc)
    proc.kill()
    raise AssertionError(f"server exited with {proc.wait()} before listening")


def _stop_like_the_client(server: Server) -> int | None:
    """SIGTERM, then SIGKILL after 3 s: the exit status, ``None`` if killed."""
    server.client.close()
    server.proc.send_signal(signal.SIGTERM)
    try:
        return server.proc.wait(timeout=KILL_AFTER)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
        return None
    finally:
        assert server.proc.stdout is not None
        server.proc.stdout.close()


def _idle_keep_alive(url: str) -> socket.socket:
    """A raw connection that made one request, read its whole answer and
    stays open: what an HTTP client's pool holds between turns."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200"), head
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return sock


@contextlib.contextmanager
def _decoding(server: Server, max_tokens: int) -> Iterator[Iterator[str]]:
    """A streamed answer of ``max_tokens``: its lines, once its first text
    arrived (the sequence decodes, not only submitted)."""
    body = {
        "messages": [{"role": "user", "content": "Count."}],
        "max_tokens": max_tokens,
        "stream": True,
        **FIXED,
    }
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as stream,
    ):
        lines = stream.iter_lines()
        for line in lines:
            if carries_text(line):
                break
        yield lines


def test_sigterm_closes_an_idle_keep_alive_connection_at_once_and_drains_a_stream(
    dense_model: Path,
) -> None:
    # A long graceful timeout: an idle connection waited for would show.
    server = start_server(dense_model, "--graceful-timeout", "60")
    idle = _idle_keep_alive(server.url)
    try:
        with _decoding(server, 1000) as lines:
            server.proc.send_signal(signal.SIGTERM)
            idle.settimeout(KILL_AFTER)
            assert idle.recv(1) == b"", "the idle connection is closed by the server"
            assert server.proc.poll() is None, "the stream is still draining"
            rest = list(lines)
        chunks = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert rest[-1] == "data: [DONE]" or "data: [DONE]" in rest
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finishes[-1] == "length", "the stream ran to its end"
        assert server.proc.wait(timeout=30) == 0
    finally:
        idle.close()
        stop_server(server)


def test_a_stream_still_running_when_the_drain_ends_gets_an_error_frame_not_a_cut(
    dense_model: Path,
) -> None:
    server = start_server(dense_model, "--graceful-timeout", "1")
    try:
        # Far longer than the drain's 1 s on this model.
        with _decoding(server, 30000) as lines:
            server.proc.send_signal(signal.SIGTERM)
            rest = list(lines)  # ends when the server closes the stream
        chunks = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        errors = [c["error"] for c in chunks if "error" in c]
        assert len(errors) == 1, rest[-5:]
        assert errors[0]["code"] == "shutting_down"
        assert "--graceful-timeout" in errors[0]["message"]
        assert chunks[-1] == {"error": errors[0]}, "the error frame is the stream's last"
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
        assert "length" not in finishes, "the stream did not run to its end"
        assert server.proc.wait(timeout=30) == 0
    finally:
        stop_server(server)


def test_sigterm_with_an_idle_keep_alive_connection_exits_within_the_clients_3_s(
    dense_model: Path,
) -> None:
    server = start_server(dense_model, "--graceful-timeout", "60")
    with httpx.Client(timeout=30) as pool:
        assert pool.get(f"{server.url}/health").status_code == 200  # kept alive
        assert _stop_like_the_client(server) == 0


def _turn(url: str, history: list[dict[str, str]], cache_id: str, text: str) -> dict[str, Any]:
    history.append({"role": "user", "content": text})
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": history, "max_tokens": 8, "cache_id": cache_id, **FIXED},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return body


def _stats_ids(url: str) -> set[str]:
    body = httpx.get(f"{url}/v1/cache/stats", timeout=10).json()
    entries = body["data"] if isinstance(body, dict) else body  # the seed's shape: a list
    return {e["cache_id"] for e in entries}


def test_a_stop_like_the_clients_loses_no_dirty_entry(dense_model: Path, tmp_path: Path) -> None:
    persist = ["--persist-dir", str(tmp_path)]
    server = _seed_launch(dense_model, *persist)
    ids = [f"session-{i}" for i in range(3)]
    histories: dict[str, list[dict[str, str]]] = {cid: [] for cid in ids}
    last: dict[str, int] = {}
    try:
        for k in range(2):
            for cid in ids:
                body = _turn(server.url, histories[cid], cid, f"Turn {k} of {cid}: about ships.")
                last[cid] = body["usage"]["prompt_tokens"]
    finally:
        status = _stop_like_the_client(server)
    assert status == 0, "exited by itself, before the SIGKILL"

    restarted = start_server(dense_model, *persist)
    try:
        for cid in ids:
            body = _turn(restarted.url, histories[cid], cid, "And the next one?")
            # Read from disk: at least the whole previous prompt is reused.
            assert body["usage"]["cached_tokens"] >= last[cid], (cid, body["usage"])
        assert set(ids) <= _stats_ids(restarted.url)
    finally:
        assert stop_server(restarted) == 0


PARENT = """
import subprocess, sys
child = subprocess.Popen(
    [sys.executable, "-m", "gezel_trio", "--model", sys.argv[1], "--port", "0",
     "--log-level", "INFO"],
    stdout=subprocess.PIPE, stderr=open(sys.argv[2], "w"), text=True,
)
for line in child.stdout:
    if line.startswith("gezel-trio listening on "):
        print(child.pid, flush=True)
        break
sys.stdin.read()  # until killed
"""


def test_the_seed_profile_drains_and_exits_when_its_parent_dies(
    dense_model: Path, tmp_path: Path
) -> None:
    """No flag: the seed launch runs the watchdog by itself."""
    log = tmp_path / "stderr.txt"
    parent = [sys.executable, "-c", PARENT, str(dense_model), str(log)]
    assert orphan_exits(parent, 2 * KILL_AFTER), "the server outlived its parent"
    assert "received SIGTERM: draining" in log.read_text()


ORPHAN = """
import os, select, sys
r, w = os.pipe()
if os.fork() == 0:
    os.close(r)
    parent = os.pidfd_open(os.getppid())
    os.write(w, b"x")
    os.close(w)
    select.select([parent], [], [])  # until the middle process is gone
    os.execv(sys.executable, [sys.executable, "-m", "gezel_trio", "--model", sys.argv[1],
                              "--port", "0"])
os.close(w)
os.read(r, 1)
"""


def test_the_seed_profile_refuses_to_start_as_an_orphan(dense_model: Path) -> None:
    """As the seed did: a server whose parent is already gone loads nothing."""
    middle = subprocess.Popen(
        [sys.executable, "-c", ORPHAN, str(dense_model)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert middle.wait(timeout=30) == 0
    assert middle.stdout is not None
    assert middle.stderr is not None
    # The orphan holds both pipes: they reach EOF when it exits.
    err = b""
    while True:
        readable, _, _ = select.select([middle.stderr], [], [], 60)
        assert readable, "the orphan did not exit"
        chunk = os.read(middle.stderr.fileno(), 65536)
        if not chunk:
            break
        err += chunk
    out = middle.stdout.read()
    middle.stdout.close()
    middle.stderr.close()
    assert b"the parent process is already gone" in err, err
    assert b"Loading model" not in out


# Linux's F_SETPIPE_SZ: a one-page pipe fills with a few lines.
_F_SETPIPE_SZ = 1031


def test_sigterm_exits_in_time_while_nobody_reads_stdout(dense_model: Path) -> None:
    """A supervisor that stopped reading (alive, its pipe full) does not
    hold the exit: SIGTERM ends the process within ``--shutdown-timeout``
    plus a second, the lines stdout cannot take dropped."""
    shutdown_timeout = 3.0
    r, w = os.pipe()
    fcntl.fcntl(w, _F_SETPIPE_SZ, 4096)
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "gezel_trio", "serve", "--model", str(dense_model)),
            *("--port", "0", "--log-level", "WARNING", "--graceful-timeout", "3"),
            *("--shutdown-timeout", str(shutdown_timeout)),
            # A marker per prefill chunk: every request below has lines to print.
            *("--prefill-marker-min-tokens", "0", "--prefill-marker-interval", "0"),
        ],
        stdout=w,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        out = b""
        while not (out.endswith(b"\n") and b"gezel-trio listening on " in out):
            byte = os.read(r, 1)  # one byte at a time: nothing read ahead
            assert byte, "the server exited before listening"
            out += byte
        url = out.decode().split()[-1]
        # From here on nobody reads: fill what is left of the pipe.
        os.set_blocking(w, False)
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(w, b".")
        os.set_blocking(w, True)
        for i in range(3):
            body = {"messages": [{"role": "user", "content": f"{i} hello " * 500}]}
            answer = httpx.post(
                f"{url}/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=60
            )
            assert answer.status_code == 200
        proc.send_signal(signal.SIGTERM)
        try:
            status = proc.wait(timeout=shutdown_timeout + 1)
        except subprocess.TimeoutExpired:
            pytest.fail("still running a second past --shutdown-timeout with stdout full")
        assert status == 0
    finally:
        os.close(w)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(r)
