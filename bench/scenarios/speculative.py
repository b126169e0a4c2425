"""Speculative decoding (draft-free lookup) on agent-shaped work: decode
tok/s with ``--speculation lookup`` against ``--speculation off``, per
workload and stream count, with the acceptance ``/metrics`` counted.

Two ``gezel-trio serve`` processes on the same float32 weights (default:
SmolLM2-135M-Instruct, the default model: a trained model, so its outputs
repeat what it read as a real one's do), both up for the whole run, their
rounds interleaved in an order that turns each repeat. Greedy requests
(``temperature: 0``; ``--temperature`` samples, unseeded, with
``ignore_eos`` so every stream writes its budget, and a sampled sequence's
proposals are rejection-sampled), N identical streams released
together, ``max_tokens = --tokens``; the decode metric is
``bench/_sse.py``'s.

Workloads:

``code``
    a Python file in the prompt, and the model asked to write it out again
    with one name changed (the model repeats a file with small changes);
``tools``
    a tool-call loop: a tool's output (a directory listing) in the history,
    and the model asked to quote it back;
``chat``
    open chat (a poem): little recurs, so lookup rarely proposes and the
    gate must keep speculation from costing anything.

Acceptance: the lookup server's ``gezel_spec_decode_num_*`` counters over
each round: accepted / proposed tokens, and the tokens each verify gained.

The lookup server remembers what finished sequences held
(``mlx.lookup.RecentSequences``), and each round repeats its prompt: from a
workload's second round on, its streams may also propose from the previous
round's answers, as a retried request would.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2 as httpx

from bench import _servers, _sse
from bench._report import ratio
from bench._scenario import Context, Option, Result, Scenario, table
from bench._sse import Measurement, StreamTiming, aggregate

WORKLOADS = ("code", "tools", "chat")
MODES = ("lookup", "off")
_ROOT = Path(__file__).resolve().parents[2]
_FILE = _ROOT / "src" / "gezel_trio" / "mlx" / "lookup.py"


def messages(workload: str) -> list[dict[str, Any]]:
    if workload == "code":
        source = _FILE.read_text("utf-8")
        body = source[source.index("class NgramLookup") :][:1800]
        return [
            {
                "role": "user",
                "content": f"Here is a Python file:\n```python\n{body}\n```\n"
                "Write the whole file again with the method `propose` renamed to "
                "`suggest`. Output only the code.",
            }
        ]
    if workload == "tools":
        listing = "\n".join(
            f"-rw-r--r--  1 dev  staff  {1000 + 37 * i:>6}  Nov {1 + i % 28:>2} 10:{i % 60:02d}  "
            f"src/harbour/{name}.py"
            for i, name in enumerate(
                [
                    "ledger",
                    "berth",
                    "tide",
                    "manifest",
                    "crane",
                    "pilot",
                    "dock",
                    "cargo",
                    "quay",
                    "anchor",
                    "buoy",
                    "hull",
                    "keel",
                    "mast",
                    "rudder",
                    "sail",
                ]
            )
        )
        return [
            {"role": "user", "content": "List the files under src/harbour."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "shell", "arguments": '{"cmd": "ls -l src/harbour"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": listing},
            {"role": "user", "content": "Quote the listing above exactly, line by line."},
        ]
    return [{"role": "user", "content": "Write a short poem about the sea at night."}]


def body(workload: str, tokens: int, temperature: float = 0.0) -> dict[str, Any]:
    out = {
        "messages": messages(workload),
        "max_tokens": tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if temperature > 0:
        # Sampled streams would end at different lengths, each run its own:
        # every stream writes its whole budget.
        out["ignore_eos"] = True
    return out


def _counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("gezel_spec_decode_num_") and "_total " in line:
            name, value = line.split()
            out[name.removeprefix("gezel_spec_decode_num_").removesuffix("_total")] = float(value)
    return out


def run(ctx: Context) -> Result:
    a = ctx.args
    model_dir = _servers.float32_model(a.model)
    streams = sorted(set(a.streams))
    width = max(streams)
    results: list[Measurement] = []
    accept: list[dict[str, Any]] = []
    # Every stream's text, per workload, stream count and mode: greedy, so
    # one text each, the same with and without speculation.
    texts: dict[tuple[str, int, str], set[str]] = {}
    with contextlib.ExitStack() as stack:
        urls: dict[str, str] = {}
        for mode in MODES:
            with ctx.phase(f"{mode}: start, warm up"):
                flags = ["--max-concurrency", str(width), "--log-level", "WARNING"]
                srv = stack.enter_context(
                    _servers.gezel_server(
                        model_dir,
                        ctx.workdir / f"{mode}.log",
                        [*flags, "--speculation", mode],
                        label=f"gezel {mode}",
                    )
                )
                urls[mode] = srv.url
                _sse.stream_once(srv.url, body("chat", 16))
        rounds: list[tuple[str, int, str]] = [
            (w, n, m) for w in a.workloads for n in streams for m in MODES
        ]
        with ctx.phase(f"rounds, interleaved, {a.repeats} each"):
            for r in range(a.repeats):
                for w, n, mode in rounds if r % 2 == 0 else rounds[::-1]:
                    url = urls[mode]
                    before = _counters(url) if mode == "lookup" else {}
                    logs = _sse.streams_together(
                        url, body(w, a.tokens, a.temperature), n, f"{w}/{mode}"
                    )
                    m = aggregate(f"{w}/{mode}", a.tokens, [StreamTiming.of(x) for x in logs])
                    results.append(m)
                    texts.setdefault((w, n, mode), set()).update(x.text for x in logs)
                    if mode == "lookup":
                        after = _counters(url)
                        accept.append(
                            {
                                "workload": w,
                                "streams": n,
                                **{k: after[k] - before.get(k, 0.0) for k in after},
                            }
                        )

    def med(system: str, n: int) -> float | None:
        vals = [m.tok_s for m in results if m.system == system and m.streams == n]
        return statistics.median(vals) if vals else None

    def runs(system: str, n: int) -> list[float]:
        return [m.tok_s for m in results if m.system == system and m.streams == n]

    def acc(w: str, n: int, f: Callable[[dict[str, Any]], float]) -> float | None:
        rows = [x for x in accept if x["workload"] == w and x["streams"] == n]
        vals = [f(x) for x in rows]
        return statistics.median(vals) if vals else None

    rows = []
    for w in a.workloads:
        for n in streams:
            on, off = med(f"{w}/lookup", n), med(f"{w}/off", n)
            pairs = zip(runs(f"{w}/lookup", n), runs(f"{w}/off", n), strict=False)
            rows.append(
                (
                    w,
                    n,
                    off,
                    on,
                    ratio(on, off),
                    " ".join(f"{x / y:.2f}" for x, y in pairs),
                    "sampled"
                    if a.temperature > 0
                    else "yes"
                    if texts.get((w, n, "lookup")) == texts.get((w, n, "off"))
                    else "NO",
                    acc(
                        w,
                        n,
                        lambda x: (
                            x["accepted_tokens"] / x["draft_tokens"] if x["draft_tokens"] else 0.0
                        ),
                    ),
                    acc(w, n, lambda x: x["draft_tokens"]),
                    acc(w, n, lambda x: x["accepted_tokens"]),
                )
            )
    return Result(
        data={
            "model": str(model_dir),
            "tokens_per_stream": a.tokens,
            "temperature": a.temperature,
            "streams": streams,
            "runs": results,
            "acceptance": accept,
            "texts": {f"{w}/{n}/{m}": sorted(v) for (w, n, m), v in texts.items()},
        },
        tables=[
            table(
                "Decode tok/s, lookup speculation against none",
                "workload | streams:d | off tok/s:.1f | lookup tok/s:.1f | lookup / off:.3f"
                " | each repeat | same text | accepted / proposed:.2f | proposed tokens:.0f"
                " | accepted tokens:.0f",
                rows,
                "medians over the repeats (each repeat: that repeat's lookup / off, the"
                " machine's noise); same text: every stream of every repeat wrote one and"
                " the same text with and without speculation; proposed and accepted: the"
                " lookup server's gezel_spec_decode_num_* counters over one round (all"
                " streams)",
            )
        ],
        title=(
            f"model {model_dir.name}, {a.tokens} tokens per stream, temperature"
            f" {a.temperature:g}, median of {a.repeats}"
        ),
    )


SCENARIO = Scenario(
    name="speculative",
    doc=__doc__ or "",
    run=run,
    options=(
        Option("streams", [1, 2, 4], "concurrent streams", int, "+", quick=[1]),
        Option("tokens", 96, "max_tokens per stream", int, quick=32),
        Option("repeats", 2, "rounds per workload, stream count and mode", int, quick=1),
        Option(
            "workloads", list(WORKLOADS), "workloads", str, "+", choices=WORKLOADS, quick=["code"]
        ),
        Option("model", None, "a model directory (default: the default model)", Path),
        Option("temperature", 0.0, "sampling temperature (0: greedy)", float),
    ),
)
