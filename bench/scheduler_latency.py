"""Scheduler latency: priorities, /health under prefill, admission, disconnects.

Usage (from the repository root)::

    python bench/scheduler_latency.py [--sections ttft health admission disconnect]
                                      [--systems gezel mlx_lm.server] [--repeats 5]
                                      [--model DIR] [--json OUT]

All sections use one model (default: the bench dense demo model), greedy
requests (``temperature: 0``) rendered with ``enable_thinking=False``,
streamed over HTTP SSE with ``stream_options.include_usage``. Every request's
user message starts with a unique ``Ticket NNNN:`` so no prompt-cache entry
of an earlier request can shorten its prefill (on either server). "First
token" of a stream is the arrival of its first SSE chunk with non-empty
``content`` (or ``reasoning_content``, or a ``finish_reason``); the role-only
chunk and comment frames (``: queued N``, ``: prefill d/t``, ``: parked``,
``: resumed``, ``: keepalive``) don't count. TTFT = first token - the moment
the client started sending the request. One server runs at a time; each is
started as in ``bench/decode_throughput.py`` (gezel: ready on its
``gezel-trio listening on URL`` stdout line; ``mlx_lm.server``: ``/health``
polling) and stopped with SIGINT, then SIGKILL, in a ``finally``.

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
    interactive request ends, the script waits until every background stream
    has produced another chunk, then closes them (both servers cancel a
    sequence whose client left). ``mlx_lm.server`` runs once per
    ``--mlx-concurrency`` value as ``--decode-concurrency N
    --prompt-concurrency N``: with N = the number of background streams the
    interactive request has no free slot and waits for a background stream to
    finish (no ``ignore_eos`` there, so that may be an early EOS).
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

import argparse
import contextlib
import itertools
import json
import math
import os
import re
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx2 as httpx

if __package__ in (None, ""):  # run as a script: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common
from bench import decode_throughput as dt

SECTIONS = ("ttft", "health", "admission", "disconnect")
SYSTEMS = ("gezel", "mlx_lm.server")
ADMISSION_TOKENS = (16, 256, 32, 128, 64, 16, 192, 48)
INTERACTIVE_TEXT = "Name three colors."
BACKGROUND_TEXT = dt.PROMPT
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


TICKETS = _Tickets()


def body_for(
    system: str,
    text: str,
    max_tokens: int,
    *,
    background: bool = False,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": f"{TICKETS.next()} {text}"}],
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


# --- one SSE stream on its own thread ---------------------------------------


@dataclass
class StreamLog:
    """What one stream did; times are perf_counter seconds."""

    name: str
    sent: float = math.nan
    content: list[float] = field(default_factory=list)
    comments: list[tuple[float, str]] = field(default_factory=list)
    finished: float | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    cancelled: bool = False
    done: bool = False

    @property
    def first(self) -> float | None:
        """First token: first content chunk, else the finish chunk."""
        if self.content:
            return self.content[0]
        return self.finished

    @property
    def ttft(self) -> float:
        return self.first - self.sent if self.first is not None else math.nan

    def comment_time(self, prefix: str, after: float = -math.inf) -> float | None:
        for t, text in self.comments:
            if t > after and text.startswith(prefix):
                return t
        return None


class SseStream:
    """A streaming chat completion read on a daemon thread with its own
    connection. ``cancel`` makes the reader leave after its next line (which
    closes the connection); every event notifies ``cond``."""

    def __init__(self, url: str, body: dict[str, Any], name: str, cond: threading.Condition):
        self.log = StreamLog(name)
        self._url = url
        self._body = body
        self._cond = cond
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> SseStream:
        self._thread.start()
        return self

    def cancel(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _run(self) -> None:
        log = self.log
        try:
            with httpx.Client(timeout=dt._REQUEST_TIMEOUT_S) as client:
                log.sent = time.perf_counter()
                url = f"{self._url}/v1/chat/completions"
                with client.stream("POST", url, json=self._body) as resp:
                    if resp.status_code != 200:
                        resp.read()
                        raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
                    for line in resp.iter_lines():
                        now = time.perf_counter()
                        if self._stop.is_set():
                            log.cancelled = True
                            break
                        if self._line(line, now):
                            break
                        self._notify()
        except Exception as exc:  # reported by the caller
            log.error = repr(exc)
        finally:
            log.done = True
            self._notify()

    def _line(self, line: str, now: float) -> bool:
        """Record one SSE line; True at ``[DONE]``."""
        log = self.log
        if line.startswith(":"):
            log.comments.append((now, line[1:].strip()))
            return False
        if not line.startswith("data:"):
            return False
        data = line[5:].strip()
        if data == "[DONE]":
            return True
        obj = json.loads(data)
        if "error" in obj:
            raise RuntimeError(f"stream error: {obj['error']}")
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content"):
                log.content.append(now)
            if choice.get("finish_reason"):
                log.finished = now
                log.finish_reason = choice["finish_reason"]
        usage = obj.get("usage")
        if usage:
            log.prompt_tokens = usage.get("prompt_tokens", log.prompt_tokens)
            log.completion_tokens = usage.get("completion_tokens", log.completion_tokens)
        return False


def wait_for(cond: threading.Condition, pred: Callable[[], bool], what: str) -> None:
    with cond:
        if not cond.wait_for(pred, timeout=_WAIT_S):
            raise RuntimeError(f"timed out after {_WAIT_S}s waiting for {what}")


def run_one(url: str, body: dict[str, Any], name: str, cond: threading.Condition) -> StreamLog:
    s = SseStream(url, body, name, cond).start()
    wait_for(cond, lambda: s.log.done, name)
    s.join(5.0)
    return checked(s.log)


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


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def med(values: Sequence[float | None]) -> float:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(vals) if vals else math.nan


# --- servers -----------------------------------------------------------------


@contextlib.contextmanager
def gezel_server(model_dir: Path, logdir: Path, name: str, flags: Sequence[str]) -> Iterator[str]:
    """Start gezel-trio with ``flags`` on a free port; yield its URL once it
    prints its listening line; always stop it (as in decode_throughput)."""
    log = logdir / f"{name}.log"
    cmd_flags = ["--log-level", "WARNING", *flags]
    with _common.gezel_server(model_dir, log, cmd_flags, label=name) as server:
        yield server.url


def warm_up(url: str, system: str, cond: threading.Condition) -> None:
    run_one(url, body_for(system, INTERACTIVE_TEXT, 8), "warm-up", cond)


# --- section 1: interactive TTFT, idle vs under background load --------------


@dataclass
class TtftRound:
    system: str
    idle_ttft_s: float
    loaded_ttft_s: float
    parked_s: float | None  # median over bg streams of resumed - parked (gezel)
    bg_stall_s: float  # longest bg inter-chunk gap overlapping the interactive request
    bg_gap_s: float  # median bg inter-chunk gap before the interactive request
    bg_chunks_at_send: list[int]
    interactive_prompt_tokens: int | None
    notes: list[str] = field(default_factory=list)


def ttft_round(
    url: str, system: str, label: str, args: argparse.Namespace, cond: threading.Condition
) -> TtftRound:
    wait_idle(url, system)
    idle = run_one(url, body_for(system, INTERACTIVE_TEXT, args.interactive_tokens), "idle", cond)
    wait_idle(url, system)
    notes: list[str] = []
    bgs = [
        SseStream(
            url,
            body_for(system, BACKGROUND_TEXT, args.bg_tokens, background=True),
            f"bg{k}",
            cond,
        ).start()
        for k in range(args.bg_streams)
    ]
    try:
        wait_for(
            cond,
            lambda: all(b.log.done or len(b.log.content) >= args.settle for b in bgs),
            "background streams to produce content",
        )
        for b in bgs:
            checked(b.log)
        if any(b.log.done for b in bgs):
            notes.append("a background stream ended before the interactive request")
        chunks = [len(b.log.content) for b in bgs]
        inter = run_one(
            url, body_for(system, INTERACTIVE_TEXT, args.interactive_tokens), "loaded", cond
        )
        end = inter.finished or inter.first or time.perf_counter()
        wait_for(
            cond,
            lambda: all(b.log.done or (b.log.content and b.log.content[-1] > end) for b in bgs),
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
        ts = b.log.content
        for a, c in itertools.pairwise(ts):
            if c > inter.sent and a < end:
                stall = max(stall, c - a)
            elif c <= inter.sent:
                gaps.append(c - a)
        p = b.log.comment_time("parked")
        r = b.log.comment_time("resumed")
        if p is not None and r is not None:
            parked.append(r - p)
    ended = sum(1 for b in bgs if b.log.finished is not None and b.log.finished < end)
    if ended:
        notes.append(f"{ended} background stream(s) finished before the interactive one ended")
    if system == "gezel" and len(parked) < len(bgs):
        notes.append(f"{len(bgs) - len(parked)} background stream(s) showed no parked/resumed")
    return TtftRound(
        system=label,
        idle_ttft_s=idle.ttft,
        loaded_ttft_s=inter.ttft,
        parked_s=statistics.median(parked) if parked else None,
        bg_stall_s=stall,
        bg_gap_s=med(gaps),
        bg_chunks_at_send=chunks,
        interactive_prompt_tokens=inter.prompt_tokens,
        notes=notes,
    )


def run_ttft(
    url: str, system: str, label: str, args: argparse.Namespace, cond: threading.Condition
) -> list[TtftRound]:
    warm_up(url, system, cond)
    ttft_round(url, system, label, args, cond)  # warm-up: both lanes, batch shapes
    out = []
    for _ in range(args.repeats):
        out.append(ttft_round(url, system, label, args, cond))
        _progress(f"  {label}: {_fmt_ttft(out[-1])}")
    return out


def _fmt_ttft(r: TtftRound) -> str:
    parked = f"{r.parked_s:.2f}s" if r.parked_s is not None else "-"
    note = f"  [{'; '.join(r.notes)}]" if r.notes else ""
    return (
        f"idle {r.idle_ttft_s * 1e3:.0f} ms, loaded {r.loaded_ttft_s * 1e3:.0f} ms, "
        f"parked {parked}, stall {r.bg_stall_s:.2f}s{note}"
    )


def render_ttft(rounds: list[TtftRound]) -> str:
    head = (
        f"{'system':<20}{'idle ms':>9}{'loaded ms':>11}{'ratio':>8}{'parked s':>10}"
        f"{'bg stall s':>12}{'bg gap ms':>11}   runs loaded/idle ms"
    )
    rows = [head]
    for label in dict.fromkeys(r.system for r in rounds):
        rs = [r for r in rounds if r.system == label]
        idle = med([r.idle_ttft_s for r in rs])
        loaded = med([r.loaded_ttft_s for r in rs])
        parked = med([r.parked_s for r in rs])
        parked_txt = f"{parked:.2f}" if not math.isnan(parked) else "-"
        runs = " ".join(f"{r.loaded_ttft_s * 1e3:.0f}/{r.idle_ttft_s * 1e3:.0f}" for r in rs)
        rows.append(
            f"{label:<20}{idle * 1e3:>9.0f}{loaded * 1e3:>11.0f}{loaded / idle:>8.2f}"
            f"{parked_txt:>10}{med([r.bg_stall_s for r in rs]):>12.2f}"
            f"{med([r.bg_gap_s for r in rs]) * 1e3:>11.0f}   {runs}"
        )
    return "\n".join(rows)


# --- section 2: /health latency during a long prefill --------------------------


@dataclass
class HealthResult:
    prompt_tokens: int | None
    prefill_s: float  # long request: send -> first token
    prefill_comments: int
    interval_s: float
    idle_ms: list[float]
    during_ms: list[float]


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
    url: str, interval: float, stop: threading.Event, out: list[tuple[float, float]]
) -> None:
    with httpx.Client(timeout=30.0) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = client.get(f"{url}/health")
            t1 = time.perf_counter()
            if r.status_code != 200:
                raise RuntimeError(f"/health: HTTP {r.status_code}")
            out.append((t0, t1 - t0))
            time.sleep(interval)


def run_health(
    url: str, model_dir: Path, args: argparse.Namespace, cond: threading.Condition
) -> HealthResult:
    wait_idle(url, "gezel")
    samples: list[tuple[float, float]] = []
    stop = threading.Event()
    poller = threading.Thread(
        target=_poll_health, args=(url, args.health_interval, stop, samples), daemon=True
    )
    t_idle = time.perf_counter()
    poller.start()
    try:
        time.sleep(2.0)
        body = body_for("gezel", long_prompt(model_dir, args.long_prompt), 1)
        s = SseStream(url, body, "long", cond).start()
        wait_for(cond, lambda: s.log.done, "the long-prompt request")
    finally:
        stop.set()
        poller.join(30.0)
    log = checked(s.log)
    first = log.first
    assert first is not None
    return HealthResult(
        prompt_tokens=log.prompt_tokens,
        prefill_s=log.ttft,
        prefill_comments=sum(1 for _, c in log.comments if c.startswith("prefill")),
        interval_s=args.health_interval,
        idle_ms=[lat * 1e3 for t, lat in samples if t_idle <= t < log.sent],
        during_ms=[lat * 1e3 for t, lat in samples if log.sent <= t < first],
    )


def render_health(h: HealthResult) -> str:
    rows = [f"{'/health latency ms':<34}{'samples':>8}{'p50':>9}{'p99':>9}{'max':>9}"]
    for name, vals in (
        ("idle (2 s before)", h.idle_ms),
        (f"during prefill ({h.prompt_tokens} tok, {h.prefill_s:.1f} s)", h.during_ms),
    ):
        rows.append(
            f"{name:<34}{len(vals):>8}{pct(vals, 50):>9.1f}{pct(vals, 99):>9.1f}"
            f"{max(vals, default=math.nan):>9.1f}"
        )
    rows.append(
        f"(poll: sleep {h.interval_s * 1e3:.0f} ms between requests; "
        f"{h.prefill_comments} ': prefill' comments on the long stream)"
    )
    return "\n".join(rows)


# --- section 3: continuous admission vs static waves -------------------------


@dataclass
class AdmissionRound:
    mode: str
    total_s: float
    mean_ttft_s: float
    max_ttft_s: float
    mean_latency_s: float
    ttft_s: list[float]
    latency_s: list[float]
    completion_tokens: list[int | None]


def admission_round(
    url: str, mode: str, args: argparse.Namespace, cond: threading.Condition
) -> AdmissionRound:
    wait_idle(url, "gezel")
    streams: list[SseStream] = []
    t0 = time.perf_counter()
    for i, n in enumerate(ADMISSION_TOKENS):
        delay = t0 + i * args.stagger - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        body = body_for("gezel", INTERACTIVE_TEXT, n)
        streams.append(SseStream(url, body, f"req{i}", cond).start())
    wait_for(cond, lambda: all(s.log.done for s in streams), "the admission workload")
    logs = [checked(s.log) for s in streams]
    ends = [lg.finished for lg in logs if lg.finished is not None]
    ttfts = [lg.ttft for lg in logs]
    lats = [(lg.finished or math.nan) - lg.sent for lg in logs]
    return AdmissionRound(
        mode=mode,
        total_s=max(ends) - min(lg.sent for lg in logs),
        mean_ttft_s=statistics.fmean(ttfts),
        max_ttft_s=max(ttfts),
        mean_latency_s=statistics.fmean(lats),
        ttft_s=ttfts,
        latency_s=lats,
        completion_tokens=[lg.completion_tokens for lg in logs],
    )


def render_admission(rounds: list[AdmissionRound]) -> str:
    rows = [
        f"{'mode':<14}{'total s':>9}{'mean TTFT s':>13}{'max TTFT s':>12}"
        f"{'mean latency s':>16}   runs total s"
    ]
    for mode in dict.fromkeys(r.mode for r in rounds):
        rs = [r for r in rounds if r.mode == mode]
        rows.append(
            f"{mode:<14}{med([r.total_s for r in rs]):>9.2f}"
            f"{med([r.mean_ttft_s for r in rs]):>13.2f}{med([r.max_ttft_s for r in rs]):>12.2f}"
            f"{med([r.mean_latency_s for r in rs]):>16.2f}   "
            + " ".join(f"{r.total_s:.2f}" for r in rs)
        )
    return "\n".join(rows)


# --- section 4: disconnect -> next admission ---------------------------------


@dataclass
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
        (parts.hostname or _common.HOST, parts.port or 80), timeout=_WAIT_S
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


def disconnect_round(url: str, cond: threading.Condition) -> DisconnectRound:
    wait_idle(url, "gezel")
    ref = run_one(url, body_for("gezel", INTERACTIVE_TEXT, 4), "B-idle", cond)
    wait_idle(url, "gezel")
    sock, a_chunks = _raw_stream_open(url, body_for("gezel", BACKGROUND_TEXT, 400), 2)
    b: SseStream | None = None
    try:
        b = SseStream(url, body_for("gezel", INTERACTIVE_TEXT, 4), "B", cond).start()
        bl = b.log
        wait_for(cond, lambda: bl.done or bl.comment_time("queued") is not None, "B queued")
        if bl.done:
            raise RuntimeError(f"B ended before it was queued: {checked(bl)}")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        t_close = time.perf_counter()
        sock.close()
        wait_for(cond, lambda: bl.done, "B to finish")
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


def render_disconnect(rounds: list[DisconnectRound]) -> str:
    frame = med([r.close_to_frame_s for r in rounds])
    tok = med([r.close_to_token_s for r in rounds])
    ref = med([r.b_idle_ttft_s for r in rounds])
    kinds = sorted({r.first_frame.split()[0] for r in rounds})
    rows = [
        f"{'close->B first frame ms':>24}{'close->B token ms':>19}{'B idle TTFT ms':>16}"
        f"{'token - idle ms':>17}   runs close->token ms",
        f"{frame * 1e3:>24.0f}{tok * 1e3:>19.0f}{ref * 1e3:>16.0f}{(tok - ref) * 1e3:>17.0f}   "
        + " ".join(f"{r.close_to_token_s * 1e3:.0f}" for r in rounds),
        f"(first frame after the close was: {', '.join(kinds)})",
    ]
    return "\n".join(rows)


# --- driver ------------------------------------------------------------------


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _load() -> str:
    return _common.fmt_load(_common.loadavg())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="ttft")
    p.add_argument("--model", type=Path, default=None, help="default: the bench demo model")
    p.add_argument("--json", type=Path, default=None, metavar="OUT")
    p.add_argument("--repeats", type=int, default=5, help="ttft and disconnect repeats")
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--bg-streams", type=int, default=4)
    p.add_argument("--bg-tokens", type=int, default=400)
    p.add_argument("--settle", type=int, default=4, help="bg chunks each before interactive")
    p.add_argument("--interactive-tokens", type=int, default=8)
    p.add_argument("--mlx-concurrency", type=int, nargs="+", default=[4])
    p.add_argument("--long-prompt", type=int, default=2000, help="health: prompt tokens")
    p.add_argument("--health-interval", type=float, default=0.02)
    p.add_argument("--stagger", type=float, default=0.4, help="admission: arrival spacing s")
    p.add_argument("--admission-repeats", type=int, default=2)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.admission_repeats < 1 or args.settle < 1:
        p.error("--repeats, --admission-repeats and --settle must be >= 1")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir: Path = args.model if args.model is not None else _common.build_default_model()
    sections = set(args.sections)
    cond = threading.Condition()
    base = ["--max-concurrency", str(args.max_concurrency), "--prefill-step-size", "512"]
    flags: dict[str, list[str]] = {
        "gezel": base,
        "gezel --static-waves": [*base, "--static-waves"],
        "gezel (disconnect)": ["--max-concurrency", "1", "--prefill-step-size", "512"],
    }
    ttft: list[TtftRound] = []
    health: HealthResult | None = None
    admission: list[AdmissionRound] = []
    disconnect: list[DisconnectRound] = []
    started = time.monotonic()
    load_before = _load()
    _progress(f"load average before: {load_before}")

    with tempfile.TemporaryDirectory(prefix="gezel-sched-") as tmp:
        logdir = Path(tmp)
        want_ttft = "ttft" in sections and "gezel" in args.systems
        if want_ttft or "health" in sections:
            with gezel_server(model_dir, logdir, "gezel", flags["gezel"]) as url:
                if want_ttft:
                    t0 = time.monotonic()
                    ttft += run_ttft(url, "gezel", "gezel", args, cond)
                    _progress(f"[ttft gezel: {time.monotonic() - t0:.0f}s, load {_load()}]")
                if "health" in sections:
                    t0 = time.monotonic()
                    health = run_health(url, model_dir, args, cond)
                    _progress(f"[health: {time.monotonic() - t0:.0f}s, load {_load()}]")
        if "ttft" in sections and "mlx_lm.server" in args.systems:
            for c in args.mlx_concurrency:
                label = f"mlx_lm.server c={c}"
                t0 = time.monotonic()
                with dt.mlx_server(model_dir, c, logdir) as url:
                    ttft += run_ttft(url, "mlx_lm.server", label, args, cond)
                _progress(f"[ttft {label}: {time.monotonic() - t0:.0f}s, load {_load()}]")
        if "admission" in sections:
            for mode, key in (("continuous", "gezel"), ("static-waves", "gezel --static-waves")):
                t0 = time.monotonic()
                with gezel_server(model_dir, logdir, mode, flags[key]) as url:
                    warm_up(url, "gezel", cond)
                    for _ in range(args.admission_repeats):
                        admission.append(admission_round(url, mode, args, cond))
                        r = admission[-1]
                        _progress(f"  {mode}: total {r.total_s:.2f}s TTFT {r.mean_ttft_s:.2f}s")
                _progress(f"[admission {mode}: {time.monotonic() - t0:.0f}s, load {_load()}]")
        if "disconnect" in sections:
            t0 = time.monotonic()
            with gezel_server(model_dir, logdir, "mc1", flags["gezel (disconnect)"]) as url:
                warm_up(url, "gezel", cond)
                for _ in range(args.repeats):
                    disconnect.append(disconnect_round(url, cond))
                    r4 = disconnect[-1]
                    _progress(
                        f"  disconnect: frame {r4.close_to_frame_s * 1e3:.0f} ms "
                        f"({r4.first_frame}), token {r4.close_to_token_s * 1e3:.0f} ms"
                    )
            _progress(f"[disconnect: {time.monotonic() - t0:.0f}s, load {_load()}]")

    load_after = _load()
    print(f"model: {model_dir}")
    print(f"wall: {time.monotonic() - started:.0f}s; load average (1/5/15 min):")
    print(f"  before {load_before}, after {load_after} (this run keeps about 1 core busy)")
    for name, fl in flags.items():
        print(f"{name}: serve {' '.join(fl)} --log-level WARNING")
    if "ttft" in sections and "mlx_lm.server" in args.systems:
        for c in args.mlx_concurrency:
            print(f"mlx_lm.server c={c}: {' '.join(dt._mlx_flags(c))}")
    if ttft:
        print(
            f"\n== 1. interactive TTFT, idle vs {args.bg_streams} background streams "
            f"(bg max_tokens {args.bg_tokens}, interactive max_tokens "
            f"{args.interactive_tokens}, median of {args.repeats}) =="
        )
        print(render_ttft(ttft))
        notes = sorted({n for r in ttft for n in r.notes})
        for n in notes:
            print(f"note: {n}")
    if health is not None:
        print("\n== 2. /health latency during a long prefill (gezel) ==")
        print(render_health(health))
    if admission:
        print(
            f"\n== 3. continuous vs static waves (gezel, 8 requests, max_tokens "
            f"{list(ADMISSION_TOKENS)}, every {args.stagger}s, median of "
            f"{args.admission_repeats}) =="
        )
        print(render_admission(admission))
    if disconnect:
        print(
            "\n== 4. client disconnect -> next admission (gezel --max-concurrency 1, "
            f"median of {args.repeats}) =="
        )
        print(render_disconnect(disconnect))
    if args.json is not None:
        payload = {
            "model": str(model_dir),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "loadavg": {"before": load_before, "after": load_after},
            "gezel_flags": flags,
            "mlx_lm_server_flags": {str(c): dt._mlx_flags(c) for c in args.mlx_concurrency},
            "ttft": [asdict(r) for r in ttft],
            "health": asdict(health) if health is not None else None,
            "admission": [asdict(r) for r in admission],
            "disconnect": [asdict(r) for r in disconnect],
        }
        _common.write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
