"""Host-thread cost against the number of prompt-cache entries: decode tok/s and p99 step.

Everything the engine's host thread does between two model steps - the
stats view it publishes, the seed lookup in memory and on disk, the save at
each end, write-behind - should cost the same with 10 entries as with
50,000, or decoding slows as the cache fills. This fills the cache to each
size of ``--entries`` with cheap synthetic entries (``--entry-tokens`` each,
token ids outside any vocabulary, so no prompt ever seeds from them; the
same number of metadata records in the disk index, unless ``--no-persist``), then
runs ``--rounds`` rounds of ``--round-streams`` fresh prompts of ``--prompt-tokens``
tokens decoding ``--tokens`` each on the real MLX backend (the tiny demo
model at ``--size tiny``), driving the host loop directly, in a child
process (``bench/_worker.py``). A host step is one turn of the loop: the
orders applied (admission, with its seed lookup), the model step, the
report with the cache view, one write-behind look.

Reported per size: decode tokens per second over the timed rounds, and the
median, p99 and worst host step in milliseconds.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import _worker
from bench._scenario import Context, Option, Plot, Result, Scenario, Series, table

# Synthetic token ids: far above any vocabulary, so a real prompt shares none.
_SYNTHETIC = 50_000_000


def _percentile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(
    model: str,
    sizes: list[int],
    entry_tokens: int,
    rounds: int,
    streams: int,
    prompt_tokens: int,
    tokens: int,
    persist: bool,
) -> Iterator[dict[str, Any]]:
    """One row per cache size; runs in a child process (bench._worker)."""
    from gezel_trio.core.config import EngineConfig
    from gezel_trio.core.events import Delta
    from gezel_trio.core.request import GenerationRequest, SamplingParams
    from gezel_trio.host.exchange import Orders
    from gezel_trio.host.loop import _make_host
    from gezel_trio.host.persist import DiskEntry
    from gezel_trio.mlx.backend import MlxBackend

    scratch = tempfile.TemporaryDirectory(prefix="gezel-host-cache-", ignore_cleanup_errors=True)
    config = EngineConfig.from_flags(
        model=Path(model),
        cache_budget_mb=1 << 20,  # every synthetic entry fits: nothing is evicted
        persist_dir=Path(scratch.name) if persist else None,
        write_behind=persist,
    )
    backend = MlxBackend(config)
    host = _make_host(backend, config, False)
    cache = host.cache
    rng = random.Random(0)
    tail = tuple(range(_SYNTHETIC + 1, _SYNTHETIC + entry_tokens))

    def fake_blocks(ranges: Any) -> list[tuple[Any, int]]:
        return [(None, 1) for _ in ranges]

    filled = 0
    rid = 0

    def one_round() -> tuple[list[float], int, float]:
        nonlocal rid
        admit = []
        for _ in range(streams):
            rid += 1
            prompt = tuple(rng.randrange(10, 250) for _ in range(prompt_tokens))
            request = GenerationRequest(
                prompt,
                max_tokens=tokens,
                ignore_eos=True,
                min_tokens=tokens,
                sampling=SamplingParams(temperature=0.0),
            )
            admit.append((rid, request))
        orders = Orders(admit=tuple(admit), lane="interactive")
        steps: list[float] = []
        generated = 0
        t_start = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            host.apply(orders)
            if not host.seqs:
                break
            report = host.step("interactive")
            host.write_behind()
            steps.append(time.perf_counter() - t0)
            generated += sum(1 for _, e in report.events if isinstance(e, Delta))
            orders = Orders(lane="interactive")
        host.report()
        return steps, generated, time.perf_counter() - t_start

    for size in sizes:
        t_fill = time.perf_counter()
        while filled < size:
            synthetic = (_SYNTHETIC + entry_tokens + filled, *tail)
            cache.store.add(synthetic, fake_blocks, dirty=False)
            if cache.disk is not None:
                key = f"anon:synthetic{filled}"
                cache.disk.index[key] = DiskEntry(key, synthetic, "anonymous", size=1)
            filled += 1
        fill_s = time.perf_counter() - t_fill
        one_round()  # warm-up: the first view at this size, MLX's kernels
        steps: list[float] = []
        generated = 0
        wall = 0.0
        for _ in range(rounds):
            s, g, w = one_round()
            steps += s
            generated += g
            wall += w
        ms = [x * 1000 for x in steps]
        yield {
            "entries": size,
            "store_entries": len(cache.store),
            "disk_entries": len(cache.disk.index) if cache.disk is not None else 0,
            "fill_s": round(fill_s, 2),
            "steps": len(ms),
            "tokens": generated,
            "decode_tps": round(generated / wall, 1) if wall else 0.0,
            "step_p50_ms": round(statistics.median(ms), 3),
            "step_p99_ms": round(_percentile(ms, 0.99), 3),
            "step_max_ms": round(max(ms), 3),
        }
    cache.close_disk(time.monotonic() + 30)  # the writer thread's last writes land
    backend.close()
    scratch.cleanup()


def run(ctx: Context) -> Result:
    a = ctx.args
    model = ctx.demo_model("dense")
    with ctx.phase("measure"):
        rows = _worker.run(
            f"{__name__}:measure",
            model=str(model),
            sizes=sorted(set(a.entries)),
            entry_tokens=a.entry_tokens,
            rounds=a.rounds,
            streams=a.round_streams,
            prompt_tokens=a.prompt_tokens,
            tokens=a.tokens,
            persist=not a.no_persist,
        )
    cells = [
        (r["entries"], r["disk_entries"], r["tokens"], r["decode_tps"], r["step_p50_ms"],
         r["step_p99_ms"], r["step_max_ms"])
        for r in rows
    ]  # fmt: skip
    tab = table(
        f"Decode against cache size ({a.round_streams} streams,"
        f" {a.tokens} tokens, {a.rounds} rounds)",
        "entries:d | disk entries:d | tokens:d | decode tok/s:.1f | step p50 ms:.2f"
        " | step p99 ms:.2f | step max ms:.2f",
        cells,
    )
    xs = [r["entries"] for r in rows]
    plots = [
        Plot(
            "Decode rate against cache entries",
            "cache entries",
            "tok/s",
            (Series("decode tok/s", xs, [r["decode_tps"] for r in rows]),),
            logx=True,
        ),
        Plot(
            "Host step time against cache entries",
            "cache entries",
            "ms",
            (
                Series("p99", xs, [r["step_p99_ms"] for r in rows]),
                Series("p50", xs, [r["step_p50_ms"] for r in rows], "--"),
            ),
            logx=True,
        ),
    ]
    return Result({"size": ctx.size, "rows": rows}, [tab], plots, title=f"size {ctx.size}")


SCENARIO = Scenario(
    name="host_cache",
    doc=__doc__ or "",
    run=run,
    options=(
        Option(
            "entries",
            [10, 1000, 10_000, 50_000],
            "cache sizes (entries) to measure at",
            int,
            "+",
            quick=[10, 1000, 10_000],
        ),
        Option("entry_tokens", 128, "tokens of each synthetic entry", int),
        Option("rounds", 3, "timed rounds of fresh prompts per size", int, quick=2),
        Option("round_streams", 4, "concurrent sequences per round", int),
        Option("prompt_tokens", 48, "tokens of each fresh prompt", int),
        Option("tokens", 32, "tokens each sequence decodes", int, quick=16),
        Option("no_persist", False, "without the disk index (no --persist-dir)", kind="flag"),
    ),
)
