"""Small random-weight demo models, built locally with no download.

``ensure_demo_model(kind, size)`` materialises a model directory that
``mlx_lm.load(path)`` accepts:

* ``dense``: a llama-style (``model_type: "llama"``) full-attention model, so
  every layer gets a plain, trimmable ``KVCache``.
* ``hybrid``: a dense Qwen 3.5-style (``model_type: "qwen3_5"``) model whose
  layers are gated-delta linear attention (``ArraysCache``, not trimmable)
  except every ``full_attention_interval``-th one, which is full attention
  (``KVCache``).
* ``vision``: a LLaVA-style (``model_type: "llava"``) vision-language model
  that mlx-vlm loads: a CLIP vision tower, a two-layer projector and the
  dense kind's llama language model, with the files its processor reads
  (``preprocessor_config.json`` for transformers' ``CLIPImageProcessor``,
  ``processor_config.json`` for mlx-vlm's ``LlavaProcessor``). Its tokenizer
  is the shared one plus an ``<image>`` token, which the chat template
  writes for an image part and the processor expands to one token per patch
  (16 for the tiny size's 32x32 pixels in 8x8 patches, 64 for bench's 112x112
  in 14x14).
* ``fim``: the dense kind with StarCoder's fill-in-the-middle tokens
  (``<fim_prefix>``, ``<fim_suffix>``, ``<fim_middle>``, special) appended
  after the trained vocabulary, for ``suffix`` and ``/infill``.

Three more kinds have the shapes of model families in the seed's catalog that
load differently from the others, for the loader's tests:

* ``ple``: a Gemma 4 E-series-style (``model_type: "gemma4"``, the text in
  ``text_config``) model with a per-layer embedding table
  (``embed_tokens_per_layer``, declared by ``vocab_size_per_layer_input`` and
  ``hidden_size_per_layer_input``), sliding-window and full attention layers,
  the last layers sharing earlier layers' KV (fewer caches than layers) and
  tied embeddings. Like the catalog's checkpoints it declares a vision config
  and ships ``preprocessor_config.json`` and vision and audio tensors, which
  the text model drops.
* ``ple-gemma3n``: the same for Gemma 3n (``model_type: "gemma3n"``: AltUp
  and Laurel blocks, per-layer feed-forward widths), its tensors named as
  Hugging Face's checkpoints name them (``model.language_model.*``,
  ``model.vision_tower.*``, ``model.audio_tower.*``).
* ``lfm2``: an LFM2.5-style (``model_type: "lfm2"``) model of short
  convolution and attention layers whose config gives the feed-forward width
  only as ``intermediate_size`` (no ``block_ff_dim``, which older mlx-lm and
  mlx-vlm required), with tied embeddings.
* ``qwen3_5-text``: the hybrid kind as a text-only Qwen 3.5 export: the
  multimodal architecture name (``Qwen3_5ForConditionalGeneration``), the text
  in ``text_config``, no vision config, only ``language_model.*`` tensors,
  sharded in two files with ``model.safetensors.index.json`` (the shape whose
  absent vision tower mlx-vlm's strict loading rejected for the seed).

Sizes: ``tiny`` (hidden 64, 4 layers, float32, about 2 MB) for tests and
``bench`` (hidden 512, 8 layers, bfloat16, 42-47 MB) so that prefill and
decode cost something measurable.

All kinds share one tokenizer: a byte-level BPE trained at build time,
deterministically, on the English text in ``data/corpus.txt``, with the
same normalizer, pre-tokenizer and decoder as Qwen's (transformers rebuilds
qwen3_5 tokenizers that way whatever tokenizer.json says, so only that
pipeline behaves the same for both kinds). Its alphabet is the byte symbols
of printable ASCII plus newline, so every id decodes on its own to valid
text; other characters encode to ``<unk>`` for the dense kind, while the
hybrid kind's Qwen3_5Tokenizer (whose BPE has no unk) drops them. mlx-lm
streams it with its ``BPEStreamingDetokenizer``, which, like decode, gives
back the text exactly, except that it drops the first character of the
output when that is a space. The first ten ids are fixed (see
``SPECIAL_TOKENS`` and ``CONTROL_TOKENS``).

The weights are random, drawn from explicit PRNG keys rather than the global
MLX random state, so a build is reproducible whatever else the process does. Generated text is
nonsense made of corpus word pieces. These adjustments make that useful to
tests:

* The ``lm_head`` rows of the added tokens (eos, ``<think>``,
  ``<tool_call>``, ...) are zero (with tied embeddings, their embedding
  rows; nearly zero in the Gemma 3n kind), so their logit is always 0 while
  ordinary tokens spread around it. Greedy decoding practically never picks them and generations
  run to ``max_tokens``; with sampling they stay possible but rare.
* The other ``lm_head`` rows are scaled by ``_LOGIT_SCALE`` so the logits
  have a standard deviation of about 2.3: sampling at temperature 1 is then
  peaked enough that each added token is unlikely (an eos, of two ids, comes
  about once in 14,000 steps) and not every step is a near-uniform draw.
* With tied embeddings (the ple, ple-gemma3n and lfm2 kinds) the embedding is the output
  layer: it is drawn at ``_TIED_EMBED_SCALE`` (at unit scale the input token
  dominated the residual stream and greedy decoding repeated it for ever) and
  the final norm's weight brings the logits' spread back to about 2.3.

Each directory name carries ``BUILDER_VERSION``: change it whenever the output
changes so that stale directories are not reused.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, cast, get_args

from ...mlx.model_source import cache_root, materialize

if TYPE_CHECKING:
    import mlx.core as mx

DemoKind = Literal["dense", "hybrid", "vision", "fim", "ple", "ple-gemma3n", "lfm2", "qwen3_5-text"]
DemoSize = Literal["tiny", "bench"]

BUILDER_VERSION: Final = "v2"

# Added tokens with special=True: skipped by decode(skip_special_tokens=True).
SPECIAL_TOKENS: Final = ("<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added tokens with special=False, so they survive decoding like Qwen's.
CONTROL_TOKENS: Final = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
# The trainer puts its special tokens first, so these ids are fixed; unk takes
# id 0 so that no eos id is 0 (a falsy id invites bugs in callers).
UNK_ID: Final = 0
ENDOFTEXT_ID: Final = 1
IM_START_ID: Final = 2
IM_END_ID: Final = 3
# The vision kind's image placeholder, appended after the trained vocabulary.
IMAGE_TOKEN: Final = "<image>"
# The fim kind's fill-in-the-middle tokens, appended after the trained vocabulary.
FIM_TOKENS: Final = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")

_SEED: Final = 1234
_LOGIT_SCALE: Final = 4.0
_TIED_EMBED_SCALE: Final = 0.03
_TIED_LOGIT_STD: Final = 2.3
_ADDED_ROW_SCALE: Final = 1e-4
# The norm before the output layer, in the tied kinds' parameter names.
_FINAL_NORMS: Final = (
    "language_model.model.norm.weight",
    "model.language_model.norm.weight",
    "model.embedding_norm.weight",
)
_TARGET_VOCAB: Final = 4096  # an upper bound: min_frequency=2 stops earlier
_MAX_POSITIONS: Final = 32768
# Qwen2/Qwen3.5's pre-tokenizer split (transformers' PRETOKENIZE_REGEX).
_QWEN_SPLIT: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DATA_DIR: Final = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class _Dims:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    # Gated delta (linear attention) layers of the hybrid kind.
    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    # The per-layer embedding width of the ple kind (per layer).
    per_layer: int
    dtype: Literal["float32", "bfloat16"]


def _dims(size: DemoSize) -> _Dims:
    if size == "tiny":
        return _Dims(
            hidden=64,
            layers=4,
            intermediate=128,
            heads=4,
            kv_heads=2,
            head_dim=16,
            linear_k_heads=2,
            linear_v_heads=4,
            linear_k_dim=32,
            linear_v_dim=16,
            per_layer=16,
            # Exact on every backend; the size does not matter at this scale.
            dtype="float32",
        )
    return _Dims(
        hidden=512,
        layers=8,
        intermediate=1024,
        heads=8,
        kv_heads=4,
        head_dim=64,
        linear_k_heads=4,
        linear_v_heads=8,
        linear_k_dim=64,
        linear_v_dim=64,
        per_layer=64,
        # Halves the file, and is faster than float32 on MLX's CPU backend too.
        dtype="bfloat16",
    )


def _check(kind: str, size: str) -> None:
    if kind not in get_args(DemoKind):
        raise ValueError(f"unknown demo model kind {kind!r}")
    if size not in get_args(DemoSize):
        raise ValueError(f"unknown demo model size {size!r}")


def default_root() -> Path:
    """``demo-models`` in the cache (``model_source.cache_root()``)."""
    return cache_root() / "demo-models"


def demo_model_path(
    kind: DemoKind = "dense", size: DemoSize = "tiny", root: Path | None = None
) -> Path:
    """Where the demo model lives (no I/O; it may not be built yet)."""
    _check(kind, size)
    return (root if root is not None else default_root()) / (f"{kind}-{size}-{BUILDER_VERSION}")


def ensure_demo_model(
    kind: DemoKind = "dense", size: DemoSize = "tiny", root: Path | None = None
) -> Path:
    """Build the demo model if it is missing and return its directory.

    Idempotent and safe against concurrent builders (``mlx.model_source.materialize``).
    """
    target = demo_model_path(kind, size, root)
    return materialize(
        target,
        lambda tmp: _build(kind, size, tmp),
        {
            "kind": kind,
            "size": size,
            "builder_version": BUILDER_VERSION,
            "seed": _SEED,
        },
    )


def _build(kind: DemoKind, size: DemoSize, dest: Path) -> None:
    dims = _dims(size)
    vocab_size = _write_tokenizer(dest, image_token=kind == "vision", fim=kind == "fim")
    config = _model_config(kind, dims, vocab_size)
    if kind == "vision":
        config = _vision_config(size, config, vocab_size)
        _write_processor(size, dest)
    elif kind in ("ple", "ple-gemma3n"):
        # The image processor's file, as the catalog's checkpoints ship it:
        # the loader must still serve the model as text.
        _write_processor(size, dest, llava=False)
    _write_json(dest / "config.json", config)
    _write_json(
        dest / "generation_config.json",
        {
            "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
            "pad_token_id": ENDOFTEXT_ID,
        },
    )
    _write_weights(kind, dims, config, dest)


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", "utf-8")


def _write_tokenizer(dest: Path, *, image_token: bool = False, fim: bool = False) -> int:
    """Train the BPE tokenizer and write its files; return the vocab size.
    With ``image_token`` the vocabulary ends with ``<image>`` (special), with
    ``fim`` with the fill-in-the-middle tokens (special)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    # The pipeline is exactly the one transformers' Qwen3_5Tokenizer rebuilds
    # from tokenizer.json's vocab and merges (it ignores the rest of the file)
    # for model_type qwen3_5, so the dense and hybrid kinds tokenize alike.
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # Byte-level symbols of printable ASCII and newline only: every token is
    # then whole ASCII text, never a fragment of a multi-byte character.
    alphabet = [_byte_symbol(b) for b in [0x0A, *range(0x20, 0x7F)]]
    trainer = trainers.BpeTrainer(
        vocab_size=_TARGET_VOCAB,
        min_frequency=2,
        special_tokens=[*SPECIAL_TOKENS, *CONTROL_TOKENS],
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    # One piece, so that merges across lines ("\n\n") are learnt too.
    corpus = (_DATA_DIR / "corpus.txt").read_text("utf-8")
    tok.train_from_iterator([corpus], trainer=trainer)

    # The trainer registers all of its special tokens as special; the control
    # tokens must not be, or decode(skip_special_tokens=True) drops them.
    spec = json.loads(tok.to_str())
    for added in spec["added_tokens"]:
        added["special"] = added["content"] not in CONTROL_TOKENS
        added["normalized"] = False
    tok = Tokenizer.from_str(json.dumps(spec))
    expected = [*SPECIAL_TOKENS, *CONTROL_TOKENS]
    if [tok.id_to_token(i) for i in range(len(expected))] != expected:
        raise RuntimeError("demo tokenizer: added tokens did not get ids 0..9")
    if image_token:
        tok.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    if fim:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in FIM_TOKENS])
    tok.save(str(dest / "tokenizer.json"))

    template = (_DATA_DIR / "chat_template.jinja").read_text("utf-8")
    _write_json(
        dest / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": "<unk>",
            "model_max_length": _MAX_POSITIONS,
            "clean_up_tokenization_spaces": False,
            "chat_template": template.rstrip("\n"),
        },
    )
    return int(tok.get_vocab_size(with_added_tokens=True))


def _byte_symbol(b: int) -> str:
    """The character GPT-2's byte-level mapping uses for byte ``b``."""
    # Printable ASCII maps to itself; the control bytes 0x00-0x20 come first
    # in the run of stand-ins that starts at U+0100 ("\n" -> "Ċ", " " -> "Ġ").
    return chr(b) if 0x21 <= b <= 0x7E else chr(0x100 + b)


def _model_config(kind: DemoKind, dims: _Dims, vocab_size: int) -> dict[str, Any]:
    common: dict[str, Any] = {
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": _MAX_POSITIONS,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": None,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "torch_dtype": dims.dtype,
    }
    if kind in ("dense", "vision", "fim"):
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            **common,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "mlp_bias": False,
        }
    if kind == "ple":
        return _ple_config(dims, common)
    if kind == "ple-gemma3n":
        return _gemma3n_config(dims, common)
    if kind == "lfm2":
        return _lfm2_config(dims, common)
    hybrid = _hybrid_config(dims, common)
    if kind == "hybrid":
        # Flat (no text_config): mlx-lm's qwen3_5 ModelArgs accepts both.
        return hybrid
    text = {**hybrid, "model_type": "qwen3_5_text"}
    del text["architectures"]
    # Multimodal rotary sections, as the exports keep them (mlx-lm's text
    # model rotates plain positions and ignores them; mlx-vlm requires them).
    text["rope_parameters"] = {**hybrid["rope_parameters"], "mrope_section": [1, 1, 0]}
    return {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text,
        "tie_word_embeddings": False,
        "eos_token_id": IM_END_ID,
        "torch_dtype": dims.dtype,
    }


def _hybrid_config(dims: _Dims, common: dict[str, Any]) -> dict[str, Any]:
    return {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForCausalLM"],
        **common,
        "rms_norm_eps": 1e-6,
        "full_attention_interval": 4,
        "linear_num_key_heads": dims.linear_k_heads,
        "linear_num_value_heads": dims.linear_v_heads,
        "linear_key_head_dim": dims.linear_k_dim,
        "linear_value_head_dim": dims.linear_v_dim,
        "linear_conv_kernel_dim": 4,
        "num_experts": 0,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
        },
    }


def _ple_config(dims: _Dims, common: dict[str, Any]) -> dict[str, Any]:
    layers = ["sliding_attention", "full_attention"] * (dims.layers // 2)
    text = {
        **common,
        "model_type": "gemma4_text",
        "num_key_value_heads": 1,
        "global_head_dim": 2 * dims.head_dim,
        "rms_norm_eps": 1e-6,
        # The per-layer embedding table: one row of layers x width per token.
        "vocab_size_per_layer_input": common["vocab_size"],
        "hidden_size_per_layer_input": dims.per_layer,
        # The last half of the layers reuse the KV of the last earlier layer
        # of their type, so the model keeps fewer caches than it has layers.
        "num_kv_shared_layers": dims.layers // 2,
        "layer_types": layers,
        "sliding_window": 128,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
    }
    return {
        "model_type": "gemma4",
        "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"model_type": "gemma4_vision", "hidden_size": dims.hidden},
        "vocab_size": common["vocab_size"],
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "torch_dtype": dims.dtype,
    }


def _gemma3n_config(dims: _Dims, common: dict[str, Any]) -> dict[str, Any]:
    text = {
        **common,
        "model_type": "gemma3n_text",
        "intermediate_size": [dims.intermediate] * dims.layers,
        "rms_norm_eps": 1e-6,
        "vocab_size_per_layer_input": common["vocab_size"],
        "hidden_size_per_layer_input": dims.per_layer,
        "num_kv_shared_layers": dims.layers // 2,
        "layer_types": ["sliding_attention", "full_attention"] * (dims.layers // 2),
        "sliding_window": 128,
        "rope_local_base_freq": 10000.0,
        "rope_theta": 1000000.0,
        "final_logit_softcapping": 30.0,
        "activation_sparsity_pattern": [0.0] * dims.layers,
        "altup_num_inputs": 4,
        "altup_coef_clip": 120.0,
        "altup_correct_scale": True,
        "altup_active_idx": 0,
        "laurel_rank": 8,
        "tie_word_embeddings": True,
    }
    return {
        "model_type": "gemma3n",
        "architectures": ["Gemma3nForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"model_type": "gemma3n_vision", "hidden_size": dims.hidden},
        "audio_config": {"model_type": "gemma3n_audio", "hidden_size": dims.hidden},
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "torch_dtype": dims.dtype,
    }


def _lfm2_config(dims: _Dims, common: dict[str, Any]) -> dict[str, Any]:
    # Conv, conv, attention, ...: LFM2's pattern of short convolutions
    # (ArraysCache) with attention (KVCache) every third layer.
    kinds = ["conv", "conv", "full_attention"]
    config = {
        **common,
        "model_type": "lfm2",
        "architectures": ["Lfm2ForCausalLM"],
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": dims.hidden,
        "block_multiple_of": 32,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": True,
        # The feed-forward width as LFM2.5 exports give it: intermediate_size
        # only (mlx-lm 0.31 and mlx-vlm 0.6 required block_ff_dim).
        "intermediate_size": 3 * dims.intermediate // 2,
        "layer_types": [kinds[i % 3] for i in range(dims.layers)],
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    }
    del config["head_dim"]  # hidden_size // heads
    return config


def _vision_config(size: DemoSize, text: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """A LLaVA config around the dense kind's text config."""
    image, patch, hidden, layers = (32, 8, 32, 2) if size == "tiny" else (112, 14, 256, 4)
    return {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "text_config": text,
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": hidden,
            "intermediate_size": hidden * 2,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "image_size": image,
            "patch_size": patch,
            "projection_dim": hidden,
            "num_channels": 3,
            "layer_norm_eps": 1e-5,
        },
        # The <image> token is the last id of the vocabulary.
        "image_token_index": vocab_size - 1,
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "vocab_size": vocab_size,
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "torch_dtype": text["torch_dtype"],
    }


def _write_processor(size: DemoSize, dest: Path, *, llava: bool = True) -> None:
    image, patch = (32, 8) if size == "tiny" else (112, 14)
    _write_json(
        dest / "preprocessor_config.json",
        {
            "image_processor_type": "CLIPImageProcessor",
            "do_resize": True,
            "size": {"shortest_edge": image},
            "do_center_crop": True,
            "crop_size": {"height": image, "width": image},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            # CLIP's own statistics, as real LLaVA checkpoints ship them.
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "do_convert_rgb": True,
            "resample": 3,
        },
    )
    if not llava:
        return
    _write_json(
        dest / "processor_config.json",
        {
            "processor_class": "LlavaProcessor",
            "patch_size": patch,
            "vision_feature_select_strategy": "default",
            "num_additional_image_tokens": 1,
            "image_token": IMAGE_TOKEN,
        },
    )


def _demo_module(kind: DemoKind, config: dict[str, Any]) -> Any:
    """The model class that ``load()`` builds for ``config``, instantiated
    only for its parameter names and shapes."""
    if kind == "vision":
        from mlx_vlm.models import llava

        cfg = llava.ModelConfig.from_dict(config)
        cfg.text_config = llava.TextConfig.from_dict(config["text_config"])
        cfg.vision_config = llava.VisionConfig.from_dict(config["vision_config"])
        return llava.Model(cfg)
    from mlx_lm.models import gemma3n, gemma4, lfm2, llama, qwen3_5

    by_kind = {"dense": llama, "fim": llama, "ple": gemma4, "ple-gemma3n": gemma3n, "lfm2": lfm2}
    arch = by_kind.get(kind, qwen3_5)
    return arch.Model(arch.ModelArgs.from_dict(config))


def _write_weights(kind: DemoKind, dims: _Dims, config: dict[str, Any], dest: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    # Its own (global-RNG) initial values are replaced below.
    model = _demo_module(kind, config)
    params = sorted(cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters())))
    keys = mx.random.split(mx.random.key(_SEED), len(params))
    dtype = mx.bfloat16 if dims.dtype == "bfloat16" else mx.float32
    tied = bool((config.get("text_config") or config).get("tie_word_embeddings"))
    weights: dict[str, mx.array] = {}
    for i, (name, value) in enumerate(params):
        w = _init_param(name, tuple(value.shape), keys[i], tied=tied)
        # A_log stays float32 as in real checkpoints (see cast_predicate).
        weights[name] = w if name.endswith("A_log") else w.astype(dtype)
    if kind == "ple":
        # A tensor of each tower and projector, named as mlx-vlm exports the
        # catalog's multimodal checkpoints: the text model's sanitize drops them.
        for tower in ("vision_tower.patch_embedder", "embed_vision.embedding_projection"):
            weights[f"{tower}.weight"] = mx.zeros((dims.hidden, 48), dtype)
        weights["audio_tower.subsample_conv_projection.weight"] = mx.zeros((dims.hidden, 48), dtype)
    elif kind == "ple-gemma3n":
        for tower in ("vision_tower", "audio_tower", "embed_vision", "embed_audio"):
            weights[f"model.{tower}.embedding.weight"] = mx.zeros((dims.hidden, 48), dtype)
    mx.eval(weights)
    # MLX-native names and layouts: qwen3_5's sanitize then changes nothing
    # (conv1d weights are already (C, K, 1), so no +1 shift of the norms).
    if kind != "qwen3_5-text":
        mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
        return
    # Two shards and their index, as the text-only exports come.
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, part in shards.items():
        shard = {n: weights[n] for n in part}
        mx.save_safetensors(str(dest / file), shard, metadata={"format": "mlx"})
    _write_json(
        dest / "model.safetensors.index.json",
        {
            "metadata": {"total_size": sum(w.nbytes for w in weights.values())},
            "weight_map": {n: file for file, part in shards.items() for n in part},
        },
    )


def _init_param(name: str, shape: tuple[int, ...], key: mx.array, *, tied: bool) -> mx.array:
    import mlx.core as mx

    if tied and name in _FINAL_NORMS:
        # A normed hidden state has length sqrt(width): logits of std
        # scale * weight * sqrt(width).
        return mx.full(shape, _TIED_LOGIT_STD / (_TIED_EMBED_SCALE * shape[0] ** 0.5))
    if name.endswith("norm.weight") or name.endswith("dt_bias"):
        return mx.ones(shape)
    if name.endswith("layer_scalar"):
        return mx.ones(shape)
    if len(shape) == 1 and "norm" in name and name.endswith(".weight"):
        return mx.ones(shape)  # the vision tower's layer_norm1 / pre_layrnorm ...
    if name.endswith("class_embedding") or name.endswith("position_embedding.weight"):
        return mx.random.normal(shape, key=key) * 0.02
    if name.endswith(".bias"):
        return mx.zeros(shape)
    if name.endswith("A_log"):
        # Decay rates as in the reference init, kept away from log(0).
        return mx.log(mx.random.uniform(1.0, 16.0, shape, key=key))
    if name.endswith("embed_tokens.weight"):
        # Unit scale: the input token stays prominent in the residual stream
        # (every layer is pre-normed, so nothing downstream needs it smaller).
        w = mx.random.normal(shape, key=key)
        if tied:
            # The output layer too: the added tokens' rows are zero, as the
            # lm_head rows are below. Gemma 3n's AltUp divides by the
            # magnitude of a token's embedding, so there they are merely
            # small (their logits then within about 0.01 of 0).
            n_added = len(SPECIAL_TOKENS) + len(CONTROL_TOKENS)
            added = w * _ADDED_ROW_SCALE if name.startswith("model.language_model.") else 0.0
            w = mx.where(mx.arange(shape[0])[:, None] < n_added, added, w * _TIED_EMBED_SCALE)
        return w
    fan_in = 1
    for d in shape[1:]:
        fan_in *= d
    bound = fan_in**-0.5
    w = mx.random.uniform(-bound, bound, shape, key=key)
    if name.endswith("lm_head.weight"):
        # See the module docstring: zero rows for the added tokens, sharper
        # logits for the rest.
        n_added = len(SPECIAL_TOKENS) + len(CONTROL_TOKENS)
        row = mx.arange(shape[0])[:, None]
        w = mx.where(row < n_added, 0.0, w * _LOGIT_SCALE)
        if name.startswith("language_model."):
            # Never generate the vision kind's <image> (the last id); the
            # qwen3_5 kinds' last piece is zeroed too, as it always was.
            w = mx.where(row == shape[0] - 1, 0.0, w)
    return w


def main(argv: list[str] | None = None) -> int:
    """Build one demo model (default: dense tiny) and print its directory."""
    parser = argparse.ArgumentParser(description="Build a random-weight demo model.")
    parser.add_argument("--kind", choices=get_args(DemoKind), default="dense")
    parser.add_argument("--size", choices=get_args(DemoSize), default="tiny")
    parser.add_argument("--root", type=Path, default=None)
    args = parser.parse_args(argv)
    print(ensure_demo_model(args.kind, args.size, args.root))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
