"""Fixed tags inside a call's body, read from text cut anywhere.

The tagged markups (Qwen3-Coder's, GLM's, Gemma 4's head, string delimiter
and closing marker) each, at some point, expect one of a few fixed strings.
The text arrives in pieces cut anywhere, so a tag may be split over two
pieces: its start is held until the next piece decides it. What a tag means
once read is the markup's own (``_tag_done``). A bare word (a name, Gemma's
bare keys and values) is held the same way until a character ends it.
"""

from __future__ import annotations

import re

from ._body import FAILED, RUNNING

__all__ = ["TaggedBody", "held_word"]


def _common_prefix(a: str, b: str) -> int:
    k = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        k += 1
    return k


def held_word(
    pattern: re.Pattern[str], text: str, i: int, parts: list[str]
) -> tuple[str | None, int]:
    """The word ``pattern`` matches at ``i``, after the ``parts`` of it that
    earlier pieces held, and where it ends; ``None`` while the end of the
    text cuts it (what it matched is then held in ``parts``)."""
    m = pattern.match(text, i)
    assert m is not None
    parts.append(m.group())
    j = m.end()
    if j == len(text):
        return None, j
    word = "".join(parts)
    parts.clear()
    return word, j


class TaggedBody:
    """What the tagged bodies share: the ``Body`` outcome fields, reading one
    of a few tags (``_tag``), and failing (``_fail``)."""

    status = RUNNING
    back = ""
    complete = False
    _lit = ""  # a tag cut by the end of the text

    def _tag(self, text: str, i: int, tags: tuple[str, ...]) -> int:
        """Read the first of ``tags`` that stands at ``i`` (after the held
        start of one) and hand it to ``_tag_done``; hold a start that the
        end of the text cuts; fail where no tag can stand."""
        lit = self._lit
        cand = lit + text[i : i + max(len(tag) for tag in tags)]
        best = 0
        for tag in tags:
            if cand.startswith(tag):
                self._lit = ""
                return self._tag_done(tag, i + len(tag) - len(lit))
            best = max(best, _common_prefix(cand, tag))
        if best == len(cand):  # a tag cut by the end of the text
            self._lit = cand
            return len(text)
        self._lit = ""
        return self._fail(i + best - len(lit), back=cand[:best])

    def _tag_done(self, tag: str, i: int) -> int:
        """``tag`` was read and ends before ``i``: where to go on from."""
        raise NotImplementedError

    def _fail(self, i: int, back: str = "") -> int:
        self.status = FAILED
        self.back = back
        return i
