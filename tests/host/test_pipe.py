"""The threaded host's exchange (``host.loop._Pipe``): while it decodes it
hands a report over and steps on with the answer to the report before;
it waits for its own report's answer when the Trio side has news, or when
it has nothing left to step. Driven with a token that runs each callback
when the test says, so what the host collects, and when, is exact."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gezel_trio.host.exchange import Orders, StepReport
from gezel_trio.host.loop import _Pipe


class _Token:
    """A Trio token whose callbacks run when ``run`` is called (the Trio
    thread catching up), or at once with ``eager``."""

    def __init__(self, eager: bool = False) -> None:
        self.eager = eager
        self.pending: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def run_sync_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self.pending.append((fn, args))
        if self.eager:
            self.run()

    def run(self) -> None:
        while self.pending:
            fn, args = self.pending.pop(0)
            fn(*args)


class _Link:
    """Answers report ``i`` (its ``memory`` field) with orders naming ``i``
    (in ``remove``), so the test sees which report each answer is for."""

    def __init__(self) -> None:
        self.wants_answer = False
        self.fail_on: int | None = None
        self.seen: list[int] = []

    def exchange(self, report: StepReport) -> Orders:
        assert report.memory is not None
        self.seen.append(report.memory)
        if report.memory == self.fail_on:
            raise RuntimeError(f"exchange {report.memory} failed")
        self.wants_answer = False  # these orders answered the news
        return Orders(remove=(report.memory,))


def _pipe(eager: bool) -> tuple[_Pipe, _Token, _Link]:
    token, link = _Token(eager), _Link()
    return _Pipe(token, link), token, link  # type: ignore[arg-type]


def _answered(answers: tuple[Orders, ...]) -> list[int]:
    return [rid for orders in answers for rid in orders.remove]


def test_a_decoding_host_steps_on_with_the_answer_to_the_report_before() -> None:
    pipe, token, link = _pipe(eager=False)
    # The first report of a busy spell: nothing answered yet, nothing waited for.
    assert _answered(pipe.exchange(StepReport(memory=1), ahead=True)) == []
    assert pipe.in_flight == 1
    token.run()  # the Trio thread answers report 1 while step 2 computes
    assert _answered(pipe.exchange(StepReport(memory=2), ahead=True)) == [1]
    token.run()
    assert _answered(pipe.exchange(StepReport(memory=3), ahead=True)) == [2]
    assert pipe.in_flight == 1  # never more than one report unanswered
    assert link.seen == [1, 2]


def test_news_on_the_trio_side_makes_the_host_wait_for_its_own_reports_answer() -> None:
    pipe, _, link = _pipe(eager=True)
    assert _answered(pipe.exchange(StepReport(memory=1), ahead=True)) == []
    link.wants_answer = True  # a request arrived: the next orders admit it
    # Both answers, in order: the one in flight, then this report's own.
    assert _answered(pipe.exchange(StepReport(memory=2), ahead=True)) == [1, 2]
    assert pipe.in_flight == 0
    # Nothing new: ahead again.
    assert _answered(pipe.exchange(StepReport(memory=3), ahead=True)) == []
    assert pipe.in_flight == 1


def test_a_host_with_nothing_left_to_step_waits_for_every_answer() -> None:
    pipe, _, _ = _pipe(eager=True)
    pipe.exchange(StepReport(memory=1), ahead=True)
    assert _answered(pipe.exchange(StepReport(memory=2), ahead=False)) == [1, 2]
    assert pipe.in_flight == 0
    assert _answered(pipe.exchange(StepReport(memory=3), ahead=False)) == [3]


def test_an_exchange_that_raised_re_raises_on_the_host_thread() -> None:
    pipe, _, link = _pipe(eager=True)
    link.fail_on = 1
    pipe.exchange(StepReport(memory=1), ahead=True)  # raised on the Trio side, in flight
    with pytest.raises(RuntimeError, match="exchange 1 failed"):
        pipe.exchange(StepReport(memory=2), ahead=True)
