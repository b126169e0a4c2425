"""The seed client's own reading of a streamed answer: it takes only
``delta.content`` and splits the think block off itself.

A behaviour model of the gezel app's streaming reasoning split (its MLX
provider's ``StreamingReasoningSplit``), written here from its contract: the
answer starts inside reasoning when the model's template opens the block in
the prompt; otherwise an opening marker starts it; the first closing marker
ends it; a trailing fragment that could still become a marker is held back;
a block never closed stays reasoning at the end. Tests read a stream through
it to check what the app would show live.
"""

from __future__ import annotations

import re

__all__ = ["ClientThinkSplit"]

_CLOSE = ("</think>", "</reasoning>", "[/think]", "<|end|>")
_OPEN = ("<think>", "<reasoning>", "[think]")
_OPEN_RE = re.compile(r"<think>|<reasoning>|\[THINK\]", re.IGNORECASE)


class ClientThinkSplit:
    """``push`` a content delta, get ``(visible, reasoning)`` safe to show
    now; ``flush`` at the end of the turn."""

    def __init__(self, *, opens_in_reasoning: bool) -> None:
        self._buffer = ""
        self._inside = opens_in_reasoning

    def push(self, chunk: str) -> tuple[str, str]:
        self._buffer += chunk
        return self._drain(final=False)

    def flush(self) -> tuple[str, str]:
        return self._drain(final=True)

    def _drain(self, *, final: bool) -> tuple[str, str]:
        visible, reasoning = "", ""
        while self._buffer:
            if self._inside:
                found = self._first_close()
                if found is None:
                    break
                at, marker = found
                reasoning += self._buffer[:at]
                self._buffer = self._buffer[at + len(marker) :]
                self._inside = False
                continue
            m = _OPEN_RE.search(self._buffer)
            if m is None:
                break
            visible += self._buffer[: m.start()]
            self._buffer = self._buffer[m.end() :]
            self._inside = True
        if final:
            if self._inside:
                reasoning += self._buffer
            else:
                visible += self._buffer
            self._buffer = ""
            return visible, reasoning
        keep = self._held_back()
        cut = len(self._buffer) - keep
        if cut > 0:
            released, self._buffer = self._buffer[:cut], self._buffer[cut:]
            if self._inside:
                reasoning += released
            else:
                visible += released
        return visible, reasoning

    def _first_close(self) -> tuple[int, str] | None:
        low = self._buffer.lower()
        hits = [(low.find(m), m) for m in _CLOSE if low.find(m) >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        markers = _CLOSE if self._inside else _OPEN
        longest = max(len(m) for m in _CLOSE)
        for n in range(min(longest - 1, len(self._buffer)), 0, -1):
            tail = self._buffer[-n:].lower()
            if any(m.startswith(tail) for m in markers):
                return n
        return 0
