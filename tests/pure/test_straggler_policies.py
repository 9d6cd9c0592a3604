"""Pure tests of straggler detection, rebalancing and within-step work choice (no Ray, no torch)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from jobspec.wire import Phase, Progress
from policies.eviction import SlowEviction, silent_workers
from policies.rebalance import Rebalancer, proportional_counts
from policies.straggler import StragglerDetector, WorkerStep
from policies.work_stealing import (
    FREE,
    RESCUE_AFTER_MIN_S,
    Backup,
    ClaimKind,
    ClaimState,
    Finished,
    RunShards,
    StepPlan,
    Wait,
    block_late,
    pick_work,
)


def _step(rng: random.Random, speeds: list[float], noise: float, shards: list[int] | None = None) -> list[WorkerStep]:
    shards = shards or [4] * len(speeds)
    return [
        WorkerStep(w, shards[w], 0.01 / speeds[w] * (1 + rng.uniform(-noise, noise))) for w in range(len(speeds))
    ]


def test_detector_raises_no_false_positive_on_noise():
    rng = random.Random(0)
    detector = StragglerDetector()
    for step in range(300):
        report = detector.observe(step, _step(rng, [1.0] * 4, noise=0.2))
        assert report.late == () and report.persistent == (), (step, report)


def test_detector_finds_a_2x_slowdown_within_a_few_steps_and_forgets_it_after():
    rng = random.Random(1)
    detector = StragglerDetector()
    for step in range(20):
        detector.observe(step, _step(rng, [1.0] * 4, noise=0.1))
    first_late = first_persistent = None
    for step in range(20, 40):
        report = detector.observe(step, _step(rng, [1.0, 1.0, 0.5, 1.0], noise=0.1))
        assert set(report.late) <= {2} and set(report.persistent) <= {2}
        if report.late and first_late is None:
            first_late = step
        if report.newly_persistent:
            first_persistent = step
            assert report.newly_persistent == (2,)
            assert report.evidence()["slowness"]["2"] > 1.5
    assert first_late == 20  # late in the very first slow step
    assert first_persistent is not None and first_persistent <= 20 + detector.persistent_steps
    for step in range(40, 60):
        report = detector.observe(step, _step(rng, [1.0] * 4, noise=0.1))
    assert report.persistent == () and report.late == ()


def test_detector_judges_finish_time_so_a_rebalanced_slow_worker_is_not_late():
    rng = random.Random(2)
    detector = StragglerDetector()
    for step in range(30):
        report = detector.observe(step, _step(rng, [1.0, 1.0, 1.0, 1 / 3], noise=0.05, shards=[5, 5, 5, 1]))
    assert report.late == () and report.persistent == (3,)


def test_detector_judges_arrival_so_a_stall_is_late_once_and_never_persistent():
    rng = random.Random(3)
    detector = StragglerDetector()
    for step in range(45):
        workers = _step(rng, [1.0] * 4, noise=0.05)
        stall_s = 10 * workers[0].arrival
        if step % 20 == 9:  # worker 2 stalls and its shards are taken: no speed to judge
            workers[2] = WorkerStep(2, 0, 0.0, arrival_s=stall_s)
        elif step % 20 == 19:  # it stalls, then computes its shards at its usual speed
            workers[2] = WorkerStep(2, 4, workers[2].shard_s, arrival_s=stall_s + workers[2].arrival)
        report = detector.observe(step, workers)
        assert report.late == ((2,) if step % 10 == 9 else ()), (step, report)
        assert report.persistent == ()
    assert report.lateness[2] < 1.5


def test_detector_rejects_bad_settings():
    with pytest.raises(ValueError):
        StragglerDetector(min_ratio=1.0)
    with pytest.raises(ValueError):
        StragglerDetector(window=3, persistent_steps=4)


@pytest.mark.parametrize(
    "total, speeds, low, high, expected",
    [
        (16, {0: 1, 1: 1, 2: 1, 3: 1}, 1, 16, {0: 4, 1: 4, 2: 4, 3: 4}),
        (16, {0: 1, 1: 1, 2: 1, 3: 1 / 3}, 1, 16, {0: 5, 1: 5, 2: 5, 3: 1}),
        (16, {0: 1, 1: 0.01}, 1, 16, {0: 15, 1: 1}),  # bounded below
        (16, {0: 1, 1: 0.01}, 1, 10, {0: 10, 1: 6}),  # and above
        (7, {0: 1, 1: 1, 2: 1}, 0, 7, {0: 3, 1: 2, 2: 2}),  # ties to the lower id
    ],
)
def test_proportional_counts(total, speeds, low, high, expected):
    assert proportional_counts(total, speeds, low, high) == expected


def test_proportional_counts_rejects_impossible_bounds():
    with pytest.raises(ValueError, match="cannot split"):
        proportional_counts(3, {0: 1.0, 1: 1.0}, 2, 3)


def test_rebalancer_converges_to_equal_finish_times_and_then_holds():
    rng = random.Random(3)
    rebalancer = Rebalancer(16)
    rebalancer.reset([0, 1, 2, 3])
    speeds = [1.0, 1.0, 1.0, 1 / 3]
    decisions = []
    for _ in range(60):
        measured = {w: 0.01 / speeds[w] * (1 + rng.uniform(-0.15, 0.15)) for w in range(4)}
        decision = rebalancer.observe(measured)
        if decision is not None:
            decisions.append(decision)
            assert decision.predicted_step_s < decision.previous_step_s
    assert rebalancer.counts == {0: 5, 1: 5, 2: 5, 3: 1}
    assert len(decisions) == 1  # converged in one move, no oscillation after


def test_rebalancer_keeps_an_even_split_under_noise():
    rng = random.Random(4)
    rebalancer = Rebalancer(16)
    rebalancer.reset([0, 1, 2, 3])
    for _ in range(200):
        assert rebalancer.observe({w: 0.01 * (1 + rng.uniform(-0.25, 0.25)) for w in range(4)}) is None
    assert rebalancer.counts == {0: 4, 1: 4, 2: 4, 3: 4}


def _states(plan: StepPlan, **overrides: ClaimState) -> dict[int, ClaimState]:
    states = dict.fromkeys(range(plan.num_shards), FREE)
    states.update({int(k[1:]): v for k, v in overrides.items()})
    return states


PLAN = StepPlan(((0, 1, 2, 3), (4, 5, 6, 7)), expected_shard_s=0.01)


def test_without_laggards_a_worker_runs_all_its_shards_in_one_sealed_pass():
    decision = pick_work(0, PLAN, _states(PLAN), {})
    assert decision == RunShards((0, 1, 2, 3), seal=True)


def test_without_mitigation_nothing_is_stolen():
    plan = StepPlan(PLAN.shards_by_rank, suspects=frozenset({1}), steal=False, speculate=False)
    done = ClaimState(ClaimKind.DONE, 0)
    assert pick_work(0, plan, _states(plan, s0=done, s1=done, s2=done, s3=done), {}) == Finished()


def test_with_a_suspect_own_shards_go_in_two_passes_and_its_free_shards_are_stolen():
    plan = StepPlan(PLAN.shards_by_rank, suspects=frozenset({1}), expected_shard_s=0.01)
    assert pick_work(0, plan, _states(plan), {}) == RunShards((0, 1), seal=False)
    mine_done = {f"s{s}": ClaimState(ClaimKind.DONE, 0) for s in range(4)}
    states = _states(plan, **mine_done, s4=ClaimState(ClaimKind.RUN, 1))
    assert pick_work(0, plan, states, {}) == RunShards((6, 7), seal=False, stolen_from=1)
    # The suspect itself never seals, so its shards can still be backed up.
    assert pick_work(1, plan, _states(plan, **mine_done), {}) == RunShards((4, 5), seal=False)


def test_a_late_running_shard_gets_one_backup_and_then_the_idle_worker_waits():
    done = {f"s{s}": ClaimState(ClaimKind.DONE, 0) for s in range(4)}
    running = {f"s{s}": ClaimState(ClaimKind.RUN, 1) for s in range(4, 8)}
    states = _states(PLAN, **done, **running)
    assert pick_work(0, PLAN, states, dict.fromkeys(range(8), 0.001)) == Wait()
    late = PLAN.late_after_s(1, ClaimKind.RUN) + 0.001
    assert pick_work(0, PLAN, states, {5: late, 4: late / 2}) == Backup(5, owner=1)
    states[5] = ClaimState(ClaimKind.RACE, 1, 0)
    assert pick_work(0, PLAN, states, {5: late}) == Wait()


def test_a_block_is_late_once_all_its_shards_sat_unstarted_past_late_factor():
    late = PLAN.late_after_s(1, ClaimKind.FREE)
    assert late == pytest.approx(3.0 * 4 * 0.01) and late > RESCUE_AFTER_MIN_S
    states = _states(PLAN, **{f"s{s}": ClaimState(ClaimKind.SEALED, 0) for s in range(4)})
    assert not block_late(PLAN, 1, states, dict.fromkeys(range(8), late * 0.9))
    assert block_late(PLAN, 1, states, dict.fromkeys(range(8), late * 1.1))
    # One of its shards started (or its owner sealed them): not a block to rescue.
    states[5] = ClaimState(ClaimKind.RUN, 1)
    assert not block_late(PLAN, 1, states, dict.fromkeys(range(8), late * 1.1))
    # Without an expected time nothing is late, and a rank without shards never is.
    unknown = StepPlan(PLAN.shards_by_rank)
    assert not block_late(unknown, 1, _states(unknown), dict.fromkeys(range(8), 100.0))
    assert not block_late(StepPlan(((0, 1), ()), expected_shard_s=0.01), 1, _states(StepPlan(((0, 1), ()))), {})
    # A block that should take a millisecond is not late after a few: that is scheduling.
    quick = StepPlan(PLAN.shards_by_rank, expected_shard_s=0.0001)
    assert not block_late(quick, 1, _states(quick), dict.fromkeys(range(8), 0.02))
    assert block_late(quick, 1, _states(quick), dict.fromkeys(range(8), RESCUE_AFTER_MIN_S + 0.01))


def test_finished_once_every_shard_is_done_or_sealed():
    states = _states(
        PLAN, **{f"s{s}": ClaimState(ClaimKind.DONE, 0) for s in range(4)},
        **{f"s{s}": ClaimState(ClaimKind.SEALED, 1) for s in range(4, 8)},
    )
    assert pick_work(0, PLAN, states, {}) == Finished()
    states[7] = ClaimState(ClaimKind.RACE, 1, 0)
    assert pick_work(1, PLAN, states, {}) == Wait()


@pytest.mark.parametrize("text", ["free", "run:3", "sealed:0", "race:2:1", "done:4"])
def test_claim_states_round_trip(text):
    assert ClaimState.decode(text).encode() == text


def _progress(step: int, phase: str, since_s: float = 6.0) -> Progress:
    return Progress(step=step, phase=Phase(phase), since_s=since_s, next_step=step)


def test_the_worker_holding_up_a_step_is_silent_but_a_slow_step_for_all_is_not():
    waiting = {0: _progress(7, "reduce"), 1: _progress(7, "idle", 1.0), 3: _progress(8, "compute")}
    assert [e.worker for e in silent_workers({**waiting, 2: _progress(7, "stall")}, 5.0)] == [2]
    assert [e.worker for e in silent_workers({**waiting, 2: None}, 5.0)] == [2]  # no answer
    assert [e.worker for e in silent_workers({**waiting, 2: _progress(6, "reduce")}, 5.0)] == [2]
    everyone_busy = {w: _progress(7, "compute") for w in range(4)}
    assert silent_workers(everyone_busy, 5.0) == []
    # Nobody has waited silent_s yet (a batch's next step just began): nobody is silent.
    just_began = {0: _progress(7, "reduce", 1.0), 1: _progress(7, "compute", 1.0)}
    assert silent_workers(just_began, 5.0) == []
    # The step held up is the latest one waited in that long: those still in it hold it up.
    later = {0: _progress(9, "reduce"), 1: _progress(9, "compute"), 2: _progress(8, "done")}
    assert [(e.worker, e.evidence["step"]) for e in silent_workers(later, 5.0)] == [(1, 9), (2, 9)]


def test_only_a_persistent_and_far_slower_worker_is_evicted_for_slowness():
    shard_s = {0: 0.01, 1: 0.011, 2: 0.012, 3: 0.1}

    def evicted_after(steps: int, persistent: set[int], late: set[int], ratio: float = 8.0) -> list[int]:
        eviction = SlowEviction(ratio, window=4, required=3)
        return [[e.worker for e in eviction.observe(shard_s, persistent, late)] for _ in range(steps)][-1]

    assert evicted_after(3, {3}, {3}) == [3]
    assert evicted_after(2, {3}, {3}) == []  # one or two slow steps are not evidence yet
    assert evicted_after(5, set(), {3}) == []  # not (yet) persistent
    assert evicted_after(5, {3}, set()) == []  # rebalancing absorbed it
    assert evicted_after(5, {3}, {3}, ratio=10.0) == []  # not slow enough


def test_slow_eviction_needs_most_of_the_window_and_starts_over_when_a_worker_recovers():
    """A worker descheduled for one step on a busy machine looks 8x slower for that step
    (tests/ray_jobs/test_job.py's clean built-in example lost a worker to that in CI)."""
    eviction = SlowEviction(8.0, window=4, required=3)
    slow, normal = {0: 0.01, 1: 0.01, 2: 0.1}, {0: 0.01, 1: 0.01, 2: 0.012}
    for shard_s in (normal, slow, normal, slow):
        assert eviction.observe(shard_s, {2}, {2}) == []
    (evict,) = eviction.observe(slow, {2}, {2})
    assert evict.worker == 2 and evict.evidence["slow_steps"] == 3 and evict.evidence["ratio"] == 10.0
    eviction = SlowEviction(8.0, window=4, required=3)
    for persistent in ({2}, {2}, set(), {2}, {2}):  # recovered in between: counted anew
        assert eviction.observe(slow, persistent, {2}) == []
    with pytest.raises(ValueError, match="required"):
        SlowEviction(8.0, window=2, required=3)

def _greedy_split(total: int, speeds: dict[int, float], low: int, high: int) -> dict[int, int]:
    """The rule proportional_counts implements, shard by shard: the next shard to the worker
    that would finish it first, ties to the lower id."""
    import heapq

    counts = dict.fromkeys(sorted(speeds), low)
    heap = [((low + 1) / speeds[w], w) for w in sorted(speeds)]
    heapq.heapify(heap)
    for _ in range(total - low * len(speeds)):
        _, worker = heapq.heappop(heap)
        counts[worker] += 1
        if counts[worker] < high:
            heapq.heappush(heap, ((counts[worker] + 1) / speeds[worker], worker))
    return counts


def test_the_vectorised_split_is_the_greedy_split_ties_and_bounds_included():
    rng = random.Random(7)
    for _ in range(400):
        n = rng.choice([1, 2, 3, 7, 50, 300])
        low, high = rng.randint(0, 2), rng.randint(3, 40)
        total = rng.randint(low * n, high * n)
        # Equal speeds (all ties), a few distinct speeds, or continuous ones.
        pick = rng.choice([lambda: 1.0, lambda: rng.choice([0.5, 1.0, 2.0, 3.0]), lambda: 1 / rng.uniform(0.001, 0.1)])
        speeds = {3 * w + 1: pick() for w in range(n)}
        assert proportional_counts(total, speeds, low, high) == _greedy_split(total, speeds, low, high)


def test_median_without_each_element_is_the_median_of_the_rest():
    import statistics

    from policies.eviction import median_without

    rng = random.Random(3)
    for n in (2, 3, 4, 9, 10):
        values = sorted(rng.choice([0.1, 0.2, 0.5, 1.0, rng.random()]) for _ in range(n))
        got = median_without(np.array(values), np.arange(n))
        want = [statistics.median(values[:i] + values[i + 1:]) for i in range(n)]
        assert got.tolist() == pytest.approx(want)


def test_the_detector_judges_columns_as_it_judges_reports():
    rng = random.Random(11)
    by_reports, by_columns = StragglerDetector(), StragglerDetector()
    for step in range(30):
        workers = [WorkerStep(w, 4, 0.01 * (3 if w == 5 and step > 8 else 1) * (1 + 0.05 * rng.random()), 0.0) for w in range(8)]
        a = by_reports.observe(step, workers)
        b = by_columns.observe_arrays(
            step, np.arange(8), np.full(8, 4), np.array([w.shard_s for w in workers]), np.array([w.arrival for w in workers])
        )
        assert (a.late, a.persistent, a.newly_persistent, a.cutoff) == (b.late, b.persistent, b.newly_persistent, b.cutoff)
    assert a.persistent == (5,)


def test_a_persistent_straggler_that_ran_nothing_keeps_its_eviction_evidence():
    # (The review's case: a step with its shards all stolen is no sign of recovery.)
    eviction = SlowEviction(2.0, window=3, required=2)
    assert eviction.observe({0: 1, 1: 1, 2: 10}, {2}, {2}) == []
    assert eviction.observe({0: 1, 1: 1}, {2}, {2}) == []
    assert [e.worker for e in eviction.observe({0: 1, 1: 1, 2: 10}, {2}, {2})] == [2]
