"""What shared KV blocks cost and save: copy time against bytes.

Usage::

    python bench/cache_blocks.py [--models dense hybrid] [--size bench|tiny]
                                 [--lengths 1024 4096] [--repeat 5] [--json OUT]

The prompt cache keeps attention KV in 64-token blocks that entries share
(``cache_store``), so a sequence's seed is assembled from blocks
(``MlxBackend.join_state``: one concatenation per layer) and a saved state is
cut into the blocks the trie lacks (``state_blocks``). A store of whole
states, as ``mlx_lm.server``'s ``LRUPromptCache`` keeps, instead copies each
state once when it is stored and once (``deepcopy``) when it seeds.

For each prompt length L this measures, on the model's real cache layout
(keys and values of the real shapes and dtype, random contents):

* ``blocks``: cutting a state of L tokens into blocks (all new);
* ``join``: assembling an L-token seed from those blocks (evaluated);
* ``whole``: one contiguous copy of the same state (the whole-state baseline);

and the bytes four conversations hold when they share an L-token system
prompt and add 256 tokens each: stored in blocks vs as four whole states.
Times are medians of ``--repeat`` runs, milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write_json


def _median_ms(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def _join(backend: Any, blocks: list[Any], n: int, rest: Any) -> None:
    import mlx.core as mx

    seed = backend.join_state(blocks, n, rest)
    mx.eval([c.state for c in seed])


def _whole(arrays: list[Any]) -> None:
    import mlx.core as mx

    mx.eval([mx.array(a) for a in arrays])


def measure(kind: str, size: str, lengths: list[int], repeat: int) -> dict[str, Any]:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from gezel_trio.cache_store import BLOCK_TOKENS, CacheStore
    from gezel_trio.config import EngineConfig
    from gezel_trio.demo_model import ensure_demo_model
    from gezel_trio.mlx_backend import MlxBackend

    backend = MlxBackend(EngineConfig(model=ensure_demo_model(kind, size)))  # type: ignore[arg-type]
    layout = make_prompt_cache(backend._model)
    probe = backend._model(mx.array([[1, 2, 3, 4]]), cache=layout)
    mx.eval(probe, [c.state for c in layout])
    rows = []
    for n in lengths:
        state: list[Any] = []
        for c in layout:
            if type(c) is KVCache:
                k = mx.random.normal((*c.keys.shape[:2], n, c.keys.shape[3])).astype(c.keys.dtype)
                v = mx.random.normal((*c.values.shape[:2], n, c.values.shape[3])).astype(
                    c.values.dtype
                )
                kv = KVCache()
                kv.keys, kv.values, kv.offset = k, v, n
                state.append(kv)
            else:
                state.append(c)  # linear-attention state: its size does not depend on n
        mx.eval([c.state for c in state])
        ranges = [(s, min(s + BLOCK_TOKENS, n)) for s in range(0, n, BLOCK_TOKENS)]
        rest, rest_nbytes = backend.state_rest(state)
        made = backend.state_blocks(state, ranges)
        blocks = [b for b, _ in made]
        arrays = [a for _, a in tree_flatten([c.state for c in state]) if isinstance(a, mx.array)]
        t_blocks = _median_ms(partial(backend.state_blocks, state, ranges), repeat)
        t_join = _median_ms(partial(_join, backend, blocks, n, rest), repeat)
        t_whole = _median_ms(partial(_whole, arrays), repeat)
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
        rows.append(
            {
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
        )
    backend.close()
    return {"model": kind, "size": size, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=("dense", "hybrid"), default=["dense", "hybrid"])
    p.add_argument("--size", choices=("bench", "tiny"), default="bench")
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", type=Path, default=None, metavar="OUT")
    args = p.parse_args(argv)
    results = [measure(m, args.size, args.lengths, args.repeat) for m in args.models]
    print(
        f"{'model':<8}{'tokens':>7}{'blocks':>7}{'cut ms':>9}{'join ms':>9}{'whole ms':>10}"
        f"{'4x blocks MiB':>15}{'4x whole MiB':>14}{'saved':>7}"
    )
    for r in results:
        for row in r["rows"]:
            saved = 1 - row["four_sessions_block_bytes"] / row["four_sessions_whole_bytes"]
            print(
                f"{r['model']:<8}{row['tokens']:>7}{row['blocks']:>7}{row['cut_ms']:>9.2f}"
                f"{row['join_ms']:>9.2f}{row['whole_copy_ms']:>10.2f}"
                f"{row['four_sessions_block_bytes'] / 2**20:>15.2f}"
                f"{row['four_sessions_whole_bytes'] / 2**20:>14.2f}{saved:>7.0%}"
            )
    if args.json is not None:
        write_json(args.json, {"results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
