"""The MLX backend: mlx-lm's ``BatchGenerator`` behind ``backend.Backend``.

Everything here runs on the engine's host thread: the model is loaded there,
the generation stream is created there (MLX streams are thread-local), and
each ``step`` is one ``BatchGenerator.next()``.

``MlxBackend`` composes its parts, each of which owns one thing: loading
the model and reading its facts (``mlx.loading``), the cache states' layout
and codec (``mlx.states``), how a request's tokens are chosen
(``mlx.decoding``), and the generator lanes the requests run in
(``mlx.lanes``, over ``mlx.generators`` and ``mlx.vision``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, cast

import attrs
import mlx.core as mx

from ..core.backend import (
    Admission,
    BackendFigures,
    Captured,
    ConstraintCompiler,
    Detokenizer,
    ImagePreparer,
    StepOutput,
)
from ..core.config import EngineConfig
from ..core.model import GroupInfo, ModelInfo
from ..core.request import Priority
from ..shaping.prompt import ChatTemplateRenderer
from ..shaping.template_budget import TemplateBudget
from ..shaping.toolcalls import GENERIC
from ..tuning import applies, plain
from ..tuning.priority import set_compute_priority
from . import mlx_lm_surface
from .decoding import Decoding
from .lanes import Lanes
from .loading import LoadedModel, load_model, model_facts
from .states import CacheLayout, MlxStates

__all__ = ["MlxBackend"]

log = logging.getLogger("gezel_trio.mlx")


class MlxBackend:
    """``backend.Backend`` over mlx-lm. Construct it on the host thread.
    ``split`` keeps a rank's part of the loaded model and says how
    (``mlx.group.Sharding``, under ``mlx.launch``)."""

    def __init__(
        self, config: EngineConfig, *, split: Callable[[LoadedModel], GroupInfo] | None = None
    ) -> None:
        if not applies(config.tuning):
            log.info("platform tuning: off (the plain path: each tuning flag's plain value)")
        config = attrs.evolve(config, tuning=plain(config.tuning))
        said = set_compute_priority(config.tuning.compute_priority, config.tuning.compute_nice)
        log.info("compute threads: %s", said)
        loaded = load_model(config)
        model, tokenizer = loaded.model, loaded.tokenizer
        self._vision = loaded.vision
        # Under mlx.launch each rank holds its shard of the model (mlx.group).
        group_info = split(loaded) if split is not None else None
        self._group = group_info
        self._model = model
        self._tokenizer = tokenizer
        self._stream = mx.new_stream(mx.default_device())
        # The KV format (mlx.kv_quant) and which layers the prompt cache
        # cuts into blocks (mlx.states).
        layout = CacheLayout(model, config, self._vision is not None, self._stream)
        self._states = MlxStates(model, layout, self._stream)
        facts = model_facts(config, loaded)
        decoding = Decoding(
            tokenizer,
            eos_ids=facts.eos,
            vocab_size=facts.vocab_size,
            vocab_width=facts.vocab_width,
            think_ids=facts.think_ids,
        )
        # The generator lanes, and what their generators are made of
        # (mlx.generators: speculation, the compiled step, step threads).
        self._lanes = Lanes(
            config,
            model,
            tokenizer,
            layout,
            decoding,
            vision=self._vision,
            group=self._group,
            stops=facts.stops,
            stream=self._stream,
        )
        footprint, room = layout.budget(config, self._lanes.kit.weights, self._stream)
        self._info = facts.info(
            config,
            loaded,
            trimmable=layout.trimmable,
            kv_format=layout.format,
            kv=footprint,
            kv_room=room,
            group=group_info,
        )
        self._renderer = ChatTemplateRenderer(
            tokenizer,
            boundaries=not layout.trimmable,
            generic_tools=self._info.tool_format == GENERIC.name,
            drop_past_tool_calls=config.shaping.drop_past_tool_calls,
            template_budget=TemplateBudget(
                config.shaping.template_render_seconds, config.shaping.template_max_chars
            ),
        )
        self._compiler = decoding.compiler(self._info.tool_format, self._info.think_markers)

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def stream(self) -> Any:
        """The MLX stream every call of this backend runs on."""
        return self._stream

    @property
    def renderer(self) -> ChatTemplateRenderer:
        return self._renderer

    @property
    def compiler(self) -> ConstraintCompiler | None:
        return self._compiler

    @property
    def images(self) -> ImagePreparer | None:
        vision: ImagePreparer | None = self._vision
        return vision

    @property
    def states(self) -> MlxStates:
        return self._states

    def token_text(self, token: int) -> str:
        return str(self._tokenizer.decode([token]))

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(tokens)))

    def detokenizer(self, keep_leading_space: bool = False) -> Detokenizer:
        detok: Any = self._tokenizer.detokenizer  # a fresh copy
        if keep_leading_space:
            # A raw prompt's continuation (" Paris" after "... France is")
            # keeps its first space.
            mlx_lm_surface.keep_leading_space(detok)
        return cast(Detokenizer, detok)

    def insert(self, admissions: Sequence[Admission]) -> dict[int, Exception]:
        """Each admission on its own: one whose sampler, processors or seed
        state cannot be built or queued is refused alone."""
        return self._lanes.insert(admissions)

    def remove(self, rids: Sequence[int]) -> dict[int, Captured]:
        return self._lanes.remove(rids)

    def capture(self, rid: int) -> Captured | None:
        return self._lanes.capture(rid)

    def step(self, lane_name: Priority) -> StepOutput:
        return self._lanes.step(lane_name)

    def memory_in_use(self) -> int:
        return int(mx.get_active_memory())

    def figures(self) -> BackendFigures:
        return self._lanes.kit.figures()

    def reclaim(self) -> None:
        self._lanes.kit.reclaim()

    def reset(self, lane_name: Priority) -> None:
        self._lanes.reset(lane_name)

    def close(self) -> None:
        self._lanes.close()
