"""The gated delta rule over a prompt in chunks, on the CPU (``--gated-delta-prefill``).

Qwen 3.5's linear-attention layers (and the other families of mlx-lm that
call ``mlx_lm.models.gated_delta.gated_delta_update``) keep a state ``S``
per head and run, token by token::

    S_t = g_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T,    y_t = S_t q_t

On Apple's GPU mlx-lm runs that loop in a Metal kernel. Everywhere else it
runs ``gated_delta_ops``: a Python loop over the prompt's tokens that
builds one small compiled step per token and layer. On the hybrid bench
model (8 heads of 64, 2 cores) a 512-token chunk took 6 ms of graph
building with the GIL held and 64 ms to run, per layer; a 5,929-token
prefill spent about a third of its time there, and the Trio thread waited
for the GIL behind the building (docs/performance.md).

``chunked`` computes the same recurrence in chunks of ``CHUNK`` tokens, as
the chunked form of the delta rule does (Yang et al., "Gated Delta
Networks", 2024; flash-linear-attention's ``chunk_gated_delta_rule``).
Within a chunk, with ``G_t`` the product of the chunk's gates up to ``t``::

    u_t = b_t (v_t - G_t S_0 k_t) - sum_{j<t} b_t (G_t/G_j) (k_t.k_j) u_j
    y_t = G_t S_0 q_t + sum_{j<=t} (G_t/G_j) (q_t.k_j) u_j
    S_C = G_C S_0 + sum_j (G_C/G_j) u_j k_j^T

The sums over ``j`` are a unit lower-triangular system (solved with
``mx.linalg.tri_inv``) and small matmuls, computed for every chunk at once;
only three matmuls per chunk carry the state from one chunk to the next.
Ratios of gates are taken as differences of cumulative log-gates, masked
before they are exponentiated, so nothing divides and nothing overflows (a
gate of 0 counts as the smallest normal float).
A padded position (a batch's left padding, ``mask`` false) gets the gate 1
and the weight 0: it leaves the state as it was, as ``gated_delta_ops``
does (its output is padding's, read by nobody).

Measured on the hybrid bench model's shapes (2 cores, OpenBLAS): a 512-token
chunk in 0.4 ms of building and 7.5 ms of running, against 6 and 64.
The results differ from the token loop's in float rounding only (1e-7 of
outputs about 0.15 in the tests), but they do differ, and they depend on
where the prompt's chunks begin: ``--gated-delta-prefill sequential`` keeps
mlx-lm's loop, to compare with mlx-lm to the bit.

Calls shorter than ``MIN_TOKENS`` (a decode step, a speculative verify of a
few tokens), calls with a gate per key dimension (``g`` of 4 dimensions),
and calls while the default device is a GPU go to mlx-lm's own function.
``routed`` makes the function that decides; the backend has mlx-lm call it
in place of ``gated_delta_ops`` only while its step runs
(``mlx.mlx_lm_surface.gated_delta_kernel_as``), and mlx-lm's own is back
after each step, so two backends in one process each run their own mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import mlx.core as mx

from ..core.config import GATED_DELTA_PREFILLS

__all__ = ["CHUNK", "MIN_TOKENS", "Routed", "chunked", "routed"]

# Tokens per chunk: 32 ran a 512-token prompt in 7.5 ms, 64 in 10.9 (the
# hybrid bench model's shapes); a shorter call is one chunk.
CHUNK: Final = 32
# Below this many tokens the token loop is mlx-lm's (at 4 tokens it took
# 0.47 ms against 0.34 chunked, at 16 1.8 against 0.4): a speculative
# verify of a few tokens stays as the decode steps around it compute.
MIN_TOKENS: Final = 16

_TINY: Final = 1.1754944e-38  # the smallest normal float32


def chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """``gated_delta_ops``'s contract, computed in chunks.

    q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g, beta: [B, T, Hv];
    state: [B, Hv, Dv, Dk]; mask: [B, T] (true where a token is real).
    Returns y: [B, T, Hv, Dv] (q's dtype) and the state after T (float32).
    """
    if g.ndim != 3:
        raise ValueError(f"chunked takes a gate per head ([B, T, Hv]), not {g.shape}")
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    f32 = mx.float32
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=f32)
    if (repeat := Hv // Hk) > 1:
        q = mx.repeat(q, repeat, -2)
        k = mx.repeat(k, repeat, -2)
    # A gate of 0 (or one that underflowed) counts as the smallest normal
    # float's: its log is finite, and what it multiplies is gone either way.
    log_g = mx.log(mx.maximum(g.astype(f32), _TINY))
    b = beta.astype(f32)
    if mask is not None:
        log_g = mx.where(mask[..., None], log_g, 0.0)
        b = mx.where(mask[..., None], b, 0.0)
    C = min(CHUNK, T)
    N = -(-T // C)
    pad = N * C - T

    def per_chunk(x: mx.array) -> mx.array:  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = x.astype(f32)
        if pad:
            x = mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, N, C, Hv, *x.shape[3:])
        return mx.moveaxis(x, 3, 1)

    qc, kc, vc, lc, bc = (per_chunk(x) for x in (q, k, v, log_g, b))
    L = mx.cumsum(lc, axis=-1)  # log G_t within each chunk: [B, H, N, C]
    lower = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    strict = mx.tril(mx.ones((C, C), dtype=mx.bool_), -1)
    # G_t / G_j for j <= t; the masked differences are not exponentiated.
    ratio = mx.where(lower, mx.exp(mx.where(lower, L[..., :, None] - L[..., None, :], 0.0)), 0.0)
    kt = kc.swapaxes(-1, -2)
    system = mx.where(strict, bc[..., :, None] * ratio * (kc @ kt), 0.0)
    inverse = mx.linalg.tri_inv(system + mx.eye(C, dtype=f32), upper=False, stream=mx.cpu)
    gate = mx.exp(L)
    u_of_v = inverse @ (bc[..., None] * vc)  # u = u_of_v - u_of_s @ S_0^T
    u_of_s = inverse @ ((bc * gate)[..., None] * kc)
    scores = ratio * (qc @ kt)
    gated_q = gate[..., None] * qc
    carry_k = mx.exp(L[..., -1:] - L)[..., None] * kc
    carry_s = gate[..., -1][..., None, None]
    ys = []
    s = state.astype(f32)
    for n in range(N):
        st = s.swapaxes(-1, -2)
        u = u_of_v[:, :, n] - u_of_s[:, :, n] @ st
        ys.append(gated_q[:, :, n] @ st + scores[:, :, n] @ u)
        s = carry_s[:, :, n] * s + u.swapaxes(-1, -2) @ carry_k[:, :, n]
    y = mx.stack(ys, axis=2).reshape(B, Hv, N * C, Dv)[:, :, :T]
    return mx.moveaxis(y, 1, 2).astype(q.dtype), s


class Routed:
    """What mlx-lm calls in place of ``gated_delta_ops`` while a backend's
    step runs: ``chunked`` for a prompt on the CPU, mlx-lm's own function
    (``sequential``) for everything else (the module docstring)."""

    def __init__(self, sequential: Callable[..., Any]) -> None:
        self.sequential = sequential

    def __call__(
        self,
        q: mx.array,
        k: mx.array,
        v: mx.array,
        g: mx.array,
        beta: mx.array,
        state: mx.array | None = None,
        mask: mx.array | None = None,
    ) -> tuple[mx.array, mx.array]:
        if q.shape[1] >= MIN_TOKENS and g.ndim == 3 and mx.default_device() == mx.cpu:
            return chunked(q, k, v, g, beta, state, mask)
        out: tuple[mx.array, mx.array] = self.sequential(q, k, v, g, beta, state, mask)
        return out


def routed(mode: str, sequential: Callable[..., Any]) -> Routed | None:
    """The function mlx-lm should call for ``mode`` (``--gated-delta-prefill``)
    over its own ``sequential`` one: ``None`` for ``sequential``, which is
    mlx-lm's own loop for every call."""
    if mode not in GATED_DELTA_PREFILLS:
        raise ValueError(f"unknown gated-delta prefill {mode!r}")
    return Routed(sequential) if mode == "chunked" else None
