"""Where one decode step's time goes: a sampled profile of a real server.

``gezel-trio serve`` runs on the model (the dense demo model of ``--size``
unless ``--model`` or ``--default-model``), as ``decode`` starts it, and for
each stream count one round of ``--tokens`` greedy tokens per stream is
streamed over HTTP SSE while py-spy samples the server's threads
(``py-spy record --threads --idle --nonblocking``: the process is never
paused). Each sample is put in one category by its innermost frame that a
rule names (``HOST`` and ``TRIO`` below); a category's time is its samples
over the rate, and its cost per token that time over the tokens the round
generated. ``decode tok/s`` is ``decode``'s metric for the same round, taken
while py-spy samples (its own cost is small but not nothing).

The two threads that matter are the host thread (``gezel-mlx-host``: every
MLX call, the model step, the detokenizer and stop filter, the exchange with
the Trio side) and the Trio thread (``MainThread``: the engine's Trio side,
the HTTP server, shaping, SSE encoding, socket writes). MLX computes on its
own threads with the GIL released: on the host thread that shows as waiting
in ``mx.eval`` inside mlx-lm's step, which is the floor every other line
competes with for the CPU.
"""

from __future__ import annotations

import collections
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import _servers, _sse
from bench._scenario import Context, Option, Result, Scenario, table
from bench._sse import StreamTiming, aggregate
from bench.scenarios.decode import chat_body

RATE = 100  # samples per second per thread (py-spy takes CPU too: keep it low)

# (category, function pattern, file pattern): the first rule that matches a
# frame, looking from the innermost frame outward, names the sample.
Rule = tuple[str, str, str]
HOST: tuple[Rule, ...] = (
    ("idle (no work)", r"wait_for_work", r""),
    ("exchange with the Trio thread", r"from_thread_run_sync|_send_message_to_trio", r"trio/"),
    ("waiting for MLX (the step computing)", r"^GenerationBatch\._step$", r"mlx_lm/generate\.py"),
    # The compiled step (``--compiled-step``): MLX replaying its trace; a
    # new trace's Python is in mlx-lm's models, the graph build's rule.
    ("the compiled step's call", r"^CompiledDecode\.__call__$", r"gezel_trio/mlx/compiled_step"),
    ("building the model graph", r"", r"mlx_lm/models/|mlx/nn/"),
    ("sampling", r"sampl|categorical|logsumexp", r""),
    ("detokenizer", r"Detokenizer|detok", r""),
    ("stop filter and shaping", r"", r"gezel_trio/shaping/"),
    ("prompt cache", r"", r"gezel_trio/host/(prompt_cache|persist)\.py|gezel_trio/core/cache"),
    ("mlx-lm batching", r"", r"mlx_lm/generate\.py"),
    ("backend bookkeeping", r"", r"gezel_trio/mlx/"),
    ("host loop bookkeeping", r"", r"gezel_trio/host/"),
)
TRIO: tuple[Rule, ...] = (
    ("idle (epoll)", r"get_events", r"trio/_core/_io_epoll"),
    ("exchange with the host", r"", r"gezel_trio/engine/_link\.py"),
    ("socket write", r"send_all|_nonblocking_helper|protocol_send", r""),
    ("SSE encode", r"frame|dump_json|_chunk|render|encode", r"gezel_trio/http/|json/"),
    ("shaping", r"", r"gezel_trio/shaping/"),
    ("event delivery", r"", r"gezel_trio/engine/"),
    ("HTTP server (hypercorn, h11, quart)", r"", r"hypercorn/|h11/|quart"),
    ("trio scheduling", r"", r"trio/"),
)
THREADS = {"gezel-mlx-host": ("host", HOST), "MainThread": ("trio", TRIO)}
_FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>[^:]*):\d+\)$")


def classify(frames: list[str], rules: tuple[Rule, ...]) -> str:
    """The category of one sample (its frames outermost first)."""
    for frame in reversed(frames):
        m = _FRAME.match(frame)
        fn, file = (m["fn"], m["file"]) if m else (frame, "")
        for name, fn_pat, file_pat in rules:
            if (not fn_pat or re.search(fn_pat, fn)) and (
                not file_pat or re.search(file_pat, file)
            ):
                return name
    return "other"


def tally(raw: str) -> dict[str, collections.Counter[str]]:
    """py-spy's raw (collapsed) output: samples per category, per thread."""
    out: dict[str, collections.Counter[str]] = {
        "host": collections.Counter(),
        "trio": collections.Counter(),
    }
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1]
        if thread not in THREADS or not count.isdigit():
            continue
        which, rules = THREADS[thread]
        out[which][classify(frames[1:], rules)] += int(count)
    return out


def _py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise RuntimeError("py-spy is not installed: pip install -e '.[bench]'")
    return found


def profile_round(url: str, pid: int, n: int, tokens: int, out: Path) -> dict[str, Any]:
    """One round of ``n`` streams under py-spy: the tally and the decode metric."""
    spy = subprocess.Popen(
        [_py_spy(), "record", "--pid", str(pid), "--threads", "--idle", "--nonblocking",
         "--rate", str(RATE), "--format", "raw", "--output", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        logs = _sse.streams_together(url, chat_body("gezel", tokens), n, "gezel")
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes what it has and exits
        _, err = spy.communicate(timeout=60)
    if not out.exists():
        raise RuntimeError(f"py-spy wrote nothing: {err.strip()[-400:]}")
    m = aggregate("gezel", tokens, [StreamTiming.of(log) for log in logs])
    counts = tally(out.read_text())
    generated = sum(m.per_stream_tokens)
    return {
        "streams": n,
        "tok_s": m.tok_s,
        "tokens": generated,
        "samples": {k: dict(v) for k, v in counts.items()},
        "ms_per_token": {
            k: {c: 1000 * s / RATE / generated for c, s in v.items()} for k, v in counts.items()
        },
    }


def run(ctx: Context) -> Result:
    a = ctx.args
    if a.default_model:
        model_dir = _servers.float32_copy(
            _servers.default_model(), _servers.default_model().parents[2] / "bench-float32"
        )
    else:
        # float32, as gezel-trio computes on the CPU (see ``decode``).
        stored = a.model if a.model is not None else ctx.demo_model("dense")
        model_dir = _servers.float32_copy(stored, stored.parent / "bench-float32")
    streams = sorted(set(a.streams))
    flags = [
        "--max-concurrency",
        str(max(streams)),
        "--log-level",
        "WARNING",
        "--speculation",
        "off",
    ]
    rounds = []
    with (
        ctx.phase("gezel"),
        _servers.gezel_server(model_dir, ctx.workdir / "gezel.log", flags) as srv,
    ):
        _sse.streams_together(srv.url, chat_body("gezel", 32), 1, "warm-up")
        for n in streams:
            rounds.append(
                profile_round(srv.url, srv.proc.pid, n, a.tokens, ctx.workdir / f"spy-{n}.txt")
            )
    tables = []
    for which, rules in (("host", HOST), ("trio", TRIO)):
        names = [r[0] for r in rules] + ["other"]
        rows = []
        for name in names:
            cells = [r["ms_per_token"][which].get(name, 0.0) for r in rounds]
            shares = [
                r["samples"][which].get(name, 0) / max(1, sum(r["samples"][which].values()))
                for r in rounds
            ]
            if any(cells):
                pairs = zip(cells, shares, strict=True)
                rows.append([name, *(f"{c:.2f} ({100 * s:.0f}%)" for c, s in pairs)])
        header = " | ".join(["category", *(f"{n} streams: ms/token (share)" for n in streams)])
        thread = "host thread (gezel-mlx-host)" if which == "host" else "Trio thread (MainThread)"
        tables.append(table(f"{thread}: time per generated token", header, rows))
    tables.append(
        table(
            "Decode during the profile",
            "streams:d | decode tok/s:.1f | tokens:d",
            [[r["streams"], r["tok_s"], r["tokens"]] for r in rounds],
        )
    )
    return Result(
        data={
            "model": str(model_dir),
            "rate": RATE,
            "tokens_per_stream": a.tokens,
            "rounds": rounds,
        },
        tables=tables,
        title=f"model {model_dir.name}, {a.tokens} tokens per stream",
    )


SCENARIO = Scenario(
    name="profile",
    doc=__doc__ or "",
    run=run,
    options=(
        Option("streams", [1, 4], "concurrent streams to profile", int, "+", quick=[1]),
        Option("tokens", 256, "max_tokens per stream", int, quick=64),
        Option("model", None, "a model directory (default: the dense demo model)", Path),
        Option(
            "default_model",
            False,
            "SmolLM2-135M-Instruct (gezel-trio's default), float32",
            kind="flag",
        ),
    ),
)
