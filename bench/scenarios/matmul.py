"""Decode-shaped matmuls on the CPU, per weight format: float32 on OpenBLAS
against MLX's quantized (8- and 4-bit) and bfloat16 kernels.

One token's product ``x @ W.T`` for the weight shapes of a model (default:
SmolLM2-135M's: the attention and MLP projections and the tied head),
evaluated in a loop with the weight resident, in a child process bound to
the servers' OpenBLAS (``bench._worker``). GB/s is the weight's bytes over
the time: on a memory-bound decode step, what a format reads per token is
what it costs only if its kernel keeps up with memory. This is the figure
behind holding weights as float32 on Linux CPUs (``gezel_trio.mlx.loading``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from bench import _worker
from bench._scenario import Context, Option, Result, Scenario, table

# SmolLM2-135M: hidden 576, MLP 1536, 3 KV heads of 64, vocabulary 49152.
SHAPES = ("1536x576", "576x576", "192x576", "576x1536", "49152x576")
FORMATS = ("float32", "q8", "q4", "bfloat16")


def measure(
    shapes: list[str], rows: int, seconds: float, group_size: int
) -> Iterator[dict[str, Any]]:
    """In the child: one dict per (shape, format)."""
    import mlx.core as mx

    def timed(f: Any) -> float:
        for _ in range(5):
            mx.eval(f())
        n, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            mx.eval(f())
            n += 1
        return elapsed / n

    for shape in shapes:
        out, inner = (int(v) for v in shape.split("x"))
        w = mx.random.normal((out, inner))
        x = mx.random.normal((rows, inner))
        mx.eval(w, x)
        for fmt in FORMATS:
            if fmt.startswith("q"):
                bits = int(fmt[1:])
                wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
                mx.eval(wq, scales, biases)
                nbytes = wq.nbytes + scales.nbytes + biases.nbytes

                def f(
                    wq: Any = wq, s: Any = scales, b: Any = biases, bits: int = bits, x: Any = x
                ) -> Any:
                    return mx.quantized_matmul(
                        x, wq, s, b, transpose=True, group_size=group_size, bits=bits
                    )
            else:
                dtype = getattr(mx, fmt)
                wd, xd = w.astype(dtype), x.astype(dtype)
                mx.eval(wd, xd)
                nbytes = wd.nbytes

                def f(wd: Any = wd, xd: Any = xd) -> Any:
                    return xd @ wd.T

            s = timed(f)
            yield {"shape": shape, "format": fmt, "ms": 1e3 * s, "gb_s": nbytes / s / 1e9}


def run(ctx: Context) -> Result:
    a = ctx.args
    with ctx.phase("matmuls"):
        got = _worker.run(
            f"{__name__}:measure",
            shapes=list(a.shapes),
            rows=a.rows,
            seconds=a.seconds,
            group_size=64,
        )
    by = {(r["shape"], r["format"]): r for r in got}
    rows = [
        (shape, *(f"{by[shape, f]['ms']:.3f} ({by[shape, f]['gb_s']:.1f})" for f in FORMATS))
        for shape in a.shapes
    ]
    return Result(
        data={"rows_per_product": a.rows, "measurements": got},
        tables=[
            table(
                f"ms per product (GB/s of weight read), {a.rows} row(s)",
                " | ".join(["weight out x in", *FORMATS]),
                rows,
                "q8 / q4: mx.quantized_matmul, group size 64; float32: OpenBLAS's sgemm",
            )
        ],
        title=f"{a.rows} row(s) per product",
    )


SCENARIO = Scenario(
    name="matmul",
    doc=__doc__ or "",
    run=run,
    options=(
        Option("shapes", list(SHAPES), "weight shapes, OUTxIN", str, "+", quick=["576x576"]),
        Option("rows", 1, "rows of x (the batch's tokens)", int),
        Option("seconds", 1.0, "seconds per measurement", float, quick=0.2),
    ),
)
