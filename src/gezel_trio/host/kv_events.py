"""The prompt cache's blocks as vLLM's KV events, for a router that routes
by them (docs/scale-out.md, "KV events").

**Wire format**: vLLM's (``vllm/distributed/kv_events.py`` since its
events became maps, vLLM PR 42892; what vllm-router 0.1.17 decodes). Each
batch is one ZMQ message of three frames: the topic, the batch's sequence
number (8 bytes, big-endian, one more per batch) and a msgpack payload,
the array ``[ts, events, data_parallel_rank]``. Each event is a map with
its class name under ``"type"``:

- ``BlockStored``: ``block_hashes`` (a chain: each block's parent is the
  one before it), ``parent_block_hash`` (the first one's; ``None`` at a
  path's start), ``token_ids`` (the blocks' tokens, in order),
  ``block_size``, ``lora_id``, ``medium`` (``"GPU"``: vLLM's name for the
  memory a step reads directly), ``lora_name``, ``extra_keys`` (one per
  block: ``[salt]`` on a salted path's first block, else ``None``),
  ``group_idx``, ``kv_cache_spec_kind``;
- ``BlockRemoved``: ``block_hashes``, ``medium``, ``group_idx``;
- ``AllBlocksCleared``: the first batch (whatever a router remembers of an
  earlier process at this address is gone) and the last one.

**Hashes**: vLLM's ``sha256_cbor`` (``hash_block_tokens`` in
``vllm/v1/core/kv_cache_utils.py``): the sha256 of the canonical CBOR of
``(parent hash, block tokens, extra keys)``, where a path's first block
has for parent ``NONE_HASH`` (sha256_cbor of the seed ``"0"``: vLLM with
``PYTHONHASHSEED=0``) and for extra keys ``(salt,)`` when salted (vLLM's
``cache_salt``), ``None`` otherwise. On the wire, the hash's low 64 bits
as an integer (vLLM's default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``).
The blocks are the prompt cache's own: 64 tokens at absolute multiples;
only full ones are announced (``CacheStore``, "Block log").

**Threads**: the store hashes a block when it makes it, on the host
thread. Once per engine step (``_Host.report``) the host thread takes the
store's block log, encodes the step's batch and hands it to the publisher
thread over an inproc ZMQ pair without waiting (``publish_nowait``). The
publisher thread (``gezel-kv-events``) owns the PUB socket and the replay
ROUTER socket and waits on the pair and the ROUTER in one poll: idle, it
costs nothing, and nothing on the host thread waits for the network.

**Backpressure**: the sequence number is given on the host thread, so a
batch dropped anywhere is a gap a subscriber sees (vllm-router then
forgets what it knew of this server). The pair holds ``PENDING`` batches:
beyond that (a stuck publisher thread) a batch is dropped and counted. PUB
drops a slow subscriber's batches past ZMQ's high-water mark, as vLLM's.
The last ``REPLAY_KEPT`` batches are kept for replay (vLLM's
``buffer_steps``): a request of one frame, the first sequence number
wanted (8 bytes, big-endian), is answered with ``[seq, payload]`` for
each kept batch from there, then ``[-1, b""]``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

import cbor2
import msgspec
import zmq

from ..core.cache_store import Node
from ..core.errors import ModelLoadError

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "KvEvents",
    "block_events",
    "block_hash",
]

log = logging.getLogger("gezel_trio.kv_events")

# Batches waiting for the publisher thread, and batches kept for replay.
PENDING = 10_000
REPLAY_KEPT = 10_000
# How long a closing PUB socket may still send its last batches.
LINGER_MS = 500
# Bound on the publisher thread's last sends at close.
CLOSE_TIMEOUT = 2.0
# vLLM's names: the memory tier a step reads directly, the one group of
# layers announced (the attention layers the prompt cache blocks).
MEDIUM = "GPU"
SPEC_KIND = "full_attention"
# vLLM's replay end marker.
_END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STOP = b""


# --- vLLM's event types (vllm/distributed/kv_events.py) ---------------------


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event: a map tagged with its class name under ``"type"``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[str, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One batch: ``[ts, events, data_parallel_rank]`` on the wire."""

    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


# --- the hashes ---------------------------------------------------------------


def _sha256_cbor(value: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


# A path's first block's parent: vLLM's NONE_HASH under PYTHONHASHSEED=0.
NONE_HASH = _sha256_cbor("0")


def block_hash(parent: bytes | None, tokens: tuple[int, ...], salt: str) -> bytes:
    """vLLM's ``hash_block_tokens`` with ``sha256_cbor``: ``parent`` is
    ``None`` for a path's first block, ``salt`` given for that block only
    (``core.cache_store.BlockHasher``)."""
    extra = (salt,) if salt else None
    return _sha256_cbor((parent or NONE_HASH, tokens, extra))


def wire_hash(digest: bytes) -> int:
    """A block hash as vLLM sends it by default: its low 64 bits."""
    return int.from_bytes(digest[-8:], "big")


def block_events(
    changes: Sequence[tuple[bool, Node, str]], block_size: int
) -> list[BlockStored | BlockRemoved]:
    """The store's block log (``CacheStore.take_block_log``) as events:
    blocks made one under the other in a row are one ``BlockStored`` (as
    vLLM sends a request's new blocks), freed ones in a row one
    ``BlockRemoved``."""
    events: list[BlockStored | BlockRemoved] = []
    tail: Node | None = None  # the last block of the last event, a BlockStored
    for made, node, salt in changes:
        if not made:
            tail = None
            last = events[-1] if events else None
            if isinstance(last, BlockRemoved):
                last.block_hashes.append(wire_hash(node.digest))
            else:
                events.append(BlockRemoved([wire_hash(node.digest)], MEDIUM, group_idx=0))
            continue
        parent = node.parent
        assert parent is not None
        extra = (salt,) if salt else None
        last = events[-1] if events else None
        if tail is not None and parent is tail and isinstance(last, BlockStored):
            last.block_hashes.append(wire_hash(node.digest))
            last.token_ids.extend(node.tokens)
            assert last.extra_keys is not None
            last.extra_keys.append(extra)
        else:
            events.append(
                BlockStored(
                    [wire_hash(node.digest)],
                    wire_hash(parent.digest) if parent.digest else None,
                    list(node.tokens),
                    block_size,
                    None,
                    MEDIUM,
                    None,
                    extra_keys=[extra],
                    group_idx=0,
                    kv_cache_spec_kind=SPEC_KIND,
                )
            )
        tail = node
    return events


# --- the publisher --------------------------------------------------------------


class KvEvents:
    """The ``BlockEvents`` add-on that ``--kv-events`` attaches (``addons``;
    ``host.block_events``): a ZMQ PUB socket bound at ``endpoint`` (and a
    replay ROUTER socket at ``replay``) that sends the prompt cache's block
    events, from its own thread. Made on the host thread, which alone calls
    ``publish_nowait`` and ``close``; raises ``ModelLoadError`` when an
    address cannot be bound (``tcp://HOST:*``: a free port, then named by
    ``endpoint``). Its first batch, ``AllBlocksCleared``, is sent at once."""

    def __init__(
        self, endpoint: str, *, block_size: int, replay: str | None = None, topic: str = ""
    ) -> None:
        self.block_size = block_size
        self._topic = topic.encode("utf-8")
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self.dropped = 0
        self._closed = False
        self._ctx = zmq.Context()
        try:
            self._pub = self._bound(zmq.PUB, endpoint)
            self._replay = self._bound(zmq.ROUTER, replay) if replay is not None else None
            # Where they are bound (a wildcard port resolved).
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = (
                self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
                if self._replay is not None
                else None
            )
            # The pair: this thread's end sends, the publisher's receives.
            self._inbox = self._bound(zmq.PAIR, f"inproc://gezel-kv-events-{id(self)}")
            self._inbox.set_hwm(PENDING)
            self._outbox = self._ctx.socket(zmq.PAIR)
            self._outbox.set_hwm(PENDING)
            self._outbox.connect(f"inproc://gezel-kv-events-{id(self)}")
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            # Refused at start, before the engine is ready, as a bad --kv-bits is.
            raise ModelLoadError(f"--kv-events: {exc}") from exc
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_KEPT)
        # The sockets above pass to this thread when it starts (a memory
        # barrier, as ZMQ asks of a socket that changes threads), the
        # outbox excepted: only the host thread uses it.
        self._thread = threading.Thread(target=self._run, name="gezel-kv-events", daemon=True)
        self._thread.start()
        log.info(
            "KV events on %s%s, blocks of %d tokens",
            self.endpoint,
            f" (replay on {self.replay_endpoint})" if self.replay_endpoint else "",
            block_size,
        )
        self._send([AllBlocksCleared()])

    # The store's BlockHasher (host.block_events.BlockEvents).
    hash_block = staticmethod(block_hash)

    def _bound(self, kind: int, address: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        try:
            sock.bind(address)
        except zmq.ZMQError as exc:
            why = zmq.strerror(exc.errno) if exc.errno is not None else str(exc)
            raise zmq.ZMQError(exc.errno, f"cannot bind {address}: {why}") from exc
        return sock

    # --- the host thread ------------------------------------------------------

    @property
    def sent(self) -> int:
        """Batches handed to the publisher thread (dropped ones included):
        the next batch's sequence number."""
        return self._seq

    def publish_nowait(self, changes: Sequence[tuple[bool, Node, str]]) -> None:
        """One engine step's block changes, as one batch (none: nothing sent)."""
        events: list[KvEvent] = [*block_events(changes, self.block_size)]
        if events and not self._closed:
            self._send(events)

    def _send(self, events: list[KvEvent]) -> None:
        payload = self._encoder.encode(KVEventBatch(time.time(), events, 0))
        seq = self._seq
        self._seq += 1
        try:
            self._outbox.send_multipart((seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("KV events: the publisher thread is behind; batches are dropped")

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Last act (the host's shutdown): ``AllBlocksCleared``, then the
        publisher thread sends what it holds and stops, joined within
        ``timeout`` seconds; the sockets close."""
        if self._closed:
            return
        self._send([AllBlocksCleared()])
        self._closed = True
        try:
            self._outbox.send(_STOP, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("KV events: the publisher thread did not take its stop")
        self._thread.join(timeout)
        self._outbox.close(linger=0)
        if self._thread.is_alive():
            # Terminating the context would wait for its sockets: the
            # thread (a daemon) is left to the process's exit.
            log.warning("KV events: the publisher thread did not stop in %.1f s", timeout)
            return
        self._ctx.term()

    # --- the publisher thread -------------------------------------------------

    def _run(self) -> None:
        sockets = [self._inbox, self._pub]
        if self._replay is not None:
            sockets.append(self._replay)
        try:
            self._serve()
        except Exception:
            log.exception("the KV-event publisher failed; no more events are sent")
        finally:
            for sock in sockets:
                sock.close()  # PUB lingers LINGER_MS for its last batches

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._replay is not None and self._replay in ready:
                self._answer_replay()
            if self._inbox in ready:
                frames = self._inbox.recv_multipart()
                if frames == [_STOP]:
                    return
                seq, payload = frames
                # PUB never blocks: past a subscriber's high-water mark it drops.
                self._pub.send_multipart((self._topic, seq, payload))
                self._kept.append((int.from_bytes(seq, "big"), payload))

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:  # [identity, b"", first wanted]
            log.warning("KV events: a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._kept):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", _END_SEQ, b""))
