"""Platform tuning: what the server does beyond the plain MLX path on a Linux CPU.

On Apple silicon the plain path runs: MLX computes on Metal and
Accelerate, and none of what follows applies (each piece checks its
platform and does nothing elsewhere). On a Linux CPU these extras apply,
each measured on 2 cores (docs/performance.md has the runs):

- ``blas``: MLX's CPU wheel links Netlib's reference BLAS; OpenBLAS is
  preloaded before MLX loads, so its matmuls bind there (a 1024x1024
  float32 matmul: 5 GFLOP/s against 140).
- ``step_threads`` (``--decode-threads``): a decode step of few sequences
  runs on one OpenBLAS thread where the load-time measurement says one is
  at most 15% slower alone (one stream through HTTP: 117-137 tokens/s
  against 101 on two threads).
- ``priority`` (``--compute-priority``, ``--compute-nice``): the compute
  threads at ``SCHED_BATCH`` and nice 5, so the Trio thread is not kept
  waiting behind them (``/health`` p99 during a long prefill: 5.2-6.1 ms at
  nice 0, 2.8-5.2 at nice 5).
- ``sched``: the Trio thread asks for a 0.1 ms EEVDF slice (Linux 6.12+;
  ``/health`` p99 5.2-5.9 ms against 6.5-7.0).
- ``gil`` (``--prefill-switch-ms``): the GIL's switch interval at 0.5 ms
  while a prompt prefills (``/health`` p99 4.3-5.4 ms against 11.3-11.7
  on the hybrid model).
- ``gated_delta`` (``--gated-delta-prefill``): Qwen 3.5's linear-attention
  prefill in chunks of 32 tokens, in place of mlx-lm's token loop, only
  while the backend's step runs (a 512-token chunk: 7.5 ms against 64).
- ``rows_last``: ``nn.Linear`` as ``W @ xᵀ`` while a compiled step of a
  few sequences or a short verify is built (a step of 4 sequences 7% less).

``--platform-tuning off`` turns every one of them off, whatever their own
flags say: MLX's own BLAS, OpenBLAS's default threads, the normal CPU
policy and slice, Python's switch interval, mlx-lm's gated delta loop and
``nn.Linear``'s own product. ``applies`` says whether a config has them,
``plain`` is the config with each flag at its plain value.

This module imports no ``mlx``: ``tuning.blas`` must run before ``mlx``
loads, and the host loop and the server use ``gil`` and ``sched`` without it.
"""

from __future__ import annotations

import attrs

from ..core.config import TuningSettings

__all__ = ["applies", "plain"]


def applies(tuning: TuningSettings) -> bool:
    """Whether ``tuning`` runs the platform tuning (``--platform-tuning``)."""
    return tuning.platform_tuning != "off"


def plain(tuning: TuningSettings) -> TuningSettings:
    """``tuning`` as it runs: with the platform tuning off, each tuning
    flag at its plain value (the normal CPU policy, all threads for every
    step, mlx-lm's gated delta loop, Python's switch interval)."""
    if applies(tuning):
        return tuning
    return attrs.evolve(
        tuning,
        compute_priority="normal",
        decode_threads="all",
        gated_delta_prefill="sequential",
        prefill_switch_ms=0.0,
    )
