"""A fake KV state and its operations: the prompt cache and the disk cache
run on them without MLX (``tests/host``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs


@attrs.frozen
class FakeState:
    """Stands for a KV state holding exactly ``tokens``."""

    tokens: tuple[int, ...]
    trimmable: bool


class FakeOps:
    def __init__(self, trimmable: bool) -> None:
        self.trimmable = trimmable
        self.joins = 0

    def state_offsets(self, state: Any) -> list[int | None]:
        return [len(state.tokens), None]

    def state_blocks(self, state: Any, ranges: Sequence[tuple[int, int]]) -> list[tuple[Any, int]]:
        return [(tuple(state.tokens[s:e]), 10 * (e - s)) for s, e in ranges]

    def state_rest(self, state: Any) -> tuple[Any, int]:
        return (None, 0) if self.trimmable else (tuple(state.tokens), 7)

    def join_state(self, blocks: Sequence[Any], length: int, rest: Any) -> Any:
        self.joins += 1
        tokens = tuple(t for b in blocks for t in b)[:length]
        assert len(tokens) == length, "the blocks are short of the seed"
        assert rest is None or rest == tokens, "the rest state is another position's"
        return FakeState(tokens, self.trimmable)

    # a codec, so DiskCache can use the same fake
    def dump_state(self, state: Any, metadata: dict[str, str], path: Path) -> None:
        data = {"tokens": list(state.tokens), "t": state.trimmable, "meta": metadata}
        path.write_text(json.dumps(data))

    def forget_state(self, path: Path) -> None:
        pass

    def load_state(self, payload: bytes, path: Path) -> tuple[Any, dict[str, str]]:
        data = json.loads(payload)
        return FakeState(tuple(data["tokens"]), data["t"]), data["meta"]
