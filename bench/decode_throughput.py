"""Steady decode throughput: raw mlx-lm vs gezel-trio vs ``mlx_lm.server``.

Usage::

    python bench/decode_throughput.py [--streams 1 4] [--tokens 128] [--repeats 3]
                                      [--model DIR] [--json OUT]

One run measures, side by side and on the same model, prompt and token budget:

``raw``
    mlx-lm's ``BatchGenerator`` driven in-process by a tight ``next()`` loop,
    with no stop sequences (so every sequence runs exactly ``--tokens``). It
    runs in a child process of this script that exits before any server
    starts, so it never shares the CPU with a server.
``gezel``
    ``python -m gezel_trio serve --max-concurrency MAX(streams)`` over HTTP
    SSE, with ``ignore_eos: true``.
``mlx_lm.server``
    ``python -m mlx_lm server`` over HTTP SSE (flags in ``_MLX_SERVER_FLAGS``
    below; it has no ``ignore_eos``, so every stream's token count is checked
    and a short stream is flagged in the table).

The systems run one after another, never together. Each gets one warm-up
request first; then every stream count is measured ``--repeats`` times and
the median is reported. All requests are greedy (``temperature: 0``), carry
the same single short user message rendered with ``enable_thinking=False``,
and ask for ``max_tokens = --tokens``. N concurrent streams are N identical
requests released together (a thread per stream behind a barrier; for
``raw``, N prompts inserted in one ``insert`` call).

The metric, identical for all three systems:

* for each stream i: ``first_i`` = arrival time of its first generated token
  (raw: the ``next()`` that returned it; HTTP: the first SSE chunk with
  non-empty content - the role-only chunk and keep-alive comments don't
  count), ``last_i`` = arrival of its last token (HTTP: the chunk with
  ``finish_reason``), ``n_i`` = tokens it generated (HTTP: ``usage`` from the
  stream, requested with ``stream_options.include_usage``);
* aggregate decode tok/s = ``sum_i(n_i - 1) / (max_i last_i - min_i first_i)``.

Each stream's first token only opens its clock, so prefill and time-to-first
token are excluded, while anything that stalls decode inside the window -
including the prefill of a stream admitted after another one has started -
is included. ``spread`` in the table is ``max_i first_i - min_i first_i``:
how staggered the streams' starts were.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx2 as httpx

PROMPT = "Write a short story about a lighthouse keeper and a stormy night."
HOST = "127.0.0.1"
SYSTEMS = ("raw", "gezel", "mlx_lm.server")
_STARTUP_TIMEOUT_S = 180.0
_REQUEST_TIMEOUT_S = 300.0
_STOP_TIMEOUT_S = 20.0
# mlx_lm.server flags besides --model/--host/--port; the concurrency ones are
# filled in to match gezel's --max-concurrency.
_MLX_SERVER_FLAGS = (
    "--temp",
    "0.0",
    "--chat-template-args",
    '{"enable_thinking": false}',
    "--log-level",
    "WARNING",
)


@dataclass
class StreamTiming:
    """One stream (sequence) of one measurement, times in perf_counter seconds."""

    first: float
    last: float
    tokens: int
    server_tps: float | None = None  # gezel's own usage.generation_tps
    tokens_at_first: int | None = None  # usage.output_tokens on the first chunk (gezel)


@dataclass
class Measurement:
    system: str
    streams: int
    tokens_per_stream: int
    tok_s: float
    window_s: float
    spread_s: float
    per_stream_tokens: list[int]
    server_tps: list[float] = field(default_factory=list)
    tokens_at_first: list[int] = field(default_factory=list)

    @property
    def short(self) -> bool:
        """A stream ended before max_tokens (e.g. on EOS)."""
        return any(n != self.tokens_per_stream for n in self.per_stream_tokens)


def aggregate(system: str, max_tokens: int, timings: Sequence[StreamTiming]) -> Measurement:
    """The metric of the module docstring over one concurrent round."""
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


# --- raw mlx-lm (runs in a child process) ----------------------------------


def _raw_worker(model_dir: str, streams: list[int], max_tokens: int, repeats: int) -> None:
    """Child-process body: measure BatchGenerator, print JSON lines on stdout."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import load

    model, tokenizer = load(model_dir)
    prompt: list[int] = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, enable_thinking=False
    )
    width = max(streams)

    def one_round(n: int, tokens: int) -> list[StreamTiming]:
        # Fresh generator per round, sized like gezel's (batch = max streams);
        # stop_tokens=None: no EOS stop, every sequence runs `tokens` tokens.
        gen = BatchGenerator(
            model,
            stop_tokens=None,
            completion_batch_size=width,
            prefill_batch_size=width,
            prefill_step_size=512,
        )
        try:
            uids = gen.insert([list(prompt)] * n, max_tokens=[tokens] * n)
            first: dict[int, float] = {}
            last: dict[int, float] = {}
            count = dict.fromkeys(uids, 0)
            done: set[int] = set()
            while len(done) < n:
                _, responses = gen.next()
                now = time.perf_counter()
                for r in responses:
                    first.setdefault(r.uid, now)
                    last[r.uid] = now
                    count[r.uid] += 1
                    if r.finish_reason is not None:
                        done.add(r.uid)
            return [StreamTiming(first[u], last[u], count[u]) for u in uids]
        finally:
            gen.close()

    one_round(1, min(max_tokens, 32))  # warm-up
    for n in streams:
        for _ in range(repeats):
            m = aggregate("raw", max_tokens, one_round(n, max_tokens))
            print(json.dumps(asdict(m)), flush=True)


def run_raw(
    model_dir: Path, streams: list[int], max_tokens: int, repeats: int
) -> list[Measurement]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--raw-worker",
        "--model",
        str(model_dir),
        "--tokens",
        str(max_tokens),
        "--repeats",
        str(repeats),
        "--streams",
        *map(str, streams),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"raw worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    out = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            out.append(Measurement(**json.loads(line)))
    return out


# --- servers ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def _stop(proc: subprocess.Popen[Any]) -> None:
    """SIGINT (a graceful drain for both servers), then SIGKILL if it hangs."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def _log_on_error(name: str, log: Path) -> Iterator[None]:
    """On an error while a server is up, show its log tail (the log is deleted
    with the run's temporary directory)."""
    try:
        yield
    except Exception:
        print(f"--- {name} log tail ({log.name}) ---\n{_tail(log)}", file=sys.stderr)
        raise


@contextlib.contextmanager
def gezel_server(model_dir: Path, max_concurrency: int, logdir: Path) -> Iterator[str]:
    """Start gezel-trio on a free port; yield its base URL once it says it is
    listening (the line it prints on stdout); always stop it."""
    log = logdir / "gezel.log"
    cmd = [
        sys.executable, "-m", "gezel_trio", "serve",
        "--model", str(model_dir),
        "--host", HOST,
        "--port", "0",
        "--max-concurrency", str(max_concurrency),
        "--log-level", "WARNING",
    ]  # fmt: skip
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        marker = "gezel-trio listening on "
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"gezel-trio not ready after {_STARTUP_TIMEOUT_S}s")
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"gezel-trio exited early:\n{_tail(log)}")
            if marker in line:
                break
        with _log_on_error("gezel-trio", log):
            yield line.split(marker, 1)[1].strip()
    finally:
        _stop(proc)


def _mlx_flags(max_concurrency: int) -> list[str]:
    return [
        "--decode-concurrency",
        str(max_concurrency),
        "--prompt-concurrency",
        str(max_concurrency),
        *_MLX_SERVER_FLAGS,
    ]


@contextlib.contextmanager
def mlx_server(model_dir: Path, max_concurrency: int, logdir: Path) -> Iterator[str]:
    """Start ``mlx_lm server`` on a free port; yield its base URL once
    ``/health`` answers (bounded polling); always stop it."""
    log = logdir / "mlx_lm_server.log"
    port = _free_port()
    cmd = [
        sys.executable, "-m", "mlx_lm", "server",
        "--model", str(model_dir),
        "--host", HOST,
        "--port", str(port),
        *_mlx_flags(max_concurrency),
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        with httpx.Client(timeout=2.0) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"mlx_lm.server exited early:\n{_tail(log)}")
                with contextlib.suppress(httpx.TransportError):
                    status = client.get(f"{url}/health").status_code
                    if status == 200:
                        break
                    # 503: its generation thread (which loads the model) died.
                    raise RuntimeError(f"mlx_lm.server unhealthy ({status}):\n{_tail(log)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mlx_lm.server not ready after {_STARTUP_TIMEOUT_S}s")
                time.sleep(0.2)  # polling interval, not a readiness guess
        with _log_on_error("mlx_lm.server", log):
            yield url
    finally:
        _stop(proc)


def _request_body(system: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": False},
    }
    if system == "gezel":
        body["ignore_eos"] = True
    return body


def _one_stream(url: str, body: dict[str, Any], barrier: threading.Barrier) -> StreamTiming:
    first: float | None = None
    last: float | None = None
    tokens: int | None = None
    server_tps: float | None = None
    tokens_at_first: int | None = None
    with httpx.Client(timeout=_REQUEST_TIMEOUT_S) as client:
        barrier.wait()
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:500]}")
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators and ': keep-alive' comments
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if "error" in obj:
                    raise RuntimeError(f"stream error: {obj['error']}")
                for choice in obj.get("choices") or ():
                    delta = choice.get("delta") or {}
                    text = delta.get("content") or delta.get("reasoning_content") or ""
                    if text and first is None:
                        first = now
                    if text or choice.get("finish_reason"):
                        last = now
                usage = obj.get("usage")
                if usage and first == now and tokens_at_first is None:
                    tokens_at_first = usage.get("output_tokens")
                if usage:
                    tokens = int(usage["completion_tokens"])
                    server_tps = usage.get("generation_tps", server_tps)
    if first is None or last is None or tokens is None:
        raise RuntimeError(f"incomplete stream: first={first} last={last} tokens={tokens}")
    return StreamTiming(first, last, tokens, server_tps, tokens_at_first)


def http_round(url: str, system: str, n: int, max_tokens: int) -> list[StreamTiming]:
    """N identical streaming requests released together; one thread each."""
    barrier = threading.Barrier(n)
    results: list[StreamTiming | BaseException | None] = [None] * n
    body = _request_body(system, max_tokens)

    def worker(i: int) -> None:
        try:
            results[i] = _one_stream(url, body, barrier)
        except Exception as exc:  # reported below, in the caller's thread
            barrier.abort()
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    timings: list[StreamTiming] = []
    for r in results:
        if not isinstance(r, StreamTiming):
            raise RuntimeError(f"{system}: a stream failed: {r!r}")
        timings.append(r)
    return timings


def run_http(
    system: str, url: str, streams: list[int], max_tokens: int, repeats: int
) -> list[Measurement]:
    http_round(url, system, 1, min(max_tokens, 32))  # warm-up
    out = []
    for n in streams:
        for _ in range(repeats):
            out.append(aggregate(system, max_tokens, http_round(url, system, n, max_tokens)))
    return out


# --- driver ----------------------------------------------------------------


def build_default_model() -> Path:
    proc = subprocess.run(
        [sys.executable, "-m", "gezel_trio", "demo-model", "--kind", "dense", "--size", "bench"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(proc.stdout.strip().splitlines()[-1])


def median_by(results: list[Measurement], system: str, n: int) -> float | None:
    vals = [m.tok_s for m in results if m.system == system and m.streams == n]
    return statistics.median(vals) if vals else None


def render_table(results: list[Measurement], streams: list[int], systems: Sequence[str]) -> str:
    rows = [f"{'system':<15}{'streams':>8}{'tok/s (median)':>16}{'runs':>28}{'spread s':>10}"]
    for system in systems:
        for n in streams:
            ms = [m for m in results if m.system == system and m.streams == n]
            if not ms:
                continue
            med = statistics.median(m.tok_s for m in ms)
            runs = " ".join(f"{m.tok_s:.1f}" for m in ms)
            spread = statistics.median(m.spread_s for m in ms)
            flag = "  SHORT" if any(m.short for m in ms) else ""
            rows.append(f"{system:<15}{n:>8}{med:>16.1f}{runs:>28}{spread:>10.2f}{flag}")
    rows.append("")
    pairs = [("gezel", "raw"), ("mlx_lm.server", "raw"), ("gezel", "mlx_lm.server")]
    for n in streams:
        parts = []
        for a, b in pairs:
            va, vb = median_by(results, a, n), median_by(results, b, n)
            if va is not None and vb:
                parts.append(f"{a}/{b} = {va / vb:.3f}")
        if parts:
            rows.append(f"streams={n}: " + "   ".join(parts))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    p.add_argument("--tokens", type=int, default=128, help="max_tokens per stream")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", type=Path, default=None, help="default: the bench demo model")
    p.add_argument("--json", type=Path, default=None, metavar="OUT")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--raw-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    streams: list[int] = sorted(set(args.streams))
    if min(streams) < 1 or args.tokens < 2 or args.repeats < 1:
        p.error("--streams >= 1, --tokens >= 2 and --repeats >= 1 are required")

    model_dir: Path = args.model if args.model is not None else build_default_model()
    if args.raw_worker:
        _raw_worker(str(model_dir), streams, args.tokens, args.repeats)
        return 0

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    width = max(streams)
    results: list[Measurement] = []
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="gezel-bench-") as tmp:
        logdir = Path(tmp)
        for system in args.systems:
            t0 = time.monotonic()
            if system == "raw":
                results += run_raw(model_dir, streams, args.tokens, args.repeats)
            elif system == "gezel":
                with gezel_server(model_dir, width, logdir) as url:
                    results += run_http(system, url, streams, args.tokens, args.repeats)
            else:
                with mlx_server(model_dir, width, logdir) as url:
                    results += run_http(system, url, streams, args.tokens, args.repeats)
            print(f"[{system}: {time.monotonic() - t0:.0f}s]", file=sys.stderr, flush=True)

    print(f"model: {model_dir}")
    print(
        f"tokens/stream: {args.tokens}, repeats: {args.repeats}, "
        f"wall: {time.monotonic() - started:.0f}s"
    )
    load_after = os.getloadavg()[0]
    print(f"1-min load average: {load_before:.2f} before, {load_after:.2f} after (this run keeps")
    print("  about 1 core busy; much more than that means something else shared the CPUs)")
    print("tok/s = sum(n_i - 1) / (max last_i - min first_i); spread = max first_i - min first_i")
    print()
    print(render_table(results, streams, args.systems))
    if any(m.short for m in results):
        print("\nSHORT: some stream ended before max_tokens (EOS); its tokens are still counted.")
    if args.json is not None:
        payload = {
            "model": str(model_dir),
            "prompt": PROMPT,
            "tokens_per_stream": args.tokens,
            "repeats": args.repeats,
            "streams": streams,
            "loadavg_1min": {"before": load_before, "after": load_after},
            "metric": "sum(n_i - 1) / (max_i last_i - min_i first_i)",
            "mlx_lm_server_flags": _mlx_flags(width),
            "median_tok_s": {
                s: {str(n): median_by(results, s, n) for n in streams} for s in args.systems
            },
            "runs": [asdict(m) for m in results],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
