"""Speculative decoding on agent-shaped work: decode tok/s with draft-free
lookup (``--speculation lookup``), with lookup and a draft model
(``--draft-model``), and against ``--speculation off``; and
``mlx_lm.server`` with and without its ``--draft-model``, per workload and
stream count, with the acceptance ``/metrics`` counted.

One server per system on the same float32 weights (default:
SmolLM2-135M-Instruct, the default model: a trained model, so its outputs
repeat what it read as a real one's do), all up for the whole run, their
rounds interleaved in an order that turns each repeat. Each system is
measured against its baseline (``BASELINE``: gezel-trio's against
``off``, ``mlx_lm.server``'s draft against ``mlx_lm.server``). Greedy
requests (``temperature: 0``; ``--temperature`` samples, unseeded, with
``ignore_eos`` so every stream writes its budget, and a sampled sequence's
proposals are rejection-sampled), N identical streams released together,
``max_tokens = --tokens``; the decode metric is ``bench/_sse.py``'s.

``--draft DIR`` is the draft model (float32 as the target; ``self``: the
target as its own draft, an upper bound on what a draft can give, since
every proposal is the target's own choice and costs a target's pass).
``mlx_lm.server`` with a draft model serves one sequence at a time.

Workloads:

``code``
    a Python file in the prompt, and the model asked to write it out again
    with one name changed (the model repeats a file with small changes);
``tools``
    a tool-call loop: a tool's output (a directory listing) in the history,
    and the model asked to quote it back;
``chat``
    open chat (a poem): little recurs, so lookup rarely proposes and the
    gate must keep speculation from costing anything;
``random``
    random letters in the prompt, and the model asked for a new list of the
    kind: where no proposer can help, speculation must cost nothing.

Acceptance: each gezel-trio server's ``gezel_spec_decode_num_*`` counters
over each round: accepted / proposed tokens, and of them the draft
model's.

Every stream of a run has its own prompt: the workload's, its last message
ending with a tag (the repeat, the stream count and the stream's index), the same tags for
every system, so each text is compared with its baseline's. The prompt
cache serves what the tags share; the lookup may still propose from what
earlier rounds' answers held (``mlx.speculation.lookup.RecentSequences``), as in an
agent's later turns, but never a repeated prompt's whole answer.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2 as httpx

from bench import _servers, _sse
from bench._report import ratio
from bench._scenario import Context, Option, Result, Scenario, table
from bench._sse import Measurement, StreamTiming, aggregate

WORKLOADS = ("code", "tools", "chat", "random")
SYSTEMS = ("lookup", "draft", "off", "mlx_lm.server", "mlx_lm.server-draft")
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
    if workload == "random":
        rng = random.Random(11)
        words = " ".join(
            "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
            for _ in range(60)
        )
        return [
            {
                "role": "user",
                "content": f"Here are some random letters: {words}\nInvent a new word "
                "list of the same kind, different from this one.",
            }
        ]
    return [{"role": "user", "content": "Write a short poem about the sea at night."}]


def body(workload: str, tokens: int, temperature: float = 0.0, tag: str = "") -> dict[str, Any]:
    """A request of ``workload``; ``tag`` ends its last message, so that
    no two streams of a run send one prompt (see ``_streams``)."""
    msgs = messages(workload)
    if tag:
        msgs[-1] = {**msgs[-1], "content": f"{msgs[-1]['content']}\n(request {tag})"}
    out = {
        "messages": msgs,
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


# What each system is measured against: the same server without speculation.
BASELINE = {
    "lookup": "off",
    "draft": "off",
    "mlx_lm.server-draft": "mlx_lm.server",
    "mlx_lm.server": "off",
}


def _draft_dir(draft: str | None, model_dir: Path) -> Path | None:
    if draft is None:
        return None
    if draft == "self":
        return model_dir  # an upper bound: every proposal is the target's own choice
    return _servers.float32_model(Path(draft))


def _start(
    stack: contextlib.ExitStack,
    ctx: Context,
    system: str,
    model_dir: Path,
    draft: Path | None,
    width: int,
    num_draft: int,
) -> str:
    if system.startswith("mlx_lm.server"):
        flags = _servers.mlx_decode_flags(width)
        if system == "mlx_lm.server-draft":
            flags += ["--draft-model", str(draft), "--num-draft-tokens", str(num_draft)]
        srv = stack.enter_context(
            _servers.mlx_server(model_dir, ctx.workdir / f"{system}.log", flags)
        )
        return srv.url
    flags = ["--max-concurrency", str(width), "--log-level", "WARNING"]
    flags += ["--speculation", "off" if system == "off" else "lookup"]
    flags += ["--num-draft-tokens", str(num_draft)]
    if system == "draft":
        flags += ["--draft-model", str(draft)]
    srv = stack.enter_context(
        _servers.gezel_server(model_dir, ctx.workdir / f"{system}.log", flags, label=system)
    )
    return srv.url


def run(ctx: Context) -> Result:
    a = ctx.args
    model_dir = _servers.float32_model(a.model)
    draft = _draft_dir(a.draft, model_dir)
    systems = list(dict.fromkeys(a.systems))
    if draft is None:
        systems = [s for s in systems if s not in ("draft", "mlx_lm.server-draft")]
    for s in list(systems):
        if BASELINE.get(s) not in (None, *systems):
            systems.append(BASELINE[s])
    streams = sorted(set(a.streams))
    width = max(streams)
    results: list[Measurement] = []
    accept: list[dict[str, Any]] = []
    # Every stream's text, per workload, stream count and system: greedy,
    # so one text each, the same with and without speculation.
    texts: dict[tuple[str, int, str], set[str]] = {}
    with contextlib.ExitStack() as stack:
        urls: dict[str, str] = {}
        for system in systems:
            with ctx.phase(f"{system}: start, warm up"):
                urls[system] = _start(stack, ctx, system, model_dir, draft, width, a.num_draft)
                _sse.stream_once(urls[system], body("chat", 16))
        rounds: list[tuple[str, int, str]] = [
            (w, n, s) for w in a.workloads for n in streams for s in systems
        ]
        with ctx.phase(f"rounds, interleaved, {a.repeats} each"):
            for r in range(a.repeats):
                for w, n, system in rounds if r % 2 == 0 else rounds[::-1]:
                    url = urls[system]
                    counted = system in ("lookup", "draft")
                    before = _counters(url) if counted else {}
                    bodies = [body(w, a.tokens, a.temperature, f"{r}.{n}.{i}") for i in range(n)]
                    # Each stream of a run has its own prompt (its tag):
                    # mlx_lm.server --draft-model answered a prompt it had
                    # cached but its last token with one empty token, and a
                    # repeated prompt would let the lookup copy the previous
                    # round's answer, which a new turn does not offer.
                    logs = _sse.streams_of(url, bodies, f"{w}/{system}")
                    m = aggregate(f"{w}/{system}", a.tokens, [StreamTiming.of(x) for x in logs])
                    results.append(m)
                    texts.setdefault((w, n, system), set()).update(x.text for x in logs)
                    if counted:
                        after = _counters(url)
                        accept.append(
                            {
                                "workload": w,
                                "streams": n,
                                "system": system,
                                **{k: after[k] - before.get(k, 0.0) for k in after},
                            }
                        )

    def med(system: str, n: int) -> float | None:
        vals = [m.tok_s for m in results if m.system == system and m.streams == n]
        return statistics.median(vals) if vals else None

    def runs(system: str, n: int) -> list[float]:
        return [m.tok_s for m in results if m.system == system and m.streams == n]

    def acc(w: str, n: int, s: str, f: Callable[[dict[str, Any]], float]) -> float | None:
        rows = [x for x in accept if x["workload"] == w and x["streams"] == n and x["system"] == s]
        vals = [f(x) for x in rows]
        return statistics.median(vals) if vals else None

    def share(num: str, den: str) -> Callable[[dict[str, Any]], float]:
        return lambda x: x.get(num, 0.0) / x[den] if x.get(den) else 0.0

    rows = []
    for w in a.workloads:
        for n in streams:
            for system in systems:
                base = BASELINE.get(system)
                if base is None:
                    continue
                on, off = med(f"{w}/{system}", n), med(f"{w}/{base}", n)
                pairs = zip(runs(f"{w}/{system}", n), runs(f"{w}/{base}", n), strict=False)
                same = texts.get((w, n, system)) == texts.get((w, n, base))
                rows.append(
                    (
                        w,
                        n,
                        system,
                        base,
                        off,
                        on,
                        ratio(on, off),
                        " ".join(f"{x / y:.2f}" for x, y in pairs),
                        "sampled" if a.temperature > 0 else "yes" if same else "NO",
                        acc(w, n, system, share("accepted_tokens", "draft_tokens")),
                        acc(w, n, system, lambda x: x.get("draft_tokens", 0.0)),
                        acc(
                            w,
                            n,
                            system,
                            share("draft_model_accepted_tokens", "draft_model_tokens"),
                        ),
                        acc(w, n, system, lambda x: x.get("draft_model_tokens", 0.0)),
                    )
                )
    return Result(
        data={
            "model": str(model_dir),
            "draft": str(draft) if draft else None,
            "tokens_per_stream": a.tokens,
            "temperature": a.temperature,
            "streams": streams,
            "systems": systems,
            "runs": results,
            "acceptance": accept,
            "texts": {f"{w}/{n}/{m}": sorted(v) for (w, n, m), v in texts.items()},
        },
        tables=[
            table(
                "Decode tok/s, speculation against none",
                "workload | streams:d | system | against | its tok/s:.1f | tok/s:.1f"
                " | ratio:.3f | each repeat | same text | accepted / proposed:.2f"
                " | proposed:.0f | draft model accepted / proposed:.2f"
                " | draft model proposed:.0f",
                rows,
                "medians over the repeats (each repeat: that repeat's ratio, the machine's"
                " noise); lookup: --speculation lookup; draft: lookup and --draft-model;"
                " off: --speculation off; mlx_lm.server and mlx_lm.server-draft: without"
                " and with --draft-model (one sequence at a time); same text: every stream"
                " of every repeat wrote one and the same text as the system it is measured"
                " against; proposed and accepted: the gezel_spec_decode_num_* counters over"
                " one round (all streams)",
            )
        ],
        title=(
            f"model {model_dir.name}, draft {draft.name if draft else 'none'}, {a.tokens}"
            f" tokens per stream, temperature {a.temperature:g}, median of {a.repeats}"
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
        Option(
            "systems",
            ["lookup", "off"],
            "systems (each measured against its baseline, started with it)",
            str,
            "+",
            choices=SYSTEMS,
        ),
        Option(
            "draft",
            None,
            "the draft model's directory for draft and mlx_lm.server-draft, or 'self' (the target"
            " as its own draft: an upper bound)",
        ),
        Option("num_draft", 3, "--num-draft-tokens of every system", int),
    ),
)
