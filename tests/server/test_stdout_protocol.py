"""The stdout protocol's decisions, with the clock given: which prefill
notes become markers (the seed's minimum and interval, per request), and
how a contained failure is printed (every line tagged, none bare). The real
server process is tested against the same regular expressions in
``tests/server/test_seed_compat.py``."""

from __future__ import annotations

import io

import pytest

from gezel_trio.core.errors import EngineFailure, RequestFailed
from gezel_trio.core.events import Failed, Progress
from gezel_trio.engine import RequestNote
from gezel_trio.stdout_protocol import StdoutProtocol, StdoutSettings, tagged_traceback
from tests.support.seed import LEAF, PREFILL, TAGGED


def _printed(notes: list[tuple[float, RequestNote]], **settings: float) -> list[str]:
    out = io.StringIO()
    protocol = StdoutProtocol(StdoutSettings(**settings), out)
    for now, note in notes:
        protocol.note_nowait(note, now)
    protocol.close()
    return out.getvalue().splitlines()


def _progress(rid: int, done: int, total: int, cache_id: str | None = "s") -> RequestNote:
    return RequestNote(rid, cache_id, Progress(done, total))


def test_markers_follow_the_seed_minimum_and_interval_per_request() -> None:
    lines = _printed(
        [
            (0.0, _progress(1, 512, 1000)),  # under the 2048-token minimum: never
            (0.0, _progress(2, 512, 4096, "a")),  # first chunk: at once
            (0.1, _progress(3, 256, 3000, None)),  # another request has its own clock
            (1.0, _progress(2, 1024, 4096, "a")),
            (3.9, _progress(2, 1536, 4096, "a")),
            (4.0, _progress(2, 2048, 4096, "a")),  # the interval has passed
            (4.0, _progress(3, 384, 3000, None)),  # its own 4 s are not up yet
            (4.2, _progress(3, 512, 3000, None)),
            (5.0, _progress(2, 3584, 4096, "a")),
            (9.0, _progress(2, 4096, 4096, "a")),  # prefill over: the first token says so
        ]
    )
    assert lines == [
        "Prefill:  12%| | 512/4096 [batched] cache=a",
        "Prefill:   8%| | 256/3000 [batched]",
        "Prefill:  50%| | 2048/4096 [batched] cache=a",
        "Prefill:  17%| | 512/3000 [batched]",
    ]
    assert all(PREFILL.match(line) for line in lines)


def test_the_minimum_and_the_interval_are_settings() -> None:
    notes = [(t / 10, _progress(1, 10 * (t + 1), 100)) for t in range(5)]
    assert len(_printed(notes, prefill_min_tokens=100, prefill_interval=0.2)) == 3
    assert _printed(notes) == []
    with pytest.raises(ValueError, match="prefill_interval"):
        StdoutSettings(prefill_interval=float("inf"))


def _raised() -> RequestFailed:
    try:
        try:
            raise KeyError("logits")
        except KeyError as exc:
            raise RequestFailed("this request failed on the engine: KeyError") from exc
    except RequestFailed as err:
        return err


def test_a_contained_failure_is_tagged_on_every_line() -> None:
    err = _raised()
    lines = _printed([(0.0, RequestNote(7, "s", Failed(err)))])
    assert lines[0] == (
        "[batch] request 7 failed alone; the engine goes on: "
        "this request failed on the engine: KeyError"
    )
    assert lines[1] == "[batch] | Traceback (most recent call last):"
    assert "[batch] | KeyError: 'logits'" in lines
    leaf = "gezel_trio.core.errors.RequestFailed: this request failed on the engine: KeyError"
    assert lines[-1] == f"[batch] | {leaf}"
    assert all(TAGGED.match(line) for line in lines[1:])
    assert [line for line in lines if LEAF.match(line)] == []
    # What a bare traceback would have shown the supervisor's classifier:
    assert LEAF.match(lines[-1].removeprefix("[batch] | "))


def test_a_failed_step_prints_once_for_its_whole_batch() -> None:
    err = EngineFailure("the model step failed: RuntimeError: boom")
    notes = [(0.0, RequestNote(rid, None, Failed(err))) for rid in (1, 2, 3)]
    lines = _printed(notes)
    assert lines[0].startswith("[batch] a model step failed; its batch failed")
    assert sum(1 for line in lines if not line.startswith("[batch] | ")) == 1


def test_a_line_never_breaks_in_two() -> None:
    out = io.StringIO()
    protocol = StdoutProtocol(stream=out)
    protocol.say_nowait("Loading model from: /a\nb")
    protocol.contained_nowait("http", ["one", "two"], "GET /x answered 500")
    protocol.close()
    protocol.say_nowait("after close, written at once")
    assert out.getvalue().splitlines() == [
        "Loading model from: /a\\nb",
        "[http] GET /x answered 500",
        "[http] | one",
        "[http] | two",
        "after close, written at once",
    ]
    assert tagged_traceback("x", ["a"]) == ["[x] | a"]
