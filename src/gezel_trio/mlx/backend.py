"""The MLX backend: mlx-lm's ``BatchGenerator`` behind ``backend.Backend``.

Everything here runs on the engine's host thread: the model is loaded there,
the generation stream is created there (MLX streams are thread-local), and
each ``step`` is one ``BatchGenerator.next()``.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, Literal, cast

import attrs
import mlx.core as mx
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import (
    ArraysCache,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    save_prompt_cache,
)
from mlx_lm.sample_utils import (
    make_frequency_penalty,
    make_presence_penalty,
    make_repetition_penalty,
)

from ..core.backend import (
    Admission,
    Captured,
    Detokenizer,
    MemoryFigures,
    PrefillOut,
    RankStep,
    SpecFigures,
    StepOutput,
    TokenOut,
)
from ..core.config import EngineConfig
from ..core.constraint import Constraint
from ..core.errors import InvalidRequest, ModelLoadError
from ..core.model import GroupInfo, ModelInfo
from ..core.request import GenerationRequest, Priority, SamplingParams
from ..shaping.grammar import GRAMMAR_FORMATS, ToolFormatName, build_constraint
from ..shaping.prompt import ChatTemplateRenderer
from ..shaping.reasoning import prompt_opens_thinking_tokens
from ..shaping.template_budget import TemplateBudget
from ..shaping.text import COMMON_FRAMING_MARKERS
from ..shaping.toolcalls import GENERIC, resolve_format
from . import blas
from .compiled_step import CompiledDecode, compiled_blocker
from .constraints import GrammarTokenizer, make_grammar_processor
from .draft import DraftModel, DraftPool, check_pair
from .fingerprint import DIGESTS_DIR, model_fingerprint
from .gated_delta import install as install_gated_delta
from .group import rank_group, shard
from .kv_quant import KvPlan, KvStart, QuantizedKV, kv_format
from .kv_quant import layout as kv_layout
from .kv_quant import plan as kv_plan
from .loading import LoadedModel, load_model
from .lookup import RecentBySalt
from .memory import (
    apply_buffer_cache_limit,
    apply_wired_limit,
    clear_buffer_cache,
    kv_footprint,
    kv_room,
    log_limits,
    memory_figures,
    memory_limits,
    recommended_working_set,
    weight_bytes,
)
from .model_source import resolve_model
from .priority import set_compute_priority
from .sampling import Sampling, greedy, make_sampler
from .speculative import Roster, SpecStats, install, speculation_blocker
from .step_threads import StepThreads, choose, measure
from .vision import VisionModel, VisionPrefill, fresh_cache

__all__ = ["MlxBackend", "resolve_model_dir"]

log = logging.getLogger("gezel_trio.mlx")

Sampler = Any  # Callable[[mx.array], mx.array]
LogitsProcessor = Any  # Callable[[mx.array, mx.array], mx.array]

_ALWAYS_TRIMMABLE = (KVCache, QuantizedKVCache, QuantizedKV, ConcatenateKVCache)
# Layers the prompt cache cuts into token blocks (plain and quantized KV).
_BLOCKABLE = (KVCache, QuantizedKV)
_CACHE_CLASSES: dict[str, Any] = {
    c.__name__: c
    for c in (
        KVCache,
        QuantizedKVCache,
        QuantizedKV,
        ConcatenateKVCache,
        ArraysCache,
        RotatingKVCache,
        ChunkedKVCache,
    )
}

# Added tokens that are content, not framing: later layers parse them.
# Gemma 4's string delimiter <|"|> is content too: it spells tool-call arguments.
_CONTENT_MARKERS = ("tool_call", "tool_response", "think", "TOOL_CALLS", "ARGS", '<|"|>')


def resolve_model_dir(config: EngineConfig) -> Path:
    """The local directory to load: the model directory, the converted GGUF,
    or the default model (fetched and converted on first use)."""
    return resolve_model(config.model)


def _copy_layer(layer: Any) -> Any:
    """An independent copy of one cache layer (extracted layers may be views
    of the batch's arrays)."""
    out = copy.copy(layer)
    out.state = tree_map(lambda a: mx.array(a) if isinstance(a, mx.array) else a, layer.state)
    return out


def _joined(parts: list[Any], length: int) -> Any:
    """Blocks of one layer's keys (or values) as one, ``length`` tokens
    long: arrays, or a quantized layer's (packed, scales, biases) triples."""
    if isinstance(parts[0], tuple):
        return tuple(_joined([p[e] for p in parts], length) for e in range(len(parts[0])))
    joined = mx.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]
    return joined[..., :length, :]


def _untrimmed(text: str) -> str:
    return text


def _fingerprint(config: EngineConfig, loaded: LoadedModel) -> str:
    """The model's fingerprint (``fingerprint``): the weights' bytes are read
    for it only with a persist directory, where their digests are kept."""
    digests = (
        config.cache.persist_dir / DIGESTS_DIR if config.cache.persist_dir is not None else None
    )
    return model_fingerprint(loaded.path, held=loaded.held, digests=digests)


def _layer_signature(layer: Any) -> tuple[Any, ...]:
    """The shapes and dtypes of one cache layer's arrays, the sequence axis
    of a KV layer's ``(batch, heads, tokens, head dim)`` arrays left out:
    what a stored state must share with this model's to seed it."""
    grows = not isinstance(layer, ArraysCache)
    out: list[Any] = []
    for _, a in tree_flatten(layer.state):
        if not isinstance(a, mx.array):
            out.append(None)
            continue
        shape: list[int | None] = list(a.shape)
        if grows and a.ndim == 4:
            shape[2] = None
        out.append((tuple(shape), str(a.dtype).removeprefix("mlx.core.")))
    return tuple(out)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with path.open() as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


def tool_call_stop_ids(generation_config: dict[str, Any], added: dict[int, str]) -> set[int]:
    """The ``</tool_call>`` token ids to stop a turn at (``--stop-at-tool-call-end``),
    given the model's ``generation_config.json`` and its added tokens (id ->
    text): only for a model that declares a ``tool_call_parser``.

    Such models (Poolside Laguna and kin) rely on their own server's parser
    to stop after a closed call and list no ``</tool_call>`` among their eos
    ids: without the stop the seed saw one loop out about 450 calls in one
    turn. Models that end a call turn on their own eos (Qwen, Gemma) declare
    no parser and are left alone. The stop token keeps its text, so the call
    closes and is parsed as every other call is."""
    parser = generation_config.get("tool_call_parser")
    if not isinstance(parser, str) or not parser:
        return set()
    return {i for i, text in added.items() if text == "</tool_call>"}


def _added_tokens(tokenizer: Any) -> dict[int, str]:
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    decoder = getattr(hf, "added_tokens_decoder", None) or {}
    return {int(i): str(getattr(t, "content", t)) for i, t in decoder.items()}


# What a non-finite logprob (a masked token's -inf; NaN if logits broke) is
# reported as: JSON has no -Infinity. vLLM's OpenAI server floors every
# logprob at this value.
_LOGPROB_FLOOR: Final = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _LOGPROB_FLOOR


class _Faults:
    """The per-sequence failure boundary inside ``BatchGenerator.next()``.

    mlx-lm calls each sequence's sampler and logits processors while it
    builds the whole batch's step. Each one is wrapped: if it raises, the
    sequence is marked failed and gets a harmless value (the logits
    unchanged, the greedy token), so the step completes for everyone; the
    host then fails and removes the marked sequence before the next step.
    MLX evaluates lazily, so this catches what raises while a sequence's
    operations are built; an error that only surfaces when the batch is
    evaluated is the shared step's - which is why token ids are checked
    against the vocabulary before admission.
    """

    def __init__(self) -> None:
        self.failed: dict[int, Exception] = {}

    def take(self) -> tuple[tuple[int, Exception], ...]:
        out = tuple(self.failed.items())
        self.failed.clear()
        return out

    def sampler(self, rid: int, fn: Sampler) -> Sampler:
        def guarded_sampler(logprobs: mx.array) -> mx.array:
            if rid not in self.failed:
                try:
                    sampled: mx.array = fn(logprobs)
                    return sampled
                except Exception as exc:
                    self.failed[rid] = exc
            fallback: mx.array = mx.argmax(logprobs, axis=-1)
            return fallback

        return guarded_sampler

    def processor(self, rid: int, fn: LogitsProcessor) -> LogitsProcessor:
        def guarded_processor(tokens: mx.array, logits: mx.array) -> mx.array:
            if rid not in self.failed:
                try:
                    out: mx.array = fn(tokens, logits)
                    return out
                except Exception as exc:
                    self.failed[rid] = exc
            return logits

        return guarded_processor


def _last_token(tokens: mx.array) -> int | None:
    last: Any = tokens[-1].item() if tokens.size else None
    return None if last is None else int(last)


def _thinking_budget(budget: int, think_ids: tuple[int, int], inside: bool) -> LogitsProcessor:
    """Force ``</think>`` once ``budget`` thinking tokens were generated.

    Called before each sampling; from the second call on, the context's last
    token is the one sampled by the previous call, which is how it tracks
    whether generation is inside the block and how much it has spent.
    """
    start, end = think_ids
    state = {"inside": inside, "spent": 0, "calls": 0}

    def budget_processor(tokens: mx.array, logits: mx.array) -> mx.array:
        state["calls"] += 1
        if state["calls"] > 1:
            last = _last_token(tokens)
            if last == start:
                state["inside"] = True
            elif last == end:
                state["inside"] = False
            elif state["inside"]:
                state["spent"] += 1
        if state["inside"] and state["spent"] >= budget:
            forced = mx.full(logits.shape, -mx.inf, dtype=logits.dtype)
            forced[:, end] = 0.0
            return forced
        return logits

    return budget_processor


def _make_processors(
    p: SamplingParams, min_tokens: int, eos_ids: Sequence[int], vocab: int
) -> list[LogitsProcessor]:
    procs: list[LogitsProcessor] = []
    if p.logit_bias:
        # An index past the logits is not an error in MLX but a wild write
        # (SIGSEGV): never build one.
        bad = [i for i, _ in p.logit_bias if not 0 <= i < (vocab or i + 1)]
        if bad:
            raise InvalidRequest(
                f"logit_bias token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                param="logit_bias",
            )
        idx = mx.array([i for i, _ in p.logit_bias])
        vals = mx.array([b for _, b in p.logit_bias])

        def bias(_tokens: mx.array, logits: mx.array) -> mx.array:
            logits[:, idx] = logits[:, idx] + vals
            return logits

        procs.append(bias)
    if p.repetition_penalty is not None and p.repetition_penalty != 1.0:
        procs.append(make_repetition_penalty(p.repetition_penalty, p.repetition_context_size))
    if p.presence_penalty:
        procs.append(make_presence_penalty(p.presence_penalty, p.repetition_context_size))
    if p.frequency_penalty:
        procs.append(make_frequency_penalty(p.frequency_penalty, p.repetition_context_size))
    if min_tokens > 0 and eos_ids:
        eos = mx.array(list(eos_ids))
        seen = [0]

        def hold_eos(_tokens: mx.array, logits: mx.array) -> mx.array:
            if seen[0] < min_tokens:
                logits[:, eos] = -mx.inf
            seen[0] += 1
            return logits

        procs.append(hold_eos)
    return procs


def _split_mark(group: GroupInfo | None) -> str:
    if group is None:
        return ""
    return f"{'tp' if group.split.startswith('tensor') else 'pp'}{group.world_size}"


def _think_ids(tokenizer: Any) -> tuple[int, int] | None:
    try:
        start, end = tokenizer.think_start_id, tokenizer.think_end_id
    except (ValueError, AttributeError):
        return None  # markers that are not single tokens: no budget, no split
    return (int(start), int(end)) if start is not None and end is not None else None


class _Compiler:
    """``backend.ConstraintCompiler`` over llguidance with this model's vocabulary."""

    def __init__(
        self,
        grammar_tok: GrammarTokenizer,
        *,
        tool_format: str | None,
        think_markers: tuple[str, str] | None = None,
    ) -> None:
        self._llg = grammar_tok.llg
        # The thinking tokens free text may hold under tool_grammar (a model
        # that opens its own think block, as GLM and Gemma 4 do).
        self._text_tokens = grammar_tok.added_tokens_in(think_markers or ())
        self._format: ToolFormatName | None = next(
            (f for f in GRAMMAR_FORMATS if f == tool_format), None
        )

    def compile(
        self,
        *,
        response_format: Any,
        tools: Any,
        tool_choice: Any,
        tool_grammar: Any,
        custom_tools: Any = None,
    ) -> Constraint | None:
        forced = tool_choice not in (None, "auto", "none")
        if self._format is None and (forced or tool_grammar):
            raise InvalidRequest(
                "tool-call constraints need a model whose chat template has Hermes, "
                "Qwen3-Coder, Gemma 4 or GLM tool calls, or no tool syntax at all "
                "(the generic format)",
                param="tool_choice" if forced else "tool_grammar",
            )
        return build_constraint(
            response_format=response_format,
            tools=tools,
            tool_choice=tool_choice,
            tool_grammar=tool_grammar,
            tool_format=self._format or "hermes",
            llg_tokenizer=self._llg,
            custom_tools=custom_tools,
            text_tokens=self._text_tokens,
        )


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


class _Lane:
    """One BatchGenerator and its request-id <-> uid maps."""

    def __init__(self, gen: BatchGenerator, roster: Roster) -> None:
        self.gen = gen
        self.uid_of: dict[int, int] = {}
        self.rid_of: dict[int, int] = {}
        # How its sequences speculate (``mlx.speculative``).
        self.roster = roster
        # Whether its KV is quantized yet (``--quantized-kv-start``).
        self.quantized = False


class MlxBackend:
    """``backend.Backend`` over mlx-lm. Construct it on the host thread."""

    def __init__(self, config: EngineConfig) -> None:
        said = set_compute_priority(config.tuning.compute_priority, config.tuning.compute_nice)
        log.info("compute threads: %s", said)
        loaded = load_model(config)
        model, tokenizer, model_dir = loaded.model, loaded.tokenizer, loaded.path
        self._vision: VisionModel | None = loaded.vision
        # Under mlx.launch each rank holds its shard of the model (mlx.group).
        self._group = rank_group()
        if self._group is not None:
            if self._vision is not None:
                raise ModelLoadError(f"{model_dir.name}: an image model is not split over ranks")
            split = shard(model, self._group, model_dir.name, config.group.split)
            log.info("rank %d of %d: %s", self._group.rank(), self._group.size(), split)
            group_info: GroupInfo | None = GroupInfo(int(self._group.size()), split)
        else:
            group_info = None
        self._model = model
        self._tokenizer = tokenizer
        self._config = config
        self._stream = mx.new_stream(mx.default_device())
        # The buffer cache and wired limits of the configured policy (mlx.memory).
        self._memory_limits = memory_limits(config.memory, recommended_working_set())
        self._cache_limit = apply_buffer_cache_limit(self._memory_limits)
        apply_wired_limit(self._memory_limits)
        log_limits(config.memory, self._memory_limits)
        model_cfg = _read_json(model_dir / "config.json")
        gen_cfg = _read_json(model_dir / "generation_config.json")
        eos = set(tokenizer.eos_token_ids) | _ids(gen_cfg.get("eos_token_id"))
        eos |= _ids(model_cfg.get("eos_token_id"))
        text_cfg = model_cfg.get("text_config") or model_cfg
        context = int(
            text_cfg.get("max_position_embeddings")
            or model_cfg.get("max_position_embeddings")
            or 4096
        )
        special = [
            t
            for t in getattr(tokenizer, "all_special_tokens", [])
            if not any(m in t for m in _CONTENT_MARKERS)
        ]
        # The KV format (mlx.kv_quant): with --kv-bits, every plain attention
        # layer's cache is quantized, in the batch, the blocks and on disk.
        self._kv_bits = config.kv_quant.bits
        self._kv_plan = KvPlan(frozenset(), {})
        if self._kv_bits and self._vision is not None:
            log.warning("kv-bits: off for this model (an image model's KV stays unquantized)")
            self._kv_bits = 0
        if self._kv_bits:
            self._kv_plan = kv_plan(model, self._kv_bits, config.kv_quant.group_size, self._stream)
            kept = self._kv_plan.describe(config.kv_quant.group_size)
            if kept is not None:
                log.warning("kv-bits %d: %s", self._kv_bits, kept)
            if not self._kv_plan.layers:
                self._kv_bits = 0
        # --quantized-kv-start: unquantized until a lane's sequence is long.
        self._kv_start: KvStart | None = None
        if self._kv_bits and config.kv_quant.start > 0:
            self._kv_start = KvStart(
                config.kv_quant.start,
                self._kv_bits,
                config.kv_quant.group_size,
                self._kv_plan.layers,
            )
            log.info(
                "kv-bits %d: a lane's KV is quantized once one of its sequences holds %d tokens",
                self._kv_bits,
                config.kv_quant.start,
            )
        # Plain KV layers grow by appending, so the prompt cache can cut them
        # into shared token blocks and any prefix is a valid state; a sliding
        # window or linear attention is kept whole per checkpoint.
        layout = self._new_cache()
        self._layer_count = len(layout)
        self._blockable = [i for i, c in enumerate(layout) if type(c) in _BLOCKABLE]
        self._rest = [i for i, c in enumerate(layout) if type(c) not in _BLOCKABLE]
        trimmable = not self._rest
        self.spec_stats = SpecStats()
        # What finished sequences held, for every lane's lookups.
        self._recent = RecentBySalt()
        self._speculate = self._speculation(config, layout)
        # A prompt through linear-attention layers, in chunks on the CPU
        # (mlx.gated_delta; mlx-lm's function, so the process's).
        install_gated_delta(config.tuning.gated_delta_prefill)
        if any(type(c) is ArraysCache for c in layout):
            log.info("gated-delta prefill: %s", config.tuning.gated_delta_prefill)
        # What BatchGenerator calls: the model, its one-token steps compiled
        # where it can be (mlx.compiled_step).
        self._decode_model = self._compiled_step(config)
        # OpenBLAS's threads per step, one where one decodes faster
        # (mlx.step_threads), measured on that model.
        self._threads = self._step_threads(config)
        # A draft model's weights and the states its finished sequences left.
        self._draft: DraftModel | None = None
        self._draft_pool = DraftPool()
        if config.speculation.draft_model is not None:
            if self._speculate:
                self._draft = _load_draft(config, tokenizer)
            else:
                log.info(
                    "draft model %s: not loaded (no speculation)", config.speculation.draft_model
                )
        # KV-aware admission: each sequence's KV, and the room the memory
        # limit (or the machine) leaves for it beside the weights.
        weights = weight_bytes(model)
        if self._draft is not None:
            weights += weight_bytes(self._draft.model)
        footprint = kv_footprint(model, self._stream, self._new_cache())
        room = kv_room(config.memory, weights)
        if footprint is not None:
            log.info(
                "KV%s: %d bytes per token (+%s windowed, %d fixed); %.0f MB of weights leave "
                "%.0f MB for running sequences",
                (
                    f" (unquantized until {config.kv_quant.start} tokens: admission plans "
                    "with this size)"
                    if self._kv_start is not None
                    else f" ({self._kv_bits}-bit)"
                    if self._kv_bits
                    else ""
                ),
                footprint.per_token,
                list(footprint.windowed),
                footprint.fixed,
                weights / 2**20,
                room / 2**20,
            )
        self._vocab_width = int(text_cfg.get("vocab_size") or model_cfg.get("vocab_size") or 0)
        self._info = ModelInfo(
            model_id=model_dir.name,
            context_length=context,
            eos_ids=frozenset(eos),
            framing_markers=tuple(dict.fromkeys((*special, *COMMON_FRAMING_MARKERS))),
            trimmable=trimmable,
            # A stored state is only ever read back in the KV format it was written in.
            fingerprint="+".join(
                f
                for f in (
                    config.loading.fingerprint or _fingerprint(config, loaded),
                    kv_format(
                        self._kv_bits,
                        config.kv_quant.group_size,
                        config.kv_quant.start if self._kv_start is not None else 0,
                    ),
                    # A shard's state only seeds the same split: tensor
                    # (tp) or by layers (pp), over as many ranks.
                    _split_mark(group_info),
                )
                if f
            ),
            think_ids=_think_ids(tokenizer),
            think_markers=(
                (tokenizer.think_start, tokenizer.think_end)
                if tokenizer.has_thinking and tokenizer.think_end
                else None
            ),
            tool_format=fmt.name if (fmt := resolve_format(tokenizer.chat_template)) else None,
            vocab_size=self._vocab_width or len(tokenizer.get_vocab()),
            vision=self._vision is not None,
            kv=footprint,
            kv_room=room,
            group=group_info,
        )
        self._renderer = ChatTemplateRenderer(
            tokenizer,
            boundaries=not trimmable,
            generic_tools=self._info.tool_format == GENERIC.name,
            drop_past_tool_calls=config.shaping.drop_past_tool_calls,
            template_budget=TemplateBudget(
                config.shaping.template_render_seconds, config.shaping.template_max_chars
            ),
        )
        self._grammar_tok: GrammarTokenizer | None = None
        try:
            self._grammar_tok = GrammarTokenizer(tokenizer._tokenizer, eos_ids=eos)
        except (TypeError, ValueError) as exc:
            log.warning("constrained decoding unavailable for this tokenizer: %s", exc)
        self._compiler = (
            _Compiler(
                self._grammar_tok,
                tool_format=self._info.tool_format,
                think_markers=self._info.think_markers,
            )
            if self._grammar_tok is not None
            else None
        )
        stops = set(eos)
        if config.shaping.stop_at_tool_call_end:
            tool_stops = tool_call_stop_ids(gen_cfg, _added_tokens(tokenizer))
            if tool_stops:
                # A stop, not an eos: its text stays in the output (the
                # call closes) and the grammar's ending is untouched.
                log.info("a turn ends at its first </tool_call> (ids %s)", sorted(tool_stops))
                stops |= tool_stops
        self._eos_stops = StopSequences([[e] for e in sorted(stops)])
        self._no_stops = StopSequences()
        # One generator per priority lane: a parked background wave keeps its
        # generator (KV, processors, positions) untouched while the
        # interactive lane's generator runs, and resumes at the step it stopped.
        self._lanes: dict[Priority, _Lane] = {}
        self._lane_of: dict[int, _Lane] = {}
        # Requests that asked for logprobs: how many alternatives each wants.
        self._logprobs: dict[int, int] = {}
        self._faults = _Faults()
        # Image prefills waiting for their lane's steps, oldest first.
        self._prefills: dict[Priority, list[tuple[VisionPrefill, Admission]]] = {}
        # Sequences with images in a BatchGenerator: their key prompt (the
        # tokens the host and the cache see) and how many tokens their image
        # prefill counted before the generator took over.
        self._keys: dict[int, tuple[int, ...]] = {}
        self._offset: dict[int, int] = {}
        # What a stored state's layers must look like (``_signature``):
        # False until first asked for.
        self._layer_signatures: list[tuple[Any, ...]] | Literal[False] | None = False
        self._quantized_signatures: list[tuple[Any, ...]] | None = None

    def _new_cache(self) -> list[Any]:
        """A fresh cache for one sequence, in the configured KV format
        (unquantized until a start, ``--quantized-kv-start``)."""
        bits = 0 if self._kv_start is not None else self._kv_bits
        return kv_layout(self._model, bits, self._config.kv_quant.group_size, self._kv_plan.layers)

    def _speculation(self, config: EngineConfig, layout: Sequence[Any]) -> bool:
        """Whether the lanes speculate; says so, and why not, once."""
        if config.speculation.mode == "off" or config.speculation.num_draft_tokens == 0:
            log.info("speculation: off")
            return False
        if self._group is not None:
            # Its gate decides from each rank's own wall times, and its
            # rejection sampling draws from numpy: the ranks would part.
            log.info("speculation: off under a group of %d ranks", self._group.size())
            return False
        blocker = (
            "an image model's generator is not speculated yet"
            if self._vision is not None
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
            if self._vision is not None
            else "not under a group of ranks"
            if self._group is not None
            else compiled_blocker(self._model)
        )
        if blocker is not None:
            log.info("compiled step: off for this model (%s)", blocker)
            return self._model
        decode = CompiledDecode(self._model)
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
            measured = measure(self._decode_model, most, blas.set_threads, batches)
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

    def _new_generator(self, roster: Roster) -> BatchGenerator:
        n = self._config.scheduling.max_concurrency
        gen = BatchGenerator(
            self._decode_model,
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
                self._recent,
                self._draft,
                self._draft_pool,
                self._threads,
            )
        return gen

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
    def compiler(self) -> _Compiler | None:
        return self._compiler

    @property
    def images(self) -> VisionModel | None:
        return self._vision

    def token_text(self, token: int) -> str:
        return str(self._tokenizer.decode([token]))

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(tokens)))

    def detokenizer(self, keep_leading_space: bool = False) -> Detokenizer:
        detok: Any = self._tokenizer.detokenizer  # a fresh copy
        if keep_leading_space:
            # mlx-lm's SPM detokenizer trims the first space unless told not
            # to; its BPE one always does (``_maybe_trim_space``): a raw
            # prompt's continuation (" Paris" after "... France is") keeps it.
            if hasattr(detok, "trim_space"):
                detok.trim_space = False
            if hasattr(detok, "_maybe_trim_space"):
                detok._maybe_trim_space = _untrimmed
        return cast(Detokenizer, detok)

    def _lane(self, priority: Priority) -> _Lane:
        lane = self._lanes.get(priority)
        if lane is None:
            roster = Roster()
            lane = self._lanes[priority] = _Lane(self._new_generator(roster), roster)
        return lane

    def insert(self, admissions: Sequence[Admission]) -> dict[int, Exception]:
        """Each admission on its own: one whose sampler, processors or seed
        state cannot be built or queued is refused alone."""
        failed: dict[int, Exception] = {}
        for a in admissions:
            try:
                self._insert(self._lane(a.request.priority), a)
            except Exception as exc:
                failed[a.rid] = exc
        return failed

    def _processors(self, r: GenerationRequest) -> list[LogitsProcessor]:
        eos = sorted(self._info.eos_ids)
        # A grammar decides when the output may end; holding EOS back would
        # leave it nothing to allow once the grammar is complete.
        min_tokens = 0 if r.constraint is not None else r.min_tokens
        procs = _make_processors(r.sampling, min_tokens, eos, self._info.vocab_size)
        think = self._info.think_ids
        inside = think is not None and prompt_opens_thinking_tokens(r.prompt, think)
        if r.max_thinking_tokens is not None and think is not None:
            procs.append(_thinking_budget(r.max_thinking_tokens, think, inside))
        if r.constraint is not None:
            if self._grammar_tok is None:
                raise InvalidRequest(
                    "this model cannot constrain decoding", param="response_format"
                )
            procs.append(
                make_grammar_processor(
                    r.constraint,
                    self._grammar_tok,
                    vocab_width=self._vocab_width or self._grammar_tok.vocab_size,
                    eos_ids=eos,
                    start_after_token=think[1] if inside and think is not None else None,
                    budget=r.max_tokens,
                )
            )
        return procs

    def _insert(self, lane: _Lane, adm: Admission) -> None:
        vision = adm.request.vision
        if vision is not None:
            if self._vision is None:
                raise InvalidRequest("this model takes no images", param="messages")
            seed = len(adm.seed_tokens)
            if seed < vision.end:
                # The images are not all in the seed: prefill them first.
                self._processors(adm.request)  # refuse a bad grammar now, not later
                cuts, pos = set(), seed
                for segment in adm.segments:
                    pos += len(segment)
                    cuts.add(pos)
                prefill = VisionPrefill(
                    rid=adm.rid,
                    prompt=vision,
                    key=adm.request.prompt,
                    cache=adm.seed_state
                    if adm.seed_state is not None
                    else fresh_cache(self._vision),
                    pos=seed,
                    end=vision.end,
                    seed=seed,
                    total=len(adm.request.prompt) - seed,
                    cuts=frozenset(cuts),
                )
                self._prefills.setdefault(adm.request.priority, []).append((prefill, adm))
                return
            self._keys[adm.rid] = adm.request.prompt
        self._insert_generator(lane, adm)

    def _join(self, lane: _Lane, prefill: VisionPrefill, adm: Admission) -> None:
        """An image prefill is done: the sequence joins its lane's generator,
        seeded with what the prefill computed; the text after the last image
        prefills and decodes with the batch."""
        rest: list[tuple[int, ...]] = []
        pos = prefill.seed
        for segment in adm.segments:
            lo, hi = pos, pos + len(segment)
            if hi > prefill.end:
                rest.append(segment[max(0, prefill.end - lo) :])
            pos = hi
        self._keys[adm.rid] = adm.request.prompt
        self._offset[adm.rid] = prefill.end - prefill.seed
        self._insert_generator(
            lane,
            attrs.evolve(
                adm,
                segments=tuple(rest),
                seed_state=prefill.cache,
                seed_tokens=adm.request.prompt[: prefill.end],
            ),
        )

    def _insert_generator(self, lane: _Lane, adm: Admission) -> None:
        r = adm.request
        rid = adm.rid
        seed_tokens = list(adm.seed_tokens)
        if r.vision is not None:
            # The generator sees the model's ids, never the cache key's.
            seed_tokens = list(r.vision.model_tokens[: len(seed_tokens)])
        sampling = make_sampler(r.sampling, self._info.vocab_size)
        sampler = sampling
        if sampling is not greedy:  # the shared greedy sampler cannot fail per sequence
            sampler = self._faults.sampler(rid, sampling)
        procs = [self._faults.processor(rid, p) for p in self._processors(r)]
        # mlx-lm would make a plain cache: the batch holds one format.
        state = adm.seed_state if adm.seed_state is not None else self._new_cache()
        if self._kv_start is not None:
            state = self._lane_format(lane, state)
        (uid,) = lane.gen.insert_segments(
            [[list(seg) for seg in adm.segments]],
            max_tokens=[r.max_tokens],
            caches=[state],
            all_tokens=[seed_tokens],
            samplers=[sampler],
            logits_processors=[procs],
            # A grammar decides where the output ends, and then allows only
            # EOS: ignore_eos must not keep a finished constrained output going.
            stop_sequences=[
                self._no_stops if r.ignore_eos and r.constraint is None else self._eos_stops
            ],
        )
        lane.uid_of[rid] = uid
        lane.rid_of[uid] = rid
        if r.cache is not None and r.cache.salt:
            lane.roster.salts[uid] = r.cache.salt
        if not r.speculate:
            lane.roster.opted_out.add(uid)
        elif isinstance(sampling, Sampling) and not sampling.seeded:
            lane.roster.sampled[uid] = sampling
        self._lane_of[rid] = lane
        if r.top_logprobs is not None:
            self._logprobs[rid] = r.top_logprobs

    def _lane_format(self, lane: _Lane, state: list[Any]) -> list[Any]:
        """``state`` in the format of the lane it joins (one batch holds
        one format): an empty lane starts unquantized again; a quantized
        seed quantizes the lane; a lane already quantized quantizes the
        seed."""
        start = self._kv_start
        assert start is not None
        if not lane.uid_of:
            lane.quantized = False
        if start.holds_quantized(state):
            if not lane.quantized:
                start.quantize_generator(lane.gen)
                lane.quantized = True
            return start.quantize_state(state)  # a layer not yet quantized
        return start.quantize_state(state) if lane.quantized else state

    def _key(self, rid: int, tokens: Sequence[int]) -> tuple[int, ...]:
        """A sequence's tokens as the cache knows them, each image keyed by its content."""
        key = self._keys.get(rid)
        if key is None:
            return tuple(tokens)
        n = min(len(tokens), len(key))
        return (*key[:n], *tokens[n:])

    def _forget(self, rid: int) -> None:
        self._keys.pop(rid, None)
        self._offset.pop(rid, None)

    def _take_prefill(self, rid: int) -> VisionPrefill | None:
        for pending in self._prefills.values():
            for i, (prefill, _) in enumerate(pending):
                if prefill.rid == rid:
                    del pending[i]
                    return prefill
        return None

    def _find_prefill(self, rid: int) -> VisionPrefill | None:
        for pending in self._prefills.values():
            for prefill, _ in pending:
                if prefill.rid == rid:
                    return prefill
        return None

    def remove(self, rids: Sequence[int]) -> dict[int, Captured]:
        out = {}
        for rid in rids:
            prefill = self._take_prefill(rid)
            if prefill is not None:
                with mx.stream(self._stream):
                    state = prefill.snapshot()
                out[rid] = Captured(state, prefill.key[: prefill.pos])
        for lane in self._lanes.values():
            uids = [lane.uid_of.pop(r) for r in rids if r in lane.uid_of]
            if not uids:
                continue
            with mx.stream(self._stream):
                got = lane.gen.remove(uids, return_prompt_caches=True)
            for uid in uids:
                rid = lane.rid_of.pop(uid)
                lane.roster.forget(uid)
                self._lane_of.pop(rid, None)
                self._logprobs.pop(rid, None)
                self._faults.failed.pop(rid, None)
                if uid in got:
                    state, tokens = got[uid]
                    out[rid] = Captured(list(state), self._key(rid, tokens))
                self._forget(rid)
        return out

    def capture(self, rid: int) -> Captured | None:
        prefill = self._find_prefill(rid)
        if prefill is not None:
            with mx.stream(self._stream):
                return Captured(prefill.snapshot(), prefill.key[: prefill.pos])
        lane = self._lane_of.get(rid)
        uid = lane.uid_of.get(rid) if lane is not None else None
        if lane is None or uid is None:
            return None
        with mx.stream(self._stream):
            got = lane.gen.extract_cache([uid]).get(uid)
        if got is None:
            return None
        return Captured(list(got[0]), self._key(rid, got[1]))

    def state_offsets(self, state: Any) -> list[int | None]:
        return [getattr(c, "offset", None) if type(c) in _ALWAYS_TRIMMABLE else None for c in state]

    def state_blocks(self, state: Any, ranges: Sequence[tuple[int, int]]) -> list[tuple[Any, int]]:
        out: list[tuple[Any, int]] = []
        arrays: list[Any] = []
        with mx.stream(self._stream):
            for start, end in ranges:
                layers = []
                nbytes = 0
                for i in self._blockable:
                    c = state[i]
                    # mx.array() copies: a slice would keep the whole source
                    # buffer alive. A quantized layer's keys and values are
                    # (packed, scales, biases): each is sliced alike.
                    k, v = tree_map(
                        lambda a, start=start, end=end: mx.array(a[..., start:end, :]),
                        (c.keys, c.values),
                    )
                    layers.append((k, v))
                    flat = [a for _, a in tree_flatten((k, v))]
                    arrays += flat
                    nbytes += sum(a.nbytes for a in flat)
                out.append((tuple(layers), nbytes))
            mx.eval(arrays)
        return out

    def state_rest(self, state: Any) -> tuple[Any, int]:
        if not self._rest:
            return None, 0
        with mx.stream(self._stream):
            rest = {i: _copy_layer(state[i]) for i in self._rest}
            mx.eval([c.state for c in rest.values()])
        return rest, int(sum(c.nbytes for c in rest.values()))

    def join_state(self, blocks: Sequence[Any], length: int, rest: Any) -> Any:
        layers: list[Any] = [None] * self._layer_count
        with mx.stream(self._stream):
            for j, i in enumerate(self._blockable):
                k = _joined(self._one_format([b[j][0] for b in blocks]), length)
                v = _joined(self._one_format([b[j][1] for b in blocks]), length)
                c = (
                    QuantizedKV(self._config.kv_quant.group_size, self._kv_bits)
                    if isinstance(k, tuple)
                    else KVCache()
                )
                c.keys, c.values = k, v
                c.offset = length
                layers[i] = c
        for i, layer in (rest or {}).items():
            # A shallow copy: BatchGenerator merges seeds into fresh batch
            # arrays, so the stored arrays are never written.
            layers[i] = copy.copy(layer)
        if any(c is None for c in layers):
            raise ValueError("the rest state does not cover this model's unblockable layers")
        return layers

    def _one_format(self, parts: list[Any]) -> list[Any]:
        """One layer's blocks in one format: under ``--quantized-kv-start``
        a conversation's early blocks may be stored unquantized and its
        later ones quantized; the unquantized are quantized to join them
        (a group runs along one token, so this is what the lane's switch
        would have made of them)."""
        if all(isinstance(p, tuple) for p in parts) or not any(isinstance(p, tuple) for p in parts):
            return parts
        group, bits = self._config.kv_quant.group_size, self._kv_bits
        return [
            p if isinstance(p, tuple) else tuple(mx.quantize(p, group_size=group, bits=bits))
            for p in parts
        ]

    def dump_state(self, state: Any, metadata: dict[str, str], path: Path) -> None:
        with mx.stream(self._stream):
            save_prompt_cache(str(path), state, metadata)

    def forget_state(self, path: Path) -> None:
        pass  # the payload is the whole state

    def load_state(self, payload: bytes, path: Path) -> tuple[Any, dict[str, str]]:
        with mx.stream(self._stream):
            loaded: Any = mx.load(io.BytesIO(payload), format="safetensors", return_metadata=True)
        arrays: dict[str, Any] = loaded[0]
        flat_meta: dict[str, str] = loaded[1]
        meta_tree = tree_unflatten(list(flat_meta.items()))
        metadata, classes, scalars = meta_tree
        unknown = set(classes) - set(_CACHE_CLASSES)
        if unknown:
            # Never instantiate a class named by a file beyond the known ones.
            raise ValueError(f"unknown cache classes {sorted(unknown)}")
        for pos, kind in scalars[1:]:
            array = arrays[pos]
            if kind == "scalar":
                arrays[pos] = array.item()
            elif kind == "string":
                arrays[pos] = "".join(chr(i) for i in array.tolist())
            elif kind == "none":
                arrays[pos] = None
            else:
                raise ValueError(f"unknown scalar kind {kind!r}")
        states = tree_unflatten(list(arrays.items()))
        layers = [_CACHE_CLASSES[c].from_state(st) for c, st in zip(classes, states, strict=True)]
        ref = self._new_cache()
        if [self._kind(c) for c in layers] != [self._kind(c) for c in ref]:
            raise ValueError("cache layers do not match this model's layout")
        self._check_shapes(layers)
        return layers, dict(metadata)

    def ready_state_checks(self) -> None:
        """Make what ``load_state`` checks states against now (a one-token
        pass of the model, the first time): a group's ranks run it at the
        same order, for its collectives."""
        self._signature()
        self._quantized_signature()

    def _kind(self, layer: Any) -> type[Any]:
        """A stored layer's class as the layout sees it: under
        ``--quantized-kv-start`` a planned layer is plain or quantized."""
        kind: type[Any] = type(layer)
        if self._kv_start is not None and kind is QuantizedKV:
            kind = KVCache
        return kind

    def _check_shapes(self, layers: list[Any]) -> None:
        """Raise ``ValueError`` naming the first layer whose arrays' shapes or
        dtypes are not the ones this model's cache holds: a stored state of
        another model (or one held in another dtype) would fail its lane, or
        worse, seed it with nonsense."""
        expected = self._signature()
        if expected is None:
            return
        quantized = self._quantized_signature()
        for i, (layer, want) in enumerate(zip(layers, expected, strict=True)):
            got = _layer_signature(layer)
            if type(layer) is QuantizedKV and quantized is not None:
                want = quantized[i]
            if got != want:
                raise ValueError(f"layer {i} holds {got}, this model's cache {want}")

    def _quantized_signature(self) -> list[tuple[Any, ...]] | None:
        """Under ``--quantized-kv-start``, the signature of every layer once
        quantized (from a one-token pass, made once); else ``None``."""
        start = self._kv_start
        if start is None:
            return None
        if self._quantized_signatures is None:
            with mx.stream(self._stream):
                ref = start.quantize_state(self._new_cache())
                self._model(mx.array([[0]]), cache=ref)
                mx.eval([c.state for c in ref])
            self._quantized_signatures = [_layer_signature(c) for c in ref]
        return self._quantized_signatures

    def _signature(self) -> list[tuple[Any, ...]] | None:
        """The signature of every layer of this model's cache, from a
        one-token forward pass made the first time it is asked for (a few
        milliseconds on the tiny models, one decode step on any); ``None``
        (warned once) where that pass fails: states are then checked by
        layer type only."""
        if self._layer_signatures is False:
            try:
                with mx.stream(self._stream):
                    ref = self._new_cache()
                    self._model(mx.array([[0]]), cache=ref)
                    mx.eval([c.state for c in ref])
                self._layer_signatures = [_layer_signature(c) for c in ref]
            except Exception as exc:  # a model whose bare forward pass fails
                log.warning("stored cache states are checked by layer type only: %s", exc)
                self._layer_signatures = None
        return self._layer_signatures

    def _step_images(
        self, lane_name: Priority
    ) -> tuple[list[PrefillOut], list[tuple[int, Exception]]]:
        """One chunk of the lane's oldest image prefill, inside that
        sequence's own failure boundary; a finished one joins the generator
        first (so a capture between steps still finds it here)."""
        pending = self._prefills.get(lane_name)
        progress: list[PrefillOut] = []
        failed: list[tuple[int, Exception]] = []
        if not pending or self._vision is None:
            return progress, failed
        while pending and pending[0][0].done:
            prefill, adm = pending.pop(0)
            try:
                self._join(self._lane(lane_name), prefill, adm)
            except Exception as exc:
                self._forget(prefill.rid)
                failed.append((prefill.rid, exc))
        if pending:
            prefill = pending[0][0]
            try:
                with mx.stream(self._stream):
                    prefill.advance(self._vision, self._config.scheduling.prefill_step_size)
            except Exception as exc:
                pending.pop(0)
                failed.append((prefill.rid, exc))
                # Whatever the failed graph left queued on the stream is run
                # now: a stream left with such work aborts the process when
                # it exits (mlx 0.32, seen with a vision tower that raised).
                mx.synchronize(self._stream)
            else:
                progress.append(
                    PrefillOut(
                        prefill.rid,
                        prefill.pos - prefill.seed,
                        prefill.total,
                        prefill.pos in prefill.cuts,
                    )
                )
        return progress, failed

    def step(self, lane_name: Priority) -> StepOutput:
        if self._threads is not None:
            self._before_step(lane_name)
        image_progress, image_failed = self._step_images(lane_name)
        lane = self._lanes.get(lane_name)
        if lane is None:
            return StepOutput(tuple(image_progress), (), tuple(image_failed))
        try:
            with mx.stream(self._stream):
                prompt_responses, gen_responses = lane.gen.next()
                start = self._kv_start
                if start is not None and not lane.quantized and start.due(lane.gen):
                    start.quantize_generator(lane.gen)
                    lane.quantized = True
        finally:
            failed = (*image_failed, *self._faults.take())
        rid_of = lane.rid_of
        prefill = (
            *image_progress,
            *(
                PrefillOut(
                    rid_of[r.uid],
                    int(r.progress[0]) + self._offset.get(rid_of[r.uid], 0),
                    int(r.progress[1]) + self._offset.get(rid_of[r.uid], 0),
                    bool(r.end_of_segment),
                )
                for r in prompt_responses
                if r.uid in rid_of and not r.end_of_prompt
            ),
        )
        tokens = []
        for r in gen_responses:
            rid = rid_of.get(r.uid)
            if rid is None:
                continue
            finish: Literal["stop", "length"] | None = r.finish_reason
            logprob, top = self._token_logprobs(rid, int(r.token), r.logprobs)
            drafted, accepted = getattr(r, "drafted", 0), getattr(r, "accepted", 0)
            if finish is None:
                tokens.append(
                    TokenOut(rid, int(r.token), None, None, (), logprob, top, drafted, accepted)
                )
                continue
            state = list(r.prompt_cache) if r.prompt_cache is not None else None
            held = self._key(rid, r.all_tokens or ())
            tokens.append(
                TokenOut(rid, int(r.token), finish, state, held, logprob, top, drafted, accepted)
            )
            self._logprobs.pop(rid, None)
            self._forget(rid)
            del rid_of[r.uid]
            del lane.uid_of[rid]
            lane.roster.forget(r.uid)
            self._lane_of.pop(rid, None)
        return StepOutput(prefill, tuple(tokens), failed)

    def _before_step(self, lane_name: Priority) -> None:
        """OpenBLAS's threads for what the lane's next step runs: its
        decoding sequences, and whether a prompt or an image prefills (a
        verify says its own rows, ``mlx.speculative``)."""
        assert self._threads is not None
        lane = self._lanes.get(lane_name)
        gen = lane.gen if lane is not None else None
        decoding = len(gen._generation_batch) if gen is not None else 0
        prefilling = bool(self._prefills.get(lane_name)) or (
            gen is not None and bool(gen._unprocessed_sequences or gen._currently_processing)
        )
        self._threads.before_step(decoding, prefilling)

    def _token_logprobs(
        self, rid: int, token: int, logprobs: Any
    ) -> tuple[float | None, tuple[tuple[int, float], ...]]:
        k = self._logprobs.get(rid)
        if k is None or logprobs is None:
            return None, ()
        chosen = _finite(float(logprobs[token].item()))
        if k == 0:
            return chosen, ()
        idx = mx.argpartition(-logprobs, kth=k - 1)[:k]
        ids: Any = idx.tolist()
        vals: Any = logprobs[idx].tolist()
        # A token a grammar, min_tokens or a thinking budget masked is -inf:
        # floored as vLLM floors it, so every step lists k alternatives.
        pairs = sorted(
            ((int(i), _finite(float(v))) for i, v in zip(ids, vals, strict=True)),
            key=lambda t: -t[1],
        )
        return chosen, tuple(pairs)

    def memory_in_use(self) -> int:
        return int(mx.get_active_memory())

    def memory_figures(self) -> MemoryFigures:
        return memory_figures(self._cache_limit)

    def rank_steps(self) -> tuple[RankStep, ...]:
        return ()

    def speculation_figures(self) -> SpecFigures:
        return self.spec_stats.figures()

    def reclaim(self) -> None:
        clear_buffer_cache()

    def reset(self, lane_name: Priority) -> None:
        for prefill, _ in self._prefills.pop(lane_name, []):
            self._forget(prefill.rid)
        lane = self._lanes.pop(lane_name, None)
        if lane is not None:
            for rid in lane.uid_of:
                self._lane_of.pop(rid, None)
                self._logprobs.pop(rid, None)
                self._forget(rid)
            lane.gen.close()
        clear_buffer_cache()

    def close(self) -> None:
        for name in list(self._lanes):
            self.reset(name)
        self._prefills.clear()
        mx.synchronize(self._stream)
        if self._threads is not None:
            self._threads.close()
