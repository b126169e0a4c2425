"""A GGUF file (llama.cpp's format) as an mlx-lm model directory.

``convert_gguf(src, dest)`` writes what ``mlx_lm.load(dest)`` reads:
``model.safetensors``, ``config.json``, ``tokenizer.json``,
``tokenizer_config.json`` (with the chat template) and
``generation_config.json``. Everything comes from the file itself; nothing
is looked up on a model hub.

* **Header.** ``gguf.GGUFReader`` (llama.cpp's own reader) gives the
  metadata and every tensor's type, so an unsupported architecture,
  tokenizer or tensor type is refused, by name, before any work.
* **Weights.** ``mx.load`` reads GGUF natively and returns Q4_0, Q4_1 and
  Q8_0 tensors in MLX's affine quantized form (``weight``, ``scales``,
  ``biases``, group size 32; embeddings are often Q8_0 beside Q4 layers, so
  the bits are recorded per layer) and F32/F16/BF16, Q2_K and Q6_K as
  floats. Its Q4_K decoding disagrees with llama.cpp's (measured against
  ``gguf.quants.dequantize`` on the same blocks), and it cannot read Q5_K,
  Q3_K, Q5_0 or the IQ types: a file holding any of those is decoded with
  ``gguf.quants`` instead, every tensor to float16. Tensors are renamed to
  mlx-lm's (``blk.3.attn_q`` -> ``model.layers.3.self_attn.q_proj``).
* **RoPE.** llama.cpp stores a llama model's Q and K rows permuted for
  interleaved ("traditional") RoPE; ``rope_traditional: true`` applies RoPE
  the way they were permuted for, which gives the same attention scores as
  the original checkpoint. Qwen files keep the original order. Llama 3.1+
  files carry their long-context frequency scaling as a ``rope_freqs``
  tensor; it becomes mlx-lm's ``llama3`` ``rope_scaling`` (its factor is the
  tensor's largest value), after checking that those parameters reproduce
  the tensor.
* **Tokenizer.** Rebuilt with ``tokenizers`` from the vocabulary, merges
  and token types. ``tokenizer.ggml.model = "gpt2"`` is a byte-level BPE
  whose pre-tokenizer is chosen from ``tokenizer.ggml.pre`` (``smollm``
  splits digits one by one, ``qwen2`` and ``llama-bpe`` split by their
  regexes), exactly as the original ``tokenizer.json`` of those families is
  written. ``"llama"`` is a SentencePiece BPE (Llama 2, Mistral 7B): the
  merges are derived from the pieces' scores, as transformers' converter
  does, with byte fallback and the ``▁`` space marker (prefixed once, at
  the start, when ``add_space_prefix`` says so). Control tokens become
  special added tokens, user-defined ones (``<think>``) plain added tokens.
  BOS/EOS/padding ids, ``add_bos_token`` and the chat template come from the
  metadata.

Runs on whatever thread calls it (no Trio); it uses MLX only to read and
write arrays, before any engine exists.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import attrs

from ..core.errors import ModelLoadError
from .gguf_tokenizer import (
    PRE_TOKENIZERS,
    UnsupportedGguf,
    generation_config,
    tokenizer,
    tokenizer_config,
)

if TYPE_CHECKING:
    import gguf
    import mlx.core as mx

__all__ = ["CONVERTER_VERSION", "UnsupportedGguf", "convert_gguf"]

# Part of every converted directory's name: change it whenever the output
# changes, so that stale conversions are not reused.
CONVERTER_VERSION: Final = "v1"

Progress = Callable[[str], None]


# --- what is supported --------------------------------------------------------


@attrs.frozen
class _Arch:
    model_type: str
    # llama.cpp permutes Q/K rows of llama models for interleaved RoPE.
    rope_traditional: bool
    qk_norm: bool = False


_ARCHS: Final = {
    "llama": _Arch("llama", rope_traditional=True),
    "qwen2": _Arch("qwen2", rope_traditional=False),
    "qwen3": _Arch("qwen3", rope_traditional=False, qk_norm=True),
}

# Types mx.load returns faithfully; the rest go through gguf.quants.
_MLX_TYPES: Final = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q6_K"})
_QUANTIZED_BY_MLX: Final = frozenset({"Q4_0", "Q4_1", "Q8_0"})

_GLOBAL_NAMES: Final = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES: Final = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_SUFFIXES: Final = ("weight", "bias", "scales", "biases")
_ROPE_FREQS: Final = "rope_freqs.weight"


# --- the header ---------------------------------------------------------------


@attrs.frozen
class _Header:
    meta: Mapping[str, Any]
    tensor_types: Mapping[str, str]  # GGUF tensor name -> type name

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(key, default)

    def need(self, key: str) -> Any:
        if key not in self.meta:
            raise UnsupportedGguf(f"GGUF metadata has no {key!r}")
        return self.meta[key]


def _read_header(reader: gguf.GGUFReader) -> _Header:
    meta = {name: field.contents() for name, field in reader.fields.items()}
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    return _Header(meta, types)


def _check_supported(head: _Header) -> _Arch:
    import gguf

    arch_name = head.need("general.architecture")
    arch = _ARCHS.get(arch_name)
    if arch is None:
        raise UnsupportedGguf(
            f"GGUF architecture {arch_name!r} is not supported "
            f"(supported: {', '.join(sorted(_ARCHS))})"
        )
    unknown_names = sorted(
        n
        for n in head.tensor_types
        if _mlx_name(n) is None and not (n == _ROPE_FREQS and arch.rope_traditional)
    )
    if unknown_names:
        raise UnsupportedGguf(
            f"GGUF tensor {unknown_names[0]!r} has no counterpart in mlx-lm's "
            f"{arch.model_type} model ({len(unknown_names)} such tensors)"
        )
    readable = {t.name for t in gguf.GGMLQuantizationType if _dequantizable(t)}
    bad = sorted({t for t in head.tensor_types.values() if t not in readable})
    if bad:
        raise UnsupportedGguf(f"GGUF tensor type {', '.join(bad)} is not supported")
    model = head.need("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise UnsupportedGguf(
            f"GGUF tokenizer model {model!r} is not supported "
            "(byte-level BPE 'gpt2' and SentencePiece BPE 'llama' are)"
        )
    pre = head.get("tokenizer.ggml.pre", "default")
    if model == "gpt2" and pre not in PRE_TOKENIZERS:
        raise UnsupportedGguf(
            f"GGUF pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    return arch


def _dequantizable(t: Any) -> bool:
    import gguf
    import numpy as np

    if t.name in _MLX_TYPES:
        return True
    try:
        _, size = gguf.GGML_QUANT_SIZES[t]
        gguf.quants.dequantize(np.zeros((1, size), dtype=np.uint8), t)
    except (KeyError, NotImplementedError, ValueError, TypeError):
        return False
    return True


def _mlx_name(name: str) -> str | None:
    stem, _, suffix = name.rpartition(".")
    if suffix not in _SUFFIXES:
        return None
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


# --- the conversion -----------------------------------------------------------


def convert_gguf(src: Path, dest: Path, progress: Progress = lambda _: None) -> None:
    """Write the mlx-lm directory for GGUF file ``src`` into existing ``dest``.

    Raises ``UnsupportedGguf`` (naming what) before writing anything when the
    file cannot be served; ``ModelLoadError`` when it cannot be read.
    """
    import gguf

    progress(f"reading {src.name}")
    try:
        reader = gguf.GGUFReader(src)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {src} as GGUF: {exc}") from exc
    head = _read_header(reader)
    arch = _check_supported(head)
    progress("building the tokenizer")
    tokenizer_json, special = tokenizer(head)
    progress("converting the weights")
    weights = _weights(src, reader, head)
    rope_freqs = weights.pop(_ROPE_FREQS, None)
    config = _model_config(arch, head, weights, rope_freqs)
    progress("writing the model directory")
    _write_json(dest / "config.json", config)
    (dest / "tokenizer.json").write_text(tokenizer_json, "utf-8")
    _write_json(dest / "tokenizer_config.json", tokenizer_config(head, special))
    _write_json(dest / "generation_config.json", generation_config(head))
    _save(weights, dest / "model.safetensors")


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", "utf-8")


def _weights(src: Path, reader: gguf.GGUFReader, head: _Header) -> dict[str, mx.array]:
    import mlx.core as mx

    if set(head.tensor_types.values()) <= _MLX_TYPES:
        loaded: Any = mx.load(str(src))
        arrays: dict[str, mx.array] = loaded
    else:
        arrays = _decoded_by_gguf(reader)
    out = {}
    for name, array in arrays.items():
        mlx_name = _mlx_name(name) or name
        out[mlx_name] = array  # _check_supported saw every name: known, or rope_freqs
    return out


def _decoded_by_gguf(reader: gguf.GGUFReader) -> dict[str, mx.array]:
    """Every tensor as float16 (float32 kept), decoded by llama.cpp's reference code."""
    import gguf
    import mlx.core as mx
    import numpy as np

    out = {}
    for t in reader.tensors:
        data = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        array = mx.array(data)
        out[t.name] = array if t.tensor_type.name == "F32" else array.astype(mx.float16)
    return out


def _save(weights: Mapping[str, mx.array], path: Path) -> None:
    import mlx.core as mx

    mx.save_safetensors(str(path), dict(weights), metadata={"format": "mlx"})


def _bits(weights: Mapping[str, mx.array], module: str) -> int:
    w, scales = weights[f"{module}.weight"], weights[f"{module}.scales"]
    # uint32 columns hold in*bits/32 values; scales one per 32 inputs.
    return int(w.shape[-1] // scales.shape[-1])


def _quantization(weights: Mapping[str, mx.array]) -> dict[str, Any] | None:
    modules = [n.removesuffix(".scales") for n in weights if n.endswith(".scales")]
    if not modules:
        return None
    bits = {m: _bits(weights, m) for m in modules}
    common = Counter(bits.values()).most_common(1)[0][0]
    quant: dict[str, Any] = {"group_size": 32, "bits": common}
    for module, b in sorted(bits.items()):
        if b != common:
            quant[module] = {"group_size": 32, "bits": b}
    return quant


def _f32(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999e-06)."""
    return float(f"{float(value):.7g}")


def _llama3_rope_scaling(rope_freqs: Any, head_dim: int, base: float) -> dict[str, Any]:
    """mlx-lm's ``llama3`` rope_scaling for llama.cpp's ``rope_freqs`` factors.

    llama.cpp computes them from the checkpoint's factor, low/high frequency
    factors (1 and 4 in every Llama 3 release) and original context (8192);
    the factor is the largest value. The others are checked, not assumed:
    recomputing the tensor from them must give it back.
    """
    import numpy as np

    got = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    factor, old = float(f"{got.max():.6g}"), 8192
    scaling: dict[str, Any] = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": old,
    }
    low_wavelen, high_wavelen = old / 1.0, old / 4.0
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - 1.0) / (4.0 - 1.0)
    want = np.where(
        wavelen < high_wavelen,
        1.0,
        np.where(wavelen > low_wavelen, factor, 1 / ((1 - smooth) / factor + smooth)),
    )
    if want.shape != got.shape or not np.allclose(want, got, rtol=1e-4):
        raise UnsupportedGguf(
            "GGUF rope_freqs are not Llama 3's frequency scaling "
            f"(factor {factor}, low 1, high 4, original context {old})"
        )
    return scaling


def _model_config(
    arch: _Arch, head: _Header, weights: Mapping[str, Any], rope_freqs: Any = None
) -> dict[str, Any]:
    a = head.need("general.architecture")
    hidden = int(head.need(f"{a}.embedding_length"))
    heads = head.need(f"{a}.attention.head_count")
    kv_heads = head.get(f"{a}.attention.head_count_kv", heads)
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        raise UnsupportedGguf("GGUF files with per-layer head counts are not supported")
    head_dim = int(head.get(f"{a}.attention.key_length", hidden // heads))
    rope_dims = int(head.get(f"{a}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise UnsupportedGguf(
            f"GGUF rope.dimension_count {rope_dims} differs from the head size {head_dim} "
            "(partial rotary embeddings are not supported)"
        )
    tokens = head.need("tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(head.need(f"{a}.block_count")),
        "intermediate_size": int(head.need(f"{a}.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(head.need(f"{a}.attention.layer_norm_rms_epsilon")),
        "vocab_size": int(head.get(f"{a}.vocab_size", len(tokens))),
        "max_position_embeddings": int(head.get(f"{a}.context_length", 4096)),
        "rope_theta": _f32(head.get(f"{a}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in weights,
        "mlp_bias": False,
    }
    if arch.rope_traditional:
        config["rope_traditional"] = True
    scaling = head.get(f"{a}.rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {
            "type": "linear",
            "factor": float(head.need(f"{a}.rope.scaling.factor")),
        }
    elif scaling not in (None, "none"):
        raise UnsupportedGguf(f"GGUF rope scaling {scaling!r} is not supported")
    if rope_freqs is not None:
        if "rope_scaling" in config:
            raise UnsupportedGguf("GGUF file has both rope_freqs and a rope scaling type")
        config["rope_scaling"] = _llama3_rope_scaling(rope_freqs, head_dim, config["rope_theta"])
    quant = _quantization(weights)
    if quant is not None:
        config["quantization"] = quant
    return config
