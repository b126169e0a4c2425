"""What each lane's ``BatchGenerator`` is made of: the model it calls (its
decode step compiled where it can be, ``mlx.compiled_step``), OpenBLAS's
threads per step (``tuning.step_threads``), speculation and its draft model
(``mlx.speculation``), and MLX's memory limits, which a new
generator would undo (``mlx.memory``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import ArraysCache

from ..core.config import EngineConfig
from ..core.errors import ModelLoadError
from ..core.figures import BackendFigures
from ..tuning import applies, blas
from ..tuning.gated_delta import Routed, routed
from ..tuning.step_threads import StepThreads, choose, measure
from .compiled_step import CompiledDecode, compiled_blocker
from .loading import load_model
from .memory import (
    apply_buffer_cache_limit,
    apply_wired_limit,
    clear_buffer_cache,
    log_limits,
    memory_figures,
    memory_limits,
    recommended_working_set,
    weight_bytes,
)
from .mlx_lm_surface import gated_delta_kernel
from .speculation import (
    DraftModel,
    DraftPool,
    RecentBySalt,
    Roster,
    SpecStats,
    check_pair,
    install,
    speculation_blocker,
)

__all__ = ["Generators"]

log = logging.getLogger("gezel_trio.mlx")


def _load_draft(config: EngineConfig, tokenizer: Any) -> DraftModel:
    """The ``--draft-model``, loaded and adapted as the target is; one that
    cannot propose for the target is refused by name (``ModelLoadError``)."""
    assert config.speculation.draft_model is not None
    loaded = load_model(attrs.evolve(config, model=config.speculation.draft_model))
    name = loaded.path.name
    if loaded.vision is not None:
        raise ModelLoadError(f"draft model {name}: an image model cannot draft")
    check_pair(name, loaded.model, loaded.tokenizer, tokenizer)
    log.info(
        "speculation: draft model %s (%.0f MB of weights) where the lookup proposes nothing",
        name,
        weight_bytes(loaded.model) / 2**20,
    )
    return DraftModel(loaded.model, name, prefill_step=config.scheduling.prefill_step_size)


class Generators:
    """Makes the lanes' generators, all alike, and owns what they share:
    the decode model, the step threads, speculation's counts and memory."""

    def __init__(
        self,
        config: EngineConfig,
        model: Any,
        tokenizer: Any,
        layout: Sequence[Any],
        *,
        vision: bool,
        group: Any,
        stream: Any,
    ) -> None:
        self._config = config
        self._model = model
        self._vision = vision
        self._group = group
        self._stream = stream
        # The buffer cache and wired limits of the configured policy (mlx.memory).
        self._memory_limits = memory_limits(config.memory, recommended_working_set())
        self._cache_limit = apply_buffer_cache_limit(self._memory_limits)
        apply_wired_limit(self._memory_limits)
        log_limits(config.memory, self._memory_limits)
        self.spec_stats = SpecStats()
        # What finished sequences held, for every lane's lookups.
        self.recent = RecentBySalt()
        self._speculate = self._speculates(config, layout)
        # A prompt through linear-attention layers, in chunks on the CPU
        # (tuning.gated_delta), while this backend's steps run.
        self.gated_delta: Routed | None = routed(
            config.tuning.gated_delta_prefill, gated_delta_kernel()
        )
        if any(type(c) is ArraysCache for c in layout):
            log.info("gated-delta prefill: %s", config.tuning.gated_delta_prefill)
        # What BatchGenerator calls: the model, its one-token steps compiled
        # where it can be (mlx.compiled_step).
        self.decode_model = self._compiled_step(config)
        # OpenBLAS's threads per step, one where one decodes faster
        # (tuning.step_threads), measured on that model.
        self.threads = self._step_threads(config)
        # A draft model's weights and the states its finished sequences left.
        self.draft: DraftModel | None = None
        self.draft_pool = DraftPool()
        if config.speculation.draft_model is not None:
            if self._speculate:
                self.draft = _load_draft(config, tokenizer)
            else:
                log.info(
                    "draft model %s: not loaded (no speculation)", config.speculation.draft_model
                )

    def _speculates(self, config: EngineConfig, layout: Sequence[Any]) -> bool:
        """Whether the lanes speculate; says so, and why not, once."""
        if config.speculation.mode == "off" or config.speculation.num_draft_tokens == 0:
            log.info("speculation: off")
            return False
        if self._group is not None:
            # Its gate decides from each rank's own wall times, and its
            # rejection sampling draws from numpy: the ranks would part.
            log.info("speculation: off under a group of %d ranks", self._group.world_size)
            return False
        blocker = (
            "an image model's generator is not speculated yet"
            if self._vision
            else speculation_blocker(layout)
        )
        if blocker is not None:
            log.info("speculation: off for this model (%s)", blocker)
            return False
        log.info(
            "speculation: %s, up to %d tokens per step, greedy and unseeded sampled requests",
            config.speculation.mode,
            config.speculation.num_draft_tokens,
        )
        return True

    def _compiled_step(self, config: EngineConfig) -> Any:
        """The model for BatchGenerator, its decode step compiled where it
        can be; says so, and why not, once."""
        if config.loading.compiled_step == "off":
            log.info("compiled step: off")
            return self._model
        blocker = (
            "an image model's step is not compiled"
            if self._vision
            else "not under a group of ranks"
            if self._group is not None
            else compiled_blocker(self._model)
        )
        if blocker is not None:
            log.info("compiled step: off for this model (%s)", blocker)
            return self._model
        decode = CompiledDecode(self._model, rows_last=applies(config.tuning))
        with mx.stream(self._stream):
            decode.warm()
        return self._model if decode.off is not None else decode

    def _step_threads(self, config: EngineConfig) -> StepThreads | None:
        """The thread count per step, measured now; ``None``: all of them
        for every step (and says why)."""
        most = blas.thread_count()
        why = (
            "--decode-threads all"
            if config.tuning.decode_threads == "all"
            else "OpenBLAS's thread count is not this process's to change"
            if most is None
            else "one thread in all"
            if most < 2
            else "not under a group of ranks"
            if self._group is not None
            else None
        )
        if why is not None or most is None:
            log.info("decode threads: all, for every step (%s)", why)
            return None
        batches = [b for b in (1, 2, 4, 8) if b <= config.scheduling.max_concurrency]
        with mx.stream(self._stream):
            measured = measure(self.decode_model, most, blas.set_threads, batches)
        if measured.too_long_s is not None:
            log.info(
                "decode threads: all, for every step (a decode step took %.0f ms: long "
                "enough for every thread to pay)",
                1e3 * measured.too_long_s,
            )
            return None
        timings = measured.timings
        one_up_to = choose(timings)
        log.info(
            "decode threads: 1 for a decode step of up to %d sequences, %d otherwise (%s)",
            one_up_to,
            most,
            "; ".join(
                f"{b}: {1e3 * one:.1f} ms on 1, {1e3 * all_:.1f} on {most}"
                for b, one, all_ in timings
            ),
        )
        return StepThreads(most, one_up_to, blas.set_threads) if one_up_to else None

    def new_generator(self, roster: Roster) -> BatchGenerator:
        n = self._config.scheduling.max_concurrency
        gen = BatchGenerator(
            self.decode_model,
            completion_batch_size=n,
            prefill_batch_size=n,
            prefill_step_size=self._config.scheduling.prefill_step_size,
            stream=self._stream,
        )
        # BatchGenerator wires Metal's whole recommended working set; wired
        # pages never come back under pressure (the seed saw a 27B wire 96 GiB
        # for a ~45 GB working set), so the planned limit is put back.
        apply_wired_limit(self._memory_limits)
        if self._speculate:
            install(
                gen,
                self._config.speculation.num_draft_tokens,
                roster,
                self.spec_stats,
                self.recent,
                self.draft,
                self.draft_pool,
                self.threads,
            )
        return gen

    @property
    def weights(self) -> int:
        """Bytes of weights: the model's, and a draft model's."""
        held = weight_bytes(self._model)
        if self.draft is not None:
            held += weight_bytes(self.draft.model)
        return held

    def figures(self) -> BackendFigures:
        return BackendFigures(
            memory=memory_figures(self._cache_limit), speculation=self.spec_stats.figures()
        )

    def reclaim(self) -> None:
        clear_buffer_cache()

    def close(self) -> None:
        if self.threads is not None:
            self.threads.close()
