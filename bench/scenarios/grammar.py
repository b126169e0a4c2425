"""Cost of grammar-constrained decoding: json_schema vs free decode, and mask time per step.

One run, on the dense demo model of ``--size`` by default (``--model DIR``
for another), has two phases, one after the other, never together:

in-process (first, in a child process that exits before the server starts)
    mlx-lm's ``BatchGenerator`` driven by a tight ``next()`` loop, as the
    decode scenario's ``raw`` system does, once per mode and stream count,
    ``--mask-tokens`` tokens per sequence. Constrained sequences each get
    their own ``GrammarProcessor`` (``GrammarTokenizer`` +
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
    ``mask share`` = total mask time / total ``next()`` time. Its tok/s (the
    decode metric below) is from one run per row.
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
    no constraint, ``ignore_eos: true`` (as in the decode scenario).
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

The metric is the decode metric of ``bench/_sse.py``: per stream,
``first_i`` / ``last_i`` = arrival of its first / last generated token (HTTP:
first SSE chunk with content, the chunk with ``finish_reason``), ``n_i`` =
tokens it generated (HTTP: ``usage.completion_tokens``); tok/s =
``sum_i(n_i - 1) / (max_i last_i - min_i first_i)``; ``spread`` =
``max_i first_i - min_i first_i``.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import attrs

from bench import _servers, _sse, _worker
from bench._report import percentile, ratio
from bench._scenario import Context, Option, Plot, Result, Scenario, Series, Table, table
from bench._sse import Measurement, StreamTiming, aggregate

PROMPT: Final = "List some Greek letters, or describe them, as a JSON object."
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


# --- in-process phase (in a child process, bench._worker) ----------------------


@attrs.define
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
    mask_ms: dict[str, float] = attrs.Factory(dict)  # median, p99, max
    mask_total_s: float = 0.0
    sync_total_s: float = 0.0
    call_total_s: float = 0.0
    processor_errors: list[str] = attrs.Factory(list)

    @property
    def short(self) -> bool:
        return any(n != self.tokens_per_stream for n in self.per_stream_tokens)

    def per_step_ms(self, total_s: float) -> float | None:
        return total_s * 1e3 / self.proc_steps if self.proc_steps else None


def _stats_ms(seconds: Sequence[float]) -> dict[str, float]:
    if not seconds:
        return {}
    return {
        "median": statistics.median(seconds) * 1e3,
        "p99": percentile(seconds, 99) * 1e3,
        "max": max(seconds) * 1e3,
    }


def mask_worker(
    model_dir: str, streams: list[int], modes: list[str], max_tokens: int
) -> Iterator[dict[str, Any]]:
    """One generation per (stream count, mode)."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import load

    from gezel_trio.mlx.constraints import GrammarProcessor, GrammarTokenizer
    from gezel_trio.mlx.constraints import make_grammar_processor as make_processor
    from gezel_trio.shaping.grammar import build_constraint

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
            proc_steps=max((len(t.call) for t in timed), default=0),
            mask_ms=_stats_ms(masks),
            mask_total_s=sum(masks),
            sync_total_s=sum(s for t in timed for s in t.sync),
            call_total_s=sum(s for t in timed for s in t.call),
            processor_errors=[t.inner.error for t in timed if t.inner.error is not None],
        )

    for mode in modes:  # warm-up: kernels, llguidance
        one_round(mode, 1, 16)
    for n in streams:
        for mode in modes:
            yield attrs.asdict(one_round(mode, n, max_tokens))


# --- HTTP phase ----------------------------------------------------------------


@attrs.define
class HttpRun(Measurement):
    repeat: int = 0
    finish_reasons: list[str] = attrs.Factory(list)
    content_ok: list[bool] = attrs.Factory(list)

    @property
    def bad(self) -> bool:
        return not all(self.content_ok)


def request_body(mode: str, max_tokens: int) -> dict[str, Any]:
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


def http_round(url: str, mode: str, n: int, max_tokens: int, repeat: int) -> HttpRun:
    logs = _sse.streams_together(url, request_body(mode, max_tokens), n, mode)
    m = aggregate(mode, max_tokens, [StreamTiming.of(log) for log in logs])
    return HttpRun(
        **attrs.asdict(m),
        repeat=repeat,
        finish_reasons=[log.finish_reason or "" for log in logs],
        content_ok=[content_ok(mode, log.text) for log in logs],
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


def median_tok_s(runs: Sequence[HttpRun], mode: str, n: int) -> float | None:
    vals = [m.tok_s for m in runs if m.system == mode and m.streams == n]
    return statistics.median(vals) if vals else None


# --- the run ---------------------------------------------------------------------


def run(ctx: Context) -> Result:
    a = ctx.args
    streams: list[int] = sorted(set(a.streams))
    if min(streams) < 1 or min(a.tokens, a.mask_tokens) < 2 or a.repeats < 1:
        raise ValueError("--streams >= 1, --tokens/--mask-tokens >= 2, --repeats >= 1 required")
    modes: list[str] = ["none", *dict.fromkeys(a.schemas)]
    model_dir: Path = a.model if a.model is not None else ctx.demo_model("dense")
    with ctx.phase("in-process"):
        rows = _worker.run(
            f"{__name__}:mask_worker",
            model_dir=str(model_dir),
            streams=streams,
            modes=modes,
            max_tokens=a.mask_tokens,
        )
        inproc = [InprocRun(**r) for r in rows]
    with ctx.phase("HTTP"):
        flags = ["--max-concurrency", str(max(streams)), "--log-level", "WARNING"]
        with _servers.gezel_server(model_dir, ctx.workdir / "gezel.log", flags) as srv:
            http = run_http(srv.url, modes, streams, a.tokens, a.repeats)
    notes = []
    if any(r.short for r in inproc) or any(m.short for m in http):
        notes.append("SHORT: some stream ended before max_tokens; its tokens are still counted.")
    if any(m.bad for m in http):
        notes.append("BAD: some constrained output is not a prefix of its schema's language.")
    if any(r.processor_errors for r in inproc):
        notes.append(f"ERROR: a grammar processor failed: {[r.processor_errors for r in inproc]}")
    data = {
        "model": str(model_dir),
        "prompt": PROMPT,
        "schemas": {m: SCHEMAS[m] for m in modes if m != "none"},
        "streams": streams,
        "http_tokens_per_stream": a.tokens,
        "http_repeats": a.repeats,
        "inproc_tokens_per_sequence": a.mask_tokens,
        "metric": "sum(n_i - 1) / (max_i last_i - min_i first_i)",
        "http_median_tok_s": {
            m: {str(n): median_tok_s(http, m, n) for n in streams} for m in modes
        },
        "http_ratio_vs_none": {
            m: {
                str(n): ratio(median_tok_s(http, m, n), median_tok_s(http, "none", n))
                for n in streams
            }
            for m in modes
            if m != "none"
        },
        "inproc": inproc,
        "http_runs": http,
    }
    return Result(
        data=data,
        tables=[_inproc_table(inproc, streams, modes), _http_table(http, streams, modes, a)],
        plots=_plots(inproc, http, streams, modes),
        notes=notes,
        title=(
            f"model {model_dir.name}; HTTP {a.tokens} tokens/stream, median of {a.repeats}; "
            f"in-process {a.mask_tokens} tokens/sequence, 1 run"
        ),
    )


def _inproc_table(runs: Sequence[InprocRun], streams: list[int], modes: list[str]) -> Table:
    rows = []
    for n in streams:
        base = next((r.tok_s for r in runs if r.mode == "none" and r.streams == n), None)
        for mode in modes:
            r = next((x for x in runs if x.mode == mode and x.streams == n), None)
            if r is None:
                continue
            mk = r.mask_ms
            mask = f"{mk['median']:.3f}/{mk['p99']:.3f}/{mk['max']:.2f}" if mk else None
            share = 100 * r.mask_total_s / r.step_total_s if r.mask_ms else None
            flags = ("SHORT " if r.short else "") + ("ERROR" if r.processor_errors else "")
            rows.append(
                (
                    mode, n, r.tok_s, ratio(r.tok_s, base), r.step_ms, mask, r.mask_n,
                    r.per_step_ms(r.mask_total_s), r.per_step_ms(r.sync_total_s),
                    r.per_step_ms(r.call_total_s), share, flags.strip(),
                )
            )  # fmt: skip
    setup = (
        f"{r.mode}: build_constraint {r.compile_ms:.2f} ms, "
        f"make_grammar_processor {r.processor_ms:.2f} ms/sequence"
        for r in runs
        if r.compile_ms is not None and r.processor_ms is not None and r.streams == streams[0]
    )
    return table(
        "In-process BatchGenerator (per constrained step and sequence)",
        "mode | streams:d | tok/s:.1f | vs none:.3f | step ms:.1f | mask ms med/p99/max | masks:d"
        " | mask ms/step:.2f | sync ms/step:.2f | call ms/step:.2f | mask share %:.2f | ",
        rows,
        *setup,
    )


def _http_table(runs: Sequence[HttpRun], streams: list[int], modes: list[str], a: Any) -> Table:
    rows = []
    for n in streams:
        base = median_tok_s(runs, "none", n)
        for mode in modes:
            ms = [m for m in runs if m.system == mode and m.streams == n]
            if not ms:
                continue
            med = statistics.median(m.tok_s for m in ms)
            flags = ("SHORT " if any(m.short for m in ms) else "") + (
                "BAD" if any(m.bad for m in ms) else ""
            )
            rows.append(
                (
                    mode, n, med, " ".join(f"{m.tok_s:.1f}" for m in ms),
                    statistics.median(m.spread_s for m in ms), ratio(med, base), flags.strip(),
                )
            )  # fmt: skip
    return table(
        f"HTTP SSE, gezel-trio --max-concurrency {max(streams)}",
        "mode | streams:d | tok/s (median):.1f | runs | spread s:.2f | vs none:.3f | ",
        rows,
    )


def _plots(
    inproc: Sequence[InprocRun], http: Sequence[HttpRun], streams: list[int], modes: list[str]
) -> list[Plot]:
    def inproc_at(mode: str, n: int) -> InprocRun | None:
        return next((r for r in inproc if r.mode == mode and r.streams == n), None)

    def tok_s(r: InprocRun | None) -> float | None:
        return r.tok_s if r is not None else None

    def mask_per_step(r: InprocRun | None) -> float | None:
        return r.per_step_ms(r.mask_total_s) if r is not None else None

    return [
        Plot(
            "HTTP decode tok/s, constrained vs free",
            "concurrent streams",
            "decode tok/s (median)",
            tuple(Series(m, streams, [median_tok_s(http, m, n) for n in streams]) for m in modes),
        ),
        Plot(
            "In-process BatchGenerator tok/s",
            "concurrent streams",
            "decode tok/s",
            tuple(Series(m, streams, [tok_s(inproc_at(m, n)) for n in streams]) for m in modes),
        ),
        Plot(
            "Mask time per decode step (all sequences)",
            "concurrent streams",
            "ms per step",
            tuple(
                Series(m, streams, [mask_per_step(inproc_at(m, n)) for n in streams])
                for m in modes
                if m != "none"
            ),
        ),
    ]


SCENARIO = Scenario(
    name="grammar",
    doc=__doc__ or "",
    run=run,
    options=(
        Option("streams", [1, 4], "concurrent streams to measure", int, "+", quick=[1, 2]),
        Option("tokens", 128, "HTTP max_tokens per stream", int, quick=32),
        Option("repeats", 3, "HTTP repeats per mode and stream count", int, quick=1),
        Option("mask_tokens", 256, "in-process tokens per sequence", int, quick=64),
        Option("schemas", list(SCHEMAS), "constrained modes", str, "+", tuple(SCHEMAS)),
        Option("model", None, "a model directory (default: the dense demo model)", Path),
    ),
)
