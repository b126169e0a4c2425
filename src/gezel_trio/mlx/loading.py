"""Loading the served model onto MLX, on the engine's host thread.

``load_model(config)`` resolves ``--model`` to a local directory
(``model_source``: a directory, a converted GGUF, or the default model),
loads it with mlx-lm without ever reaching a model hub (the path is local and
the tokenizer is told so), and adapts the weights to the device:

On the CPU device, MLX's quantized matmul does not use BLAS, and its
float16/bfloat16 matmuls do not either: measured on 2 cores with OpenBLAS, a
(256x576)@(576x1536) product runs at 89 GFLOP/s in float32 against 3-4 in
half precision, and SmolLM2-135M at Q4_1 prefills at 9 tokens/s and decodes
at 7 where the same weights in float32 reach 250 and 17. So there the
weights of every quantized or half-precision ``Linear`` and ``Embedding``
are held as float32, when that fits in half the memory available;
``EngineConfig.loading.keep_quantized`` (``--keep-quantized``) keeps them as
stored. On a GPU the weights are left as they are.

One log line says which BLAS MLX is bound to and which weight format runs.

A model with a per-layer embedding table (Gemma 3n, Gemma 4 E-series) loads
as text even where its directory declares a vision tower (the image path
cannot batch its sliding-window and KV-shared layers). With
``EngineConfig.loading.map_per_layer_embeddings`` the model loads lazily and its
table is replaced, before it is ever read, by one that reads its rows from
the model's files (``ple``); a table that cannot be read that way is held in
memory like any weight, with a warning.

``model_facts`` reads what the model's files and tokenizer say of it (its
end-of-sequence and stop ids, context, framing markers, vocabulary,
thinking and tool-call markup); ``ModelFacts.info`` adds what the backend
decided (the KV format, the room for KV, the group) and the model's
fingerprint (``mlx.fingerprint``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.utils import load

from ..core.config import EngineConfig
from ..core.errors import ModelLoadError
from ..core.model import GroupInfo, KvFootprint, ModelInfo
from ..shaping.text import COMMON_FRAMING_MARKERS
from ..shaping.toolcalls import resolve_format
from ..tuning import blas
from . import mlx_lm_surface
from .fingerprint import DIGESTS_DIR, model_fingerprint
from .model_source import per_layer_embedding_table, resolve_model
from .ple import MappedEmbedding, UnmappableTable, map_table
from .vision import is_vision_model, load_vision

__all__ = [
    "LoadedModel",
    "ModelFacts",
    "hold_float32",
    "load_model",
    "model_facts",
    "resolve_model_dir",
    "tool_call_stop_ids",
]

log = logging.getLogger("gezel_trio.mlx")

# Added tokens that are content, not framing: later layers parse them.
# Gemma 4's string delimiter <|"|> is content too: it spells tool-call arguments.
_CONTENT_MARKERS = ("tool_call", "tool_response", "think", "TOOL_CALLS", "ARGS", '<|"|>')


_HALF = (mx.float16, mx.bfloat16)


@attrs.frozen
class LoadedModel:
    model: Any
    tokenizer: Any
    path: Path
    weights: str  # the weight format in use, for logs
    # A vision-language model (``vision.VisionModel``): ``model`` is then its
    # language model, as mlx-lm's class.
    vision: Any = None
    # The format the weights are held in, as loaded and adapted ("float32",
    # "4-bit/float16"): part of the model fingerprint, since the KV differs.
    held: str = ""


def load_model(config: EngineConfig) -> LoadedModel:
    """Resolve, load and adapt the model; raises ``ModelLoadError``, and
    ``RuntimeError`` naming them when the installed mlx-lm lacks names the
    backend relies on (``mlx.mlx_lm_surface``)."""
    mlx_lm_surface.check()
    path = resolve_model(config.model)
    ple = per_layer_embedding_table(path)
    if is_vision_model(path) and ple is not None:
        # Gemma 3n and Gemma 4 E-series checkpoints ship their vision (and
        # audio) towers, but their language models keep sliding-window and
        # KV-shared layers, which the image path cannot batch: they serve
        # text, on mlx-lm's class, which drops the towers' weights.
        log.info("%s: %s; serving it as a text model (images are refused)", path.name, ple)
    elif is_vision_model(path):
        held: list[str] = []

        def adapt(vlm: Any) -> str:
            stored = _stored_format(vlm)
            weights = _adapt_weights(vlm, keep=config.loading.keep_quantized)
            held.append(_held_format(stored, vlm))
            return weights

        vision, tokenizer, weights = load_vision(path, adapt)
        log.info("vision model %s: BLAS %s; weights %s", path.name, blas.describe(), weights)
        return LoadedModel(vision.text, tokenizer, path, weights, vision, held=held[-1])
    mapped = config.loading.map_per_layer_embeddings and ple is not None
    try:
        # A local directory, and the tokenizer told to stay local: nothing
        # here can reach a model hub, whatever the environment says. Lazily
        # where the table is to be mapped: its arrays are then never read.
        model, tokenizer = load(str(path), tokenizer_config={"local_files_only": True}, lazy=mapped)
    except Exception as exc:
        raise ModelLoadError(f"could not load {path}: {type(exc).__name__}: {exc}") from exc
    if mapped:
        _map_table(model, path)
    stored = _stored_format(model)
    weights = _adapt_weights(model, keep=config.loading.keep_quantized)
    log.info("model %s: BLAS %s; weights %s", path.name, blas.describe(), weights)
    return LoadedModel(model, tokenizer, path, weights, held=_held_format(stored, model))


@attrs.frozen
class ModelFacts:
    """What the model's files and tokenizer say of it: its end-of-sequence
    ids (and the ids a turn stops at besides), its context, the markers
    that frame its turns, its vocabulary, its thinking and tool-call markup."""

    name: str
    context: int
    eos: frozenset[int]
    stops: frozenset[int]
    framing_markers: tuple[str, ...]
    vocab_width: int  # the logits' width from config.json (0: unknown)
    vocab_size: int
    think_ids: tuple[int, int] | None
    think_markers: tuple[str, str] | None
    tool_format: str | None

    def info(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        *,
        trimmable: bool,
        kv_format: str,
        kv: KvFootprint | None,
        kv_room: int,
        group: GroupInfo | None,
    ) -> ModelInfo:
        """The ``ModelInfo`` the engine sees, with what the backend decided."""
        return ModelInfo(
            model_id=self.name,
            context_length=self.context,
            eos_ids=self.eos,
            framing_markers=self.framing_markers,
            trimmable=trimmable,
            # A stored state is only ever read back in the KV format it was written in.
            fingerprint="+".join(
                f
                for f in (
                    config.loading.fingerprint or _fingerprint(config, loaded),
                    kv_format,
                    # A shard's state only seeds the same split: tensor
                    # (tp) or by layers (pp), over as many ranks.
                    _split_mark(group),
                )
                if f
            ),
            think_ids=self.think_ids,
            think_markers=self.think_markers,
            tool_format=self.tool_format,
            vocab_size=self.vocab_size,
            vision=loaded.vision is not None,
            kv=kv,
            kv_room=kv_room,
            group=group,
        )


def model_facts(config: EngineConfig, loaded: LoadedModel) -> ModelFacts:
    """The model's facts, read from its ``config.json``,
    ``generation_config.json`` and tokenizer."""
    tokenizer, model_dir = loaded.tokenizer, loaded.path
    model_cfg = _read_json(model_dir / "config.json")
    gen_cfg = _read_json(model_dir / "generation_config.json")
    eos = set(tokenizer.eos_token_ids) | _ids(gen_cfg.get("eos_token_id"))
    eos |= _ids(model_cfg.get("eos_token_id"))
    text_cfg = model_cfg.get("text_config") or model_cfg
    context = int(
        text_cfg.get("max_position_embeddings") or model_cfg.get("max_position_embeddings") or 4096
    )
    special = [
        t
        for t in getattr(tokenizer, "all_special_tokens", [])
        if not any(m in t for m in _CONTENT_MARKERS)
    ]
    stops = set(eos)
    if config.shaping.stop_at_tool_call_end:
        tool_stops = tool_call_stop_ids(gen_cfg, _added_tokens(tokenizer))
        if tool_stops:
            # A stop, not an eos: its text stays in the output (the
            # call closes) and the grammar's ending is untouched.
            log.info("a turn ends at its first </tool_call> (ids %s)", sorted(tool_stops))
            stops |= tool_stops
    vocab_width = int(text_cfg.get("vocab_size") or model_cfg.get("vocab_size") or 0)
    return ModelFacts(
        name=model_dir.name,
        context=context,
        eos=frozenset(eos),
        stops=frozenset(stops),
        framing_markers=tuple(dict.fromkeys((*special, *COMMON_FRAMING_MARKERS))),
        vocab_width=vocab_width,
        vocab_size=vocab_width or len(tokenizer.get_vocab()),
        think_ids=_think_ids(tokenizer),
        think_markers=(
            (tokenizer.think_start, tokenizer.think_end)
            if tokenizer.has_thinking and tokenizer.think_end
            else None
        ),
        tool_format=fmt.name if (fmt := resolve_format(tokenizer.chat_template)) else None,
    )


def resolve_model_dir(config: EngineConfig) -> Path:
    """The local directory to load: the model directory, the converted GGUF,
    or the default model (fetched and converted on first use)."""
    return resolve_model(config.model)


def _fingerprint(config: EngineConfig, loaded: LoadedModel) -> str:
    """The model's fingerprint (``fingerprint``): the weights' bytes are read
    for it only with a persist directory, where their digests are kept."""
    digests = (
        config.cache.persist_dir / DIGESTS_DIR if config.cache.persist_dir is not None else None
    )
    return model_fingerprint(loaded.path, held=loaded.held, digests=digests)


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


def _map_table(model: Any, path: Path) -> None:
    try:
        where = map_table(model, path)
    except (UnmappableTable, OSError, ValueError) as exc:
        log.warning("%s: the per-layer embedding table is held in memory: %s", path.name, exc)
    else:
        log.info(
            "%s: per-layer embedding table read from its files as needed: %s", path.name, where
        )
    mx.eval(model.parameters())


def _stored_format(model: Any) -> str:
    quantized: set[int] = set()
    dtypes: set[str] = set()
    for _, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding):
            quantized.add(int(m.bits))
        elif isinstance(m, nn.Linear | nn.Embedding):
            dtypes.add(str(m.weight.dtype).removeprefix("mlx.core."))
    parts = [f"{b}-bit" for b in sorted(quantized)] + sorted(dtypes)
    return "/".join(parts) if parts else "none"


def _held_format(stored: str, model: Any) -> str:
    """The format ``model``'s weights are held in (part of the fingerprint):
    quantized weights widened to float32 say so, and how."""
    held = _stored_format(model)
    if "-bit" in stored and "-bit" not in held:
        held += f" (dequantized in float32 from {stored})"
    return held


def _slow_on_cpu(m: Any) -> bool:
    if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding):
        return True
    return isinstance(m, nn.Linear | nn.Embedding) and m.weight.dtype in _HALF


def _float32_bytes(modules: list[tuple[str, Any]]) -> int:
    total = 0
    for _, m in modules:
        rows, cols = m.weight.shape
        if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding):
            cols = cols * 32 // m.bits
        total += 4 * rows * cols
    return total


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def _adapt_weights(model: Any, *, keep: bool) -> str:
    stored = _stored_format(model)
    if mx.default_device() != mx.cpu:
        return f"{stored} (as stored)"
    slow = [(p, m) for p, m in model.named_modules() if _slow_on_cpu(m)]
    if not slow:
        return f"{stored} (as stored)"
    if keep:
        return f"{stored} (kept as stored: --keep-quantized)"
    need = _float32_bytes(slow)
    available = _available_memory()
    if available is not None and need > available // 2:
        return (
            f"{stored} (as stored: float32 would need {need >> 20} MiB, "
            f"more than half of the {available >> 20} MiB available)"
        )
    hold_float32(model)
    return f"float32 on CPU (stored as {stored}; {need >> 20} MiB)"


def hold_float32(model: Any) -> None:
    """Replace every quantized or half-precision ``Linear``/``Embedding`` of
    ``model`` by a float32 one (on the host thread, like every MLX call)."""
    slow = [(p, _as_float32(m)) for p, m in model.named_modules() if _slow_on_cpu(m)]
    model.update_modules(tree_unflatten(slow))
    for _, m in model.named_modules():
        if isinstance(m, MappedEmbedding):
            m.output_dtype = mx.float32  # its rows, as they are read
    mx.eval(model.parameters())


def _as_float32(m: Any) -> Any:
    if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding):
        scales, biases = m.scales, m.get("biases")
        if m.mode == "affine":
            # Half scales widened first: the weights are then computed in
            # float32, as llama.cpp dequantizes a GGUF, and MLX's CPU
            # dequantize runs 3x faster than on half scales (SmolLM2's
            # Q4_1 weights: 0.9 s against 2.4 s at load, on 2 cores).
            scales = scales.astype(mx.float32)
            biases = None if biases is None else biases.astype(mx.float32)
        w = mx.dequantize(
            m.weight, scales, biases, group_size=m.group_size, bits=m.bits, mode=m.mode
        ).astype(mx.float32)
    else:
        w = m.weight.astype(mx.float32)
    rows, cols = w.shape
    if isinstance(m, nn.QuantizedEmbedding | nn.Embedding):
        out: Any = nn.Embedding(rows, cols)
    else:
        out = nn.Linear(cols, rows, bias="bias" in m)
        if "bias" in m:
            out.bias = m.bias.astype(mx.float32)
    out.weight = w
    return out
