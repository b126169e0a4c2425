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

from ..core.shared_dir import read_regular, write_whole
from .custom_tools import INPUT_PARAMETER, partial_input

__all__ = [
    "SECRET_BYTES",
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


# --- sealed blobs: ``encrypted_content`` this server reads back --------------------

_SEAL_VERSION = b"g1"  # a generated reply (a reasoning item's)
_HISTORY_VERSION = b"h1"  # a compacted history (a compaction item's)
_MAC_BYTES = 16


class ReplySeal:
    """Opaque, authenticated blobs a client carries and sends back as an
    item's ``encrypted_content``, so this server restores what it made even
    after a restart (the key is kept in the persist dir):

    - a generated reply (``seal``/``open``): the ids it generated, so a
      reasoning item's reply is spelled as the model wrote it;
    - a compacted history (``seal_history``/``open_history``): the input
      items of ``POST /v1/responses/compact``, expanded back in place when a
      request carries the compaction item.

    A blob is a version tag, ``.``, and base64url of a zlib-compressed body
    followed by an HMAC-SHA256 (16 bytes) under ``secret`` over the tag and
    the body (``g1`` reply blobs, the first kind, cover the body only). It
    is signed, not encrypted: it holds what the client already has. A reply
    blob that does not verify, or that another model made, is ignored; a
    history that does not verify is the caller's 400."""

    def __init__(self, secret: bytes, fingerprint: str) -> None:
        self._secret = secret
        self._model = sha256(fingerprint.encode()).digest()[:8]

    def _mac(self, version: bytes, body: bytes) -> bytes:
        signed = body if version == _SEAL_VERSION else version + b"." + body
        return hmac.new(self._secret, signed, sha256).digest()[:_MAC_BYTES]

    def _sign(self, version: bytes, body: bytes) -> str:
        mac = self._mac(version, body)
        return (version + b"." + base64.urlsafe_b64encode(body + mac)).decode()

    def _verified(self, version: bytes, blob: str) -> bytes | None:
        """The body ``blob`` signs as a ``version`` blob of this key, or ``None``."""
        try:
            tag, _, data = blob.encode().partition(b".")
            raw = base64.urlsafe_b64decode(data)
        except (ValueError, UnicodeError):
            return None
        body, mac = raw[:-_MAC_BYTES], raw[-_MAC_BYTES:]
        if tag != version or len(raw) <= _MAC_BYTES:
            return None
        if not hmac.compare_digest(mac, self._mac(version, body)):
            return None
        return body

    def seal(self, reply: GeneratedReply) -> str:
        ids = array("I", (*reply.tail, *reply.tokens))
        if sys.byteorder != "little":
            ids.byteswap()
        body = self._model + struct.pack("<H", len(reply.tail)) + zlib.compress(ids.tobytes(), 6)
        return self._sign(_SEAL_VERSION, body)

    def open(self, blob: str) -> GeneratedReply | None:
        """The reply ``blob`` seals, or ``None`` (logged) when it is not one
        of this server's for this model."""
        body = self._verified(_SEAL_VERSION, blob)
        if body is None:
            log.warning("encrypted_content not made by this server (or altered); ignored")
            return None
        if body[:8] != self._model:
            log.info("encrypted_content made for another model; ignored")
            return None
        try:
            (n_tail,) = struct.unpack("<H", body[8:10])
            ids = array("I")
            ids.frombytes(zlib.decompress(body[10:]))
        except (ValueError, struct.error, zlib.error):
            log.warning("encrypted_content is not a sealed reply; ignored")
            return None
        if sys.byteorder != "little":
            ids.byteswap()
        values = tuple(ids)
        return GeneratedReply(values[:n_tail], values[n_tail:])

    def seal_history(self, items: Sequence[Any], max_bytes: int | None = None) -> str:
        """Seal ``items`` (input items as JSON values). Not bound to the
        model: any model renders a history. Raises ``ValueError`` past
        ``max_bytes`` of JSON, which ``open_history`` would refuse."""
        text = json.dumps(list(items), ensure_ascii=False, separators=(",", ":")).encode()
        if max_bytes is not None and len(text) > max_bytes:
            raise ValueError(f"the history is {len(text)} bytes of JSON, over {max_bytes}")
        return self._sign(_HISTORY_VERSION, zlib.compress(text, 6))

    def open_history(self, blob: str, max_bytes: int) -> tuple[list[Any], int]:
        """The items ``blob`` seals and the bytes of JSON they were. Raises
        ``ValueError`` saying why when it is not a history this key sealed,
        or when it holds more than ``max_bytes`` (checked before more is
        inflated)."""
        body = self._verified(_HISTORY_VERSION, blob)
        if body is None:
            raise ValueError("not sealed by this server (or altered)")
        inflate = zlib.decompressobj()
        try:
            text = inflate.decompress(body, max_bytes + 1)
        except zlib.error:
            raise ValueError("not a sealed history") from None
        if len(text) > max_bytes or inflate.unconsumed_tail:
            raise ValueError(f"holds more than {max_bytes} bytes of history")
        try:
            items = json.loads(text)
        except ValueError:
            raise ValueError("not a sealed history") from None
        if not isinstance(items, list):
            raise ValueError("not a sealed history")
        return items, len(text)


# A key is 32 random bytes (HMAC-SHA256's block is 64; 32 is its output's
# strength). A kept file of another length is not a key this server made.
SECRET_BYTES = 32
_KEY_FILE = "reply-seal.key"


def load_secret(persist_dir: Path | None) -> bytes:
    """The key sealed replies are signed with: kept in ``persist_dir`` (made
    once, readable by its owner only) so blobs outlive a restart; without
    one, a fresh key for this process. The file is written whole or not at
    all (``write_whole``) and its length checked on every start: an empty
    or short one (a start on a full disk once left 0 bytes, a key anyone
    could sign with) is replaced, never used."""
    if persist_dir is None:
        return secrets.token_bytes(SECRET_BYTES)
    path = persist_dir / _KEY_FILE
    exists = True
    try:
        kept = read_regular(path, SECRET_BYTES)
        if len(kept) == SECRET_BYTES:
            return kept
        why = f"holds {len(kept)} bytes, not a {SECRET_BYTES}-byte key"
    except FileNotFoundError:
        exists, why = False, ""
    except OSError as exc:
        # Longer than a key, a FIFO, a directory, unreadable: not one to use.
        why = f"is not a key ({exc.strerror or exc})"
    if exists:
        log.warning("%s %s: replaced (replies sealed under the old one are ignored)", path, why)
    secret = secrets.token_bytes(SECRET_BYTES)
    try:
        persist_dir.mkdir(parents=True, exist_ok=True)
        write_whole(path, secret, replace=exists)
    except FileExistsError:
        # Another process made it first: use its key (checked the same way).
        return load_secret(persist_dir)
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
# The most a ledger file may be: 1M ids are 4 MB before compression, plus
# 22 bytes a reply.
_LEDGER_MOST = 64 * 1024 * 1024


def dump_ledger(ledger: ReplyLedger, path: Path) -> None:
    """Write ``ledger`` to ``path``, whole or not at all (``write_whole``:
    a temp file fsynced and renamed)."""
    with ledger._lock:
        items = [(k, r) for k, rs in ledger._replies.items() for r in reversed(rs)]
    out = bytearray()
    for key, reply in items:
        ids = array("I", (*reply.tail, *reply.tokens))
        if sys.byteorder != "little":
            ids.byteswap()
        out += bytes.fromhex(key) + struct.pack("<HI", len(reply.tail), len(reply.tokens))
        out += ids.tobytes()
    write_whole(path, _FILE_MAGIC + zlib.compress(bytes(out), 6), replace=True)


def load_ledger(ledger: ReplyLedger, path: Path) -> int:
    """Read the replies ``dump_ledger`` wrote into ``ledger``; how many. A
    missing file is none; an unreadable one is logged and ignored."""
    try:
        data = read_regular(path, _LEDGER_MOST)
    except FileNotFoundError:
        return 0
    except OSError as exc:  # a FIFO or a device too: never waited on or read
        log.warning("cannot read %s (%s): the reply ledger starts empty", path, exc.strerror or exc)
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
