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

import base64
import hmac
import json
import logging
import os
import secrets
import struct
import sys
import threading
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from hashlib import sha256
from pathlib import Path
from typing import Any

import attrs

from .custom_tools import INPUT_PARAMETER, partial_input

__all__ = [
    "TAIL_TOKENS",
    "GeneratedReply",
    "ReplyLedger",
    "ReplySeal",
    "dump_ledger",
    "load_ledger",
    "load_secret",
    "reply_key",
]

log = logging.getLogger("gezel_trio.prompt")

# Prompt ids kept before each reply: enough to see the generation prompt
# (``<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n`` is 8-10).
TAIL_TOKENS = 12
# Replies kept under one key (one text after different prompts).
_PER_KEY = 4


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else {}
        except (ValueError, RecursionError):
            # A freeform call cut short by the budget: the client sends back
            # the input as far as it went (``custom_tool_call``), which is
            # this prefix decoded.
            partial = partial_input(value)
            return value if partial is None else {INPUT_PARAMETER: partial}
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

    def __init__(
        self,
        max_tokens: int,
        think_markers: tuple[str, str] | None = None,
        seal: ReplySeal | None = None,
    ) -> None:
        self.max_tokens = max_tokens
        self.think_markers = think_markers
        self.seal = seal
        self._lock = threading.Lock()
        self._replies: OrderedDict[str, tuple[GeneratedReply, ...]] = OrderedDict()
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
        """Keep ``reply`` under ``key``. Conversations that share a prompt
        can get the same short reply after different prompts: each keeps
        its own (the last few per key; the renderer tries each)."""
        with self._lock:
            old = self._replies.pop(key, ())
            kept = (reply, *(r for r in old if r.tail != reply.tail))[:_PER_KEY]
            self._replies[key] = kept
            self._held += _size(kept) - _size(old)
            while self._held > self.max_tokens and len(self._replies) > 1:
                _, gone = self._replies.popitem(last=False)
                self._held -= _size(gone)

    def restore(self, message: Mapping[str, Any], reply: GeneratedReply) -> None:
        """A reply a client brought back sealed: kept unless the ledger
        already holds this reply after the same prompt (its own copy is the
        whole turn)."""
        key = reply_key(message)
        with self._lock:
            if any(r.tail == reply.tail for r in self._replies.get(key, ())):
                return
        self.put(key, reply)

    def get(self, message: Mapping[str, Any]) -> tuple[GeneratedReply, ...]:
        """The replies with ``message``'s text this server generated
        recently, the latest first (empty: none)."""
        key = reply_key(message)
        with self._lock:
            replies = self._replies.get(key, ())
            if replies:
                self._replies.move_to_end(key)
            return replies


def _size(replies: Sequence[GeneratedReply]) -> int:
    return sum(len(r.tail) + len(r.tokens) for r in replies)


# --- sealed replies: Responses' ``reasoning.encrypted_content`` -------------------

_SEAL_VERSION = b"g1"
_MAC_BYTES = 16


class ReplySeal:
    """An opaque, authenticated spelling of a generated reply, that a
    client carries and sends back (a reasoning item's ``encrypted_content``)
    so this server restores the ids it generated even after a restart.

    The blob is ``g1.`` and base64url of the zlib-compressed ids (the
    prompt's tail and the reply's) with a digest of the model's fingerprint,
    followed by an HMAC-SHA256 (16 bytes) under ``secret``. It is signed,
    not encrypted: it holds token ids of text the client already has. A
    blob that does not verify, or that another model made, is ignored."""

    def __init__(self, secret: bytes, fingerprint: str) -> None:
        self._secret = secret
        self._model = sha256(fingerprint.encode()).digest()[:8]

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._secret, body, sha256).digest()[:_MAC_BYTES]

    def seal(self, reply: GeneratedReply) -> str:
        ids = array("I", (*reply.tail, *reply.tokens))
        if sys.byteorder != "little":
            ids.byteswap()
        body = self._model + struct.pack("<H", len(reply.tail)) + zlib.compress(ids.tobytes(), 6)
        blob = _SEAL_VERSION + b"." + base64.urlsafe_b64encode(body + self._mac(body))
        return blob.decode()

    def open(self, blob: str) -> GeneratedReply | None:
        """The reply ``blob`` seals, or ``None`` (logged) when it is not one
        of this server's for this model."""
        try:
            version, _, data = blob.encode().partition(b".")
            raw = base64.urlsafe_b64decode(data)
            body, mac = raw[:-_MAC_BYTES], raw[-_MAC_BYTES:]
            if version != _SEAL_VERSION or not hmac.compare_digest(mac, self._mac(body)):
                log.warning("encrypted_content not made by this server (or altered); ignored")
                return None
            if body[:8] != self._model:
                log.info("encrypted_content made for another model; ignored")
                return None
            (n_tail,) = struct.unpack("<H", body[8:10])
            ids = array("I")
            ids.frombytes(zlib.decompress(body[10:]))
            if sys.byteorder != "little":
                ids.byteswap()
        except (ValueError, struct.error, zlib.error, UnicodeError):
            log.warning("encrypted_content is not a sealed reply; ignored")
            return None
        values = tuple(ids)
        return GeneratedReply(values[:n_tail], values[n_tail:])


def load_secret(persist_dir: Path | None) -> bytes:
    """The key sealed replies are signed with: kept in ``persist_dir`` (made
    once, readable by its owner only) so blobs outlive a restart; without
    one, a fresh key for this process."""
    if persist_dir is None:
        return secrets.token_bytes(32)
    path = persist_dir / "reply-seal.key"
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot read %s (%s): sealed replies last this process only", path, exc)
        return secrets.token_bytes(32)
    secret = secrets.token_bytes(32)
    try:
        persist_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secret)
    except FileExistsError:
        return path.read_bytes()  # another process made it first
    except OSError as exc:
        log.warning("cannot write %s (%s): sealed replies last this process only", path, exc)
    return secret


# --- the ledger on disk ---------------------------------------------------------
#
# A prompt that spliced a reply is cached as spliced; after a restart an
# empty ledger would render the same history plainly and miss every entry
# the cache kept on disk for it. So with a persist dir the ledger is written
# when the engine stops and read when it starts.

_FILE_MAGIC = b"gezel-replies-1\n"


def dump_ledger(ledger: ReplyLedger, path: Path) -> None:
    """Write ``ledger`` to ``path`` (atomically: a temporary file renamed)."""
    with ledger._lock:
        items = [(k, r) for k, rs in ledger._replies.items() for r in reversed(rs)]
    out = bytearray()
    for key, reply in items:
        ids = array("I", (*reply.tail, *reply.tokens))
        if sys.byteorder != "little":
            ids.byteswap()
        out += bytes.fromhex(key) + struct.pack("<HI", len(reply.tail), len(reply.tokens))
        out += ids.tobytes()
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(_FILE_MAGIC + zlib.compress(bytes(out), 6))
    os.replace(tmp, path)


def load_ledger(ledger: ReplyLedger, path: Path) -> int:
    """Read the replies ``dump_ledger`` wrote into ``ledger``; how many. A
    missing file is none; an unreadable one is logged and ignored."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    except OSError as exc:
        log.warning("cannot read %s (%s): the reply ledger starts empty", path, exc)
        return 0
    try:
        if not data.startswith(_FILE_MAGIC):
            raise ValueError("not a reply ledger")
        raw = zlib.decompress(data[len(_FILE_MAGIC) :])
        at, count = 0, 0
        while at < len(raw):
            key = raw[at : at + 16].hex()
            n_tail, n_tokens = struct.unpack_from("<HI", raw, at + 16)
            at += 22
            ids = array("I")
            ids.frombytes(raw[at : at + 4 * (n_tail + n_tokens)])
            if len(ids) != n_tail + n_tokens:
                raise ValueError("truncated")
            if sys.byteorder != "little":
                ids.byteswap()
            at += 4 * (n_tail + n_tokens)
            values = tuple(ids)
            ledger.put(key, GeneratedReply(values[:n_tail], values[n_tail:]))
            count += 1
    except (ValueError, struct.error, zlib.error) as exc:
        log.warning("%s is not a reply ledger (%s): ignored", path, exc)
        return 0
    return count
