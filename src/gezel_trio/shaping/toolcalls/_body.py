"""The contract between the splitter and a format's body scanner."""

from __future__ import annotations

import re
from typing import Protocol

__all__ = [
    "CLOSED",
    "DONE",
    "FAILED",
    "RUNNING",
    "WS",
    "Body",
    "Owner",
    "skip_ws",
]

# Body scan outcomes.
RUNNING = 0  # everything given was consumed
DONE = 1  # the call's body is complete; the closing marker may follow
CLOSED = 2  # the closing marker was consumed (possibly before the body was complete)
FAILED = 3  # the markup is malformed at the returned position

WS = " \t\n\r"
_WS_RUN = re.compile(r"[ \t\n\r]+")


def skip_ws(text: str, i: int) -> int:
    m = _WS_RUN.match(text, i)
    return i if m is None else m.end()


class Owner(Protocol):
    """The splitter, as a body sees it: told the name once, then argument text.
    ``_is_string`` says whether a tool's parameter is declared a string (the
    markups that write values bare need the schema to tell ``"3"`` from 3)."""

    def _start(self, name: str) -> None: ...
    def _args(self, fragment: str) -> None: ...
    def _is_string(self, name: str, key: str) -> bool: ...


class Body(Protocol):
    """A call's markup after its opening marker.

    ``step`` consumes ``text`` from ``i`` and returns where it stopped: the end
    of ``text`` while ``status`` stays ``RUNNING``, otherwise the position
    that decided the outcome. On ``FAILED`` that position holds the offending
    character (not consumed) and ``back`` the end of the consumed text that
    must be read again as ordinary output. ``complete`` says whether a started
    call can still end well.
    """

    status: int
    back: str
    complete: bool

    def step(self, text: str, i: int) -> int: ...
    def closable_at_end(self) -> bool: ...
