"""``orchestrator/recovery/plan.py`` alone: who leaves a recovery and why, who carries the state
on, at which step, and which steps run again, from what the driver saw and the survivors'
settled progress. Pure: microseconds, no group."""

from __future__ import annotations

from jobspec.wire import Phase, Progress
from orchestrator.group.interface import Call
from orchestrator.recovery.plan import plan_recovery, redo_after_reform
from orchestrator.steps.pipeline import InFlight


def _at(next_step: int, step: int | None = None) -> Progress:
    return Progress(step=next_step if step is None else step, phase=Phase.COMPUTE, since_s=0.0, next_step=next_step)


def test_a_death_plan_removes_the_dead_keeps_the_survivors_and_starts_at_the_furthest():
    plan = plan_recovery(
        errors={1: "ActorDiedError"}, died={1}, silent={}, evicted=[], alive={0: _at(6), 2: _at(5)}, lost=[], steps_done=5
    )
    assert plan.dead == [1] and plan.evicted == [] and plan.leaving == [1] and not plan.nobody_lost
    assert plan.alive == {0: _at(6), 2: _at(5)} and plan.at_step == 6  # worker 0 applied step 5
    assert plan.reasons == {1: "ActorDiedError"}


def test_silent_lost_and_unavailable_workers_are_dead_and_carry_nothing_on():
    # 3 still answers probes (Ray's ActorUnavailableError) but its call failed as if it died;
    # 4 was lost while the group settled; 2 is silent by the driver's judgement.
    plan = plan_recovery(
        errors={3: "ActorUnavailableError"}, died={3}, silent={2: "no progress for 30s"}, evicted=[5],
        alive={0: _at(4), 3: _at(9)}, lost=[4], steps_done=4,
    )
    assert plan.dead == [2, 3, 4] and plan.evicted == [5] and plan.leaving == [2, 3, 4, 5]
    assert plan.alive == {0: _at(4)} and plan.at_step == 4  # 3's step 8 is not committed
    assert plan.reasons == {2: "no progress for 30s", 3: "ActorUnavailableError", 4: "did not answer", 5: "evicted"}


def test_a_failure_with_everyone_alive_loses_nobody():
    plan = plan_recovery(
        errors={0: "CollectiveTimeout", 1: "CollectiveTimeout"}, died=set(), silent={}, evicted=[],
        alive={0: _at(3), 1: _at(3)}, lost=[], steps_done=3,
    )
    assert plan.nobody_lost and plan.at_step == 3 and plan.reasons == {}


def test_the_steps_redone_are_those_thrown_away_and_after_a_roll_back_the_committed_ones_too():
    call = Call(0, object())
    in_flight = (InFlight(4, (call,), count=4), InFlight(8, (call,), count=4))
    assert redo_after_reform(in_flight, next_step=5, steps_done=5, reached=6) == [5, 6]
    assert redo_after_reform(in_flight, next_step=5, steps_done=5, reached=3) == [5]  # at least the first
    # Rolled back to a checkpoint of step 2 with steps 0-4 committed: 2-4 run again, then 5-6.
    assert redo_after_reform(in_flight, next_step=2, steps_done=5, reached=6) == [2, 3, 4, 5, 6]
