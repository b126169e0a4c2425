"""A GGUF file's tokenizer, rebuilt with ``tokenizers`` from its metadata
(``mlx.gguf``): ``tokenizer.json``, ``tokenizer_config.json`` and
``generation_config.json``.

``tokenizer.ggml.model = "gpt2"`` is a byte-level BPE whose pre-tokenizer
is chosen from ``tokenizer.ggml.pre``; ``"llama"`` is a SentencePiece BPE
whose merges are derived from the pieces' scores.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Protocol

import attrs

from ..core.errors import ModelLoadError

__all__ = [
    "PRE_TOKENIZERS",
    "Header",
    "UnsupportedGguf",
    "generation_config",
    "tokenizer",
    "tokenizer_config",
]


class Header(Protocol):
    """A GGUF file's metadata (``gguf._Header``)."""

    def get(self, key: str, default: Any = None) -> Any: ...

    def need(self, key: str) -> Any: ...


class UnsupportedGguf(ModelLoadError):
    """The file uses an architecture, tokenizer or tensor type this converter
    does not handle; the message names it."""


def _unsupported(message: str) -> ModelLoadError:
    return UnsupportedGguf(message)


@attrs.frozen
class _PreTokenizer:
    """How one ``tokenizer.ggml.pre`` value splits text before BPE."""

    split: str | None  # a Split regex, applied before a regex-free ByteLevel
    digits: bool = False  # Digits(individual_digits) before a GPT-2 ByteLevel
    nfc: bool = False
    ignore_merges: bool = False


_GPT2: Final = _PreTokenizer(split=None)
_LLAMA3_SPLIT: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The values llama.cpp writes, mapped to the pipelines of the original
# tokenizer.json files of those families.
PRE_TOKENIZERS: Final = {
    "gpt-2": _GPT2,
    "smollm": _PreTokenizer(split=None, digits=True),
    "starcoder": _PreTokenizer(split=None, digits=True),
    "refact": _PreTokenizer(split=None, digits=True),
    "llama-bpe": _PreTokenizer(split=_LLAMA3_SPLIT, ignore_merges=True),
    "qwen2": _PreTokenizer(split=_QWEN2_SPLIT, nfc=True),
}

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_NORMAL: Final = 1
_CONTROL: Final = 3
_USER_DEFINED: Final = 4


def tokenizer(head: Header) -> tuple[str, dict[str, str | None]]:
    """``tokenizer.json`` text, and the special tokens by role."""
    from tokenizers import AddedToken, processors

    tokens: list[str] = list(head.need("tokenizer.ggml.tokens"))
    types: list[int] = list(head.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if len(vocab) != len(tokens):
        raise _unsupported("GGUF vocabulary repeats a token; ids would not round-trip")
    if head.need("tokenizer.ggml.model") == "llama":
        tok = _sentencepiece_bpe(head, tokens, types, vocab)
    else:
        tok = _byte_level_bpe(head, vocab)

    # Added tokens keep their vocabulary ids; control tokens are special
    # (skipped by decode(skip_special_tokens=True)), user-defined ones are not.
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _USER_DEFINED
        ]
    )

    special = {
        role: _token(head, tokens, f"tokenizer.ggml.{role}_token_id")
        for role in ("bos", "eos", "unk", "padding")
    }
    bos = special["bos"]
    if bos is not None and head.get("tokenizer.ggml.add_bos_token", False):
        bos_id = tokens.index(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
    elif head.need("tokenizer.ggml.model") == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    text: str = tok.to_str()
    return text, special


def _byte_level_bpe(head: Header, vocab: dict[str, int]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    merges = [tuple(m.split(" ")) for m in head.need("tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise _unsupported("GGUF merges must be pairs of tokens separated by one space")
    pre = PRE_TOKENIZERS[head.get("tokenizer.ggml.pre", "default")]
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre.ignore_merges,
        )
    )
    if pre.nfc:
        tok.normalizer = normalizers.NFC()
    if pre.split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pre.split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre.digits:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


_SPACE: Final = "\u2581"  # SentencePiece's "▁"


def _sentencepiece_bpe(
    head: Header, tokens: list[str], types: list[int], vocab: dict[str, int]
) -> Any:
    """Llama 2 / Mistral-style SentencePiece BPE, as transformers writes it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    scores: list[float] = list(head.need("tokenizer.ggml.scores"))
    if len(scores) != len(tokens):
        raise _unsupported("GGUF tokenizer.ggml.scores does not match the vocabulary")
    unk = _token(head, tokens, "tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges_by_score(tokens, types, scores, vocab),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = "first" if head.get("tokenizer.ggml.add_space_prefix", True) else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE, prepend_scheme=prefix, split=False
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix == "first":
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _merges_by_score(
    tokens: list[str], types: list[int], scores: list[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Every split of a normal piece into two pieces, highest-scoring piece
    first (SentencePiece BPE merges the best-scoring pair first); ties keep
    vocabulary order, as transformers' SentencePieceExtractor does."""
    ranked: list[tuple[float, int, int, int]] = []
    for i, (piece, ty) in enumerate(zip(tokens, types, strict=True)):
        if ty != _NORMAL:
            continue
        for k in range(1, len(piece)):
            left, right = vocab.get(piece[:k]), vocab.get(piece[k:])
            if left is not None and right is not None:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    return [(tokens[left], tokens[right]) for _, _, left, right in ranked]


def _token(head: Header, tokens: list[str], key: str) -> str | None:
    i = head.get(key)
    return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None


def tokenizer_config(head: Header, special: Mapping[str, str | None]) -> dict[str, Any]:
    a = head.need("general.architecture")
    config: dict[str, Any] = {
        # The generic class reads tokenizer.json as written; a family class
        # (LlamaTokenizerFast, Qwen2Tokenizer) would rebuild its own pipeline.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": special["bos"],
        "eos_token": special["eos"],
        "unk_token": special["unk"],
        "pad_token": special["padding"],
        "add_bos_token": bool(head.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(head.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(head.get(f"{a}.context_length", 4096)),
    }
    template = head.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    return config


def generation_config(head: Header) -> dict[str, Any]:
    # End of turn and end of message end a generation as EOS does: they join the stop set.
    eos = [
        i
        for key in ("eos", "eot", "eom")
        if isinstance(i := head.get(f"tokenizer.ggml.{key}_token_id"), int)
    ]
    config: dict[str, Any] = {"eos_token_id": sorted(set(eos))}
    for key, name in (("bos", "bos_token_id"), ("padding", "pad_token_id")):
        value = head.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(value, int):
            config[name] = value
    return config
