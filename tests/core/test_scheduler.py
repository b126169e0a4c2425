"""The pure scheduling core, alone: no MLX, no Trio, no clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gezel_trio.core.errors import QueueFull
from gezel_trio.core.scheduler import Plan, Scheduler


def test_admits_up_to_max_running_in_arrival_order() -> None:
    s = Scheduler(max_running=2, max_queue=8)
    for rid in range(4):
        s.enqueue(rid, "interactive")
    assert s.plan() == Plan(admit=(0, 1), lane="interactive")
    assert s.running == (0, 1)
    assert s.queued == (2, 3)
    assert s.plan() == Plan(lane="interactive")


def test_continuous_admission_fills_a_freed_slot() -> None:
    s = Scheduler(max_running=2, max_queue=8)
    for rid in range(3):
        s.enqueue(rid, "interactive")
    s.plan()
    s.finished(0)
    assert s.plan().admit == (2,)


def test_static_waves_wait_for_the_batch_to_drain() -> None:
    s = Scheduler(max_running=2, max_queue=8, continuous=False)
    for rid in range(3):
        s.enqueue(rid, "interactive")
    assert s.plan().admit == (0, 1)
    s.finished(0)
    assert s.plan().admit == ()
    s.finished(1)
    assert s.plan().admit == (2,)


def test_queue_bound_raises_queue_full() -> None:
    s = Scheduler(max_running=1, max_queue=2)
    s.enqueue(0, "interactive")
    s.plan()  # 0 runs; the queue is empty and has room for 2
    s.enqueue(1, "interactive")
    s.enqueue(2, "interactive")
    with pytest.raises(QueueFull):
        s.enqueue(3, "interactive")
    assert s.queued == (1, 2)


def test_free_slots_count_as_room() -> None:
    s = Scheduler(max_running=2, max_queue=0)
    s.enqueue(0, "interactive")
    s.enqueue(1, "interactive")
    with pytest.raises(QueueFull):
        s.enqueue(2, "interactive")


def test_withdrawn_queued_request_is_never_admitted() -> None:
    s = Scheduler(max_running=1, max_queue=4)
    s.enqueue(0, "interactive")
    s.enqueue(1, "interactive")
    s.plan()
    assert s.withdraw(1) == "queued"
    s.finished(0)
    assert s.plan() == Plan()
    assert s.idle


def test_withdrawn_running_request_is_removed_at_the_next_plan() -> None:
    s = Scheduler(max_running=1, max_queue=4)
    s.enqueue(0, "interactive")
    s.enqueue(1, "interactive")
    s.plan()
    assert s.withdraw(0) == "running"
    assert s.withdraw(0) == "running"  # idempotent: removed once
    assert s.plan() == Plan(admit=(1,), remove=(0,), lane="interactive")
    assert s.withdraw(0) == "unknown"


def test_finishing_a_withdrawn_sequence_cancels_its_removal() -> None:
    s = Scheduler(max_running=1, max_queue=4)
    s.enqueue(0, "interactive")
    s.plan()
    s.withdraw(0)
    s.finished(0)  # the backend ended it in the same step
    assert s.plan() == Plan()


def test_interactive_first_and_background_waits_for_it() -> None:
    s = Scheduler(max_running=4, max_queue=8)
    s.enqueue(0, "background")
    s.enqueue(1, "interactive")
    s.enqueue(2, "background")
    assert s.plan() == Plan(admit=(1,), lane="interactive")
    # Background waits while interactive work holds the engine.
    assert s.plan().admit == ()
    s.finished(1)
    assert s.plan() == Plan(admit=(0, 2), lane="background")


def test_interactive_arrival_parks_the_background_wave_and_it_resumes() -> None:
    s = Scheduler(max_running=4, max_queue=8)
    s.enqueue(0, "background")
    s.enqueue(1, "background")
    assert s.plan() == Plan(admit=(0, 1), lane="background")
    s.enqueue(2, "interactive")
    assert s.plan() == Plan(admit=(2,), lane="interactive", parked=(0, 1))
    assert s.parked == (0, 1)
    s.enqueue(3, "background")  # arrives over a parked wave: waits for the resume
    assert s.plan() == Plan(lane="interactive")
    s.finished(2)
    assert s.plan() == Plan(admit=(3,), lane="background", resumed=(0, 1))
    assert s.parked == ()


def test_withdrawn_parked_sequence_leaves_the_parked_wave() -> None:
    s = Scheduler(max_running=4, max_queue=8)
    s.enqueue(0, "background")
    s.enqueue(1, "background")
    s.plan()
    s.enqueue(2, "interactive")
    s.plan()
    assert s.withdraw(1) == "running"
    assert s.plan() == Plan(remove=(1,), lane="interactive")
    assert s.parked == (0,)


def test_tight_memory_holds_preemption_back_and_collapses_the_wave() -> None:
    s = Scheduler(max_running=4, max_queue=8)
    s.enqueue(0, "background")
    s.enqueue(1, "background")
    assert s.plan(memory_tight=True) == Plan(admit=(0,), lane="background")
    s.enqueue(2, "interactive")
    # No second generator while memory is tight: interactive waits its turn.
    assert s.plan(memory_tight=True) == Plan(lane="background")
    s.finished(0)
    assert s.plan(memory_tight=True) == Plan(admit=(2,), lane="interactive")


def test_withdraw_all_empties_everything() -> None:
    s = Scheduler(max_running=1, max_queue=4)
    for rid in range(3):
        s.enqueue(rid, "interactive")
    s.plan()
    queued, running = s.withdraw_all()
    assert queued == (1, 2)
    assert running == (0,)
    assert s.plan() == Plan(remove=(0,))
    assert s.idle


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["enqueue", "withdraw", "finish", "plan"]), st.integers(0, 9)),
        max_size=60,
    ),
    st.integers(1, 4),
)
def test_invariants_hold_under_any_event_sequence(
    ops: list[tuple[str, int]], max_running: int
) -> None:
    s = Scheduler(max_running=max_running, max_queue=5)
    seen: set[int] = set()
    admitted: set[int] = set()
    for op, rid in ops:
        if op == "enqueue" and rid not in seen:
            seen.add(rid)
            try:
                s.enqueue(rid, "interactive" if rid % 2 else "background")
            except QueueFull:
                seen.discard(rid)
        elif op == "withdraw":
            s.withdraw(rid)
        elif op == "finish" and rid in s.running:
            s.finished(rid)
        elif op == "plan":
            plan = s.plan()
            assert not set(plan.admit) & admitted, "a request is admitted at most once"
            admitted |= set(plan.admit)
        interactive = [r for r in s.running if r % 2]
        background = [r for r in s.running if not r % 2]
        assert len(interactive) <= max_running
        assert len(background) <= max_running
        assert not set(s.running) & set(s.queued)
        if interactive:
            assert set(s.parked) == set(background), "background never steps beside interactive"


def test_a_parked_wave_takes_turns_once_parked_for_max_park() -> None:
    s = Scheduler(max_running=2, max_queue=4, max_park=10.0)
    s.enqueue(0, "background")
    assert s.plan(now=0.0).lane == "background"
    s.enqueue(1, "interactive")
    plan = s.plan(now=1.0)
    assert (plan.lane, plan.parked) == ("interactive", (0,))
    assert s.plan(now=10.9).lane == "interactive", "parked for less than max_park"
    plan = s.plan(now=11.0)
    assert (plan.lane, plan.resumed) == ("background", (0,))
    assert [s.plan(now=12.0 + i).lane for i in range(4)] == [
        "interactive",
        "background",
        "interactive",
        "background",
    ]
    s.finished(0)  # the starved wave drained: parking applies again
    s.enqueue(2, "background")
    s.enqueue(3, "interactive")
    assert s.plan(now=20.0).lane == "interactive"
    s.finished(1)
    s.finished(3)
    assert s.plan(now=21.0).lane == "background"
