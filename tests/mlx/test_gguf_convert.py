"""GGUF conversion checked against a model whose truth is known: the tiny
dense demo model, written out as llama.cpp writes a llama GGUF (Q and K rows
permuted for interleaved RoPE, llama.cpp tensor names, the tokenizer as
vocabulary, merges and token types) with llama.cpp's own ``gguf`` package,
then converted back and compared - logits, token ids, chat template.

F32 files must reproduce the model exactly; Q8_0 files go through MLX's
quantized form, Q5_0 files through ``gguf.quants`` decoding. Files the
converter cannot serve are refused with a message that names what.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from gezel_trio.mlx.gguf import UnsupportedGguf, convert_gguf
from gezel_trio.mlx.model_source import ensure_gguf_converted
from gezel_trio.testing.demo_models import CONTROL_TOKENS, SPECIAL_TOKENS

Q = gguf.GGMLQuantizationType

_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gguf_name(name: str) -> str:
    stem, suffix = name.rsplit(".", 1)
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}.{suffix}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows."""
    split = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
    return split.swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    model_dir: Path,
    path: Path,
    *,
    qtype: gguf.GGMLQuantizationType = Q.F32,
    arch: str = "llama",
    pre: str = "qwen2",
    add_bos: bool = False,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [
        gguf.TokenType.CONTROL
        if t in SPECIAL_TOKENS
        else gguf.TokenType.USER_DEFINED
        if t in CONTROL_TOKENS
        else gguf.TokenType.NORMAL
        for t in tokens
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(2)
    w.add_eos_token_id(3)
    w.add_pad_token_id(1)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(template)
    if extra is not None:
        extra(w)
    weights = mx.load(str(model_dir / "model.safetensors"))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for name, value in sorted(weights.items()):
        a = np.array(value.astype(mx.float32))
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = _permute(a, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            a = _permute(a, kv_heads)
        if a.ndim == 2 and qtype != Q.F32:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    model, _ = load(str(model_dir))
    out = model(mx.array([ids]))
    return np.array(out.astype(mx.float32))[0]


def _convert(tmp_path: Path, name: str, **kw: Any) -> Path:
    src = tmp_path / f"{name}.gguf"
    write_gguf(kw.pop("model_dir"), src, **kw)
    dest = tmp_path / name
    dest.mkdir()
    convert_gguf(src, dest)
    return dest


IDS = [5, 17, 300, 42, 9, 1000, 77, 3, 250, 11, 512, 64]


@pytest.mark.parametrize(
    ("qtype", "tolerance"),
    [(Q.F32, 1e-4), (Q.Q8_0, 0.15), (Q.Q5_0, 1.0)],
    ids=["f32", "q8_0-mlx-quantized", "q5_0-decoded-by-gguf"],
)
def test_converted_model_computes_the_same_logits(
    tmp_path: Path, dense_model: Path, qtype: gguf.GGMLQuantizationType, tolerance: float
) -> None:
    dest = _convert(tmp_path, qtype.name, model_dir=dense_model, qtype=qtype)
    config = json.loads((dest / "config.json").read_text())
    assert config["rope_traditional"] is True  # Q/K came permuted
    assert ("quantization" in config) == (qtype == Q.Q8_0)
    want, got = _logits(dense_model, IDS), _logits(dest, IDS)
    assert np.abs(want - got).max() < tolerance
    # The greedy continuation agrees at every position.
    assert (want.argmax(-1) == got.argmax(-1)).mean() >= (1.0 if qtype == Q.F32 else 0.9)


def test_tokenizer_ids_and_chat_template_match_the_original(
    tmp_path: Path, dense_model: Path
) -> None:
    from transformers import AutoTokenizer

    dest = _convert(tmp_path, "tok", model_dir=dense_model)
    original = AutoTokenizer.from_pretrained(str(dense_model), local_files_only=True)
    converted = AutoTokenizer.from_pretrained(str(dest), local_files_only=True)
    texts = [
        "The quick brown fox, 12345 and 6.",
        "  spaces\n\n\nlines   end  ",
        "<|im_start|>user\nhi<think>x</think><tool_call>{}</tool_call><|im_end|>",
        "don't won't I'll we've",
    ]
    for text in texts:
        ids = converted.encode(text, add_special_tokens=False)
        assert ids == original.encode(text, add_special_tokens=False), text
        assert converted.decode(ids) == text
    # Control tokens are special, user-defined ones (<think>) are not.
    assert converted.decode([3, 4], skip_special_tokens=True) == "<think>"
    messages = [{"role": "user", "content": "hi"}]
    assert converted.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    ) == original.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    generation = json.loads((dest / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [3]


def test_add_bos_token_puts_one_bos_first(tmp_path: Path, dense_model: Path) -> None:
    from transformers import AutoTokenizer

    dest = _convert(tmp_path, "bos", model_dir=dense_model, add_bos=True)
    tok = AutoTokenizer.from_pretrained(str(dest), local_files_only=True)
    ids = tok.encode("hello")
    assert ids[0] == 2
    assert ids.count(2) == 1


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"arch": "gpt2"}, "architecture 'gpt2'"),
        ({"pre": "mystery-pre"}, "pre-tokenizer 'mystery-pre'"),
        (
            {
                # A mixture-of-experts router: no such tensor in a dense llama.
                "extra": lambda w: w.add_tensor(
                    "blk.0.ffn_gate_inp.weight", np.ones((4, 64), np.float32)
                )
            },
            "tensor 'blk.0.ffn_gate_inp.weight'",
        ),
        (
            {
                "extra": lambda w: w.add_tensor(
                    "blk.0.ffn_up.bias", np.zeros((1, 40), np.uint8), raw_dtype=Q.Q8_1
                )
            },
            "tensor type Q8_1",
        ),
    ],
    ids=["architecture", "pre-tokenizer", "tensor-name", "tensor-type"],
)
def test_unsupported_files_are_refused_by_name(
    tmp_path: Path, dense_model: Path, kw: dict[str, Any], named: str
) -> None:
    src = tmp_path / "bad.gguf"
    write_gguf(dense_model, src, **kw)
    with pytest.raises(UnsupportedGguf, match=named.replace("(", r"\(")):
        convert_gguf(src, tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_a_gguf_file_is_converted_once_and_found_by_its_hash(
    tmp_path: Path, dense_model: Path
) -> None:
    src = tmp_path / "m.gguf"
    write_gguf(dense_model, src)
    seen: list[str] = []
    first = ensure_gguf_converted(src, root=tmp_path / "cache", progress=seen.append)
    assert any("converting" in s for s in seen)
    copy = tmp_path / "elsewhere.gguf"
    copy.write_bytes(src.read_bytes())
    seen.clear()
    again = ensure_gguf_converted(copy, root=tmp_path / "cache", progress=seen.append)
    assert again == first  # same content, same conversion, whatever the file's name
    assert ensure_gguf_converted(src, root=tmp_path / "cache", progress=seen.append) == first
    assert not any("converting" in s for s in seen)


# --- SentencePiece vocabularies (Llama 2 / Mistral-style files) -------------


def _sentencepiece() -> Any:
    """A SentencePiece BPE model trained here on the demo corpus, with the
    options of Llama's: byte fallback, digits split, a dummy prefix, no
    normalization."""
    import io

    import sentencepiece as spm

    from gezel_trio.testing.demo_models._builder import _DATA_DIR

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter((_DATA_DIR / "corpus.txt").read_text("utf-8").splitlines()),
        model_writer=model,
        vocab_size=600,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        add_dummy_prefix=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        user_defined_symbols=["<think>"],
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def write_sentencepiece_gguf(sp: Any, path: Path) -> None:
    """A one-layer llama with random weights and ``sp``'s vocabulary, as
    llama.cpp's converter writes a tokenizer.model."""
    n = sp.get_piece_size()
    types = []
    for i in range(n):
        if sp.is_unknown(i):
            types.append(gguf.TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(gguf.TokenType.CONTROL)
        elif sp.is_byte(i):
            types.append(gguf.TokenType.BYTE)
        elif sp.id_to_piece(i) == "<think>":
            types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    w = gguf.GGUFWriter(str(path), "llama")
    hidden, heads, ffn = 64, 4, 128
    for add in (
        lambda: w.add_block_count(1),
        lambda: w.add_context_length(512),
        lambda: w.add_embedding_length(hidden),
        lambda: w.add_feed_forward_length(ffn),
        lambda: w.add_head_count(heads),
        lambda: w.add_head_count_kv(heads),
        lambda: w.add_layer_norm_rms_eps(1e-5),
        lambda: w.add_tokenizer_model("llama"),
        lambda: w.add_token_list([sp.id_to_piece(i) for i in range(n)]),
        lambda: w.add_token_scores([sp.get_score(i) for i in range(n)]),
        lambda: w.add_token_types(types),
        lambda: w.add_unk_token_id(0),
        lambda: w.add_bos_token_id(1),
        lambda: w.add_eos_token_id(2),
        lambda: w.add_add_bos_token(True),
        lambda: w.add_add_space_prefix(True),
    ):
        add()
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (n, hidden),
        "output_norm.weight": (hidden,),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (hidden, hidden),
        "blk.0.attn_k.weight": (hidden, hidden),
        "blk.0.attn_v.weight": (hidden, hidden),
        "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_gate.weight": (ffn, hidden),
        "blk.0.ffn_up.weight": (ffn, hidden),
        "blk.0.ffn_down.weight": (hidden, ffn),
    }
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32) * 0.05)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Text that starts with a space is left out: like transformers' Llama
# tokenizer (Metaspace, prepend_scheme="first"), the rebuilt one adds no "▁"
# before a leading space, where SentencePiece adds its dummy prefix anyway.
SP_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world  2024, and 3.14 people!",
    "spaces  inside and\nnew lines\n\n  indented",
    "Ünïcödé: naïve café, 日本語, emoji 👋🏽 - all through byte fallback.",
    "a <think> user-defined piece </s> inside",
    "trailing space ",
]


def test_sentencepiece_vocabulary_encodes_as_sentencepiece_does(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    sp = _sentencepiece()
    src = tmp_path / "spm.gguf"
    write_sentencepiece_gguf(sp, src)
    dest = tmp_path / "spm"
    dest.mkdir()
    convert_gguf(src, dest)
    tok = AutoTokenizer.from_pretrained(str(dest), local_files_only=True)
    for text in SP_CORPUS:
        if "</s>" in text:
            continue  # SentencePiece spells control tokens out; the HF side matches them
        want = sp.encode(text)
        got = tok.encode(text, add_special_tokens=False)
        assert got == want, (text, tok.convert_ids_to_tokens(got), sp.encode(text, out_type=str))
        assert tok.decode(got) == text
    # add_bos_token: one BOS first.
    assert tok.encode("Hi") == [1, *sp.encode("Hi")]
    # mlx-lm streams it with its SentencePiece detokenizer, text intact.
    _, wrapper = load(str(dest))
    detok = wrapper.detokenizer
    detok.reset()
    for i in sp.encode(SP_CORPUS[3]):
        detok.add_token(i)
    detok.finalize()
    assert detok.text == SP_CORPUS[3]
    assert type(detok).__name__ == "SPMStreamingDetokenizer"


# --- Llama 3.1+ long-context RoPE ------------------------------------------


def _llama3_rope_factors(config: dict[str, Any]) -> np.ndarray:
    """llama.cpp's rope_freqs for ``config``, from mlx-lm's own Llama3RoPE."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    dims, base = config["head_dim"], config["rope_theta"]
    rope = Llama3RoPE(dims, traditional=True, base=base, scaling_config=config["rope_scaling"])
    periods = base ** (mx.arange(0, dims, 2) / dims)
    return np.array(rope._freqs / periods, dtype=np.float32)


def test_llama3_rope_freqs_become_llama3_rope_scaling(tmp_path: Path, dense_model: Path) -> None:
    import shutil

    scaled = tmp_path / "scaled"
    shutil.copytree(dense_model, scaled)
    config = json.loads((scaled / "config.json").read_text())
    config["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    (scaled / "config.json").write_text(json.dumps(config))
    factors = _llama3_rope_factors(config)
    assert len(set(factors.round(4).tolist())) > 2  # scaled, smoothed and untouched bands
    dest = _convert(
        tmp_path,
        "llama3",
        model_dir=scaled,
        extra=lambda w: w.add_tensor("rope_freqs.weight", factors),
    )
    assert json.loads((dest / "config.json").read_text())["rope_scaling"] == config["rope_scaling"]
    want, got = _logits(scaled, IDS), _logits(dest, IDS)
    assert np.abs(want - got).max() < 1e-4

    bad = tmp_path / "bad.gguf"
    noise = np.random.default_rng(0).uniform(1, 8, factors.shape).astype(np.float32)
    write_gguf(scaled, bad, extra=lambda w: w.add_tensor("rope_freqs.weight", noise))
    with pytest.raises(UnsupportedGguf, match="rope_freqs are not Llama 3's"):
        convert_gguf(bad, tmp_path)


# --- Qwen2 and Qwen3 (no Q/K permutation; attention biases, Q/K norms) ----


def _random_model(kind: str, dense_model: Path, dest: Path) -> Path:
    """A small random-weight mlx-lm model of ``kind``, on the demo tokenizer."""
    import importlib
    import shutil

    from mlx.utils import tree_flatten

    vocab = json.loads((dense_model / "config.json").read_text())["vocab_size"]
    config: dict[str, Any] = {
        "model_type": kind,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        # Qwen2 ties its embeddings here, Qwen3 has its own lm_head.
        "tie_word_embeddings": kind == "qwen2",
    }
    arch = importlib.import_module(f"mlx_lm.models.{kind}")
    mx.random.seed(7)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    dest.mkdir()
    mx.save_safetensors(str(dest / "model.safetensors"), weights)
    (dest / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(dense_model / name, dest / name)
    return dest


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_files_compute_the_same_logits(tmp_path: Path, dense_model: Path, kind: str) -> None:
    original = _random_model(kind, dense_model, tmp_path / "original")
    dest = _convert(tmp_path, kind, model_dir=original, arch=kind)
    config = json.loads((dest / "config.json").read_text())
    assert config["model_type"] == kind
    assert "rope_traditional" not in config  # Qwen files keep the original Q/K order
    if kind == "qwen2":
        assert config["attention_bias"] is True
    want, got = _logits(original, IDS), _logits(dest, IDS)
    assert np.abs(want - got).max() < 1e-4


def test_k_quants_are_decoded_as_llama_cpp_decodes_them(tmp_path: Path, dense_model: Path) -> None:
    """MLX's own GGUF reader decodes Q4_K blocks differently from llama.cpp
    (measured: a whole sub-block off), so such files go through gguf.quants."""
    rng = np.random.default_rng(3)
    block_bytes = gguf.GGML_QUANT_SIZES[Q.Q4_K][1]
    raw = rng.integers(0, 256, (128, block_bytes), dtype=np.uint8)  # 128 rows of 256 values
    raw[:, 1] &= 0x3B  # keep the f16 scales (bytes 0-3) finite and modest
    raw[:, 3] &= 0x3B

    def add_q4k(w: gguf.GGUFWriter) -> None:
        w.add_tensor("blk.0.ffn_up.bias", raw, raw_dtype=Q.Q4_K)

    dest = _convert(tmp_path, "q4k", model_dir=dense_model, extra=add_q4k)
    got = mx.load(str(dest / "model.safetensors"))["model.layers.0.mlp.up_proj.bias"]
    want = gguf.quants.dequantize(raw, Q.Q4_K).astype(np.float16)
    assert np.array_equal(np.array(got), want)


def test_half_scaled_weights_are_widened_in_float32_as_llama_cpp_does() -> None:
    """A quantized layer with half-precision scales and biases (as a Q4_1
    file converts) held as float32: each weight is ``q * scale + bias``
    computed in float32 from the half values, not rounded to half first."""
    import mlx.nn as nn

    from gezel_trio.mlx.loading import hold_float32

    rng = np.random.default_rng(7)
    layer = nn.QuantizedLinear(64, 8, bias=False, group_size=32, bits=4)
    layer.scales = mx.array(rng.uniform(0.01, 0.1, (8, 2)), dtype=mx.float16)
    layer.biases = mx.array(rng.uniform(-0.5, 0.5, (8, 2)), dtype=mx.float16)
    codes = np.asarray(rng.integers(0, 16, (8, 64)), dtype=np.uint32)
    layer.weight = mx.array((codes.reshape(8, 8, 8) << (4 * np.arange(8))).sum(-1, dtype=np.uint32))
    holder = nn.Module()
    holder.proj = layer
    hold_float32(holder)
    got = np.array(holder.proj.weight)
    assert got.dtype == np.float32
    scales = np.repeat(np.array(layer.scales.astype(mx.float32)), 32, axis=1)
    biases = np.repeat(np.array(layer.biases.astype(mx.float32)), 32, axis=1)
    want = codes.astype(np.float32) * scales + biases
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # Rounded to half first, the weights would be off by up to half's step.
    assert not np.allclose(want.astype(np.float16).astype(np.float32), want, rtol=1e-6, atol=1e-7)
