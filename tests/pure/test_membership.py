"""``Membership`` and ``JoinerPool`` (``orchestrator/group/membership.py``): the bookkeeping
the Ray group and the fake group share. Members in rank order, the leader moved to rank 0,
removals that close the ranks up and retire slots, probes that tell the living from the dead,
and slot fills paced to at most one a ``FILL_EVERY_S``."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from jobspec.runtime import ScalingConfig
from jobspec.wire import Phase, Progress
from orchestrator.group import membership
from orchestrator.group.interface import WorkerGroupError
from orchestrator.group.membership import JoinerPool, Membership


@dataclass(frozen=True)
class _Info:
    worker: int


@dataclass(frozen=True)
class _Member:
    info: _Info


class _Recorded(Membership[_Member, object]):
    """A membership whose processes are names: kills and retirements recorded, progress scripted
    (None: dead or silent)."""

    def __init__(self, workers: int, max_workers: int) -> None:
        super().__init__(ScalingConfig(workers=workers, max_workers=max_workers))
        self.members = [_Member(_Info(self._new_worker_id())) for _ in range(workers)]
        self.killed: list[int] = []
        self.retired_members: list[int] = []
        self.answers: dict[int, Progress | None] = {}

    def progress(self, timeout_s: float) -> dict[int, Progress | None]:
        return {m.info.worker: self.answers.get(m.info.worker) for m in self.members}

    def _kill(self, member: _Member) -> None:
        self.killed.append(member.info.worker)

    def _retire(self, member: _Member) -> None:
        self.retired_members.append(member.info.worker)


def _progress(step: int) -> Progress:
    return Progress(step=step, phase=Phase.DONE, since_s=0.0, next_step=step + 1)


def test_the_leader_moves_to_rank_0_and_the_others_keep_their_order():
    group = _Recorded(4, 4)
    group.lead_with(2)
    assert group.workers == [2, 0, 1, 3]
    with pytest.raises(WorkerGroupError, match=r"worker 9 is not a member \(members: \[2, 0, 1, 3\]\)"):
        group.lead_with(9)


def test_removed_workers_are_ended_and_the_ranks_close_up_and_a_retired_slot_lowers_the_capacity():
    group = _Recorded(4, 5)
    group.remove([1])
    assert group.workers == [0, 2, 3] and group.killed == [1] and group.capacity == 5
    group.remove([3], retire=True)  # an evicted worker: its slot is given up
    assert group.workers == [0, 2] and group.killed == [1, 3]
    assert group.retired_members == [3] and group.capacity == 4


def test_a_probe_tells_the_members_that_answered_from_the_dead_and_the_silent():
    group = _Recorded(3, 3)
    group.answers = {0: _progress(4), 2: _progress(5)}
    alive, dead = group.probe(timeout_s=1.0)
    assert alive == {0: _progress(4), 2: _progress(5)} and dead == [1]


def test_worker_ids_never_repeat_and_admitted_joiners_take_the_last_ranks():
    group = _Recorded(2, 4)
    group.remove([0])
    group.admit([_Member(_Info(group._new_worker_id()))])
    assert group.workers == [1, 2]  # the replacement is a new worker, never id 0 again
    group.kill(2)  # chaos: the process ends, the member stays until the driver notices
    assert group.killed == [0, 2] and group.workers == [1, 2]


class _Slots:
    """The part of a worker group a JoinerPool drives: slot fills and loaded joiners."""

    def __init__(self) -> None:
        self.fills: list[set[str]] = []
        self.loading = 0

    def fill_slots(self, dead_nodes: set[str]) -> None:
        self.fills.append(dead_nodes)

    def ready_joiners(self, timeout_s: float = 0.0) -> list[str]:
        return ["joiner"]


def test_slots_are_filled_at_most_once_a_second_unless_forced(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(membership.time, "monotonic", lambda: now[0])
    slots = _Slots()
    pool = JoinerPool(slots, 4, lambda: {"gone"})  # type: ignore[arg-type]
    pool.fill()
    pool.fill()  # too soon
    now[0] += membership.FILL_EVERY_S / 2
    pool.fill(force=True)  # a recovery needs its replacements now
    now[0] += membership.FILL_EVERY_S
    pool.fill()
    assert slots.fills == [{"gone"}] * 3


def test_collecting_with_nobody_loading_waits_and_takes_nobody(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(membership.time, "sleep", slept.append)
    slots = _Slots()
    pool = JoinerPool(slots, 4, set)  # type: ignore[arg-type]
    pool.collect(timeout_s=0.5)
    assert slept == [0.5] and pool.ready == []  # it must not spin a core the workers need
    slots.loading = 1
    pool.collect(timeout_s=0.5)
    assert pool.ready == ["joiner"]
