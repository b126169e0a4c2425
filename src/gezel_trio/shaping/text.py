"""Stop strings and leaked framing markers, applied to streamed text.

Pure string logic, used per sequence on the engine's host thread: the
detokenized text of each step goes in, the text a client may see comes out.
Text that could still turn into a stop string or a framing marker is held
back until the next segment decides it, so any chunking of the same output
yields the same emitted text.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["COMMON_FRAMING_MARKERS", "TextFilter"]

# Chat-template framing that some models emit as plain text when their stop set
# misses it. Tool-call and thinking markers are deliberately absent: those are
# content that later layers parse.
COMMON_FRAMING_MARKERS: tuple[str, ...] = (
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<eos>",
    "<bos>",
    "<pad>",
    "<|eos|>",
    "<|pad|>",
)


class TextFilter:
    """Removes framing markers and ends the text at the first stop string.

    ``feed`` returns the text that is now safe to emit; after a stop string is
    seen, ``stopped`` is true, ``matched`` names it (Anthropic's
    ``stop_sequence`` reports it) and everything after it is discarded.
    ``flush`` releases the held-back tail when the sequence ends for another
    reason.
    """

    def __init__(self, stops: Iterable[str], markers: Iterable[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._markers = tuple(m for m in markers if m)
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        buf = self._pending + text
        # Scrub before matching stops, so a marker never hides a stop string
        # and a stop string never straddles a removed marker.
        for marker in self._markers:
            if marker in buf:
                buf = buf.replace(marker, "")
        cut = self._first_stop(buf)
        if cut is not None:
            self.stopped = True
            # The first stop in request order among those starting at ``cut``.
            self.matched = next(s for s in self._stops if buf.startswith(s, cut))
            self._pending = ""
            return buf[:cut]
        keep = self._partial_tail(buf)
        self._pending = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _first_stop(self, buf: str) -> int | None:
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        return min(hits) if hits else None

    def _partial_tail(self, buf: str) -> int:
        """How much of the end of ``buf`` must wait for more text: a possible
        marker start, plus any possible stop start just before it (the marker
        may yet vanish and join the two), or a possible stop start alone."""
        marker = _longest_prefix_suffix(buf, self._markers)
        before = _longest_prefix_suffix(buf[: len(buf) - marker], self._stops) if marker else 0
        return max(marker + before, _longest_prefix_suffix(buf, self._stops))


def _longest_prefix_suffix(buf: str, words: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of a word."""
    if not words:
        return 0
    limit = min(max(len(w) for w in words) - 1, len(buf))
    for n in range(limit, 0, -1):
        tail = buf[-n:]
        if any(w.startswith(tail) for w in words):
            return n
    return 0
