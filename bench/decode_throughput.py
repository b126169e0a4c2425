"""Steady decode throughput: raw mlx-lm vs gezel-trio vs ``mlx_lm.server``.

Usage::

    python bench/decode_throughput.py [--streams 1 4] [--tokens 128] [--repeats 3]
                                      [--model DIR | --default-model]
                                      [--prefill-tokens 1024] [--json OUT]

``--default-model`` measures SmolLM2-135M-Instruct, what ``gezel-trio serve``
serves by default. On the CPU gezel-trio holds its Q4_1 weights as float32,
so every system gets the same float32 copy (``_common.float32_copy``), and
one more system, ``gezel-q4``, serves the quantized directory with
``--keep-quantized`` to show what holding float32 buys. All systems run on
the same OpenBLAS (see ``bench/_common.py``).

``--prefill-tokens N`` adds a prefill measurement per system, on a fresh
server before any decode round: one greedy request whose prompt is about N
tokens of English (``demo_data/corpus.txt``) and ``max_tokens: 1``; TTFT
cold is its time to the first token and prefill tok/s its prompt tokens over
that time (raw: time to the first token of ``BatchGenerator``); then the same
request again gives TTFT warm, the prompt cache's share (raw has none).

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
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx2 as httpx

if __package__ in (None, ""):  # run as a script: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common
from bench._common import (
    Measurement,
    StreamTiming,
    aggregate,
    build_default_model,
    print_load_1min,
    write_json,
)

PROMPT = "Write a short story about a lighthouse keeper and a stormy night."
SYSTEMS = ("raw", "gezel", "mlx_lm.server", "gezel-q4")
_CORPUS = Path(__file__).resolve().parent.parent / "src/gezel_trio/demo_data/corpus.txt"
_CHARS_PER_TOKEN = 4.4  # English BPE, measured on the corpus with SmolLM2's tokenizer
_REQUEST_TIMEOUT_S = 300.0
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


# --- raw mlx-lm (runs in a child process) ----------------------------------


def long_prompt(tokens: int) -> str:
    """About ``tokens`` tokens of English prose."""
    return _CORPUS.read_text("utf-8")[: int(tokens * _CHARS_PER_TOKEN)] + "\n\nSummarize."


def _raw_worker(
    model_dir: str, streams: list[int], max_tokens: int, repeats: int, prefill_tokens: int
) -> None:
    """Child-process body: measure BatchGenerator, print JSON lines on stdout."""
    from gezel_trio import blas

    blas.preload()  # before mlx loads: the same OpenBLAS as the servers
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import load

    model, tokenizer = load(model_dir)
    if prefill_tokens:
        long: list[int] = tokenizer.apply_chat_template(
            [{"role": "user", "content": long_prompt(prefill_tokens)}],
            add_generation_prompt=True,
            enable_thinking=False,
        )
        gen = BatchGenerator(model, stop_tokens=None, prefill_step_size=512)
        try:
            t0 = time.perf_counter()
            gen.insert([long], max_tokens=[1])
            while not gen.next()[1]:
                pass
            ttft = time.perf_counter() - t0
        finally:
            gen.close()
        print(json.dumps({"prefill": True, "prompt_tokens": len(long), "cold_s": ttft}))
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

    if not streams:
        return
    one_round(1, min(max_tokens, 32))  # warm-up
    for n in streams:
        for _ in range(repeats):
            m = aggregate("raw", max_tokens, one_round(n, max_tokens))
            print(json.dumps(asdict(m)), flush=True)


def run_raw(
    model_dir: Path, streams: list[int], max_tokens: int, repeats: int, prefill_tokens: int
) -> tuple[list[Measurement], list[dict[str, Any]]]:
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
        "--prefill-tokens",
        str(prefill_tokens),
        "--streams",
        *map(str, streams),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"raw worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    out, prefill = [], []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            if row.pop("prefill", False):
                prefill.append({"system": "raw", **row, "warm_s": None})
            else:
                out.append(Measurement(**row))
    return out, prefill


# --- servers ---------------------------------------------------------------


@contextlib.contextmanager
def gezel_server(
    model_dir: Path, max_concurrency: int, logdir: Path, *, stored_weights: bool = True
) -> Iterator[str]:
    """Start gezel-trio on a free port; yield its base URL once it says it is
    listening (the line it prints on stdout); always stop it (SIGINT)."""
    flags = ["--max-concurrency", str(max_concurrency), "--log-level", "WARNING"]
    log = logdir / f"gezel-{int(stored_weights)}.log"
    with _common.gezel_server(model_dir, log, flags, stored_weights=stored_weights) as server:
        yield server.url


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
    with _common.mlx_server(model_dir, log, _mlx_flags(max_concurrency)) as server:
        yield server.url


def _request_body(system: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": False},
    }
    if system.startswith("gezel"):
        body["ignore_eos"] = True
    return body


def prefill_http(url: str, system: str, prompt: str) -> dict[str, Any]:
    """TTFT of a long prompt on a fresh server (cold), then again (warm)."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    times, tokens = [], 0
    with httpx.Client(timeout=_REQUEST_TIMEOUT_S) as client:
        for _ in range(2):
            t0 = time.perf_counter()
            first: float | None = None
            for now, obj in _common.sse_chunks(client, url, body):
                if first is None and any(
                    (c.get("delta") or {}).get("content") or c.get("finish_reason")
                    for c in obj.get("choices") or ()
                ):
                    first = now
                if obj.get("usage"):
                    tokens = int(obj["usage"]["prompt_tokens"])
            if first is None:
                raise RuntimeError(f"{system}: no token in the prefill stream")
            times.append(first - t0)
    return {"system": system, "prompt_tokens": tokens, "cold_s": times[0], "warm_s": times[1]}


def _one_stream(url: str, body: dict[str, Any], barrier: threading.Barrier) -> StreamTiming:
    first: float | None = None
    last: float | None = None
    tokens: int | None = None
    server_tps: float | None = None
    tokens_at_first: int | None = None
    with httpx.Client(timeout=_REQUEST_TIMEOUT_S) as client:
        barrier.wait()
        for now, obj in _common.sse_chunks(client, url, body):
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
    body = _request_body(system, max_tokens)
    return _common.released_together(n, lambda b: _one_stream(url, body, b), system)


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


def render_prefill(rows: list[dict[str, Any]]) -> str:
    head = f"{'system':<15}{'prompt tok':>11}{'TTFT cold s':>13}"
    out = [f"{head}{'prefill tok/s':>15}{'TTFT warm s':>13}"]
    for r in rows:
        warm = f"{r['warm_s']:>13.3f}" if r["warm_s"] is not None else f"{'-':>13}"
        rate = r["prompt_tokens"] / r["cold_s"]
        out.append(
            f"{r['system']:<15}{r['prompt_tokens']:>11}{r['cold_s']:>13.3f}{rate:>15.1f}{warm}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    p.add_argument("--tokens", type=int, default=128, help="max_tokens per stream")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", type=Path, default=None, help="default: the bench demo model")
    p.add_argument(
        "--default-model",
        action="store_true",
        help="SmolLM2-135M-Instruct (gezel-trio's default), float32 for every system",
    )
    p.add_argument("--prefill-tokens", type=int, default=0, metavar="N")
    p.add_argument("--json", type=Path, default=None, metavar="OUT")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=None)
    p.add_argument("--raw-worker", action="store_true", help=argparse.SUPPRESS)
    # One process per system: the raw worker gets the model it measures.
    args = p.parse_args(argv)
    streams: list[int] = sorted(set(args.streams))
    if min(streams) < 1 or args.tokens < 2 or args.repeats < 1:
        p.error("--streams >= 1, --tokens >= 2 and --repeats >= 1 are required")

    if args.raw_worker:
        _raw_worker(str(args.model), streams, args.tokens, args.repeats, args.prefill_tokens)
        return 0
    quantized: Path | None = None
    if args.default_model:
        quantized = _common.prepare_default_model()
        model_dir = _common.float32_copy(quantized, quantized.parents[2] / "bench-float32")
    else:
        model_dir = args.model if args.model is not None else build_default_model()
    systems = args.systems or [s for s in SYSTEMS if s != "gezel-q4" or quantized is not None]
    if "gezel-q4" in systems and quantized is None:
        p.error("gezel-q4 needs --default-model")

    width = max(streams)
    results: list[Measurement] = []
    prefill: list[dict[str, Any]] = []
    prompt = long_prompt(args.prefill_tokens) if args.prefill_tokens else ""
    started = time.monotonic()
    load_before = _common.loadavg()[0]
    with tempfile.TemporaryDirectory(prefix="gezel-bench-") as tmp:
        logdir = Path(tmp)
        for system in systems:
            t0 = time.monotonic()
            if system == "raw":
                got, pre = run_raw(
                    model_dir, streams, args.tokens, args.repeats, args.prefill_tokens
                )
                results += got
                prefill += pre
                print(f"[raw: {time.monotonic() - t0:.0f}s]", file=sys.stderr, flush=True)
                continue
            server: contextlib.AbstractContextManager[str]
            if system == "gezel":
                server = gezel_server(model_dir, width, logdir)
            elif system == "gezel-q4":
                assert quantized is not None
                server = gezel_server(quantized, width, logdir, stored_weights=True)
            else:
                server = mlx_server(model_dir, width, logdir)
            with server as url:
                if prompt:
                    prefill.append(prefill_http(url, system, prompt))
                results += run_http(system, url, streams, args.tokens, args.repeats)
            print(f"[{system}: {time.monotonic() - t0:.0f}s]", file=sys.stderr, flush=True)

    print(f"model: {model_dir}")
    print(
        f"tokens/stream: {args.tokens}, repeats: {args.repeats}, "
        f"wall: {time.monotonic() - started:.0f}s"
    )
    load_after = _common.loadavg()[0]
    print_load_1min(load_before, load_after)
    print("tok/s = sum(n_i - 1) / (max last_i - min first_i); spread = max first_i - min first_i")
    print()
    print(render_table(results, streams, systems))
    if prefill:
        print()
        print(render_prefill(prefill))
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
                s: {str(n): median_by(results, s, n) for n in streams} for s in systems
            },
            "runs": [asdict(m) for m in results],
            "prefill": prefill,
        }
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
