"""What the host loop tells an add-on of the prompt cache's full blocks.

The loop knows only this contract; where an engine is composed
(``addons``, for the server and the package facade) an implementation is
attached when a flag asks for one (``--kv-events``:
``host.kv_events.KvEvents``, whose libraries are an extra), so an engine
without it loads none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from ..core.cache_store import Node

__all__ = ["BlockEvents", "BlockEventsFactory"]


class BlockEvents(Protocol):
    """Made on the host thread (``BlockEventsFactory``), which alone calls it."""

    def hash_block(self, parent: bytes | None, tokens: tuple[int, ...], salt: str) -> bytes:
        """A full block's hash (the store's ``BlockHasher``): ``parent`` is
        ``None`` for a path's first block, ``salt`` given for that block only."""
        ...

    def publish_nowait(self, changes: Sequence[tuple[bool, Node, str]]) -> None:
        """One engine step's block changes (``CacheStore.take_block_log``),
        without waiting for any I/O."""
        ...

    def close(self) -> None:
        """Last act of the host's shutdown, after the last changes."""
        ...


# Makes the add-on, given the prompt cache's block size in tokens.
BlockEventsFactory = Callable[[int], BlockEvents]
