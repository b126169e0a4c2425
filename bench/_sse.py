"""Streaming chat completions and their timing: the one SSE client of the bench.

``stream`` POSTs one streaming ``/v1/chat/completions`` request and records,
in ``perf_counter`` seconds, what each scenario measures from it:

* ``sent``: just before the request is sent;
* ``content``: the arrival of every chunk that carries generated text
  (``content``, ``reasoning_content``, or ``mlx_lm.server``'s
  ``reasoning``); the role-only chunk and comment frames don't count;
* ``comments``: comment frames with their arrival (gezel's ``: queued N``,
  ``: prefill d/t``, ``: parked``, ``: resumed``, ``: keepalive``);
* ``finished``: the chunk with ``finish_reason``; ``done``: ``[DONE]``;
* ``usage``: the last ``usage`` object (request it with
  ``stream_options.include_usage``), and ``usage.output_tokens`` on the
  first content chunk (gezel reports it on every chunk).

"First token" (``first``) is the first content chunk, else the finish chunk
(a reply with no text); TTFT = ``first - sent``.

Concurrency is threads, one connection each: ``released_together`` for N
identical streams released at a barrier (the decode metric below), and
``StreamThread`` for a stream read in the background while the caller waits
on a condition (the scheduler scenario).

The decode metric, identical for every system: for each stream i,
``first_i`` = arrival of its first generated token, ``last_i`` = arrival of
its last (the finish chunk), ``n_i`` = tokens it generated (HTTP:
``usage.completion_tokens``); aggregate decode tok/s = ``sum_i(n_i - 1) /
(max_i last_i - min_i first_i)``. Each stream's first token only opens its
clock, so prefill and TTFT are excluded, while anything that stalls decode
inside the window - including the prefill of a stream admitted after
another has started - is included. ``spread`` = ``max_i first_i - min_i
first_i``: how staggered the starts were.
"""

from __future__ import annotations

import json
import math
import selectors
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import httpx2 as httpx

REQUEST_TIMEOUT_S = 600.0
_T = TypeVar("_T")


def delta_text(delta: dict[str, Any]) -> str:
    """The generated text of one delta. gezel sends reasoning under both
    ``reasoning_content`` and ``reasoning`` (the same text twice);
    ``mlx_lm.server`` under ``reasoning``."""
    reasoning = delta.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = delta.get("reasoning")
    content = delta.get("content")
    return (reasoning if isinstance(reasoning, str) else "") + (
        content if isinstance(content, str) else ""
    )


@attrs.define
class StreamLog:
    """What one stream did; times are perf_counter seconds (see the module docstring)."""

    name: str = ""
    sent: float = math.nan
    content: list[float] = attrs.Factory(list)
    comments: list[tuple[float, str]] = attrs.Factory(list)
    pieces: list[str] = attrs.Factory(list)
    finished: float | None = None
    finish_reason: str | None = None
    done: float | None = None
    last_chunk: float | None = None
    usage: dict[str, Any] | None = None
    tokens_at_first: int | None = None
    error: str | None = None
    cancelled: bool = False
    ended: bool = False  # the reader has left (done, cancelled or failed)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def first(self) -> float | None:
        """First token: the first content chunk, else the finish chunk."""
        return self.content[0] if self.content else self.finished

    @property
    def last(self) -> float | None:
        """Last token: the finish chunk, else the last content chunk."""
        return self.finished if self.finished is not None else (self.content or [None])[-1]

    @property
    def ttft(self) -> float:
        return self.first - self.sent if self.first is not None else math.nan

    @property
    def end(self) -> float | None:
        """``[DONE]``, else the last data chunk."""
        return self.done if self.done is not None else self.last_chunk

    def usage_int(self, key: str) -> int | None:
        value = (self.usage or {}).get(key)
        return int(value) if value is not None else None

    def comment_time(self, prefix: str, after: float = -math.inf) -> float | None:
        for t, text in self.comments:
            if t > after and text.startswith(prefix):
                return t
        return None

    def line(self, line: str, now: float) -> bool:
        """Record one SSE line; True at ``[DONE]``."""
        if line.startswith(":"):
            self.comments.append((now, line[1:].strip()))
            return False
        if not line.startswith("data:"):
            return False  # blank separators
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = now
            return True
        obj = json.loads(data)
        if "error" in obj:
            raise RuntimeError(f"stream error: {obj['error']}")
        self.last_chunk = now
        new_content = False
        for choice in obj.get("choices") or ():
            piece = delta_text(choice.get("delta") or {})
            if piece:
                self.pieces.append(piece)
                new_content = True
            if choice.get("finish_reason"):
                self.finished = now
                self.finish_reason = choice["finish_reason"]
        if new_content:
            self.content.append(now)
        usage = obj.get("usage")
        if usage:
            if new_content and len(self.content) == 1:
                self.tokens_at_first = usage.get("output_tokens")
            self.usage = usage
        return False


def stream(
    client: httpx.Client,
    url: str,
    body: dict[str, Any],
    *,
    log: StreamLog | None = None,
    barrier: threading.Barrier | None = None,
    cancel: threading.Event | None = None,
    notify: Callable[[], None] | None = None,
) -> StreamLog:
    """POST ``body`` to ``url``'s chat completions and read the stream to
    ``[DONE]`` (or until ``cancel`` is set, which closes the connection after
    the next line); wait at ``barrier`` first; call ``notify`` after every
    line. Raise on an HTTP or stream error."""
    log = log if log is not None else StreamLog()
    if barrier is not None:
        barrier.wait()
    log.sent = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:500]}")
        for line in resp.iter_lines():
            now = time.perf_counter()
            if cancel is not None and cancel.is_set():
                log.cancelled = True
                break
            if log.line(line, now):
                break
            if notify is not None:
                notify()
    return log


def stream_once(url: str, body: dict[str, Any], **kwargs: Any) -> StreamLog:
    """``stream`` on a connection of its own."""
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        return stream(client, url, body, **kwargs)


class StreamThread:
    """A stream read on a daemon thread with its own connection. ``cancel``
    makes the reader leave after its next line (which closes the
    connection); every event notifies ``cond``; an error is kept in
    ``log.error``."""

    def __init__(
        self, url: str, body: dict[str, Any], name: str, cond: threading.Condition
    ) -> None:
        self.log = StreamLog(name)
        self._url = url
        self._body = body
        self._cond = cond
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> StreamThread:
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
        try:
            stream_once(self._url, self._body, log=self.log, cancel=self._stop, notify=self._notify)
        except Exception as exc:  # reported by the caller
            self.log.error = repr(exc)
        finally:
            self.log.ended = True
            self._notify()


def released_together(n: int, one: Callable[[threading.Barrier], _T], what: str) -> list[_T]:
    """Run ``one(barrier)`` in ``n`` threads that release their requests
    together at ``barrier``; their results, or a RuntimeError naming ``what``
    if one of them failed (the barrier is aborted so the others do not wait)."""
    barrier = threading.Barrier(n)
    results: list[tuple[_T] | BaseException | None] = [None] * n

    def worker(i: int) -> None:
        try:
            results[i] = (one(barrier),)
        except Exception as exc:  # reported below, in the caller's thread
            barrier.abort()
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got: list[_T] = []
    for r in results:
        if not isinstance(r, tuple):
            raise RuntimeError(f"{what}: a stream failed: {r!r}")
        got.append(r[0])
    return got


def streams_together(url: str, body: dict[str, Any], n: int, what: str) -> list[StreamLog]:
    """``n`` identical streaming requests released together, read by one
    lean thread (``read_together``)."""
    return read_together(url, [body] * n, what)


def read_together(url: str, bodies: Sequence[dict[str, Any]], what: str) -> list[StreamLog]:
    """One streaming request per body, sent together on raw sockets and
    read by this thread alone (``selectors``): each read is stamped with
    its arrival and kept as bytes, and the lines are parsed after the last
    stream ends. The bench's client shares the machine's cores with the
    server it measures: httpx with a thread and a JSON parse per stream
    cost 0.36-0.43 ms of CPU per token at 8 streams (docs/performance.md),
    taken from the server's compute; this reader costs a fraction of that.
    Handles chunked and close-delimited bodies (hypercorn and
    ``mlx_lm.server``)."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    sel = selectors.DefaultSelector()
    reads: list[list[tuple[float, bytes]]] = [[] for _ in bodies]
    logs = [StreamLog(what) for _ in bodies]
    socks, requests = [], []
    try:
        for i, body in enumerate(bodies):
            sock = socket.create_connection((host, port), timeout=REQUEST_TIMEOUT_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks.append(sock)
            payload = json.dumps(body).encode()
            head = (
                f"POST {parts.path.rstrip('/')}/v1/chat/completions HTTP/1.1\r\n"
                f"Host: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
            ).encode()
            sel.register(sock, selectors.EVENT_READ, i)
            requests.append(head + payload)
        for log, sock, request in zip(logs, socks, requests, strict=True):
            log.sent = time.perf_counter()
            sock.sendall(request)
        open_ = len(socks)
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while open_:
            events = sel.select(timeout=max(0.0, deadline - time.monotonic()))
            if not events:
                raise RuntimeError(f"{what}: no stream ended within {REQUEST_TIMEOUT_S:.0f} s")
            now = time.perf_counter()
            for key, _ in events:
                data = key.fileobj.recv(1 << 16)  # type: ignore[union-attr]
                if data:
                    reads[key.data].append((now, data))
                else:
                    sel.unregister(key.fileobj)
                    open_ -= 1
    finally:
        sel.close()
        for sock in socks:
            sock.close()
    for log, got in zip(logs, reads, strict=True):
        _replay(log, got, what)
    return logs


def _replay(log: StreamLog, reads: list[tuple[float, bytes]], what: str) -> None:
    """Parse one stream's stamped reads into ``log``: the head, then the
    body's lines (de-chunked when chunked), each at its read's time."""
    raw = b"".join(data for _, data in reads)
    head_end = raw.find(b"\r\n\r\n")
    if head_end < 0:
        raise RuntimeError(f"{what}: no HTTP response")
    status = raw[: raw.find(b"\r\n")].decode("latin-1")
    if " 200 " not in status + " ":
        raise RuntimeError(f"{what}: {status}: {raw[head_end + 4 :][:500]!r}")
    chunked = b"transfer-encoding: chunked" in raw[:head_end].lower()
    # Where each read's bytes end in the whole, to stamp a line with the
    # read that completed it.
    ends, total = [], 0
    for t, data in reads:
        total += len(data)
        ends.append((total, t))
    body, offsets = _body(raw, head_end + 4, chunked)
    pending, k = b"", 0
    for offset, piece in zip(offsets, body, strict=True):
        at = 0
        while (newline := piece.find(b"\n", at)) >= 0:
            line, pending = pending + piece[at:newline], b""
            at = newline + 1
            # The read that brought this newline: the first that ends past it.
            while ends[k][0] <= offset + newline:
                k += 1
            if log.line(line.decode().rstrip("\r"), ends[k][1]):
                return
        pending += piece[at:]


def _body(raw: bytes, start: int, chunked: bool) -> tuple[list[bytes], list[int]]:
    """The body's pieces and the offset in ``raw`` where each begins."""
    if not chunked:
        return [raw[start:]], [start]
    pieces, offsets, pos = [], [], start
    while pos < len(raw):
        eol = raw.find(b"\r\n", pos)
        size = int(raw[pos:eol].split(b";")[0], 16)
        if size == 0:
            break
        pieces.append(raw[eol + 2 : eol + 2 + size])
        offsets.append(eol + 2)
        pos = eol + 2 + size + 2
    return pieces, offsets


def streams_of(url: str, bodies: Sequence[dict[str, Any]], what: str) -> list[StreamLog]:
    """One streaming request per body, released together; one thread each."""
    queue = list(bodies)
    lock = threading.Lock()

    def one(barrier: threading.Barrier) -> StreamLog:
        with lock:
            body = queue.pop()
        return stream_once(url, body, barrier=barrier)

    return released_together(len(bodies), one, what)


# --- the decode metric -------------------------------------------------------


@attrs.frozen
class StreamTiming:
    """One stream (sequence) of one round, times in perf_counter seconds."""

    first: float
    last: float
    tokens: int
    server_tps: float | None = None  # gezel's own usage.generation_tps
    tokens_at_first: int | None = None  # usage.output_tokens on the first chunk (gezel)

    @classmethod
    def of(cls, log: StreamLog) -> StreamTiming:
        """The timing of a finished HTTP stream (first = first content chunk)."""
        tokens = log.usage_int("completion_tokens")
        if not log.content or log.last is None or tokens is None:
            raise RuntimeError(f"incomplete stream: first={log.first} tokens={tokens}")
        tps = (log.usage or {}).get("generation_tps")
        return cls(log.content[0], log.last, tokens, tps, log.tokens_at_first)


@attrs.define
class Measurement:
    """The decode metric over one concurrent round of ``streams`` streams."""

    system: str
    streams: int
    tokens_per_stream: int
    tok_s: float
    window_s: float
    spread_s: float
    per_stream_tokens: list[int]
    server_tps: list[float] = attrs.Factory(list)
    tokens_at_first: list[int] = attrs.Factory(list)
    # CPU seconds the round cost the serving process (all its threads) and
    # the bench's client threads; None where not measured.
    server_cpu_s: float | None = None
    client_cpu_s: float | None = None
    # gezel-trio's Trio thread (its main thread) alone.
    trio_cpu_s: float | None = None

    @property
    def short(self) -> bool:
        """A stream ended before max_tokens (e.g. on EOS)."""
        return any(n != self.tokens_per_stream for n in self.per_stream_tokens)


def aggregate(system: str, max_tokens: int, timings: Sequence[StreamTiming]) -> Measurement:
    """``sum(n_i - 1) / (max_i last_i - min_i first_i)`` over one concurrent round."""
    start = min(t.first for t in timings)
    end = max(t.last for t in timings)
    window = end - start
    counted = sum(t.tokens - 1 for t in timings)
    return Measurement(
        system=system,
        streams=len(timings),
        tokens_per_stream=max_tokens,
        tok_s=counted / window if window > 0 else float("nan"),
        window_s=window,
        spread_s=max(t.first for t in timings) - start,
        per_stream_tokens=[t.tokens for t in timings],
        server_tps=[t.server_tps for t in timings if t.server_tps is not None],
        tokens_at_first=[t.tokens_at_first for t in timings if t.tokens_at_first is not None],
    )
