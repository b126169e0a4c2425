"""The replies this server generated, so a re-sent history reuses their tokens.

Every coding agent sends its whole history again each turn. The chat
template renders the previous reply from the text the client kept, and that
text does not always tokenize back to the ids the model generated: the
stream trims the reply's first space, a Qwen-style template drops the empty
think block its generation prompt had, a word re-tokenizes to other pieces.
From the first such token on, the reply and everything after it are
prefilled again. The ledger remembers, for each recent reply, the ids the
model generated and the last few ids of the prompt it continued, keyed by
what the client will send back (``reply_key``: the answer text and the
calls, not the reasoning, which clients and templates drop freely). The
renderer (``shaping.prompt``) splices those ids back in where the rendered
history holds the reply's text.

Written from the Trio thread when a choice finishes, read from the worker
threads that render prompts: one lock. Bounded by the token ids it holds;
the least recently used replies go first. A miss is the plain rendering.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from hashlib import sha256
from typing import Any

import attrs

__all__ = ["GeneratedReply", "ReplyLedger", "reply_key"]

# Prompt ids kept before each reply: enough to see the generation prompt
# (``<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n`` is 8-10).
TAIL_TOKENS = 12


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else {}
        except ValueError:
            return value
    return value


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text"
        )
    return ""


def reply_key(message: Mapping[str, Any]) -> str:
    """What identifies an assistant message however a protocol carried it:
    its answer text and its calls (name and arguments as a JSON value, so a
    string and the object it parses to are one call)."""
    calls = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or {}
        calls.append([fn.get("name", ""), _arguments(fn.get("arguments", {}))])
    canon = json.dumps(
        [_text(message.get("content")), calls], sort_keys=True, ensure_ascii=False, default=str
    )
    return sha256(canon.encode()).hexdigest()[:32]


@attrs.frozen
class GeneratedReply:
    """A reply as generated: ``tokens`` (its end-of-turn token included when
    it stopped on one) and ``tail``, the last prompt ids before it."""

    tail: tuple[int, ...]
    tokens: tuple[int, ...]


class ReplyLedger:
    """The recent replies, at most ``max_tokens`` token ids in all.

    ``think_markers``: the model's think block markers, when it has them: an
    empty block the template drops from an old turn is put back, so the turn
    reads as the model wrote it (``shaping.prompt``)."""

    def __init__(self, max_tokens: int, think_markers: tuple[str, str] | None = None) -> None:
        self.max_tokens = max_tokens
        self.think_markers = think_markers
        self._lock = threading.Lock()
        self._replies: OrderedDict[str, GeneratedReply] = OrderedDict()
        self._held = 0

    def __len__(self) -> int:
        return len(self._replies)

    def record(
        self, message: Mapping[str, Any], prompt: Sequence[int], tokens: Sequence[int]
    ) -> None:
        """Remember the reply ``message`` that ``tokens`` spell, generated
        after ``prompt``."""
        if not tokens or len(tokens) > self.max_tokens:
            return
        self.put(reply_key(message), GeneratedReply(tuple(prompt[-TAIL_TOKENS:]), tuple(tokens)))

    def put(self, key: str, reply: GeneratedReply) -> None:
        size = len(reply.tail) + len(reply.tokens)
        with self._lock:
            old = self._replies.pop(key, None)
            if old is not None:
                self._held -= len(old.tail) + len(old.tokens)
            self._replies[key] = reply
            self._held += size
            while self._held > self.max_tokens and len(self._replies) > 1:
                _, gone = self._replies.popitem(last=False)
                self._held -= len(gone.tail) + len(gone.tokens)

    def get(self, message: Mapping[str, Any]) -> GeneratedReply | None:
        """The reply ``message`` carries, if this server generated it recently."""
        key = reply_key(message)
        with self._lock:
            reply = self._replies.get(key)
            if reply is not None:
                self._replies.move_to_end(key)
            return reply
