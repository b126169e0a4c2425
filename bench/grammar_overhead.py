"""Cost of grammar-constrained decoding: json_schema vs free decode, and mask time per step.

Usage (from the repository root)::

    python bench/grammar_overhead.py [--streams 1 4] [--tokens 128] [--repeats 3]
                                     [--mask-tokens 256] [--schemas enum_array long_string]
                                     [--model DIR] [--json OUT]

(``python -m bench.grammar_overhead`` works too.) One run, on the bench demo
model by default, has two phases, one after the other, never together:

in-process (first, in a child process that exits before the server starts)
    mlx-lm's ``BatchGenerator`` driven by a tight ``next()`` loop, as
    ``bench/decode_throughput.py``'s ``raw`` system does, once per mode and
    stream count, ``--mask-tokens`` tokens per sequence. Constrained
    sequences each get their own ``GrammarProcessor`` (``GrammarTokenizer`` +
    ``make_grammar_processor`` over a ``grammar.build_constraint`` result, as
    the server builds them), wrapped in a timer. Per step and sequence it
    reports:

    * ``mask``: ``GrammarProcessor.mask_seconds`` - llguidance's
      ``compute_bitmask``, unpacking it and building the ``mx.array`` mask
      (``mx.where`` is lazy, so applying the mask is paid in the next graph
      evaluation, not here);
    * ``sync``: waiting for the token sampled at the previous step. The
      processor reads it with ``.item()``, which blocks until the previous
      step's forward pass is done (the wrapper does that ``mx.eval`` first and
      times it; in a batch the first processor of a step waits, the others
      find it done). Without processors ``BatchGenerator`` builds step k+1's
      graph while step k still computes; with one, that overlap is lost;
    * ``call``: the whole processor call (sync + ``consume_token`` + mask).

    ``mask`` is given per sequence and step (median / p99 / max over all of
    them); ``/step`` columns are means per decode step, all sequences of the
    batch together; ``step`` is the median wall time of one ``next()``, and
    ``mask share`` = total mask time / total ``next()`` time.

    Its tok/s (same metric as below) is from one run per row.
HTTP (second)
    ``python -m gezel_trio serve --max-concurrency MAX(streams)`` over HTTP
    SSE (one server for all modes). For every stream count and repeat the
    modes run back to back, their order rotated each repeat, so a load change
    on the machine hits all of them alike; each mode gets a one-request
    warm-up first. The median of ``--repeats`` is reported, and the ratio
    constrained / unconstrained of those medians.

Modes. All requests are greedy, carry the same user message rendered with
``enable_thinking=False`` and ask for ``max_tokens``:

``none``
    no constraint, ``ignore_eos: true`` (as in decode_throughput.py).
``enum_array``
    ``{"words": [...]}`` with exactly 200 items from ``alpha|beta|gamma``
    (``minItems`` = ``maxItems``: with only ``maxItems`` the random-weight
    model closes the array after one item and the grammar forces EOS).
``long_string``
    ``{"text": "..."}`` with exactly 2000 characters: almost the whole
    vocabulary is allowed at each step, the opposite of ``enum_array``.

Constrained requests do *not* send ``ignore_eos``: with it, a grammar that
completes early leaves EOS as the only allowed token and the server keeps
generating hidden EOS tokens up to ``max_tokens`` (counted in
``completion_tokens``, ``finish_reason: "length"``), which would pass masked-
out steps off as constrained decode. Both schemas are far longer than the
default budgets, so every stream should run to ``max_tokens``; one that ends
early is flagged ``SHORT``, and one whose text is not a prefix the schema
allows is flagged ``BAD`` (the constraint was not applied).

The metric (as in decode_throughput.py): per stream, ``first_i`` / ``last_i``
= arrival of its first / last generated token (HTTP: first SSE chunk with
content, the chunk with ``finish_reason``), ``n_i`` = tokens it generated
(HTTP: ``usage.completion_tokens``); tok/s = ``sum_i(n_i - 1) / (max_i last_i
- min_i first_i)``; ``spread`` = ``max_i first_i - min_i first_i``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx2 as httpx

if __package__ in (None, ""):  # run as a script: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common
from bench._common import Measurement, StreamTiming, aggregate, build_default_model, write_json
from bench.decode_throughput import gezel_server

PROMPT: Final = "List some Greek letters, or describe them, as a JSON object."
_REQUEST_TIMEOUT_S: Final = 300.0
_ENUM: Final = ("alpha", "beta", "gamma")
SCHEMAS: Final[dict[str, dict[str, Any]]] = {
    "enum_array": {
        "type": "object",
        "properties": {
            "words": {
                "type": "array",
                "items": {"type": "string", "enum": list(_ENUM)},
                "minItems": 200,
                "maxItems": 200,
            }
        },
        "required": ["words"],
        "additionalProperties": False,
    },
    "long_string": {
        "type": "object",
        "properties": {"text": {"type": "string", "minLength": 2000, "maxLength": 2000}},
        "required": ["text"],
        "additionalProperties": False,
    },
}
# What every output of a schema starts with (compact JSON, see grammar.py).
_PREFIX: Final = {"enum_array": '{"words": [', "long_string": '{"text": "'}
_ENUM_ITEMS: Final = re.compile(r'((?:"(?:alpha|beta|gamma)", )*)(.*)', re.DOTALL)
# Ways to close a string cut anywhere (mid-escape included) so json.loads can check it.
_STRING_CLOSERS: Final = ('"}', '\\"}', '0"}', '00"}', '000"}', '0000"}')


def response_format(mode: str) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": mode, "schema": SCHEMAS[mode]}}


def content_ok(mode: str, text: str) -> bool:
    """Whether ``text`` is a prefix of some output ``mode``'s schema allows
    (always true for ``none``). Only the shapes of SCHEMAS are understood."""
    if mode == "none":
        return True
    prefix = _PREFIX[mode]
    if not text.startswith(prefix):
        return False
    body = text[len(prefix) :]
    if mode == "enum_array":
        m = _ENUM_ITEMS.fullmatch(body)
        tail = m.group(2) if m else body
        return any(f'"{w}", '.startswith(tail) for w in _ENUM)
    for closer in _STRING_CLOSERS:
        try:
            value = json.loads(text + closer)
        except ValueError:
            continue
        return isinstance(value, dict) and len(str(value.get("text", ""))) <= 2000
    return False


def _pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def _load() -> tuple[float, float, float]:
    return _common.loadavg()


def _fmt_load(load: tuple[float, float, float]) -> str:
    return _common.fmt_load(load, "/")


# --- in-process phase (runs in a child process) ---------------------------


@dataclass
class InprocRun:
    mode: str
    streams: int
    tokens_per_stream: int
    tok_s: float
    window_s: float
    per_stream_tokens: list[int]
    finish_reasons: list[str]
    steps: int
    step_ms: float  # median next() wall time
    step_total_s: float  # all next() calls
    compile_ms: float | None = None  # build_constraint
    processor_ms: float | None = None  # make_grammar_processor, mean per sequence
    mask_n: int = 0  # masks computed (sequence-steps)
    proc_steps: int = 0  # steps in which processors ran
    mask_ms: dict[str, float] = field(default_factory=dict)  # median, p99, max
    mask_total_s: float = 0.0
    sync_total_s: float = 0.0
    call_total_s: float = 0.0
    processor_errors: list[str] = field(default_factory=list)

    @property
    def short(self) -> bool:
        return any(n != self.tokens_per_stream for n in self.per_stream_tokens)


def _stats_ms(seconds: Sequence[float]) -> dict[str, float]:
    if not seconds:
        return {}
    return {
        "median": statistics.median(seconds) * 1e3,
        "p99": _pct(seconds, 99) * 1e3,
        "max": max(seconds) * 1e3,
    }


def _mask_worker(model_dir: str, streams: list[int], modes: list[str], max_tokens: int) -> None:
    """Child-process body: one generation per (stream count, mode); JSON lines on stdout."""
    from gezel_trio import blas

    blas.preload()  # before mlx loads: the same OpenBLAS as the server
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import load

    from gezel_trio.grammar import build_constraint
    from gezel_trio.mlx_constraints import GrammarProcessor, GrammarTokenizer
    from gezel_trio.mlx_constraints import make_grammar_processor as make_processor

    class Timed:
        """Times a GrammarProcessor call, the wait for the previous token apart."""

        def __init__(self, inner: GrammarProcessor) -> None:
            self.inner = inner
            self.sync: list[float] = []
            self.call: list[float] = []

        def __call__(self, tokens: Any, logits: Any) -> Any:
            t0 = time.perf_counter()
            mx.eval(tokens)  # what the processor's tokens[-1].item() would wait for
            t1 = time.perf_counter()
            out = self.inner(tokens, logits)
            t2 = time.perf_counter()
            self.sync.append(t1 - t0)
            self.call.append(t2 - t0)
            return out

    model, tokenizer = load(model_dir)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    eos_cfg = cfg.get("eos_token_id")
    eos_set = set(tokenizer.eos_token_ids)
    eos_set |= set(eos_cfg) if isinstance(eos_cfg, list) else {eos_cfg} - {None}
    eos = sorted(eos_set)
    grammar_tok = GrammarTokenizer(tokenizer._tokenizer, eos_ids=eos)
    vocab_width = int(model(mx.array([[2]])).shape[-1])
    prompt: list[int] = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, enable_thinking=False
    )
    width = max(streams)

    def one_round(mode: str, n: int, tokens: int) -> InprocRun:
        compile_ms = processor_ms = None
        timed: list[Timed] = []
        if mode != "none":
            t0 = time.perf_counter()
            constraint = build_constraint(
                response_format=response_format(mode),
                tools=None,
                tool_choice=None,
                tool_grammar=None,
                llg_tokenizer=grammar_tok.llg,
            )
            t1 = time.perf_counter()
            assert constraint is not None
            for _ in range(n):
                p = make_processor(constraint, grammar_tok, vocab_width=vocab_width, eos_ids=eos)
                timed.append(Timed(p))
            compile_ms = (t1 - t0) * 1e3
            processor_ms = (time.perf_counter() - t1) * 1e3 / n
        # Free decode runs to `tokens` (no stop, like ignore_eos); a constrained
        # sequence stops on EOS, which only a completed grammar allows.
        gen = BatchGenerator(
            model,
            stop_tokens=[[e] for e in eos] if timed else None,
            completion_batch_size=width,
            prefill_batch_size=width,
            prefill_step_size=512,
        )
        try:
            uids = gen.insert(
                [list(prompt)] * n,
                max_tokens=[tokens] * n,
                logits_processors=[[t] for t in timed] if timed else None,
            )
            first: dict[int, float] = {}
            last: dict[int, float] = {}
            count = dict.fromkeys(uids, 0)
            finish: dict[int, str] = {}
            step_s: list[float] = []
            while len(finish) < n:
                t0 = time.perf_counter()
                _, responses = gen.next()
                now = time.perf_counter()
                step_s.append(now - t0)
                for r in responses:
                    first.setdefault(r.uid, now)
                    last[r.uid] = now
                    count[r.uid] += 1
                    if r.finish_reason is not None:
                        finish[r.uid] = r.finish_reason
        finally:
            gen.close()
        m = aggregate(mode, tokens, [StreamTiming(first[u], last[u], count[u]) for u in uids])
        masks = [s for t in timed for s in t.inner.mask_seconds]
        proc_steps = max((len(t.call) for t in timed), default=0)
        return InprocRun(
            mode=mode,
            streams=n,
            tokens_per_stream=tokens,
            tok_s=m.tok_s,
            window_s=m.window_s,
            per_stream_tokens=m.per_stream_tokens,
            finish_reasons=[finish[u] for u in uids],
            steps=len(step_s),
            step_ms=statistics.median(step_s) * 1e3,
            step_total_s=sum(step_s),
            compile_ms=compile_ms,
            processor_ms=processor_ms,
            mask_n=len(masks),
            proc_steps=proc_steps,
            mask_ms=_stats_ms(masks),
            mask_total_s=sum(masks),
            sync_total_s=sum(s for t in timed for s in t.sync),
            call_total_s=sum(s for t in timed for s in t.call),
            processor_errors=[t.inner.error for t in timed if t.inner.error is not None],
        )

    for mode in dict.fromkeys(["none", *modes]):  # warm-up: kernels, llguidance
        one_round(mode, 1, 16)
    for n in streams:
        for mode in modes:
            print(json.dumps(asdict(one_round(mode, n, max_tokens))), flush=True)


def run_inproc(
    model_dir: Path, streams: list[int], modes: list[str], max_tokens: int
) -> list[InprocRun]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--mask-worker",
        "--model",
        str(model_dir),
        "--mask-tokens",
        str(max_tokens),
        "--schemas",
        *[m for m in modes if m != "none"],
        "--streams",
        *map(str, streams),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"in-process worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return [InprocRun(**json.loads(line)) for line in proc.stdout.splitlines() if line[:1] == "{"]


# --- HTTP phase ------------------------------------------------------------


@dataclass
class HttpRun(Measurement):
    repeat: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    content_ok: list[bool] = field(default_factory=list)

    @property
    def bad(self) -> bool:
        return not all(self.content_ok)


def _request_body(mode: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": False},
    }
    if mode == "none":
        body["ignore_eos"] = True
    else:
        body["response_format"] = response_format(mode)  # no ignore_eos: module docstring
    return body


def _one_stream(
    url: str, body: dict[str, Any], barrier: threading.Barrier
) -> tuple[StreamTiming, str, str]:
    """One SSE request: its timing, finish_reason and text (content + reasoning)."""
    first: float | None = None
    last: float | None = None
    tokens: int | None = None
    finish = ""
    text: list[str] = []
    with httpx.Client(timeout=_REQUEST_TIMEOUT_S) as client:
        barrier.wait()
        for now, obj in _common.sse_chunks(client, url, body):
            for choice in obj.get("choices") or ():
                delta = choice.get("delta") or {}
                piece = delta.get("content") or delta.get("reasoning_content") or ""
                text.append(piece)
                if piece and first is None:
                    first = now
                if piece or choice.get("finish_reason"):
                    last = now
                finish = choice.get("finish_reason") or finish
            usage = obj.get("usage")
            if usage:
                tokens = int(usage["completion_tokens"])
    if first is None or last is None or tokens is None:
        raise RuntimeError(f"incomplete stream: first={first} last={last} tokens={tokens}")
    return StreamTiming(first, last, tokens), finish, "".join(text)


def http_round(url: str, mode: str, n: int, max_tokens: int, repeat: int) -> HttpRun:
    """N identical streaming requests released together; one thread each."""
    body = _request_body(mode, max_tokens)
    got = _common.released_together(n, lambda b: _one_stream(url, body, b), mode)
    m = aggregate(mode, max_tokens, [g[0] for g in got])
    return HttpRun(
        **asdict(m),
        repeat=repeat,
        finish_reasons=[g[1] for g in got],
        content_ok=[content_ok(mode, g[2]) for g in got],
    )


def run_http(
    url: str, modes: list[str], streams: list[int], max_tokens: int, repeats: int
) -> list[HttpRun]:
    for mode in modes:
        http_round(url, mode, 1, min(max_tokens, 32), -1)  # warm-up
    out = []
    for n in streams:
        for r in range(repeats):
            k = r % len(modes)
            for mode in modes[k:] + modes[:k]:
                out.append(http_round(url, mode, n, max_tokens, r))
    return out


# --- report ----------------------------------------------------------------


def median_tok_s(runs: Sequence[HttpRun], mode: str, n: int) -> float | None:
    vals = [m.tok_s for m in runs if m.system == mode and m.streams == n]
    return statistics.median(vals) if vals else None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}" if a is not None and b else "-"


def render_inproc(runs: Sequence[InprocRun], streams: list[int], modes: list[str]) -> str:
    head = (
        f"{'mode':<12}{'streams':>8}{'tok/s':>8}{'vs none':>8}{'step ms':>9}"
        f"{'mask ms med/p99/max':>22}{'masks':>7}{'mask ms/step':>13}{'sync ms/step':>13}"
        f"{'call ms/step':>13}{'mask share':>11}"
    )
    rows = [head]
    for n in streams:
        base = next((r.tok_s for r in runs if r.mode == "none" and r.streams == n), None)
        for mode in modes:
            r = next((x for x in runs if x.mode == mode and x.streams == n), None)
            if r is None:
                continue
            mask = per_mask = sync = call = share = "-"
            if r.mask_ms and r.proc_steps:
                mk, k = r.mask_ms, 1e3 / r.proc_steps
                mask = f"{mk['median']:.3f}/{mk['p99']:.3f}/{mk['max']:.2f}"
                per_mask = f"{r.mask_total_s * k:.2f}"
                sync = f"{r.sync_total_s * k:.2f}"
                call = f"{r.call_total_s * k:.2f}"
                share = f"{100 * r.mask_total_s / r.step_total_s:.2f}%"
            flags = ("  SHORT" if r.short else "") + ("  ERROR" if r.processor_errors else "")
            rows.append(
                f"{mode:<12}{n:>8}{r.tok_s:>8.1f}{_ratio(r.tok_s, base):>8}{r.step_ms:>9.1f}"
                f"{mask:>22}{r.mask_n:>7}{per_mask:>13}{sync:>13}{call:>13}{share:>11}{flags}"
            )
    setup = [
        f"{r.mode}: build_constraint {r.compile_ms:.2f} ms, "
        f"make_grammar_processor {r.processor_ms:.2f} ms/sequence"
        for r in runs
        if r.compile_ms is not None and r.processor_ms is not None and r.streams == streams[0]
    ]
    return "\n".join([*rows, "", *setup])


def render_http(runs: Sequence[HttpRun], streams: list[int], modes: list[str]) -> str:
    rows = [
        f"{'mode':<12}{'streams':>8}{'tok/s (median)':>16}{'runs':>24}{'spread s':>10}"
        f"{'vs none':>9}"
    ]
    for n in streams:
        base = median_tok_s(runs, "none", n)
        for mode in modes:
            ms = [m for m in runs if m.system == mode and m.streams == n]
            if not ms:
                continue
            med = statistics.median(m.tok_s for m in ms)
            line = " ".join(f"{m.tok_s:.1f}" for m in ms)
            spread = statistics.median(m.spread_s for m in ms)
            flags = ("  SHORT" if any(m.short for m in ms) else "") + (
                "  BAD" if any(m.bad for m in ms) else ""
            )
            rows.append(
                f"{mode:<12}{n:>8}{med:>16.1f}{line:>24}{spread:>10.2f}"
                f"{_ratio(med, base):>9}{flags}"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    p.add_argument("--tokens", type=int, default=128, help="HTTP max_tokens per stream")
    p.add_argument("--repeats", type=int, default=3, help="HTTP repeats per mode and streams")
    p.add_argument("--mask-tokens", type=int, default=256, help="in-process tokens per sequence")
    p.add_argument("--schemas", nargs="+", choices=list(SCHEMAS), default=list(SCHEMAS))
    p.add_argument("--model", type=Path, default=None, help="default: the bench demo model")
    p.add_argument("--json", type=Path, default=None, metavar="OUT")
    p.add_argument("--mask-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    streams: list[int] = sorted(set(args.streams))
    if min(streams) < 1 or min(args.tokens, args.mask_tokens) < 2 or args.repeats < 1:
        p.error("--streams >= 1, --tokens/--mask-tokens >= 2 and --repeats >= 1 are required")
    modes: list[str] = ["none", *dict.fromkeys(args.schemas)]

    model_dir: Path = args.model if args.model is not None else build_default_model()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.mask_worker:
        _mask_worker(str(model_dir), streams, modes, args.mask_tokens)
        return 0

    started = time.monotonic()
    loads = {"start": _load()}
    inproc = run_inproc(model_dir, streams, modes, args.mask_tokens)
    loads["after in-process"] = _load()
    print(f"[in-process: {time.monotonic() - started:.0f}s]", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gezel-bench-") as tmp:
        with gezel_server(model_dir, max(streams), Path(tmp)) as url:
            http = run_http(url, modes, streams, args.tokens, args.repeats)
    loads["after HTTP"] = _load()
    print(f"[HTTP: {time.monotonic() - t0:.0f}s]", file=sys.stderr, flush=True)

    print(f"model: {model_dir}")
    print(
        f"HTTP: {args.tokens} tokens/stream, {args.repeats} repeats; in-process: "
        f"{args.mask_tokens} tokens/sequence, 1 run; wall: {time.monotonic() - started:.0f}s"
    )
    print(
        "load average 1/5/15 min: "
        + "; ".join(f"{k} {_fmt_load(v)}" for k, v in loads.items())
        + "\n  (this run keeps about 1 core busy; much more means something else shared the CPUs)"
    )
    print("tok/s = sum(n_i - 1) / (max last_i - min first_i); spread = max first_i - min first_i")
    print()
    print("in-process BatchGenerator (per constrained step and sequence; see module docstring):")
    print(render_inproc(inproc, streams, modes))
    print()
    print(f"HTTP SSE, gezel-trio --max-concurrency {max(streams)}:")
    print(render_http(http, streams, modes))
    if any(r.short for r in inproc) or any(m.short for m in http):
        print("\nSHORT: some stream ended before max_tokens; its tokens are still counted.")
    if any(m.bad for m in http):
        print("BAD: some constrained output is not a prefix of its schema's language.")
    if any(r.processor_errors for r in inproc):
        print("ERROR: a grammar processor failed:", [r.processor_errors for r in inproc])
    if args.json is not None:
        payload = {
            "model": str(model_dir),
            "prompt": PROMPT,
            "schemas": {m: SCHEMAS[m] for m in modes if m != "none"},
            "streams": streams,
            "http_tokens_per_stream": args.tokens,
            "http_repeats": args.repeats,
            "inproc_tokens_per_sequence": args.mask_tokens,
            "loadavg": loads,
            "metric": "sum(n_i - 1) / (max_i last_i - min_i first_i)",
            "http_median_tok_s": {
                m: {str(n): median_tok_s(http, m, n) for n in streams} for m in modes
            },
            "http_ratio_vs_none": {
                m: {
                    str(n): (a / b)
                    if (a := median_tok_s(http, m, n)) is not None
                    and (b := median_tok_s(http, "none", n))
                    else None
                    for n in streams
                }
                for m in modes
                if m != "none"
            },
            "inproc": [asdict(r) for r in inproc],
            "http_runs": [asdict(m) for m in http],
        }
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
