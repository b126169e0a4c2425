"""Past one process: replicas behind vllm-router (cached tokens and TTFT per
turn, session affinity against round robin against one replica), and one
model over two ``mlx.launch`` ranks against one process (decode tok/s).

``replicas``: ``--conversations`` agent conversations, each with a system
prompt of its own (``--prompt-tokens`` words) and ``--turns`` turns, every
turn re-sending the whole history with one new user message (as Codex and
Claude Code do), streamed, greedy, ``--tokens`` per answer, the session in
an ``x-session-id`` header. Three set-ups on the same model: one replica
alone; two replicas behind ``vllm-router --policy consistent_hash`` (the
header is the hash key); the same two behind ``--policy round_robin``.
Every set-up gets fresh replicas (an empty prompt cache). Per turn after
the first: the share of the prompt read from the prompt cache
(``usage.prompt_tokens_details.cached_tokens``) and the TTFT, medians over
the conversations. Conversations run one after another: this measures
where each turn lands, not throughput (2 cores serve both replicas).

``ranks``: decode tok/s at ``--streams`` streams for one process against
the same flags on two ranks on loopback (the ring backend, started as
``mlx.launch`` starts them, without its spinning relay), split by tensor
and by layers (``--group-split``), interleaved rounds, medians; the
orders' cost shows in it. Absolute speed on 2 shared cores
means little (both ranks share them); the ratio is the overhead.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx

from bench import _servers, _sse
from bench._scenario import Context, Option, Result, Scenario, table
from bench._sse import StreamTiming, aggregate

_BIN = Path(sys.executable).parent


def _words(n: int, seed: int) -> str:
    vocab = ["file", "patch", "test", "module", "error", "branch", "commit", "review", "build"]
    return " ".join(vocab[(seed * 7 + i * 3) % len(vocab)] for i in range(n))


@contextlib.contextmanager
def _router(workers: list[str], policy: str, log: Path) -> Iterator[str]:
    port = _servers.free_port()
    with log.open("w") as err:
        proc = subprocess.Popen(
            [
                str(_BIN / "vllm-router"),
                "--host", "127.0.0.1",
                "--port", str(port),
                "--worker-urls", *workers,
                "--policy", policy,
                "--prometheus-port", str(_servers.free_port()),
            ],
            stdout=err,
            stderr=err,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # the router prints no ready line on stdout
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm-router did not start:\n{_servers.tail(log)}")
            time.sleep(0.1)
        yield url
    finally:
        _servers.stop(proc, signal.SIGTERM)


def _conversations(
    ctx: Context, url: str, label: str, seed: int
) -> list[list[tuple[float, float]]]:
    """Per conversation, per turn: (cached share, TTFT s)."""
    a = ctx.args
    out = []
    for c in range(a.conversations):
        messages: list[dict[str, str]] = [
            {"role": "system", "content": f"agent {seed}-{c}: {_words(a.prompt_tokens, c)}"},
        ]
        turns = []
        with httpx.Client(
            timeout=_sse.REQUEST_TIMEOUT_S, headers={"x-session-id": f"{label}-{c}"}
        ) as client:
            for t in range(a.turns):
                messages.append({"role": "user", "content": f"step {t}: {_words(12, t)}"})
                body = {
                    "model": "m",
                    "messages": messages,
                    "max_tokens": a.tokens,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                log = _sse.stream(client, url, body)
                usage = log.usage or {}
                prompt = usage.get("prompt_tokens") or 1
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                turns.append((cached / prompt, (log.first or log.sent) - log.sent))
                messages.append({"role": "assistant", "content": "".join(log.pieces)})
        out.append(turns)
    return out


def _replicas(ctx: Context, model: Path) -> tuple[list[list[Any]], dict[str, Any]]:
    setups = [
        ("one replica", 1, None),
        ("2, affinity", 2, "consistent_hash"),
        ("2, round robin", 2, "round_robin"),
    ]
    rows, data = [], {}
    for seed, (name, count, policy) in enumerate(setups):
        with ctx.phase(name), contextlib.ExitStack() as stack:
            servers = [
                stack.enter_context(
                    _servers.gezel_server(
                        model, ctx.workdir / f"replica-{seed}-{i}.log", [], label=f"r{i}"
                    )
                )
                for i in range(count)
            ]
            url = servers[0].url
            if policy is not None:
                url = stack.enter_context(
                    _router([s.url for s in servers], policy, ctx.workdir / f"router-{seed}.log")
                )
            got = _conversations(ctx, url, f"s{seed}", seed)
        data[name] = got
        later = [turn for conv in got for turn in conv[1:]]
        rows.append(
            [
                name,
                statistics.median(share for share, _ in later),
                min(share for share, _ in later),
                statistics.median(ttft for _, ttft in later) * 1000,
                statistics.median(conv[0][1] for conv in got) * 1000,
            ]
        )
    return rows, data


@contextlib.contextmanager
def _group(model: Path, split: str, log: Path) -> Iterator[str]:
    """Two ranks on loopback, started as ``mlx.launch --backend ring``
    starts them (a hostfile, ``MLX_HOSTFILE`` and ``MLX_RANK``) but without
    the launcher, whose relay spins on a core of its own (docs/scale-out.md)."""
    base = _servers.free_port()
    hostfile = log.with_suffix(".hosts.json")
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    port = _servers.free_port()
    procs = []
    with log.open("w") as err:
        for rank in range(2):
            procs.append(
                subprocess.Popen(
                    [
                        str(_BIN / "gezel-trio"), "serve", "--model", str(model),
                        "--port", str(port), "--group-split", split,
                        "--speculation", "off", "--keep-quantized",
                    ],
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                    env={**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)},
                )
            )  # fmt: skip
    try:
        assert procs[0].stdout is not None
        url = None
        for line in procs[0].stdout:
            if "gezel-trio listening on " in line:
                url = line.split()[-1]
                break
        if url is None:
            raise RuntimeError(f"the group did not start:\n{_servers.tail(log)}")
        yield url
    finally:
        _servers.stop(procs[0], signal.SIGTERM)  # rank 0 drains and closes the group
        for proc in procs[1:]:
            _servers.stop(proc, signal.SIGKILL, timeout=5)
        for proc in procs:
            if proc.stdout is not None:
                proc.stdout.close()


def _ranks(ctx: Context, model: Path) -> tuple[list[list[Any]], dict[str, Any]]:
    a = ctx.args
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "write on and on about files"}],
        "max_tokens": a.tokens * 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    results: dict[str, dict[int, list[float]]] = {}
    with contextlib.ExitStack() as stack:
        urls = {
            "one process": stack.enter_context(
                _servers.gezel_server(model, ctx.workdir / "one.log", ["--speculation", "off"])
            ).url
        }
        for split in ("tensor", "layers"):
            urls[f"2 ranks, {split}"] = stack.enter_context(
                _group(model, split, ctx.workdir / f"group-{split}.log")
            )
        for r in range(a.repeats):
            order = list(urls.items())
            if r % 2:
                order.reverse()
            for name, url in order:
                for n in a.streams:
                    logs = _sse.streams_together(url, body, n, name)
                    m = aggregate(name, body["max_tokens"], [StreamTiming.of(x) for x in logs])
                    results.setdefault(name, {}).setdefault(n, []).append(m.tok_s)
    base = results["one process"]
    rows = []
    for name, by_n in results.items():
        for n, values in by_n.items():
            med = statistics.median(values)
            rows.append([name, n, med, med / statistics.median(base[n])])
    costs = []
    for split in ("tensor", "layers"):
        sent, arrived = _order_costs(ctx.workdir / f"group-{split}.log")
        # One stream: a step is one token.
        step_us = 1e6 / statistics.median(results[f"2 ranks, {split}"][min(a.streams)])
        costs.append([split, sent, arrived[0], arrived[1], step_us, arrived[0] / step_us])
    return rows, {"tok_s": results, "orders": costs}


_SENT = re.compile(r"group orders: rank 0 sent \d+ orders, each ([\d.]+) us \(median\)")
_ARRIVED = re.compile(r"group orders: rank \d+ received \d+ step orders, each ([\d.]+) us "
                      r"\(median\) / ([\d.]+) us \(p90\)")  # fmt: skip


def _order_costs(log: Path) -> tuple[float, tuple[float, float]]:
    """From a group's log (its ranks write it at the end): rank 0's time to
    pickle and send one order, and how long after it began a step's order
    reached rank 1 (median, p90), in microseconds (medians: the mean is
    a few long waits for the GIL after the send)."""
    text = log.read_text()
    sent, arrived = _SENT.search(text), _ARRIVED.search(text)
    if sent is None or arrived is None:
        raise RuntimeError(f"no order figures in {log}:\n{_servers.tail(log)}")
    return float(sent[1]), (float(arrived[1]), float(arrived[2]))


def run(ctx: Context) -> Result:
    a = ctx.args
    model = _servers.float32_model(a.model) if a.model else _servers.float32_model(None)
    tables, data = [], {"model": model.name}
    if "replicas" in a.parts:
        rows, got = _replicas(ctx, model)
        data["replicas"] = got
        tables.append(
            table(
                "Turns 2 and later: prompt read from the cache, and TTFT",
                "set-up | cached share (median):.3f | cached share (least):.3f | "
                "TTFT ms (median):.0f | turn 1 TTFT ms:.0f",
                rows,
                f"{a.conversations} conversations of {a.turns} turns, {a.tokens} tokens per "
                "answer, one after another; each set-up on fresh replicas",
            )
        )
    if "ranks" in a.parts:
        rows, got = _ranks(ctx, model)
        data["ranks"] = got
        tables.append(
            table(
                "Decode tok/s, one model over two mlx.launch ranks",
                "system | streams:d | tok/s:.1f | ÷ one process:.3f",
                rows,
                "both ranks and the client share 2 cores: the ratio is the cost of the split "
                "and its orders here, not what two machines would give",
            )
        )
        tables.append(
            table(
                "What a step's order costs (microseconds)",
                "split | rank 0 pickles and sends (median):.1f | reaches rank 1 (median):.1f | "
                "(p90):.1f | a one-stream step:.0f | share of the step:.3f",
                got["orders"],
                "rank 1 starts its part of a step when its order arrives (the same machine's "
                "clock on both ranks); rank 0 sends before it computes",
            )
        )
    return Result(data, tables, title=model.name)


SCENARIO = Scenario(
    name="scale_out",
    doc=__doc__ or "",
    run=run,
    options=(
        Option("model", None, "a model directory (default: the default model)", Path),
        Option(
            "parts",
            ["replicas", "ranks"],
            "what to measure",
            str,
            "+",
            choices=("replicas", "ranks"),
        ),
        Option("conversations", 8, "conversations per set-up", int, quick=3),
        Option("turns", 4, "turns per conversation", int, quick=2),
        Option("prompt_tokens", 400, "words in each conversation's system prompt", int),
        Option("tokens", 16, "tokens per answer (ranks: 4x per stream)", int, quick=8),
        Option("streams", [1, 4], "concurrent streams (ranks)", int, "+", quick=[1]),
        Option("repeats", 3, "interleaved rounds (ranks)", int, quick=1),
    ),
    in_default_run=False,
)
