"""The recovery log (``orchestrator/accounting/recovery_log.py``): a recovery is opened when the
group re-forms and closed by the commit of its last redone step; ``first_step_s`` counts from
the death to the next committed step, ``redo_s`` from the re-forming to the close; one cut
short by a further failure is kept without ``redo_s``; ``to_json`` is the summary's record."""

from __future__ import annotations

import types

import pytest

from orchestrator.accounting import recovery_log
from orchestrator.accounting.recovery_log import Recovery, RecoveryLog


class Clock:
    """Stands in for the module's ``time``: ``time()`` answers ``now``, set by the test."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock(1000.0)
    monkeypatch.setattr(recovery_log, "time", types.SimpleNamespace(time=fake.time))
    return fake


def recovery(at_step: int = 5, redo: list[int] | None = None, started: float = 1000.0) -> Recovery:
    return Recovery(
        at_step=at_step, workers=[1], reasons={1: "ActorDiedError: killed"}, started=started, redo_steps=redo or []
    )


def test_a_commit_with_no_recovery_open_closes_nothing(clock: Clock) -> None:
    log = RecoveryLog()
    assert log.committed(3) is None
    assert log.done == [] and log.open is None


def test_a_recovery_with_nothing_to_redo_is_closed_by_the_next_commit(clock: Clock) -> None:
    log = RecoveryLog()
    opened = recovery(redo=[])
    log.opened(opened)
    clock.now += 2.0
    assert log.committed(5) is opened
    assert log.open is None and log.done == [opened]
    assert opened.redo_s == pytest.approx(2.0)


def test_a_recovery_stays_open_until_its_last_redone_step_is_committed(clock: Clock) -> None:
    log = RecoveryLog()
    opened = recovery(redo=[5, 6, 7])
    log.opened(opened)
    for step in (5, 6):
        clock.now += 1.0
        assert log.committed(step) is None
        assert log.open is opened and opened.redo_s is None and log.done == []
    clock.now += 1.0
    assert log.committed(7) is opened
    assert log.open is None and log.done == [opened]


def test_first_step_s_counts_from_the_death_to_the_first_commit_and_redo_s_from_the_reform(clock: Clock) -> None:
    log = RecoveryLog()
    opened = recovery(redo=[5, 6], started=1000.0)  # the worker died at t=1000
    clock.now = 1003.0  # re-formed 3 s later
    log.opened(opened)
    clock.now = 1004.5  # the first redone step committed
    log.committed(5)
    assert opened.first_step_s == pytest.approx(4.5) and opened.redo_s is None
    clock.now = 1010.0  # the last one: first_step_s stays the first step's
    log.committed(6)
    assert opened.first_step_s == pytest.approx(4.5)
    assert opened.redo_s == pytest.approx(7.0)


def test_a_recovery_cut_short_by_another_failure_is_kept_without_redo_s(clock: Clock) -> None:
    log = RecoveryLog()
    first, second = recovery(at_step=5, redo=[5, 6]), recovery(at_step=6, redo=[6])
    log.opened(first)
    clock.now += 1.0
    log.committed(5)
    clock.now += 1.0
    log.opened(second)  # a death while step 6 was redone
    assert log.done == [first] and log.open is second
    assert first.redo_s is None and first.first_step_s == pytest.approx(1.0)
    clock.now += 1.0
    assert log.committed(6) is second
    assert log.done == [first, second]


def test_to_json_is_the_summarys_record_of_the_time_split() -> None:
    done = Recovery(
        at_step=7, workers=[1, 2], reasons={1: "died", 2: "evicted"}, started=5.0, detect_s=0.5, reform_s=1.5,
        transfer_s=0.25, redo_s=2.0, first_step_s=4.0, redo_steps=[7, 8], reformed_at=9.0, waited_s=1.0,
    )
    assert done.to_json() == {
        "at_step": 7, "workers": [1, 2], "reasons": {1: "died", 2: "evicted"}, "detect_s": 0.5, "reform_s": 1.5,
        "transfer_s": 0.25, "redo_s": 2.0, "first_step_s": 4.0, "redo_steps": [7, 8], "waited_s": 1.0,
    }
