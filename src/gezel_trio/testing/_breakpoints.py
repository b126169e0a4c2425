"""Stop the world at a named point of the engine's life.

With the inline host loop, the engine advances only when its Trio task runs;
``Breakpoints.at`` is awaited at every named point, and a point a test asked
for parks the engine there until the test says ``release()``. Everything
else in the Trio run keeps going, so the test can cancel scopes, submit
requests or inspect state while the engine stands still.
"""

from __future__ import annotations

import attrs
import trio

from ..host.exchange import Point

__all__ = ["Breakpoint", "Breakpoints"]


@attrs.define(eq=False)
class Breakpoint:
    kind: str
    rid: int | None
    index: int | None
    _reached: trio.Event = attrs.field(factory=trio.Event)
    _released: trio.Event = attrs.field(factory=trio.Event)
    hit: Point | None = None

    def matches(self, point: Point) -> bool:
        return (
            point.kind == self.kind
            and (self.rid is None or point.rid == self.rid)
            and (self.index is None or point.index == self.index)
        )

    async def reached(self) -> Point:
        """Wait until the engine stops here; returns the point it stopped at."""
        await self._reached.wait()
        assert self.hit is not None
        return self.hit

    def release(self) -> None:
        """Let the engine go on."""
        self._released.set()


class Breakpoints:
    """An ``Observer`` for ``open_engine(..., inline=True, observer=...)``.

    ``points`` records every point passed, in order, for assertions.
    """

    def __init__(self) -> None:
        self._pending: list[Breakpoint] = []
        self.points: list[Point] = []

    def add(self, kind: str, rid: int | None = None, index: int | None = None) -> Breakpoint:
        """Stop the next time the engine passes ``kind`` (for ``rid``, at
        ``index``, when given). One-shot."""
        bp = Breakpoint(kind, rid, index)
        self._pending.append(bp)
        return bp

    async def at(self, point: Point) -> None:
        self.points.append(point)
        for bp in list(self._pending):
            if bp.matches(point):
                self._pending.remove(bp)
                bp.hit = point
                bp._reached.set()
                await bp._released.wait()
        await trio.lowlevel.checkpoint()
