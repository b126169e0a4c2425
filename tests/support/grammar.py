"""What a grammar accepts, checked with llguidance's own matcher over a
byte-level tokenizer built in-process with ``tokenizers`` (one token per
byte plus a markup's special tokens), so any text can be fed and the result
is exactly the grammar's language, independent of any model."""

from __future__ import annotations

from typing import Any

import llguidance
from tokenizers import Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel

from gezel_trio.shaping.grammar import Constraint, build_constraint, parser_limits

# The Hermes markup's special tokens, and its think tags.
SPECIALS = ["<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]


def byte_tokenizer(specials: list[str]) -> Any:
    alphabet = sorted(ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    eos = tok.token_to_id("<|im_end|>") if "<|im_end|>" in specials else 0
    return llguidance.LLTokenizer(tok.to_str(), eos_token=eos)


def build(**kw: Any) -> Constraint | None:
    args: dict[str, Any] = {
        "response_format": None,
        "tools": None,
        "tool_choice": None,
        "tool_grammar": None,
    }
    args.update(kw)
    return build_constraint(**args)


def accepts(tok: Any, c: Constraint, text: str, *, special: bool = True) -> bool:
    """Whether ``text`` is a complete sentence of ``c``'s grammar.

    With ``special`` the tag spellings become the special tokens, as a
    Hermes model emits them; without, they are plain bytes.
    """
    m = llguidance.LLMatcher(tok, c.grammar, limits=parser_limits(), log_level=0)
    assert not m.is_error(), m.get_error()
    # tokenize_str(parse_special=False) still yields added tokens (the HF
    # tokenizer matches them first); greedy_tokenize works on bytes only.
    ids = tok.tokenize_str(text, parse_special=True) if special else tok.greedy_tokenize(text)
    return bool(m.consume_tokens(ids)) and bool(m.is_accepting())
