"""What shared KV blocks cost and save: copy time against bytes.

The prompt cache keeps attention KV in 64-token blocks that entries share
(``cache_store``), so a sequence's seed is assembled from blocks
(``MlxStates.join_state``: one concatenation per layer) and a saved state is
cut into the blocks the trie lacks (``state_blocks``). A store of whole
states, as ``mlx_lm.server``'s ``LRUPromptCache`` keeps, instead copies each
state once when it is stored and once (``deepcopy``) when it seeds.

For each demo model of ``--models`` (at ``--size``) and each prompt length L
of ``--lengths`` this measures, in a child process (``bench/_worker.py``), on
the model's real cache layout (keys and values of the real shapes and dtype,
random contents):

* ``cut``: cutting a state of L tokens into blocks (all new);
* ``join``: assembling an L-token seed from those blocks (evaluated);
* ``whole``: one contiguous copy of the same state (the whole-state baseline);

and the bytes four conversations hold when they share an L-token system
prompt and add 256 tokens each: stored in blocks vs as four whole states.
Times are medians of ``--repeats`` runs, milliseconds. On the hybrid model
only one layer in four is attention KV; its linear-attention state is a
fixed-size copy per checkpoint and cannot be split.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from bench import _worker
from bench._scenario import Context, Option, Plot, Result, Scenario, Series, table

# (row key, curve name, line style) of the two panels.
_TIME_CURVES = (("cut_ms", "cut", "-"), ("join_ms", "join", "--"), ("whole_copy_ms", "whole", ":"))
_BYTE_CURVES = (
    ("four_sessions_block_bytes", "blocks", "-"),
    ("four_sessions_whole_bytes", "whole states", "--"),
)


def _median_ms(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def measure(
    kinds: list[str], size: str, lengths: list[int], repeat: int
) -> Iterator[dict[str, Any]]:
    """One row per (model, length); runs in a child process (bench._worker)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from gezel_trio.core.cache_store import BLOCK_TOKENS, CacheStore
    from gezel_trio.core.config import EngineConfig
    from gezel_trio.mlx.backend import MlxBackend
    from gezel_trio.testing.demo_models import ensure_demo_model

    def join(backend: Any, blocks: list[Any], n: int, rest: Any) -> None:
        seed = backend.states.join_state(blocks, n, rest)
        mx.eval([c.state for c in seed])

    def whole(arrays: list[Any]) -> None:
        mx.eval([mx.array(a) for a in arrays])

    for kind in kinds:
        backend = MlxBackend(EngineConfig.from_flags(model=ensure_demo_model(kind, size)))  # type: ignore[arg-type]
        layout = make_prompt_cache(backend._model)
        probe = backend._model(mx.array([[1, 2, 3, 4]]), cache=layout)
        mx.eval(probe, [c.state for c in layout])
        for n in lengths:
            state: list[Any] = []
            for c in layout:
                if type(c) is KVCache:
                    shape = (*c.keys.shape[:2], n, c.keys.shape[3])
                    vshape = (*c.values.shape[:2], n, c.values.shape[3])
                    kv = KVCache()
                    kv.keys = mx.random.normal(shape).astype(c.keys.dtype)
                    kv.values = mx.random.normal(vshape).astype(c.values.dtype)
                    kv.offset = n
                    state.append(kv)
                else:
                    state.append(c)  # linear-attention state: its size does not depend on n
            mx.eval([c.state for c in state])
            ranges = [(s, min(s + BLOCK_TOKENS, n)) for s in range(0, n, BLOCK_TOKENS)]
            rest, rest_nbytes = backend.states.state_rest(state)
            made = backend.states.state_blocks(state, ranges)
            blocks = [b for b, _ in made]
            arrays = [
                a for _, a in tree_flatten([c.state for c in state]) if isinstance(a, mx.array)
            ]
            t_blocks = _median_ms(partial(backend.states.state_blocks, state, ranges), repeat)
            t_join = _median_ms(partial(join, backend, blocks, n, rest), repeat)
            t_whole = _median_ms(partial(whole, arrays), repeat)
            per_token = sum(nb for _, nb in made) / n
            # Four conversations sharing the n-token head, 256 own tokens each.
            store = CacheStore(1 << 62, trimmable=backend.info.trimmable)
            whole_bytes = 0
            for i in range(4):
                tokens = (*range(n), *range(10_000 * (i + 1), 10_000 * (i + 1) + 256))

                def fake(rs: Any, per_token: float = per_token) -> list[tuple[Any, int]]:
                    return [(None, int((e - s) * per_token)) for s, e in rs]

                store.add(tokens, fake, rest=None, rest_nbytes=rest_nbytes)
                whole_bytes += int(len(tokens) * per_token) + rest_nbytes
            yield {
                "model": kind,
                "tokens": n,
                "blocks": len(ranges),
                "cut_ms": round(t_blocks, 3),
                "join_ms": round(t_join, 3),
                "whole_copy_ms": round(t_whole, 3),
                "kv_bytes_per_token": per_token,
                "rest_bytes": rest_nbytes,
                "four_sessions_block_bytes": store.total_bytes,
                "four_sessions_whole_bytes": whole_bytes,
            }
        backend.close()


def run(ctx: Context) -> Result:
    a = ctx.args
    with ctx.phase("measure"):
        rows = _worker.run(
            f"{__name__}:measure",
            kinds=list(a.models),
            size=ctx.size,
            lengths=sorted(set(a.lengths)),
            repeat=a.repeats,
        )
    mib = 2**20
    cells = []
    for r in rows:
        block, whole = r["four_sessions_block_bytes"], r["four_sessions_whole_bytes"]
        cells.append(
            (r["model"], r["tokens"], r["blocks"], r["cut_ms"], r["join_ms"], r["whole_copy_ms"],
             block / mib, whole / mib, 1 - block / whole)
        )  # fmt: skip
    tab = table(
        f"Blocks vs whole states (median of {a.repeats}; MiB for four conversations)",
        "model | tokens:d | blocks:d | cut ms:.2f | join ms:.2f | whole ms:.2f"
        " | 4x blocks MiB:.2f | 4x whole MiB:.2f | saved:.0%",
        cells,
    )
    series_t, series_b = [], []
    for kind in a.models:
        rs = [r for r in rows if r["model"] == kind]
        xs = [r["tokens"] for r in rs]
        for key, name, style in _TIME_CURVES:
            series_t.append(Series(f"{kind} {name}", xs, [r[key] for r in rs], style, kind))
        for key, name, style in _BYTE_CURVES:
            series_b.append(Series(f"{kind} {name}", xs, [r[key] / mib for r in rs], style, kind))
    plots = [
        Plot("Copy cost vs prompt length", "shared prompt tokens", "ms (median)", tuple(series_t)),
        Plot(
            "Four conversations sharing a prompt (+256 tokens each)",
            "shared prompt tokens",
            "MiB held",
            tuple(series_b),
        ),
    ]
    return Result({"size": ctx.size, "rows": rows}, [tab], plots, title=f"size {ctx.size}")


SCENARIO = Scenario(
    name="cache_blocks",
    doc=__doc__ or "",
    run=run,
    options=(
        Option("models", ["dense", "hybrid"], "demo model kinds", str, "+", ("dense", "hybrid")),
        Option("lengths", [1024, 4096], "shared prompt lengths", int, "+", quick=[256, 1024]),
        Option("repeats", 5, "timed runs per measurement (the median is reported)", int, quick=2),
    ),
)
