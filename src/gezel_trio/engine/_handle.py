"""A submitted request: ``n`` sequences of one prompt, read through one channel.

Every request is a group of ``n >= 1`` members (``n > 1``: choices that
continue the same prompt, which is computed once). The engine sends each
member's events on its own clone of the group's channel, tagged with the
member's index; the handle reads them as ``(index, event)`` pairs, each
member's events in order and the members interleaved as they are
generated, until every member ended with its ``Finished`` or ``Failed``.

Leaving the handle's ``with`` block - normally, by an exception, or because
the caller's cancel scope was cancelled - withdraws every member still
queued or running: a queued one is never admitted, a running one leaves the
batch before the next engine step, and the prompt cache keeps what it
computed. Withdrawal is synchronous (no checkpoint), so it is safe in
``finally`` and on the cancellation path.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import attrs
import trio

from ..core.errors import EngineClosed, GezelError
from ..core.events import Event, Failed, Finished

__all__ = ["RequestHandle", "Ticket"]


@attrs.define
class Ticket:
    """Shared by the engine and a handle: why a member ended when its
    channel could not carry the reason (the reader had fallen behind)."""

    error: GezelError | None = None


class RequestHandle:
    """A submitted request (``Engine.submit_nowait``): iterate it for
    ``(index, event)`` pairs; leave its ``with`` block to withdraw it. Each
    member yields ``Queued``/``Progress``/``Parked``/``Resumed`` notes and
    ``Delta`` values, then exactly one ``Finished`` or ``Failed``. ``rids``
    are the members' request ids, by index."""

    def __init__(
        self,
        withdraw: Callable[[int], None],
        rids: tuple[int, ...],
        events: trio.MemoryReceiveChannel[tuple[int, Event]],
        tickets: tuple[Ticket, ...],
    ) -> None:
        self._withdraw = withdraw
        self._tickets = tickets
        self._done = [False] * len(rids)
        self.rids = rids
        self.events = events

    @property
    def n(self) -> int:
        return len(self.rids)

    def __enter__(self) -> RequestHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Withdraw every member (what leaving the ``with`` block does)."""
        self.events.close()
        for rid in self.rids:
            self._withdraw(rid)

    def end(self, index: int) -> None:
        """Withdraw member ``index`` as if it had finished: its reader has
        all it wants of it (a chat choice at its last allowed tool call)."""
        self._done[index] = True
        self._withdraw(self.rids[index])

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> tuple[int, Event]:
        """The next member's event. Cancellation leaves every member queued
        or running until the ``with`` block is left."""
        if all(self._done):
            raise StopAsyncIteration
        try:
            index, event = await self.events.receive()
        except trio.EndOfChannel:
            return self._cut_short()
        return self._took(index, event)

    def next_nowait(self) -> tuple[int, Event] | None:
        """The next member's event if one is already waiting, else ``None``
        (also once every member ended); never blocks, never checkpoints."""
        if all(self._done):
            return None
        try:
            index, event = self.events.receive_nowait()
        except trio.WouldBlock:
            return None
        except trio.EndOfChannel:
            return self._cut_short()
        return self._took(index, event)

    def _took(self, index: int, event: Event) -> tuple[int, Event]:
        if isinstance(event, Finished | Failed):
            self._done[index] = True
        return index, event

    def _cut_short(self) -> tuple[int, Event]:
        """Every sender closed without a terminal event for a member: the
        engine stopped, or dropped a reader that fell behind."""
        index = self._done.index(False)
        self._done[index] = True
        return index, Failed(self._tickets[index].error or EngineClosed("the engine stopped"))
