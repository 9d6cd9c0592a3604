"""The driver's straggler control (``orchestrator/steps/straggler_control.py``): each step's
plan (the split, the suspects, which mitigations are on), and each finished step's reports
turned into counters and events (mitigation, rescues, stragglers, rebalances), suspects for the
next steps, the expected seconds per shard, and evictions that keep ``min_workers`` and, with
sharded state, a copy of every slice."""

from __future__ import annotations

from typing import Any

import pytest

from jobspec.job import JobConfig
from jobspec.step_record import StepRecord
from jobspec.wire import StepTelemetry
from orchestrator.accounting.summary import EVENT_COUNTERS
from orchestrator.steps.straggler_control import StragglerControl
from tests.helpers.fake_runs import fake_job

WORKERS = [0, 1, 2]
#: A worker persistently slow and late evicted after one such step (window 2), at 2x the others.
QUICK_EVICTION = ("stragglers.window=2", "stragglers.persistent_steps=1", "stragglers.evict_ratio=2")


class Control:
    """A ``StragglerControl`` of ``fake_job(*overrides)`` on ``workers``, its events recorded."""

    def __init__(self, *overrides: str, workers: list[int] = WORKERS) -> None:
        self.job: JobConfig = fake_job(*overrides)
        self.counters = dict.fromkeys(EVENT_COUNTERS, 0)
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.control = StragglerControl(self.job, workers, self.counters, self.record)

    def record(self, kind: str, **fields: Any) -> None:
        self.events.append((kind, fields))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [fields for name, fields in self.events if name == kind]

    def step(
        self, step: int, shard_s: dict[int, float], stalled: dict[int, float] | None = None, **by_worker: dict[int, Any]
    ) -> None:
        """Run ``step`` as planned: each worker its planned shards at ``shard_s[w]`` seconds each,
        after ``stalled[w]`` seconds of stall; ``by_worker[field][w]`` sets a report's field."""
        plan = self.control.plan(step)
        reports = []
        for rank, worker in enumerate(self.control.workers):
            shards = plan.shards_by_rank[rank]
            fields = {name: values[worker] for name, values in by_worker.items() if worker in values}
            reports.append(StepTelemetry(
                step=step, rank=rank, worker=worker, shards=shards, samples=16 * len(shards), global_samples=256,
                loss=1.0, compute_s=shard_s[worker] * len(shards), comm_s=0.0, optim_s=0.0, step_s=0.1,
                shards_counted=16, shards_run=len(shards), shard_s=shard_s[worker],
                stalled_s=(stalled or {}).get(worker, 0.0), **fields,
            ))
        self.control.observe(step, StepRecord.of(step, reports))


EVEN = {0: 0.01, 1: 0.01, 2: 0.01}


def test_the_first_plan_splits_the_shards_evenly_in_rank_order_with_mitigation_on() -> None:
    plan = Control().control.plan(0)
    assert [len(shards) for shards in plan.shards_by_rank] == [6, 5, 5]
    assert sorted(s for shards in plan.shards_by_rank for s in shards) == list(range(16))
    assert plan.suspects == frozenset() and plan.steal and plan.speculate and plan.late_factor == 3.0


def test_with_mitigation_off_no_plan_steals_or_speculates() -> None:
    plan = Control("stragglers.mitigation=false").control.plan(0)
    assert not plan.steal and not plan.speculate
    assert not Control("stragglers.mitigation=false").control.evicting


def test_shuffled_shards_are_dealt_anew_each_step_and_the_same_for_the_same_step() -> None:
    first, second = Control("chaos.shuffle_shards=true").control, Control("chaos.shuffle_shards=true").control
    plans = [first.plan(step).shards_by_rank for step in range(6)]
    assert plans == [second.plan(step).shards_by_rank for step in range(6)]
    assert len(set(plans)) > 1
    assert all(sorted(s for shards in plan for s in shards) == list(range(16)) for plan in plans)


def test_mitigation_figures_are_added_to_the_counters_with_one_event_a_step() -> None:
    control = Control()
    control.step(0, EVEN, stolen={0: 3}, backups={0: 2}, backups_won={0: 1}, races_lost={1: 1})
    counters = control.counters
    named = ("stolen_shards", "speculative_shards", "speculative_won", "races_lost")
    assert [counters[name] for name in named] == [3, 2, 1, 1]
    (event,) = control.of("mitigation")
    assert event["step"] == 0
    assert [event[name] for name in ("stolen", "backups", "backups_won", "races_lost")] == [3, 2, 1, 1]
    assert event["workers"] == {
        0: {"stolen": 3, "backups": 2, "backups_won": 1, "races_lost": 0},
        1: {"stolen": 0, "backups": 0, "backups_won": 0, "races_lost": 1},
    }
    control.step(1, EVEN)
    assert len(control.of("mitigation")) == 1  # a step nobody mitigated says nothing


def test_a_rescue_pass_is_counted_once_a_step_not_once_a_rank() -> None:
    control = Control()
    control.step(
        0, EVEN, stalled={1: 1.25}, rescued={0: 3, 1: 3, 2: 3}, gave_up={1: True}, rescue_s={0: 0.1, 1: 0.2, 2: 0.3},
    )
    assert control.counters["rescues"] == 1 and control.counters["rescued_shards"] == 3
    (event,) = control.of("rescue")
    assert event == {"step": 0, "shards": 3, "gave_up": {1: 1.25}, "rescue_s": 0.3}


def test_a_worker_late_two_steps_in_a_row_is_a_suspect_in_the_next_plans() -> None:
    control = Control()
    for step in range(3):  # the detector's warm-up: nobody is late yet
        control.step(step, EVEN)
    control.step(3, EVEN, stalled={2: 1.0})
    assert control.control.suspects == set() and control.control.quiet  # once is noise
    assert [(e["worker"], e["status"]) for e in control.of("straggler")] == [(2, "late")]
    control.step(4, EVEN, stalled={2: 1.0})
    assert control.control.suspects == {2} and not control.control.quiet
    assert control.control.plan(5).suspects == frozenset({2})  # its rank
    assert control.counters["stragglers_detected"] == 2
    control.step(5, EVEN)
    assert control.control.suspects == set() and not control.control.quiet  # the plan changed back


def test_the_expected_seconds_per_shard_is_the_median_of_the_workers_not_suspected() -> None:
    control = Control()
    speeds = {0: 0.01, 1: 0.02, 2: 0.025}
    for step in range(3):
        control.step(step, speeds)
    assert control.control.expected_shard_s == pytest.approx(0.02)
    assert control.control.plan(3).expected_shard_s == pytest.approx(0.02)
    for step in (3, 4):
        control.step(step, speeds, stalled={2: 1.0})
    assert control.control.suspects == {2}
    assert control.control.expected_shard_s == pytest.approx(0.015)


def test_a_persistently_slow_late_worker_is_evicted_while_min_workers_remain() -> None:
    slow = {0: 0.01, 1: 0.01, 2: 0.1}
    control = Control(*QUICK_EVICTION, "scaling.min_workers=2")
    for step in range(4):
        control.step(step, slow)
    ((evict),) = control.control.pending_evictions
    assert evict.worker == 2 and evict.reason == "slow" and not control.control.quiet
    assert [e["worker"] for e in control.of("straggler") if e["status"] == "persistent"] == [2]
    kept = Control(*QUICK_EVICTION, "scaling.min_workers=3")
    for step in range(4):
        kept.step(step, slow)
    assert kept.control.pending_evictions == []


def test_a_slow_worker_holding_the_only_copy_of_its_slice_is_not_evicted() -> None:
    control = Control(*QUICK_EVICTION, "sharding.group_size=3")
    for step in range(4):
        control.step(step, {0: 0.01, 1: 0.01, 2: 0.1})
    assert control.control.pending_evictions == []
    skipped = control.of("evict_skipped")
    assert skipped and skipped[0]["workers"] == [2] and "sharded optimizer state" in skipped[0]["reason"]


def test_measured_speeds_rebalance_the_split_of_the_next_plans() -> None:
    control = Control("stragglers.rebalance=true")
    speeds = {0: 0.01, 1: 0.01, 2: 0.03}
    for step in range(10):
        control.step(step, speeds)
        if control.counters["rebalances"]:
            break
    assert control.counters["rebalances"] == 1 and len(control.of("rebalance")) == 1
    counts = [len(shards) for shards in control.control.plan(step + 1).shards_by_rank]
    assert sum(counts) == 16 and counts[2] < counts[0] and counts[2] < counts[1]


def test_a_new_group_starts_the_split_over_and_forgets_who_left() -> None:
    control = Control(*QUICK_EVICTION, "scaling.min_workers=2")
    for step in range(3):
        control.step(step, EVEN)
    for step in (3, 4):
        control.step(step, {0: 0.01, 1: 0.01, 2: 0.1}, stalled={2: 1.0})
    assert control.control.suspects == {2} and control.control.pending_evictions
    control.control.set_workers([0, 1, 7])
    assert control.control.suspects == set() and control.control.pending_evictions == []
    plan = control.control.plan(5)
    assert [len(shards) for shards in plan.shards_by_rank] == [6, 5, 5] and plan.suspects == frozenset()
    control.step(5, {0: 0.01, 1: 0.01, 7: 0.01})  # the newcomer reports as rank 2
