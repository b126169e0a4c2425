"""Open connections against the real server process: idle ones past
``--max-connections`` close the longest idle while ``/health`` and a chat
answer, a connection whose client left gives its descriptor back at once,
the open-file limit is raised to its hard limit, and a request without the
key gets its 401 from its headers alone.

No test waits a guessed time: each waits, with a deadline, on what the
client sees - a response, or the server's end of a connection (EOF). The
server accepts in order, so once a connection opened after a batch is
answered, every connection of the batch has been accepted. A client that
half-closes its connection reads the server's EOF only once the server has
closed its socket: that EOF is the event that the descriptor is gone."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.process import Server, start_server, stop_server

pytestmark = pytest.mark.slow

CAP = 64
IDLE = 200
KEY = "sk-connections"
# Far below the 75 s keep-alive timer that once held a closed connection.
DEADLINE = 15.0


# The sockets the server holds with no client connected (its listening
# socket, Trio's wake-up pairs: one made as the first chat runs), by pid.
_OWN: dict[int, int] = {}


@pytest.fixture(scope="module")
def server(dense_model: Path) -> Iterator[Server]:
    srv = start_server(dense_model, "--max-connections", str(CAP), "--api-key", KEY)
    assert _status(_post_chat(srv)) == 200
    _OWN[srv.proc.pid] = _sockets(srv.proc.pid)
    yield srv
    assert stop_server(srv) == 0


def _address(server: Server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _sockets(pid: int) -> int:
    """The sockets ``pid`` holds open."""
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed while listed
            held += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return held


def _ask(server: Server, raw: bytes) -> bytes:
    """``raw`` sent on a new connection; the response, read to the server's EOF."""
    with socket.create_connection(_address(server), timeout=DEADLINE) as sock:
        sock.sendall(raw)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def _get_health(server: Server) -> bytes:
    host, _port = _address(server)
    return _ask(
        server, f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
    )


def _post_chat(server: Server, key: str = KEY) -> bytes:
    host, _port = _address(server)
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return _ask(server, head.encode() + body)


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def _ends(socks: list[socket.socket]) -> list[socket.socket]:
    """Which of ``socks`` the server closed within ``DEADLINE``: each read
    to its EOF (or reset) as it comes."""
    pending = list(socks)
    ended = []
    stop = time.monotonic() + DEADLINE
    while pending and (left := stop - time.monotonic()) > 0:
        readable, _, _ = select.select(pending, [], [], left)
        for sock in readable:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                pending.remove(sock)
                ended.append(sock)
    return ended


def _open(server: Server, n: int) -> list[socket.socket]:
    return [socket.create_connection(_address(server), timeout=DEADLINE) for _ in range(n)]


def _release(socks: list[socket.socket]) -> None:
    """Half-close each of ``socks``, wait for the server to close its end,
    then close them: the server holds none of them after."""
    for sock in socks:
        with contextlib.suppress(OSError):  # closed by the server already
            sock.shutdown(socket.SHUT_WR)
    _ends(socks)
    for sock in socks:
        sock.close()


def test_idle_connections_past_the_cap_close_the_longest_idle(server: Server) -> None:
    idle = _open(server, IDLE)
    try:
        # Answered at once: each connection past the cap closed the longest
        # idle one, the probe's and the chat's included.
        assert _status(_get_health(server)) == 200
        assert _status(_post_chat(server)) == 200
        # The flood's own past the cap, and one for the probe; the chat's
        # took the probe's slot, or (when it came first) one more.
        evicted = IDLE - CAP + 1
        assert len(_ends(idle[:evicted])) == evicted
        kept = idle[evicted + 1 :]
        readable, _, _ = select.select(kept, [], [], 0)
        assert readable == []
        assert _sockets(server.proc.pid) <= _OWN[server.proc.pid] + CAP
    finally:
        _release(idle)


def test_a_closed_connection_gives_its_descriptor_back_at_once(server: Server) -> None:
    host, _port = _address(server)
    # Half of them never send anything; half were served once and kept alive.
    silent = _open(server, CAP // 2)
    served = _open(server, CAP // 2 - 1)
    for sock in served:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    try:
        for sock in silent + served:
            sock.shutdown(socket.SHUT_WR)
        # The server's EOF comes as it closes its socket: at once, not when
        # a keep-alive timer fires.
        assert len(_ends(silent + served)) == len(silent + served)
        assert _sockets(server.proc.pid) == _OWN[server.proc.pid]
    finally:
        _release(silent + served)


def test_the_open_file_limit_is_raised_to_the_hard_limit(server: Server) -> None:
    limits = Path(f"/proc/{server.proc.pid}/limits").read_text().splitlines()
    soft, hard = next(line for line in limits if line.startswith("Max open files")).split()[3:5]
    assert soft == hard


def test_a_cap_above_the_open_file_limit_is_refused_at_start(dense_model: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gezel_trio",
            "serve",
            "--model",
            str(dense_model),
            "--port",
            "0",
            "--max-connections",
            "10000000",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--max-connections 10000000" in done.stderr
    assert "open-file limit" in done.stderr


def test_a_wrong_key_is_answered_from_its_headers(server: Server) -> None:
    host, _port = _address(server)
    with socket.create_connection(_address(server), timeout=DEADLINE) as sock:
        # Announces 8 MB and sends none of it: the 401 comes anyway.
        sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {8 * 1024 * 1024}\r\n\r\n".encode()
        )
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    assert _status(data) == 401
    assert b"connection: close" in head


def test_an_unauthenticated_body_is_not_read(server: Server) -> None:
    """A client sending 7 MB of a body without the key: the server stops
    reading at once. The client's send buffer is small, so what it gets
    to send is what the server's socket took: a few hundred KB of buffers,
    never the 7 MB (which the app once read beside its key check)."""
    host, _port = _address(server)
    sent = 0
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        sock.settimeout(DEADLINE)
        sock.connect(_address(server))
        sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {8 * 1024 * 1024}\r\n\r\n".encode()
        )
        chunk = b"x" * 65536
        try:
            while sent < 7 * 1024 * 1024:
                sent += sock.send(chunk)
        except OSError:  # the server answered and closed; or stopped reading (the timeout)
            pass
    assert sent < 3 * 1024 * 1024
