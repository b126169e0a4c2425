"""Scheduler latency: priorities, /health under prefill, admission, disconnects.

All sections use one model (the dense demo model of ``--size``, or ``--model
DIR``), greedy requests (``temperature: 0``) rendered with
``enable_thinking=False``, streamed over HTTP SSE with
``stream_options.include_usage``. Every request's user message starts with a
unique ``Ticket NNNN:`` so no prompt-cache entry of an earlier request can
shorten its prefill (on either server). "First token" of a stream is the
arrival of its first SSE chunk with text (``content`` or reasoning), or its
``finish_reason`` chunk; the role-only chunk and comment frames (``:
queued N``, ``: prefill d/t``, ``: parked``, ``: resumed``, ``: keepalive``)
don't count. TTFT = first token - the moment the client started sending the
request. One server runs at a time; each is started and stopped by
``bench/_servers.py`` (``mlx_lm.server`` with the decode scenario's flags).

``ttft`` - interactive TTFT, idle vs under background load (gezel and
``mlx_lm.server``)
    Per repeat: (1) on an idle server, one interactive request (a ~15-token
    user message, ``max_tokens = --interactive-tokens``); (2) ``--bg-streams``
    long streams (``max_tokens = --bg-tokens``; gezel: ``priority:
    "background"`` and ``ignore_eos``; ``mlx_lm.server``: ordinary requests,
    it has no priorities) are started together and, once every one of them has
    produced ``--settle`` content chunks, the same kind of interactive request
    is sent. Reported: medians of idle and loaded TTFT and their ratio;
    ``parked`` = median over the background streams of (``: resumed`` arrival
    - ``: parked`` arrival) (gezel only); ``bg stall`` = the longest gap
    between consecutive content chunks of any background stream that overlaps
    the interactive request (both systems; compare with ``bg gap``, the median
    inter-chunk gap of the background streams before it). After the
    interactive request ends, the scenario waits until every background
    stream has produced another chunk, then closes them (both servers cancel
    a sequence whose client left). One unmeasured round warms both lanes and
    batch shapes first. ``mlx_lm.server`` runs once per ``--mlx-concurrency``
    value as ``--decode-concurrency N --prompt-concurrency N``: with N = the
    number of background streams the interactive request has no free slot and
    waits for a background stream to finish (no ``ignore_eos`` there, so that
    may be an early EOS).
``health`` - ``/health`` latency while a long prompt is prefilled (gezel)
    One request with a ~``--long-prompt``-token prompt and ``max_tokens: 1``
    (``--prefill-step-size 512``). A second thread, on its own keep-alive
    connection, GETs ``/health`` in a loop, sleeping ``--health-interval``
    between a response and the next request. Samples sent between the long
    request's send and its first token are the "during prefill" set; ~2 s of
    the same loop on the idle server before it are the baseline. Reported:
    count, p50, p99 (nearest rank), max.
``admission`` - continuous admission vs ``--static-waves`` (gezel)
    ``--max-concurrency 4``; 8 interactive requests with ``ignore_eos`` and
    ``max_tokens`` 16, 256, 32, 128, 64, 16, 192, 48, the i-th sent at
    ``i * --stagger`` s. Reported per mode (a fresh server each): total time
    (first send to last ``[DONE]``), mean and max TTFT, mean request latency;
    median over ``--admission-repeats``.
``disconnect`` - client disconnect to the freed slot's next admission (gezel)
    ``--max-concurrency 1``. Request A (``max_tokens`` 400, ``ignore_eos``)
    is sent over a raw socket and read until it has streamed 2 content
    chunks; request B (short prompt, ``max_tokens`` 4) is then sent and, once
    B's stream shows ``: queued``, A's socket is closed with ``SO_LINGER``
    0 (an RST, like a killed client). Reported: close -> B's first frame
    after the close (its ``: prefill`` comment: admission plus one prefill
    chunk), close -> B's first token, and B-sized TTFT on the idle server as
    the reference (so close->first token minus that is the admission delay).
"""

from __future__ import annotations

import itertools
import json
import math
import re
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import httpx2 as httpx

from bench import _gezel_stalls, _servers
from bench._report import median as med
from bench._report import percentile as pct
from bench._scenario import Context, Option, Plot, Result, Scenario, Series, Table, table
from bench._sse import StreamLog, StreamThread
from bench.scenarios.decode import PROMPT as BACKGROUND_TEXT

SECTIONS = ("ttft", "health", "admission", "disconnect")
SYSTEMS = ("gezel", "mlx_lm.server")
ADMISSION_TOKENS = (16, 256, 32, 128, 64, 16, 192, 48)
INTERACTIVE_TEXT = "Name three colors."
FILLER = "the keeper checks the lamp, logs the wind and counts the ships."
_WAIT_S = 180.0  # generous bound on any single wait
_MLX_SETTLE_S = 1.0  # mlx_lm.server reports no load: pause after cancelling streams
_CONTENT_RE = re.compile(rb'"delta": ?\{"content": ?"[^"]')


class _Tickets:
    """Unique ``Ticket NNNN:`` prefixes: no request shares a cached prefix."""

    def __init__(self) -> None:
        self._n = 0
        self._lock = threading.Lock()

    def next(self) -> str:
        with self._lock:
            self._n += 1
            return f"Ticket {self._n:04d}:"


def body_for(
    tickets: _Tickets, system: str, text: str, max_tokens: int, *, background: bool = False
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": f"{tickets.next()} {text}"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": False},
    }
    if system == "gezel":
        body["ignore_eos"] = True
        body["priority"] = "background" if background else "interactive"
    return body


@attrs.define
class _Run:
    """What the sections share: the options, ticket numbers, one condition
    that every stream notifies, and the progress line."""

    args: Any
    ctx: Context
    tickets: _Tickets = attrs.Factory(_Tickets)
    cond: threading.Condition = attrs.Factory(threading.Condition)

    def body(self, system: str, text: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
        return body_for(self.tickets, system, text, max_tokens, **kw)

    def start(self, url: str, body: dict[str, Any], name: str) -> StreamThread:
        return StreamThread(url, body, name, self.cond).start()

    def wait_for(self, pred: Callable[[], bool], what: str) -> None:
        with self.cond:
            if not self.cond.wait_for(pred, timeout=_WAIT_S):
                raise RuntimeError(f"timed out after {_WAIT_S}s waiting for {what}")

    def run_one(self, url: str, body: dict[str, Any], name: str) -> StreamLog:
        s = self.start(url, body, name)
        self.wait_for(lambda: s.log.ended, name)
        s.join(5.0)
        return checked(s.log)

    def warm_up(self, url: str, system: str) -> None:
        self.run_one(url, self.body(system, INTERACTIVE_TEXT, 8), "warm-up")


def checked(log: StreamLog) -> StreamLog:
    if log.error is not None:
        raise RuntimeError(f"{log.name}: {log.error}")
    if log.first is None and not log.cancelled:
        raise RuntimeError(f"{log.name}: no token")
    return log


def wait_idle(url: str, system: str) -> None:
    """gezel: poll /health until nothing runs or waits. mlx_lm.server reports
    no load, so: a fixed pause for cancelled sequences to leave."""
    if system != "gezel":
        time.sleep(_MLX_SETTLE_S)
        return
    deadline = time.monotonic() + _WAIT_S
    with httpx.Client(timeout=10.0) as client:
        while True:
            h = client.get(f"{url}/health").json()
            if h.get("running") == 0 and h.get("queued") == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not idle after {_WAIT_S}s: {h}")
            time.sleep(0.05)


# --- ttft: interactive TTFT, idle vs under background load ---------------------


@attrs.define
class TtftRound:
    system: str
    idle_ttft_s: float
    loaded_ttft_s: float
    parked_s: float | None  # median over bg streams of resumed - parked (gezel)
    bg_stall_s: float  # longest bg inter-chunk gap overlapping the interactive request
    bg_gap_s: float  # median bg inter-chunk gap before the interactive request
    bg_chunks_at_send: list[int]
    interactive_prompt_tokens: int | None
    notes: list[str] = attrs.Factory(list)


def ttft_round(r: _Run, url: str, system: str, label: str) -> TtftRound:
    a = r.args
    wait_idle(url, system)
    idle = r.run_one(url, r.body(system, INTERACTIVE_TEXT, a.interactive_tokens), "idle")
    wait_idle(url, system)
    notes: list[str] = []
    bgs = [
        r.start(url, r.body(system, BACKGROUND_TEXT, a.bg_tokens, background=True), f"bg{k}")
        for k in range(a.bg_streams)
    ]
    try:
        r.wait_for(
            lambda: all(b.log.ended or len(b.log.content) >= a.settle for b in bgs),
            "background streams to produce content",
        )
        for b in bgs:
            checked(b.log)
        if any(b.log.ended for b in bgs):
            notes.append("a background stream ended before the interactive request")
        chunks = [len(b.log.content) for b in bgs]
        inter = r.run_one(url, r.body(system, INTERACTIVE_TEXT, a.interactive_tokens), "loaded")
        end = inter.finished or inter.first or time.perf_counter()
        r.wait_for(
            lambda: all(b.log.ended or (b.log.content and b.log.content[-1] > end) for b in bgs),
            "background streams to resume",
        )
    finally:
        for b in bgs:
            b.cancel()
        for b in bgs:
            b.join(30.0)
    for b in bgs:
        if b.log.error is not None:
            raise RuntimeError(f"{b.log.name}: {b.log.error}")
    stall = 0.0
    gaps: list[float] = []
    parked: list[float] = []
    for b in bgs:
        for t0, t1 in itertools.pairwise(b.log.content):
            if t1 > inter.sent and t0 < end:
                stall = max(stall, t1 - t0)
            elif t1 <= inter.sent:
                gaps.append(t1 - t0)
        p = b.log.comment_time("parked")
        q = b.log.comment_time("resumed")
        if p is not None and q is not None:
            parked.append(q - p)
    ended = sum(1 for b in bgs if b.log.finished is not None and b.log.finished < end)
    if ended:
        notes.append(f"{ended} background stream(s) finished before the interactive one ended")
    if system == "gezel" and len(parked) < len(bgs):
        notes.append(f"{len(bgs) - len(parked)} background stream(s) showed no parked/resumed")
    return TtftRound(
        system=label,
        idle_ttft_s=idle.ttft,
        loaded_ttft_s=inter.ttft,
        parked_s=med(parked) if parked else None,
        bg_stall_s=stall,
        bg_gap_s=med(gaps),
        bg_chunks_at_send=chunks,
        interactive_prompt_tokens=inter.usage_int("prompt_tokens"),
        notes=notes,
    )


def run_ttft(r: _Run, url: str, system: str, label: str) -> list[TtftRound]:
    r.warm_up(url, system)
    ttft_round(r, url, system, label)  # warm-up: both lanes, batch shapes
    out = []
    for _ in range(r.args.repeats):
        out.append(ttft_round(r, url, system, label))
        x = out[-1]
        parked = f"{x.parked_s:.2f}s" if x.parked_s is not None else "-"
        r.ctx.progress(
            f"{label}: idle {x.idle_ttft_s * 1e3:.0f} ms, loaded {x.loaded_ttft_s * 1e3:.0f} ms,"
            f" parked {parked}, stall {x.bg_stall_s:.2f}s"
            + (f" [{'; '.join(x.notes)}]" if x.notes else "")
        )
    return out


# --- health: /health latency during a long prefill -----------------------------


@attrs.define
class HealthResult:
    prompt_tokens: int | None
    prefill_s: float  # long request: send -> first token
    prefill_comments: int
    interval_s: float
    idle_ms: list[float]
    during_ms: list[float]
    # Each answer during the prefill less the time the probe's own thread
    # waited runnable for a core meanwhile (the kernel's run_delay): the
    # server's part and the wire's.
    during_less_probe_wait_ms: list[float] = attrs.Factory(list)


def long_prompt(model_dir: Path, target: int) -> str:
    """A user message of about ``target`` tokens (counted with the model's
    tokenizer when it loads; the chat template adds a few more)."""
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

        def count(s: str) -> int:
            return len(tok.encode(s).ids)
    except Exception:  # no tokenizer.json: ~1.3 tokens per word

        def count(s: str) -> int:
            return int(len(s.split()) * 1.3)

    lines: list[str] = []
    per_line = count(f"Line 100: {FILLER}\n")
    while per_line * len(lines) < target:
        lines.append(f"Line {len(lines) + 1}: {FILLER}\n")
    text = "".join(lines)
    while count(text) > target and len(lines) > 1:
        lines.pop()
        text = "".join(lines)
    return text + "Summarize the log."


def _poll_health(
    url: str, interval: float, stop: threading.Event, out: list[tuple[float, float, float]]
) -> None:
    """GET ``/health`` on one kept-alive connection every ``interval``
    seconds, as a load balancer's probe does: the request's bytes written
    on a raw socket and the answer read to its ``Content-Length``. The
    latency is the server's and the machine's: httpx's own Python per
    request (1-2 ms of this machine's CPU, on cores the prefill fills)
    measured the client as much as the server. hypercorn closes a
    connection after 1,000 requests (``keep_alive_max_requests``), as a
    server may: the probe then connects again, and that request's
    latency, which includes the connect, is not counted."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    queued = _gezel_stalls.queued_ns_reader()  # this (the probe's) thread's
    while not stop.is_set():
        with socket.create_connection((host, port), timeout=30.0) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not stop.is_set():
                q0 = queued()
                t0 = time.perf_counter()
                try:
                    sock.sendall(request)
                    status = _read_response(sock)
                except (_Closed, ConnectionError):
                    break
                t1 = time.perf_counter()
                if status != 200:
                    raise RuntimeError(f"/health: HTTP {status}")
                out.append((t0, t1 - t0, (queued() - q0) / 1e9))
                time.sleep(interval)


class _Closed(RuntimeError):
    """The server closed the probe's connection between answers."""


def _read_response(sock: socket.socket) -> int:
    """Read one HTTP/1.1 response with a ``Content-Length``; its status."""
    data = b""
    while b"\r\n\r\n" not in data:
        got = sock.recv(65536)
        if not got and not data:
            raise _Closed("/health: the connection closed before an answer")
        if not got:
            raise RuntimeError("/health: the connection closed")
        data += got
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(
        int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:")
    )
    while len(body) < length:
        got = sock.recv(65536)
        if not got:
            raise RuntimeError("/health: the connection closed")
        body += got
    return int(lines[0].split()[1])


def run_health(r: _Run, url: str, model_dir: Path) -> HealthResult:
    a = r.args
    wait_idle(url, "gezel")
    samples: list[tuple[float, float, float]] = []
    stop = threading.Event()
    poller = threading.Thread(
        target=_poll_health, args=(url, a.health_interval, stop, samples), daemon=True
    )
    t_idle = time.perf_counter()
    poller.start()
    try:
        time.sleep(2.0)
        s = r.start(url, r.body("gezel", long_prompt(model_dir, a.long_prompt), 1), "long")
        r.wait_for(lambda: s.log.ended, "the long-prompt request")
    finally:
        stop.set()
        poller.join(30.0)
    log = checked(s.log)
    first = log.first
    assert first is not None
    return HealthResult(
        prompt_tokens=log.usage_int("prompt_tokens"),
        prefill_s=log.ttft,
        prefill_comments=sum(1 for _, c in log.comments if c.startswith("prefill")),
        interval_s=a.health_interval,
        idle_ms=[lat * 1e3 for t, lat, _ in samples if t_idle <= t < log.sent],
        during_ms=[lat * 1e3 for t, lat, _ in samples if log.sent <= t < first],
        during_less_probe_wait_ms=[
            (lat - wait) * 1e3 for t, lat, wait in samples if log.sent <= t < first
        ],
    )


# --- admission: continuous admission vs static waves ---------------------------


@attrs.define
class AdmissionRound:
    mode: str
    total_s: float
    mean_ttft_s: float
    max_ttft_s: float
    mean_latency_s: float
    ttft_s: list[float]
    latency_s: list[float]
    completion_tokens: list[int | None]


def admission_round(r: _Run, url: str, mode: str) -> AdmissionRound:
    wait_idle(url, "gezel")
    streams: list[StreamThread] = []
    t0 = time.perf_counter()
    for i, n in enumerate(ADMISSION_TOKENS):
        delay = t0 + i * r.args.stagger - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        streams.append(r.start(url, r.body("gezel", INTERACTIVE_TEXT, n), f"req{i}"))
    r.wait_for(lambda: all(s.log.ended for s in streams), "the admission workload")
    logs = [checked(s.log) for s in streams]
    ends = [lg.finished for lg in logs if lg.finished is not None]
    ttfts = [lg.ttft for lg in logs]
    lats = [(lg.finished or math.nan) - lg.sent for lg in logs]
    return AdmissionRound(
        mode=mode,
        total_s=max(ends) - min(lg.sent for lg in logs),
        mean_ttft_s=sum(ttfts) / len(ttfts),
        max_ttft_s=max(ttfts),
        mean_latency_s=sum(lats) / len(lats),
        ttft_s=ttfts,
        latency_s=lats,
        completion_tokens=[lg.usage_int("completion_tokens") for lg in logs],
    )


# --- disconnect: client disconnect -> next admission ---------------------------


@attrs.define
class DisconnectRound:
    close_to_frame_s: float  # close -> B's first frame after the close
    first_frame: str  # what that frame was
    close_to_token_s: float  # close -> B's first token
    b_idle_ttft_s: float  # a B-shaped request on the idle server
    a_chunks_before_close: int


def _raw_stream_open(url: str, body: dict[str, Any], chunks: int) -> tuple[socket.socket, int]:
    """POST ``body`` on a raw socket; return once ``chunks`` content chunks
    arrived (the socket is left open and unread from then on)."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        "Accept: text/event-stream\r\n\r\n"
    ).encode()
    sock = socket.create_connection(
        (parts.hostname or _servers.HOST, parts.port or 80), timeout=_WAIT_S
    )
    try:
        sock.sendall(head + payload)
        buf = b""
        while len(_CONTENT_RE.findall(buf)) < chunks:
            data = sock.recv(65536)
            if not data:
                raise RuntimeError(f"request A: connection closed early: {buf[-300:]!r}")
            buf += data
        return sock, len(_CONTENT_RE.findall(buf))
    except BaseException:
        sock.close()
        raise


def disconnect_round(r: _Run, url: str) -> DisconnectRound:
    wait_idle(url, "gezel")
    ref = r.run_one(url, r.body("gezel", INTERACTIVE_TEXT, 4), "B-idle")
    wait_idle(url, "gezel")
    sock, a_chunks = _raw_stream_open(url, r.body("gezel", BACKGROUND_TEXT, 400), 2)
    b: StreamThread | None = None
    try:
        b = r.start(url, r.body("gezel", INTERACTIVE_TEXT, 4), "B")
        bl = b.log
        r.wait_for(lambda: bl.ended or bl.comment_time("queued") is not None, "B queued")
        if bl.ended:
            raise RuntimeError(f"B ended before it was queued: {checked(bl)}")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        t_close = time.perf_counter()
        sock.close()
        r.wait_for(lambda: bl.ended, "B to finish")
    finally:
        sock.close()
        if b is not None:
            b.cancel()
            b.join(30.0)
    bl = checked(b.log)
    first_tok = bl.first
    assert first_tok is not None
    frames = [(t, c) for t, c in bl.comments if t > t_close] + [(first_tok, "first token")]
    t_frame, what = min(frames)
    return DisconnectRound(
        close_to_frame_s=t_frame - t_close,
        first_frame=what,
        close_to_token_s=first_tok - t_close,
        b_idle_ttft_s=ref.ttft,
        a_chunks_before_close=a_chunks,
    )


# --- the run ---------------------------------------------------------------------


def run(ctx: Context) -> Result:
    a = ctx.args
    if a.repeats < 1 or a.admission_repeats < 1 or a.settle < 1:
        raise ValueError("--repeats, --admission-repeats and --settle must be >= 1")
    stored: Path = a.model if a.model is not None else ctx.demo_model("dense")
    # The demo models are bf16 on disk; every system gets the float32 copy
    # gezel-trio computes with on the CPU (bf16 matmuls skip OpenBLAS).
    model_dir = _servers.float32_copy(stored, stored.parent / "bench-float32")
    sections = set(a.sections)
    r = _Run(a, ctx)
    base = ["--max-concurrency", str(a.max_concurrency), "--prefill-step-size", "512"]
    flags: dict[str, list[str]] = {
        "continuous": base,
        "static-waves": [*base, "--static-waves"],
        "disconnect": ["--max-concurrency", "1", "--prefill-step-size", "512"],
    }

    def gezel(name: str) -> Any:
        fl = ["--log-level", "WARNING", *flags[name]]
        return _servers.gezel_server(model_dir, ctx.workdir / f"gezel-{name}.log", fl)

    ttft: list[TtftRound] = []
    health: HealthResult | None = None
    admission: list[AdmissionRound] = []
    disconnect: list[DisconnectRound] = []
    want_ttft = "ttft" in sections and "gezel" in a.systems
    if want_ttft or "health" in sections:
        with gezel("continuous") as srv:
            if want_ttft:
                with ctx.phase("ttft gezel"):
                    ttft += run_ttft(r, srv.url, "gezel", "gezel")
            if "health" in sections:
                with ctx.phase("health"):
                    health = run_health(r, srv.url, model_dir)
    if "ttft" in sections and "mlx_lm.server" in a.systems:
        for c in a.mlx_concurrency:
            label = f"mlx_lm.server c={c}"
            log = ctx.workdir / f"mlx_lm_server-c{c}.log"
            with ctx.phase(f"ttft {label}"):
                with _servers.mlx_server(model_dir, log, _servers.mlx_decode_flags(c)) as srv:
                    ttft += run_ttft(r, srv.url, "mlx_lm.server", label)
    if "admission" in sections:
        for mode in ("continuous", "static-waves"):
            with ctx.phase(f"admission {mode}"), gezel(mode) as srv:
                r.warm_up(srv.url, "gezel")
                for _ in range(a.admission_repeats):
                    admission.append(admission_round(r, srv.url, mode))
                    x = admission[-1]
                    ctx.progress(f"{mode}: total {x.total_s:.2f}s TTFT {x.mean_ttft_s:.2f}s")
    if "disconnect" in sections:
        with ctx.phase("disconnect"), gezel("disconnect") as srv:
            r.warm_up(srv.url, "gezel")
            for _ in range(a.repeats):
                disconnect.append(disconnect_round(r, srv.url))
                d = disconnect[-1]
                ctx.progress(
                    f"disconnect: frame {d.close_to_frame_s * 1e3:.0f} ms ({d.first_frame}), "
                    f"token {d.close_to_token_s * 1e3:.0f} ms"
                )

    data = {
        "model": str(model_dir),
        "gezel_flags": {k: [*v, "--log-level", "WARNING"] for k, v in flags.items()},
        "mlx_lm_server_flags": {str(c): _servers.mlx_decode_flags(c) for c in a.mlx_concurrency},
        "ttft": ttft,
        "health": health,
        "admission": admission,
        "disconnect": disconnect,
    }
    tables: list[Table] = []
    plots: list[Plot] = []
    notes: list[str] = []
    if ttft:
        tables.append(_ttft_table(ttft, a))
        notes += sorted({n for x in ttft for n in x.notes})
        labels = list(dict.fromkeys(x.system for x in ttft))
        plots.append(
            Plot(
                "Interactive TTFT, idle vs under background load",
                "",
                "TTFT ms (median)",
                tuple(
                    Series(
                        which,
                        labels,
                        [
                            med([getattr(x, f"{which}_ttft_s") for x in ttft if x.system == lb])
                            * 1e3
                            for lb in labels
                        ],
                    )
                    for which in ("idle", "loaded")
                ),
                kind="bar",
            )
        )
    if health is not None:
        tables.append(_health_table(health))
        stats = ("p50", "p99", "max")
        plots.append(
            Plot(
                "/health latency during a long prefill (gezel)",
                "",
                "ms",
                tuple(
                    Series(name, stats, [pct(vals, 50), pct(vals, 99), max(vals, default=math.nan)])
                    for name, vals in (
                        ("idle", health.idle_ms),
                        ("during prefill", health.during_ms),
                    )
                ),
                kind="bar",
            )
        )
    if admission:
        tables.append(_admission_table(admission, a))
        modes = list(dict.fromkeys(x.mode for x in admission))
        cols = ("total_s", "mean_ttft_s", "max_ttft_s", "mean_latency_s")
        plots.append(
            Plot(
                "Continuous admission vs static waves (gezel)",
                "",
                "s (median)",
                tuple(
                    Series(
                        m,
                        ["total", "mean TTFT", "max TTFT", "mean latency"],
                        [med([getattr(x, c) for x in admission if x.mode == m]) for c in cols],
                    )
                    for m in modes
                ),
                kind="bar",
            )
        )
    if disconnect:
        tables.append(_disconnect_table(disconnect, a))
        plots.append(
            Plot(
                "Client disconnect -> next admission (gezel, max-concurrency 1)",
                "",
                "ms (median)",
                (
                    Series(
                        "gezel",
                        ["close -> B first frame", "close -> B token", "B idle TTFT"],
                        [
                            med([x.close_to_frame_s for x in disconnect]) * 1e3,
                            med([x.close_to_token_s for x in disconnect]) * 1e3,
                            med([x.b_idle_ttft_s for x in disconnect]) * 1e3,
                        ],
                    ),
                ),
                kind="bar",
            )
        )
    return Result(data, tables, plots, notes, title=f"model {model_dir.name}")


def _ttft_table(rounds: list[TtftRound], a: Any) -> Table:
    rows = []
    for label in dict.fromkeys(x.system for x in rounds):
        rs = [x for x in rounds if x.system == label]
        idle = med([x.idle_ttft_s for x in rs])
        loaded = med([x.loaded_ttft_s for x in rs])
        rows.append(
            (
                label, idle * 1e3, loaded * 1e3, loaded / idle, med([x.parked_s for x in rs]),
                med([x.bg_stall_s for x in rs]), med([x.bg_gap_s for x in rs]) * 1e3,
                " ".join(f"{x.loaded_ttft_s * 1e3:.0f}/{x.idle_ttft_s * 1e3:.0f}" for x in rs),
            )
        )  # fmt: skip
    return table(
        f"1. Interactive TTFT, idle vs {a.bg_streams} background streams (bg max_tokens "
        f"{a.bg_tokens}, interactive max_tokens {a.interactive_tokens}, median of {a.repeats})",
        "system | idle ms:.0f | loaded ms:.0f | ratio:.2f | parked s:.2f | bg stall s:.2f"
        " | bg gap ms:.0f | runs loaded/idle ms",
        rows,
    )


def _health_table(h: HealthResult) -> Table:
    rows = [
        (name, len(vals), pct(vals, 50), pct(vals, 99), max(vals, default=math.nan))
        for name, vals in (
            ("idle (2 s before)", h.idle_ms),
            (f"during prefill ({h.prompt_tokens} tok, {h.prefill_s:.1f} s)", h.during_ms),
            ("the same, less the probe's own wait for a core", h.during_less_probe_wait_ms),
        )
    ]
    return table(
        "2. /health latency during a long prefill (gezel)",
        "/health latency ms | samples:d | p50:.1f | p99:.1f | max:.1f",
        rows,
        f"Poll: sleep {h.interval_s * 1e3:.0f} ms between requests; "
        f"{h.prefill_comments} `: prefill` comments on the long stream. The probe's "
        "own wait for a core is the kernel's run_delay of its thread during each request "
        "(the bench's client shares the server's cores).",
    )


def _admission_table(rounds: list[AdmissionRound], a: Any) -> Table:
    rows = []
    for mode in dict.fromkeys(x.mode for x in rounds):
        rs = [x for x in rounds if x.mode == mode]
        rows.append(
            (
                mode, med([x.total_s for x in rs]), med([x.mean_ttft_s for x in rs]),
                med([x.max_ttft_s for x in rs]), med([x.mean_latency_s for x in rs]),
                " ".join(f"{x.total_s:.2f}" for x in rs),
            )
        )  # fmt: skip
    return table(
        f"3. Continuous vs static waves (gezel, 8 requests, max_tokens {list(ADMISSION_TOKENS)}, "
        f"every {a.stagger}s, median of {a.admission_repeats})",
        "mode | total s:.2f | mean TTFT s:.2f | max TTFT s:.2f | mean latency s:.2f | runs total s",
        rows,
    )


def _disconnect_table(rounds: list[DisconnectRound], a: Any) -> Table:
    frame = med([x.close_to_frame_s for x in rounds])
    tok = med([x.close_to_token_s for x in rounds])
    ref = med([x.b_idle_ttft_s for x in rounds])
    kinds = sorted({x.first_frame.split()[0] for x in rounds})
    runs = " ".join(f"{x.close_to_token_s * 1e3:.0f}" for x in rounds)
    return table(
        f"4. Client disconnect -> next admission (gezel, max-concurrency 1, median of {a.repeats})",
        "close->B first frame ms:.0f | close->B token ms:.0f | B idle TTFT ms:.0f"
        " | token - idle ms:.0f | runs close->token ms",
        [(frame * 1e3, tok * 1e3, ref * 1e3, (tok - ref) * 1e3, runs)],
        f"The first frame after the close was: {', '.join(kinds)}.",
    )


SCENARIO = Scenario(
    name="scheduler",
    doc=__doc__ or "",
    run=run,
    options=(
        Option("sections", list(SECTIONS), "sections to run", str, "+", SECTIONS),
        Option("systems", list(SYSTEMS), "systems of the ttft section", str, "+", SYSTEMS),
        Option("model", None, "a model directory (default: the dense demo model)", Path),
        Option("repeats", 5, "ttft and disconnect repeats", int, quick=2),
        Option("max_concurrency", 4, "gezel --max-concurrency (ttft, health, admission)", int),
        Option("bg_streams", 4, "background streams (ttft)", int),
        Option("bg_tokens", 400, "background max_tokens (ttft)", int, quick=200),
        Option("settle", 4, "background chunks each before the interactive request", int),
        Option("interactive_tokens", 8, "interactive max_tokens (ttft)", int),
        Option("mlx_concurrency", [4], "mlx_lm.server concurrency values (ttft)", int, "+"),
        Option("long_prompt", 2000, "prompt tokens (health)", int, quick=1000),
        Option("health_interval", 0.02, "seconds between /health polls", float),
        Option("stagger", 0.4, "seconds between admission arrivals", float),
        Option("admission_repeats", 2, "admission repeats", int, quick=1),
    ),
)
