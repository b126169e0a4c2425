"""Steady decode throughput and prefill: raw mlx-lm vs gezel-trio vs ``mlx_lm.server``.

One run measures, side by side and on the same model, prompt and token budget:

``raw``
    mlx-lm's ``BatchGenerator`` driven in-process by a tight ``next()`` loop,
    with no stop sequences (so every sequence runs exactly ``--tokens``). It
    runs in a child process that waits, idle, while a server is measured.
``gezel``
    ``python -m gezel_trio serve --max-concurrency MAX(streams) --speculation
    off`` over HTTP SSE, with ``ignore_eos: true`` (speculation changes what
    is decoded per step; ``bench speculative`` measures it).
``mlx_lm.server``
    ``python -m mlx_lm server --decode-concurrency N --prompt-concurrency N
    --temp 0.0 --chat-template-args '{"enable_thinking": false}'`` over HTTP
    SSE; it has no ``ignore_eos``, so every stream's token count is checked
    and a short stream is flagged ``SHORT`` in the table.
``gezel-q4`` (``--default-model`` only)
    gezel-trio on the quantized weights with ``--keep-quantized``.

All systems run on the same OpenBLAS (``bench/_servers.py``) and the same
float32 weights, as gezel-trio computes on the CPU (a float32 copy of the
model, made once: the demo models are bf16 on disk, and bf16 matmuls skip
BLAS, which doubled a bench model's step). The default model is the dense
demo model of ``--size``; ``--model DIR`` measures another one;
``--default-model`` measures SmolLM2-135M-Instruct, what ``gezel-trio
serve`` serves by default. On the CPU gezel-trio holds its Q4_1 weights as
float32, so every system gets the same float32 copy, and ``gezel-q4`` shows
what holding float32 buys.

Every system is started first (raw as a ``bench._worker.Session``, a child
that waits for each round) and stays up for the run, idle while another is
measured; the decode rounds then interleave: for each repeat and stream
count, one round of every system, in an order that turns each repeat, so a
slow spell of a shared machine falls on all of them alike. Only one system
computes at a time. Each gets one warm-up request first (a 32-token reply to
the short prompt below) and its prefill rows right after it. All requests are
greedy (``temperature: 0``), carry the same single short user message
rendered with ``enable_thinking=False``, and ask for ``max_tokens =
--tokens``. N concurrent streams are N identical requests released together
(a thread per stream behind a barrier; for ``raw``, N prompts inserted in one
``insert`` call). Every stream count is measured ``--repeats`` times and the
median is reported. Each system's round is also paired with raw's round of
the same repeat and stream count, run just before or after it: the median
of those ratios, a distribution-free interval for it and how many reach
0.98 (the bar: gezel-trio at most 2% behind raw) are in "Paired rounds".
On this shared 2-core VM a round's speed moves by 20% from one to the
next; with 5 rounds the interval is the whole range, and 15 give one of
96%. ``gezel-alt`` (``--alt-flags '...'``) is gezel-trio with more serve
flags: a setting measured against the default in one run.

Decode tok/s is the metric of ``bench/_sse.py``, identical for all systems:
``sum_i(n_i - 1) / (max_i last_i - min_i first_i)``, where ``first_i`` is the
arrival of stream i's first generated token (raw: the ``next()`` that
returned it; HTTP: its first SSE chunk with text - the role-only chunk and
keep-alive comments don't count), ``last_i`` the arrival of its last (HTTP:
the chunk with ``finish_reason``) and ``n_i`` the tokens it generated (HTTP:
``usage.completion_tokens``). Prefill and time-to-first-token are excluded;
anything that stalls decode inside the window, including the prefill of a
stream admitted after another has started, is included. ``spread`` is
``max_i first_i - min_i first_i``: how staggered the streams' starts were.

Prefill (``--prefill-tokens N ...``, after the warm-up and before any decode
round): for each N, one greedy request whose user message is about N tokens
of English (``src/gezel_trio/testing/demo_models/data/corpus.txt``, each length from
its own place in the text, so no length shares a cached prefix with
another) and ``max_tokens:
1``. TTFT cold is its time to the first token, prefill tok/s its prompt
tokens over that time (raw: time to the first token of a fresh
``BatchGenerator``); the same request again gives TTFT warm, the prompt
cache's share (raw has no cache).
"""

from __future__ import annotations

import contextlib
import math
import shlex
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from bench import _gezel_stalls, _servers, _sse, _worker
from bench._report import ratio
from bench._scenario import Context, Option, Plot, Result, Scenario, Series, Table, table
from bench._sse import Measurement, StreamTiming, aggregate

PROMPT = "Write a short story about a lighthouse keeper and a stormy night."
SYSTEMS = ("raw", "gezel", "mlx_lm.server", "gezel-q4", "gezel-eager", "gezel-alt")
# Run only when asked for (--systems): gezel-eager is gezel-trio with
# --compiled-step off, to show what the compiled step gives in the same run;
# gezel-alt is gezel-trio with --alt-flags, to compare a setting in one run.
_ON_REQUEST = ("gezel-q4", "gezel-eager", "gezel-alt")
_CORPUS = Path(__file__).resolve().parents[2] / "src/gezel_trio/testing/demo_models/data/corpus.txt"
_CHARS_PER_TOKEN = 4.4  # English BPE, measured on the corpus with SmolLM2's tokenizer
_METRIC = "tok/s = sum(n_i - 1) / (max last_i - min first_i); spread = max first_i - min first_i"
_RATIOS = (
    ("gezel", "raw"),
    ("mlx_lm.server", "raw"),
    ("gezel", "mlx_lm.server"),
    ("gezel-eager", "raw"),
    ("gezel", "gezel-eager"),
    ("gezel-alt", "raw"),
    ("gezel-alt", "gezel"),
)
# The bar gezel-trio's decode is held to (at least 0.98 of raw's): how many
# of a run's paired rounds reach it.
_LINE = 0.98


def long_prompt(tokens: int, part: int = 0) -> str:
    """About ``tokens`` tokens of English prose, from the ``part``-th place of
    the corpus (different parts share no prefix)."""
    corpus = _CORPUS.read_text("utf-8")
    start = (part * len(corpus) // 7) % len(corpus)
    text = (corpus[start:] + "\n\n" + corpus)[: int(tokens * _CHARS_PER_TOKEN)]
    return text + "\n\nSummarize."


def chat_body(system: str, max_tokens: int) -> dict[str, Any]:
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


# --- raw mlx-lm (in a child process, bench._worker) ---------------------------


def raw_session(
    model_dir: str, width: int, requests: Iterator[dict[str, Any]]
) -> Iterator[dict[str, Any]]:
    """Measure ``BatchGenerator`` (a ``bench._worker.Session``): for each
    request, ``{"prefill": N}`` (one cold prefill row) or ``{"streams": n,
    "tokens": t}`` (one decode round), one dict back."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import load

    model, tokenizer = load(model_dir)
    prompt: list[int] = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, enable_thinking=False
    )

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

    def prefill(part: int, n_tokens: int) -> dict[str, Any]:
        long: list[int] = tokenizer.apply_chat_template(
            [{"role": "user", "content": long_prompt(n_tokens, part)}],
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
            # The long prefill's freed buffers, kept in MLX's buffer cache,
            # slowed this process's later decode rounds (8 streams of the
            # dense bench model: 518 against 554 tok/s): the decode rounds
            # measure raw at its best, as without the prefill rows.
            mx.clear_cache()
        return {"system": "raw", "prompt_tokens": len(long), "cold_s": ttft, "warm_s": None}

    one_round(1, 32)  # warm-up
    for req in requests:
        if "prefill" in req:
            yield prefill(req["part"], req["prefill"])
        else:
            n, tokens = req["streams"], req["tokens"]
            cpu = time.process_time()  # this worker's threads: the engine's CPU
            m = aggregate("raw", tokens, one_round(n, tokens))
            yield attrs.asdict(attrs.evolve(m, server_cpu_s=time.process_time() - cpu))


# --- HTTP systems ---------------------------------------------------------------


def prefill_http(url: str, system: str, prompt: str) -> dict[str, Any]:
    """TTFT of a long prompt not in any cache (cold), then again (warm)."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    times, tokens = [], 0
    for _ in range(2):
        log = _sse.stream_once(url, body)
        if log.first is None:
            raise RuntimeError(f"{system}: no token in the prefill stream")
        times.append(log.ttft)
        tokens = log.usage_int("prompt_tokens") or 0
    return {"system": system, "prompt_tokens": tokens, "cold_s": times[0], "warm_s": times[1]}


def http_round(url: str, system: str, n: int, max_tokens: int, pid: int) -> Measurement:
    """One round of ``n`` streams, with the CPU it cost the server (process
    ``pid``) and this process (the client's threads)."""
    server, client = _servers.cpu_seconds(pid), time.process_time()
    main = _servers.cpu_seconds(pid, pid)
    logs = _sse.streams_together(url, chat_body(system, max_tokens), n, system)
    m = aggregate(system, max_tokens, [StreamTiming.of(log) for log in logs])
    return attrs.evolve(
        m,
        server_cpu_s=_servers.cpu_seconds(pid) - server,
        client_cpu_s=time.process_time() - client,
        trio_cpu_s=_servers.cpu_seconds(pid, pid) - main if system.startswith("gezel") else None,
    )


def _start(
    stack: contextlib.ExitStack,
    system: str,
    model_dir: Path,
    quantized: Path | None,
    width: int,
    ctx: Context,
    prefill: list[int],
    pre: list[dict[str, Any]],
    stalls: list[dict[str, Any]],
) -> Callable[[int], Measurement]:
    """Start ``system`` on ``stack``, warm it up, measure its prefill rows
    into ``pre``; returns how to measure one decode round of n streams
    (for gezel, with its Trio thread's stalls during the round in ``stalls``)."""
    tokens = ctx.args.tokens
    if system == "raw":
        session = stack.enter_context(
            _worker.Session(f"{__name__}:raw_session", model_dir=str(model_dir), width=width)
        )
        for part, n_tokens in enumerate(prefill):
            pre.append(session.ask({"prefill": n_tokens, "part": part}))
        return lambda n: Measurement(**session.ask({"streams": n, "tokens": tokens}))
    watch = ctx.workdir / f"{system}-stalls.json" if system.startswith("gezel") else None
    alt = shlex.split(ctx.args.alt_flags or "") if system == "gezel-alt" else []
    url, pid = stack.enter_context(
        _serve(system, model_dir, quantized, width, ctx.workdir, watch, alt)
    )
    http_round(url, system, 1, min(tokens, 32), pid)  # warm-up
    for part, n_tokens in enumerate(prefill):
        pre.append(prefill_http(url, system, long_prompt(n_tokens, part)))
    if watch is None:
        return lambda n: http_round(url, system, n, tokens, pid)

    def watched(n: int) -> Measurement:
        _gezel_stalls.mark(watch)
        m = http_round(url, system, n, tokens, pid)
        seen = _gezel_stalls.read_stalls(watch, after=time.time())
        stalls.append({"system": system, "streams": n, **seen})
        return m

    return watched


@contextlib.contextmanager
def _serve(
    system: str,
    model_dir: Path,
    quantized: Path | None,
    width: int,
    workdir: Path,
    stalls: Path | None = None,
    alt: list[str] | None = None,
) -> Iterator[tuple[str, int]]:
    log = workdir / f"{system}.log"
    if system == "mlx_lm.server":
        with _servers.mlx_server(model_dir, log, _servers.mlx_decode_flags(width)) as srv:
            yield srv.url, srv.proc.pid
        return
    # Speculation off: this compares what serving costs per token against
    # the same decoding; what speculation gains is `bench speculative`'s.
    flags = ["--max-concurrency", str(width), "--log-level", "WARNING", "--speculation", "off"]
    if system == "gezel-eager":
        flags += ["--compiled-step", "off"]
    flags += alt or []
    model = quantized if system == "gezel-q4" and quantized is not None else model_dir
    with _servers.gezel_server(model, log, flags, label=system, stalls=stalls) as srv:
        yield srv.url, srv.proc.pid


# --- the run ----------------------------------------------------------------------


def median_by(results: list[Measurement], system: str, n: int) -> float | None:
    vals = [m.tok_s for m in results if m.system == system and m.streams == n]
    return statistics.median(vals) if vals else None


def run(ctx: Context) -> Result:
    a = ctx.args
    streams: list[int] = sorted(set(a.streams))
    prefill: list[int] = [n for n in a.prefill_tokens or () if n > 0]
    if min(streams) < 1 or a.tokens < 2 or a.repeats < 1:
        raise ValueError("--streams >= 1, --tokens >= 2 and --repeats >= 1 are required")
    quantized: Path | None = None
    if a.default_model:
        quantized = _servers.default_model()
        model_dir = _servers.float32_copy(quantized, quantized.parents[2] / "bench-float32")
    else:
        # The demo models are bf16 on disk; gezel-trio computes in float32 on
        # the CPU (OpenBLAS), so every system gets the same float32 copy.
        stored = a.model if a.model is not None else ctx.demo_model("dense")
        model_dir = _servers.float32_copy(stored, stored.parent / "bench-float32")
    default = [s for s in SYSTEMS if s not in _ON_REQUEST] + (["gezel-q4"] if quantized else [])
    systems = list(a.systems or default)
    if "gezel-q4" in systems and quantized is None:
        raise ValueError("gezel-q4 needs --default-model")

    if "gezel-alt" in systems and not a.alt_flags:
        raise ValueError("gezel-alt needs --alt-flags (the serve flags it adds)")
    width = max(streams)
    results: list[Measurement] = []
    pre: list[dict[str, Any]] = []
    stalls: list[dict[str, Any]] = []
    pair_rounds: list[dict[str, float]] = []
    with contextlib.ExitStack() as stack:
        # Every system stays up for the whole run, idle while another is
        # measured, so the rounds interleave and a slow spell of the machine
        # (a shared host) falls on every system alike.
        rounds: dict[str, Callable[[int], Measurement]] = {}
        for system in systems:
            with ctx.phase(f"{system}: start, warm up, prefill"):
                rounds[system] = _start(
                    stack, system, model_dir, quantized, width, ctx, prefill, pre, stalls
                )
        with ctx.phase(f"decode rounds, interleaved, {a.repeats} each"):
            for r in range(a.repeats):
                for n in streams:
                    # The order turns each round: no system always goes first.
                    turn = r % len(systems)
                    for system in systems[turn:] + systems[:turn]:
                        results.append(rounds[system](n))
                    # The systems' rounds of one (repeat, streams) ran one
                    # after another: a pair shares the machine's spell.
                    ran = results[-len(systems) :]
                    pair_rounds.append({"streams": n} | {m.system: m.tok_s for m in ran})

    data = {
        "model": str(model_dir),
        "prompt": PROMPT,
        "tokens_per_stream": a.tokens,
        "repeats": a.repeats,
        "streams": streams,
        "systems": systems,
        "metric": "sum(n_i - 1) / (max_i last_i - min_i first_i)",
        "mlx_lm_server_flags": _servers.mlx_decode_flags(width),
        "median_tok_s": {s: {str(n): median_by(results, s, n) for n in streams} for s in systems},
        "runs": results,
        "paired": pair_rounds,
        "prefill": pre,
        "stalls": stalls,
    }
    return Result(
        data=data,
        tables=[
            *_tables(results, pre, streams, systems),
            *_paired_tables(pair_rounds, streams, systems),
            *_stall_tables(stalls, streams),
        ],
        plots=_plots(results, pre, streams, systems),
        notes=(
            ["SHORT: some stream ended before max_tokens (EOS); its tokens are still counted."]
            if any(m.short for m in results)
            else []
        ),
        title=f"model {model_dir.name}, {a.tokens} tokens per stream, median of {a.repeats}",
    )


def median_interval(xs: list[float]) -> tuple[float, float, float] | None:
    """A distribution-free interval for the median of ``xs``: the order
    statistics (k, n+1-k) with the largest k whose coverage
    (1 - 2 P(Binomial(n, 1/2) < k)) is still at least 95%, and that coverage.
    Under 6 values no such k exists: the whole range and its coverage."""
    n = len(xs)
    if n == 0:
        return None
    xs = sorted(xs)

    def below(k: int) -> float:  # P(Binomial(n, 1/2) < k)
        return sum(math.comb(n, i) for i in range(k)) / (1 << n)

    k = 1
    while k + 1 <= (n + 1) // 2 and 1 - 2 * below(k + 1) >= 0.95:
        k += 1
    return xs[k - 1], xs[n - k], 1 - 2 * below(k)


def _paired_tables(
    pair_rounds: list[dict[str, float]], streams: list[int], systems: list[str]
) -> list[Table]:
    """Each system's round over raw's round of the same repeat and stream
    count (they ran one after the other): the median of those ratios, an
    interval for it, and how many reached ``_LINE``. A slow spell of a shared
    machine moves both rounds of a pair; it moves a ratio of medians more."""
    if "raw" not in systems:
        return []
    rows = []
    for system in (s for s in systems if s != "raw"):
        for n in streams:
            got = [
                r[system] / r["raw"]
                for r in pair_rounds
                if r["streams"] == n and r.get("raw") and system in r
            ]
            interval = median_interval(got)
            if interval is None:
                continue
            lo, hi, coverage = interval
            rows.append(
                (
                    system,
                    n,
                    statistics.median(got),
                    f"{lo:.3f}-{hi:.3f} ({coverage:.0%})",
                    f"{sum(x >= _LINE for x in got)} of {len(got)}",
                    " ".join(f"{x:.3f}" for x in got),
                )
            )
    if not rows:
        return []
    return [
        table(
            "Paired rounds: each round over raw's beside it",
            f"system | streams:d | median ratio:.3f | interval (coverage) | >= {_LINE} | ratios",
            rows,
            "ratio = the system's tok/s over raw's in the same repeat and stream count (the"
            " two rounds ran back to back); interval: order statistics of the ratios that"
            " hold the median with the coverage shown (distribution-free; under 6 rounds"
            " the whole range)",
        )
    ]


def _cost_ms(results: list[Measurement], system: str, n: int) -> float | None:
    """What ``system`` adds to each generated token over raw, in ms: the
    difference of the medians' time per token (aggregate tok/s)."""
    got, raw = median_by(results, system, n), median_by(results, "raw", n)
    if got is None or raw is None or got <= 0 or raw <= 0:
        return None
    return 1e3 / got - 1e3 / raw


def _cpu_ms(results: list[Measurement], system: str, n: int, which: str) -> float | None:
    """The median over the rounds of CPU ms per generated token."""
    vals = []
    for m in results:
        cpu = getattr(m, which)
        if m.system == system and m.streams == n and cpu is not None:
            vals.append(1e3 * cpu / max(1, sum(m.per_stream_tokens)))
    return statistics.median(vals) if vals else None


def _cpu_rows(
    results: list[Measurement], streams: list[int], systems: list[str]
) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = []
    for system in systems:
        for n in streams:
            server = _cpu_ms(results, system, n, "server_cpu_s")
            if server is None:
                continue
            rows.append(
                (
                    system,
                    n,
                    server,
                    _cpu_ms(results, system, n, "trio_cpu_s"),
                    _cpu_ms(results, system, n, "client_cpu_s"),
                )
            )
    return rows


def _stall_tables(stalls: list[dict[str, Any]], streams: list[int]) -> list[Table]:
    """The Trio thread during the decode rounds (``bench/_gezel_stalls.py``):
    a 5 ms heartbeat's lateness and the task steps of 8 ms or more."""
    rows = []
    for system in sorted({r["system"] for r in stalls}):
        for n in streams:
            got = [r for r in stalls if r["system"] == system and r["streams"] == n and r]
            if not got:
                continue
            worst: list[Any] = max(
                (r["long_steps"][0] for r in got if r.get("long_steps")),
                default=[0.0, "", 0.0, 0.0, 0.0],
            )
            rows.append(
                (
                    system,
                    n,
                    statistics.median(r["late_p99_ms"] or 0.0 for r in got),
                    max(r["late_max_ms"] or 0.0 for r in got),
                    sum(r.get("long_step_count", 0) for r in got),
                    worst[0],
                    worst[2] if len(worst) > 2 else 0.0,
                    worst[3] if len(worst) > 3 else 0.0,
                    worst[4] if len(worst) > 4 else 0.0,
                )
            )
    if not rows:
        return []
    return [
        table(
            "The Trio thread while streams decode",
            "system | streams:d | heartbeat late p99 ms:.2f | late max ms:.2f"
            " | task steps >= 8 ms:d | longest step ms:.1f | its CPU ms:.1f | its GC ms:.1f"
            " | its wait for a core ms:.1f",
            rows,
            "a task sleeping 5 ms, how late it woke (median over rounds of each round's p99;"
            " max over all); task steps timed by a Trio instrument, with the Trio thread's CPU"
            " time in the longest one, the time Python's garbage collector ran in it and the"
            " time the thread waited runnable for a core (the kernel's run_delay); the rest"
            " of the step it slept, waiting for the GIL",
        )
    ]


def _tables(
    results: list[Measurement], pre: list[dict[str, Any]], streams: list[int], systems: list[str]
) -> list[Table]:
    rows = []
    for system in systems:
        for n in streams:
            ms = [m for m in results if m.system == system and m.streams == n]
            if ms:
                rows.append(
                    (
                        system,
                        n,
                        statistics.median(m.tok_s for m in ms),
                        " ".join(f"{m.tok_s:.1f}" for m in ms),
                        statistics.median(m.spread_s for m in ms),
                        "SHORT" if any(m.short for m in ms) else "",
                    )
                )
    out = [
        table(
            "Decode tok/s",
            "system | streams:d | tok/s (median):.1f | runs | spread s:.2f | ",
            rows,
            _METRIC,
        )
    ]
    pairs = [(x, y) for x, y in _RATIOS if x in systems and y in systems]
    costs = [x for x in systems if x != "raw"] if "raw" in systems else []
    if pairs:
        out.append(
            table(
                "Ratios of the medians",
                " | ".join(
                    [
                        "streams:d",
                        *(f"{x} / {y}:.3f" for x, y in pairs),
                        *(f"{x} ms/token over raw:.3f" for x in costs),
                    ]
                ),
                [
                    (
                        n,
                        *(
                            ratio(median_by(results, x, n), median_by(results, y, n))
                            for x, y in pairs
                        ),
                        *(_cost_ms(results, x, n) for x in costs),
                    )
                    for n in streams
                ],
                "ms/token over raw: 1000/tok_s - 1000/raw_tok_s, what a system adds per"
                " generated token (all streams together)",
            )
        )
    cpu_rows = _cpu_rows(results, streams, systems)
    if cpu_rows:
        out.append(
            table(
                "CPU per generated token",
                "system | streams:d | server ms/token:.3f | gezel Trio thread ms/token:.3f"
                " | client ms/token:.3f",
                cpu_rows,
                "CPU seconds of the round (user + system) over the tokens it generated,"
                " median of the rounds: the serving process, all its threads (raw: the"
                " engine alone; OpenBLAS's workers spin while they wait, so where the"
                " compute fills the cores this follows wall time), gezel-trio's Trio"
                " thread alone (HTTP, shaping, SSE), and the bench's HTTP client"
                " threads, which share these cores with the server. Where the compute"
                " takes every core, CPU spent beside it is decode time lost.",
            )
        )
    if pre:
        out.append(
            table(
                "Prefill",
                "system | prompt tok:d | TTFT cold s:.3f | prefill tok/s:.1f | TTFT warm s:.3f",
                [
                    (
                        r["system"],
                        r["prompt_tokens"],
                        r["cold_s"],
                        r["prompt_tokens"] / r["cold_s"],
                        r["warm_s"],
                    )
                    for r in pre
                ],
            )
        )
    return out


def _plots(
    results: list[Measurement], pre: list[dict[str, Any]], streams: list[int], systems: list[str]
) -> list[Plot]:
    plots = [
        Plot(
            "Decode throughput vs concurrent streams",
            "concurrent streams",
            "decode tok/s (all streams, median)",
            tuple(Series(s, streams, [median_by(results, s, n) for n in streams]) for s in systems),
        )
    ]
    if pre:
        series = []
        for s in systems:
            rows = sorted((r for r in pre if r["system"] == s), key=lambda r: r["prompt_tokens"])
            if not rows:
                continue
            xs = [r["prompt_tokens"] for r in rows]
            series.append(Series(f"{s} cold", xs, [r["cold_s"] for r in rows], group=s))
            if any(r["warm_s"] is not None for r in rows):
                warm = [r["warm_s"] for r in rows]
                series.append(Series(f"{s} warm", xs, warm, "--", group=s))
        plots.append(
            Plot("Time to first token vs prompt length", "prompt tokens", "TTFT s", tuple(series))
        )
    return plots


SCENARIO = Scenario(
    name="decode",
    doc=__doc__ or "",
    run=run,
    options=(
        Option("streams", [1, 4, 8], "concurrent streams to measure", int, "+", quick=[1, 2]),
        Option("tokens", 128, "max_tokens per stream", int, quick=32),
        Option("repeats", 3, "rounds per stream count (the median is reported)", int, quick=1),
        Option(
            "alt_flags",
            None,
            "the serve flags of the gezel-alt system, one string (e.g."
            " --alt-flags='--stream-hold-ms 0'): a setting against gezel in one run",
        ),
        Option(
            "prefill_tokens",
            [128, 512, 1024],
            "prompt lengths for TTFT and prefill tok/s (0: none)",
            int,
            "+",
            quick=[64, 256],
        ),
        Option("systems", None, "systems to run (default: all that apply)", str, "+", SYSTEMS),
        Option("model", None, "a model directory (default: the dense demo model)", Path),
        Option(
            "default_model",
            False,
            "SmolLM2-135M-Instruct (gezel-trio's default), float32 for every system",
            kind="flag",
        ),
    ),
)
