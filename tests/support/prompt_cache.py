"""A ``PromptCache`` over fake states, driven the way the host thread drives
it: the harness the prompt-cache, write-behind, cache-miss and host-cost
tests share."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gezel_trio.core.backend import Captured
from gezel_trio.core.request import CacheRequest, GenerationRequest
from gezel_trio.host.persist import DiskCache
from gezel_trio.host.prompt_cache import PromptCache
from tests.support.fakes import FakeOps, FakeState


def cap(tokens: Sequence[int], trimmable: bool) -> Captured:
    return Captured(FakeState(tuple(tokens), trimmable), tuple(tokens))


def request(prompt: range | tuple[int, ...], **cache: Any) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), max_tokens=4, cache=CacheRequest(**cache))


class Harness:
    """Drives a PromptCache the way the host thread does."""

    def __init__(
        self, trimmable: bool, budget: int = 10**9, disk: Path | None = None, block: int = 8
    ) -> None:
        self.ops = FakeOps(trimmable)
        self.disk = DiskCache(disk, "fp", self.ops) if disk is not None else None
        self.now = 1000.0  # the cache's clock, moved by the test
        self.cache = PromptCache(
            self.ops,
            model_trimmable=trimmable,
            budget_bytes=budget,
            disk=self.disk,
            block_tokens=block,
            clock=lambda: self.now,
        )
        self.trimmable = trimmable
        self.rid = 0

    def start(self, req: GenerationRequest) -> tuple[int, Any, Any]:
        self.rid += 1
        adm, seed = self.cache.admit(self.rid, req)
        assert adm.seed_tokens == req.prompt[: seed.reuse]
        if seed.reuse:
            assert adm.seed_state == FakeState(adm.seed_tokens, self.trimmable)
        return self.rid, adm, seed

    def prefill(self, rid: int, adm: Any, upto: int | None = None) -> None:
        """Run prefill segment by segment, capturing where the cache asks."""
        done = 0
        for seg in adm.segments:
            done += len(seg)
            if upto is not None and len(adm.seed_tokens) + done > upto:
                return
            if self.cache.wants_capture(rid, done):
                held = adm.request.prompt[: len(adm.seed_tokens) + done]
                self.cache.captured(rid, done, cap(held, self.trimmable))

    def run(self, req: GenerationRequest, generated: tuple[int, ...] = (900, 901)) -> int:
        """A whole turn; returns the reused token count."""
        rid, adm, seed = self.start(req)
        self.prefill(rid, adm)
        # The final state holds the prompt and every generated token but the last.
        self.cache.finished(rid, cap(req.prompt + generated[:-1], self.trimmable))
        return int(seed.reuse)

    def named(self, key: str) -> tuple[int, ...] | None:
        entry = self.cache.store.named(key)
        return entry.tokens if entry is not None else None


P1 = tuple(range(100))
