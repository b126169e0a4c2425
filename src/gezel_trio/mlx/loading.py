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
"""

from __future__ import annotations

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
from . import blas, mlx_lm_surface
from .model_source import per_layer_embedding_table, resolve_model
from .ple import MappedEmbedding, UnmappableTable, map_table
from .vision import is_vision_model, load_vision

__all__ = ["LoadedModel", "hold_float32", "load_model"]

log = logging.getLogger("gezel_trio.mlx")

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
            weights = _adapt_weights(vlm, keep=config.loading.keep_quantized)
            held.append(_stored_format(vlm))
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
    weights = _adapt_weights(model, keep=config.loading.keep_quantized)
    log.info("model %s: BLAS %s; weights %s", path.name, blas.describe(), weights)
    return LoadedModel(model, tokenizer, path, weights, held=_stored_format(model))


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
        w = mx.dequantize(
            m.weight, m.scales, m.get("biases"), group_size=m.group_size, bits=m.bits, mode=m.mode
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
