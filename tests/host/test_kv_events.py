"""The prompt cache's KV events (``host.kv_events``) as a router receives
them: a real ZMQ SUB socket, and the replay socket for the batches it
joined too late to see, decoded with msgpack (not the encoder's library).
The blocks announced and not removed since are exactly the cache's full
blocks, each chained to its parent and hashed as vLLM hashes it, computed
here again from vLLM's formula.

The prompt cache runs on fake states (a state is its tokens), driven as
the host thread drives it: a step's block changes are published at its
report, here after each request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import cbor2
import msgpack
import pytest
import zmq

from gezel_trio.core.backend import Captured
from gezel_trio.core.cache_store import Node
from gezel_trio.core.request import CacheRequest, GenerationRequest
from gezel_trio.host.kv_events import KvEvents, block_hash
from gezel_trio.host.prompt_cache import PromptCache
from tests.support.fakes import FakeOps, FakeState

BLOCK = 8
WAIT_MS = 5000


def _sha256_cbor(value: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


# vLLM's kv_cache_utils: NONE_HASH = sha256_cbor(PYTHONHASHSEED), then
# hash_block_tokens(parent or NONE_HASH, tokens, extra_keys).
NONE_HASH = _sha256_cbor("0")


def vllm_hash(
    parent: bytes | None, tokens: tuple[int, ...], extra: tuple[str, ...] | None
) -> bytes:
    return _sha256_cbor((parent or NONE_HASH, tokens, extra))


def low64(digest: bytes) -> int:
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


class Subscriber:
    """A router's side: a SUB socket on the events, a DEALER on the replay
    socket; the batches by sequence number, decoded."""

    def __init__(self, events: KvEvents) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(events.endpoint)
        self.replay = self.ctx.socket(zmq.DEALER)
        assert events.replay_endpoint is not None
        self.replay.connect(events.replay_endpoint)
        self.batches: dict[int, list[Any]] = {}
        self.live: set[int] = set()

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    def collect(self, sent: int) -> list[list[Any]]:
        """Every batch up to ``sent``, in order: live where the SUB socket
        got it, from the replay socket where it had not joined yet."""
        while len(self.batches) < sent:
            if self.sub.poll(WAIT_MS if self.live else 200):
                topic, seq, payload = self.sub.recv_multipart()
                assert topic == b""
                n = int.from_bytes(seq, "big")
                self.batches[n] = msgpack.unpackb(payload)
                self.live.add(n)
                continue
            first = min(set(range(sent)) - set(self.batches))
            self.replay.send_multipart([b"", first.to_bytes(8, "big")])
            while True:
                assert self.replay.poll(WAIT_MS), "the replay socket did not answer"
                empty, seq, payload = self.replay.recv_multipart()
                assert empty == b""
                if seq == (-1).to_bytes(8, "big", signed=True):
                    break
                self.batches.setdefault(int.from_bytes(seq, "big"), msgpack.unpackb(payload))
            assert self.live or len(self.batches) >= sent, "neither socket delivered"
        assert sorted(self.batches) == list(range(sent))
        return [self.batches[n] for n in range(sent)]


class View:
    """What a subscriber knows: the blocks announced and not removed, each
    with its full digest, recomputed here from its parent's and its tokens
    (the wire carries 64 bits)."""

    def __init__(self) -> None:
        self.blocks: dict[int, bytes] = {}
        self.removed: list[int] = []
        self.cleared = 0

    def apply(self, batch: list[Any]) -> None:
        ts, events, rank = batch
        assert isinstance(ts, float)
        assert rank == 0
        for event in events:
            match event["type"]:
                case "AllBlocksCleared":
                    assert set(event) == {"type"}
                    self.blocks.clear()
                    self.cleared += 1
                case "BlockStored":
                    self._stored(event)
                case "BlockRemoved":
                    assert event["medium"] == "GPU"
                    for h in event["block_hashes"]:
                        del self.blocks[h]  # only what was announced is removed
                        self.removed.append(h)
                case other:
                    raise AssertionError(f"an unknown event {other}")

    def _stored(self, event: dict[str, Any]) -> None:
        assert event["block_size"] == BLOCK
        assert event["medium"] == "GPU"
        assert event["lora_id"] is None
        assert event["lora_name"] is None
        hashes = event["block_hashes"]
        tokens = event["token_ids"]
        assert len(tokens) == BLOCK * len(hashes)
        assert len(event["extra_keys"]) == len(hashes)
        parent = event["parent_block_hash"]
        # The parent is a block the subscriber holds, or the path starts here.
        digest = self.blocks[parent] if parent is not None else None
        for i, h in enumerate(hashes):
            extra = event["extra_keys"][i]
            # A salt is hashed into a path's first block only, as vLLM's cache_salt.
            assert extra is None or (digest is None and len(extra) == 1)
            block = tuple(tokens[i * BLOCK : (i + 1) * BLOCK])
            digest = vllm_hash(digest, block, tuple(extra) if extra else None)
            assert h == low64(digest), "not vLLM's hash of its parent and tokens"
            assert h not in self.blocks
            self.blocks[h] = digest


def cache_blocks(cache: PromptCache, salts: tuple[str, ...] = ("",)) -> dict[int, bytes]:
    """The cache's full blocks under full parents, text only, hashed here:
    what must be announced."""
    out: dict[int, bytes] = {}

    def walk(node: Node, digest: bytes | None, salt: str) -> Iterator[tuple[int, bytes]]:
        for child in node.children.values():
            if len(child.tokens) < BLOCK or min(child.tokens) < 0:
                continue
            extra = (salt,) if salt and digest is None else None
            d = vllm_hash(digest, child.tokens, extra)
            yield low64(d), d
            yield from walk(child, d, salt)

    for salt in salts:
        out.update(walk(cache.store.root_of(salt), None, salt))
    return out


class Harness:
    def __init__(self, budget: int = 10**9) -> None:
        self.cache = PromptCache(
            FakeOps(trimmable=True),
            model_trimmable=True,
            budget_bytes=budget,
            block_tokens=BLOCK,
            block_hasher=block_hash,
        )
        self.events = KvEvents("tcp://127.0.0.1:*", block_size=BLOCK, replay="tcp://127.0.0.1:*")
        self.sub = Subscriber(self.events)
        self.view = View()
        self.seen = 0
        self.rid = 0

    def run(
        self, prompt: tuple[int, ...], generated: tuple[int, ...] = (900, 901), **cache: Any
    ) -> None:
        """One request, from admission to its final save, then the step's
        report publishes what it changed."""
        self.rid += 1
        req = GenerationRequest(prompt, max_tokens=4, cache=CacheRequest(**cache))
        self.cache.admit(self.rid, req)
        final = prompt + generated[:-1]
        self.cache.finished(self.rid, Captured(FakeState(final, True), final))
        self.step()

    def step(self) -> None:
        self.events.publish_nowait(self.cache.store.take_block_log())

    def receive(self) -> None:
        for batch in self.sub.collect(self.events.sent)[self.seen :]:
            self.view.apply(batch)
        self.seen = self.events.sent

    def close(self) -> None:
        self.events.close()
        self.sub.close()


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness()
    yield harness
    harness.close()


SYSTEM = tuple(range(1000, 1020))  # two full blocks and a partial one


def test_the_announced_blocks_are_the_caches_full_blocks(h: Harness) -> None:
    h.run((*SYSTEM, 1, 2, 3))
    h.receive()
    assert h.view.cleared == 1  # the first batch: nothing of an earlier process is held
    # 23 tokens saved with 1 generated: 24, three full blocks; nothing partial announced.
    assert len(h.view.blocks) == 3
    assert h.view.blocks == cache_blocks(h.cache)

    # Another conversation shares the system prompt's first two blocks.
    h.run((*SYSTEM, *range(40, 60)))
    # The first one's next turn extends its path.
    h.run((*SYSTEM, 1, 2, 3, 900, *range(70, 90)))
    # A tenant's salted path: the same tokens, other hashes from its first block on.
    h.run((*SYSTEM, 1, 2, 3), salt="tenant-a")
    # A prompt with an image key in its second block: from there nothing is announced.
    h.run((*SYSTEM[:8], *(-5,) * 8, *range(300, 316)))
    h.receive()
    want = cache_blocks(h.cache, ("", "tenant-a"))
    assert h.view.blocks == want
    assert len(want) > 10
    assert len(h.sub.live) > 1, "the SUB socket received batches live"
    salted = cache_blocks(h.cache, ("tenant-a",))
    assert salted
    assert not salted.keys() & cache_blocks(h.cache).keys()

    # Blocks are announced gone exactly when the store frees them: the
    # entries that hold them are dropped (a named one by its name).
    h.run(tuple(range(500, 530)), cache_id="s")
    h.receive()
    before = dict(h.view.blocks)
    h.cache.evict("s")
    h.step()
    h.receive()
    assert h.view.blocks == cache_blocks(h.cache, ("", "tenant-a"))
    assert len(h.view.removed) == 3
    assert before.keys() - h.view.blocks.keys() == set(h.view.removed)

    # The last batch says the server holds nothing any more.
    h.events.close()
    h.receive()
    assert h.view.cleared == 2
    assert not h.view.blocks


def test_eviction_announces_the_blocks_it_frees() -> None:
    # 10 bytes a token: a budget of 60 tokens keeps about two prompts.
    h = Harness(budget=600)
    try:
        for i in range(6):
            h.run(tuple(range(100 * i, 100 * i + 27)))
            h.receive()
            assert h.view.blocks == cache_blocks(h.cache)
        assert h.cache.store.total_bytes <= 600
        assert len(h.view.removed) >= 9  # four prompts' three full blocks each, at least
        assert len(h.view.blocks) <= 6
    finally:
        h.close()
