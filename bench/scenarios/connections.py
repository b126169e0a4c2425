"""Open connections: /health beside idle ones, descriptors after closes, unauthenticated bodies.

Usage (from the repository root, loopback only)::

    python -m bench connections [--idle 2000] [--churn 2100] [--release 1986]
        [--posts 40] [--post-mb 7]

Four phases against one ``gezel-trio serve`` on the dense demo model of
``--size`` (default flags: ``--max-connections 256``), then one more with
``--api-key``:

1. ``--idle`` connections opened and left idle (no request sent); then 100
   sequential ``/health`` probes, each on a new connection (5 s timeout,
   after one uncounted probe: the server accepts in order, so once it is
   answered every idle connection has been accepted), and one short chat
   completion. Reported: the probes' p50/p99 (ms), how many failed, the
   chat's latency and status.
2. Those closed, ``--churn`` more opened and closed at once; the same probes.
3. ``--release`` connections opened and closed; the server's open
   descriptors (``/proc/PID/fd``) 1 s later, against its count before.
4. With ``--api-key``: ``--posts`` POSTs without a key at once, each
   announcing 8 MB and sending up to ``--post-mb`` MB of it from a 64 KB
   send buffer; the server's RSS before and after, and the mean bytes the
   server took before refusing.

Every loop is bounded; every socket is the scenario's own and closed by it.
Linux only (``/proc``).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from bench import _servers
from bench._scenario import Context, Option, Result, Scenario, table

PROBES = 100
PROBE_TIMEOUT = 5.0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _connect_many(host: str, port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.settimeout(PROBE_TIMEOUT)
        try:
            s.connect((host, port))
        except OSError:
            s.close()
            break
        socks.append(s)
    return socks


def _close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()
    socks.clear()


def _request(host: str, port: int, raw: bytes) -> tuple[float, int]:
    """Milliseconds to the whole response on a new connection, and its status (0: none)."""
    start = time.perf_counter()
    with socket.create_connection((host, port), timeout=PROBE_TIMEOUT) as s:
        s.sendall(raw)
        data = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
                head, sep, body = data.partition(b"\r\n\r\n")
                if sep:
                    length = next(
                        (
                            int(line.split(b":")[1])
                            for line in head.split(b"\r\n")
                            if line.lower().startswith(b"content-length:")
                        ),
                        None,
                    )
                    if length is not None and len(body) >= length:
                        break
        except OSError:
            return (time.perf_counter() - start) * 1000, 0
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
    return (time.perf_counter() - start) * 1000, status


def _probes(host: str, port: int) -> dict[str, float]:
    raw = f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    # One probe first, not counted: the server accepts in order, so once it
    # is answered every connection opened before it has been accepted.
    with contextlib.suppress(OSError):
        _request(host, port, raw)
    ms, failed = [], 0
    for _ in range(PROBES):
        try:
            took, status = _request(host, port, raw)
        except OSError:
            took, status = PROBE_TIMEOUT * 1000, 0
        failed += status != 200
        ms.append(took)
    ms.sort()
    return {
        "p50_ms": round(ms[len(ms) // 2], 2),
        "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 2),
        "failed": failed,
    }


def _chat_ms(host: str, port: int, key: str | None = None) -> tuple[float, int]:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    raw = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    try:
        return _request(host, port, raw)
    except OSError:
        return PROBE_TIMEOUT * 1000, 0


def _unauthenticated_post(host: str, port: int, mb: float, sent: list[int]) -> None:
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {8 * 1024 * 1024}\r\n\r\n"
    ).encode()
    chunk = b"x" * 65536
    total = 0
    with socket.socket() as s:
        # A small send buffer: what the server takes is what it reads (its
        # receive buffer grows only as it reads), not what the client's
        # kernel holds (loopback buffers grow to 4 MB).
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        s.settimeout(2)
        s.connect((host, port))
        s.sendall(head)
        try:
            while total < mb * 1024 * 1024:
                total += s.send(chunk)
        except OSError:
            pass  # refused: the server closed, or stopped reading
        sent.append(total)


def _address(server: _servers.Server) -> tuple[int, str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return server.proc.pid, host, int(port)


def run(ctx: Context) -> Result:
    a = ctx.args
    model = ctx.demo_model("dense")
    out: dict[str, Any] = {}
    with (
        ctx.phase("idle and churn"),
        _servers.gezel_server(
            model, ctx.workdir / "connections.log", [], stored_weights=False
        ) as server,
    ):
        pid, host, port = _address(server)
        out["health_alone"] = _probes(host, port)
        idle = _connect_many(host, port, a.idle)
        out["idle_opened"] = len(idle)
        out["health_idle_held"] = _probes(host, port)
        out["chat_idle_held_ms_status"] = _chat_ms(host, port)
        _close_all(idle)
        churn = _connect_many(host, port, a.churn)
        out["churn_opened"] = len(churn)
        _close_all(churn)
        out["health_after_churn"] = _probes(host, port)
        # Served once, and the descriptors of the phases before given time to go.
        _request(host, port, f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        before = _fds(pid)
        socks = _connect_many(host, port, a.release)
        opened = len(socks)
        _close_all(socks)
        time.sleep(1.0)  # the figure asked for: descriptors 1 s after the close
        out["fds_release"] = {"before": before, "opened": opened, "after_1s": _fds(pid)}
    with (
        ctx.phase("unauthenticated bodies"),
        _servers.gezel_server(
            model,
            ctx.workdir / "connections-key.log",
            ["--api-key", "sk-bench"],
            stored_weights=False,
        ) as server,
    ):
        pid, host, port = _address(server)
        before_mb = _rss_mb(pid)
        sent: list[int] = []
        threads = [
            threading.Thread(target=_unauthenticated_post, args=(host, port, a.post_mb, sent))
            for _ in range(a.posts)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["rss_unauthenticated_posts"] = {
            "before_mb": round(before_mb, 1),
            "after_mb": round(_rss_mb(pid), 1),
            "taken_mean_mb": round(sum(sent) / max(1, len(sent)) / 2**20, 2),
        }
    rows = [
        ("alone", *_cells(out["health_alone"])),
        (f"{out['idle_opened']} idle held", *_cells(out["health_idle_held"])),
        (f"after {out['churn_opened']} opened and closed", *_cells(out["health_after_churn"])),
    ]
    fds = out["fds_release"]
    rss = out["rss_unauthenticated_posts"]
    chat_ms, chat_status = out["chat_idle_held_ms_status"]
    return Result(
        data=out,
        tables=[
            table(
                "/health on a new connection, 100 probes",
                "while | p50 ms:.2f | p99 ms:.2f | failed",
                rows,
                f"a chat with the idle connections held: {chat_ms:.0f} ms, status {chat_status}",
            ),
            table(
                "descriptors and memory",
                "measure | before | after",
                [
                    (
                        f"open descriptors, 1 s after {fds['opened']} open+close",
                        fds["before"],
                        fds["after_1s"],
                    ),
                    (
                        f"RSS MB, {a.posts} unauthenticated posts of {a.post_mb} MB",
                        rss["before_mb"],
                        rss["after_mb"],
                    ),
                ],
                f"the server took {rss['taken_mean_mb']} MB of each body on average",
            ),
        ],
        title=f"{a.idle} idle connections",
    )


def _cells(probes: dict[str, float]) -> tuple[float, float, float]:
    return probes["p50_ms"], probes["p99_ms"], probes["failed"]


SCENARIO = Scenario(
    name="connections",
    doc=__doc__ or "",
    run=run,
    options=(
        Option("idle", 2000, "idle connections held while /health is probed", int, quick=300),
        Option("churn", 2100, "connections opened and closed at once", int, quick=300),
        Option("release", 1986, "connections whose descriptors are counted", int, quick=300),
        Option("posts", 40, "unauthenticated POSTs at once", int, quick=8),
        Option("post_mb", 7.0, "MB each of them sends (of 8 announced)", float, quick=2.0),
    ),
)
