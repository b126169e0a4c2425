"""The held-back marker search that the tool-call and reasoning splitters share."""

from __future__ import annotations

__all__ = ["MarkerSeeker"]


def _held_tail(text: str, i: int, marker: str) -> int:
    """Length of the longest end of ``text[i:]`` that is a proper prefix of ``marker``."""
    n = len(text)
    k = text.find(marker[0], max(i, n - len(marker) + 1))
    while k >= 0:
        if marker.startswith(text[k:]):
            return n - k
        k = text.find(marker[0], k + 1)
    return 0


class MarkerSeeker:
    """Finds one marker in streamed text, holding back a possible partial match
    at the end of each piece until the next piece decides it."""

    __slots__ = ("held", "marker")

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.held = ""

    def seek(self, text: str, i: int) -> tuple[str, int, bool]:
        """Scan ``text`` from ``i``: the text before the marker (or all that is
        safe), where scanning stopped, and whether the marker was found there."""
        marker = self.marker
        held = self.held
        n = len(text)
        before = ""
        if held:
            rest = marker[len(held) :]
            if text.startswith(rest, i):
                self.held = ""
                return "", i + len(rest), True
            if n - i < len(rest) and rest.startswith(text[i:]):
                self.held = held + text[i:]
                return "", n, False
            # The held text is not the marker after all: release it one
            # character at a time until what is left could still begin one.
            pending = held + text[i]
            i += 1
            k = 1
            while not marker.startswith(pending[k:]):
                k += 1
            before, self.held = pending[:k], ""
            if k < len(pending):
                return self._resume(before, pending[k:], text, i)
        k = text.find(marker, i)
        if k >= 0:
            return before + text[i:k], k + len(marker), True
        keep = _held_tail(text, i, marker)
        self.held = text[n - keep :]
        return before + text[i : n - keep], n, False

    def _resume(self, before: str, pending: str, text: str, i: int) -> tuple[str, int, bool]:
        # ``pending`` (short, a proper prefix of the marker) starts the rest.
        self.held = pending
        out, j, found = self.seek(text, i)
        return before + out, j, found

    def take(self) -> str:
        """Release the held-back text (the output has ended)."""
        held, self.held = self.held, ""
        return held
