"""``nn.Linear`` as ``W @ xᵀ`` for a few rows, while a step's graph is built.

``nn.Linear`` computes ``x @ Wᵀ``: for OpenBLAS, a product of a few rows
against the weights' columns, which its kernels tile poorly. ``W @ xᵀ`` is
the same product the other way round, the weights' rows against a few
columns. The results are the same to the bit (every linear shape of the
demo models and SmolLM2, 1 to 16 rows, with and without a bias;
``tests/mlx/test_compiled_step.py``). On the dense bench model a compiled
decode step took 7% less at 4 sequences and 4% less at 8, one sequence's
none; a speculative verify's layers 6-7% less at 4 sequences x 4 tokens,
2-5% at 2 x 5, nothing for one sequence's (docs/performance.md). A large
head was slower that way (SmolLM2's tied head, 49,152 x 576: 8-10%), so a
caller may name the linears it applies to.

``linears_rows_last`` swaps ``nn.Linear.__call__`` only while a graph is
built (the compiled step's trace of a layer, or a verify's eager call) and
puts it back when the block ends, whatever happens in it. It runs on the
host thread, the one thread that calls MLX, so no other call sees it (one
that did would get the same values).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn

__all__ = ["computed_rows_last", "linears_rows_last"]


def computed_rows_last(self: nn.Linear, x: mx.array) -> mx.array:
    """``nn.Linear``'s product as ``W @ xᵀ``, transposed back: the same
    values to the bit, faster for a few rows (the module docstring). The
    bias starts the sum as ``addmm`` starts it in ``nn.Linear``."""
    w = self["weight"]
    columns = x.reshape(-1, x.shape[-1]).T
    y = mx.addmm(self["bias"][:, None], w, columns) if "bias" in self else w @ columns
    return y.T.reshape(*x.shape[:-1], w.shape[0])


@contextlib.contextmanager
def linears_rows_last(rows: int, only: frozenset[int] | None = None) -> Iterator[None]:
    """While a layer of ``rows`` rows is traced (or a model's graph of that
    many rows is built), ``nn.Linear`` computes as ``computed_rows_last``
    when there are two or more; with ``only``, just the linears whose ``id``
    it holds (a model's layers, not its head), each result made contiguous:
    in a call of 9 tokens a sequence or more, the attention read the
    transposed result in another order (logits 1e-6 off the model's).
    ``nn.Linear.__call__`` is its own again when the block ends."""
    if rows < 2:
        yield
        return
    linear = nn.Linear.__call__
    chosen = only or frozenset()

    def some_rows_last(self: nn.Linear, x: mx.array) -> mx.array:
        if id(self) in chosen:
            return mx.contiguous(computed_rows_last(self, x))
        own: mx.array = linear(self, x)
        return own

    nn.Linear.__call__ = computed_rows_last if only is None else some_rows_last
    try:
        yield
    finally:
        nn.Linear.__call__ = linear
