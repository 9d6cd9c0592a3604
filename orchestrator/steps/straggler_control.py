"""The driver's side of straggler handling: plans each step, feeds telemetry to the policies,
and turns their decisions into counters and events (with the evidence)."""

from __future__ import annotations

import statistics
from typing import Callable

import numpy as np

from jobspec.job import JobConfig
from jobspec.step_record import StepRecord
from policies.assignment import ShardAssignment
from policies.eviction import Evict
from policies.sharding import slices_kept
from policies.straggler_policies import StepColumns, StragglerPolicies
from policies.work_stealing import StepPlan

EventSink = Callable[..., None]
#: A step's mitigation figures per worker, as reported (``StepTelemetry``'s fields).
MITIGATION = ("stolen", "backups", "backups_won", "races_lost")


class StragglerControl:
    """Owns the detector and rebalancer of one job. Workers are named by their worker id;
    ``workers[r]`` is the id of rank r."""

    def __init__(self, job: JobConfig, workers: list[int], counters: dict[str, int], event: EventSink) -> None:
        config = job.stragglers
        self.job = job
        self.config = config
        self.workers = list(workers)
        self.counters = counters
        self.event = event
        self.policies = StragglerPolicies(job.shards, **config.policy_kwargs())
        self.policies.regroup(self.workers, [])
        self.pending_evictions: list[Evict] = []
        self.suspects: set[int] = set()
        self._late_before: set[int] = set()
        self.expected_shard_s = 0.0
        #: The last step observed left the plan as it was (run-ahead may grow).
        self.quiet = True

    @property
    def evicting(self) -> bool:
        return self.config.mitigation and self.config.evict

    def _state_stays(self, evict: list[Evict]) -> bool:
        """With sharded optimizer state, whether the workers left after ``evict`` still hold a
        copy of every slice (an evicted worker's slice is not handed over before it goes)."""
        sharding = self.job.sharding
        if not sharding.enabled:
            return True
        leaving = [self.workers.index(e.worker) for e in evict if e.worker in self.workers]
        return slices_kept(len(self.workers), sharding.group_size, leaving)

    def set_workers(self, workers: list[int]) -> None:
        """The group changed (re-formed or grown): start the split and the estimates over."""
        self.policies.regroup(list(workers), sorted(set(self.workers) - set(workers)))
        self.workers = list(workers)
        self.pending_evictions = []
        self.suspects &= set(workers)
        self._late_before &= set(workers)

    def plan(self, step: int) -> StepPlan:
        """The starting assignment of ``step`` and what the workers may do about laggards."""
        if self.job.chaos.shuffle_shards:
            assignment = ShardAssignment.shuffled(self.job.shards, len(self.workers), seed=self.job.seed * 7919 + step)
        else:
            assignment = ShardAssignment.from_counts([self.policies.rebalancer.counts[w] for w in self.workers])
        mitigation = self.config.mitigation
        return StepPlan(
            shards_by_rank=assignment.shards_by_rank,
            suspects=frozenset(r for r, w in enumerate(self.workers) if w in self.suspects),
            expected_shard_s=self.expected_shard_s,
            late_factor=self.config.late_factor,
            steal=mitigation and self.config.steal,
            speculate=mitigation and self.config.speculate,
        )

    def observe(self, step: int, record: StepRecord) -> None:
        """Account one finished step: counters, detection, rebalancing."""
        workers = record.column("worker").astype(np.int64)
        self._count_mitigation(step, record, workers)
        self._count_rescue(step, record, workers)
        # Lateness is judged on arrival at the all-reduce (stalls included), speed on shard_s.
        columns = StepColumns.of_arrays(
            workers, *(record.column(name) for name in ("shards_run", "shard_s", "compute_s", "stalled_s", "gave_up"))
        )
        decided = self.policies.observe(
            step, columns, rebalance=self.job.rebalancing, evict=self.evicting and not self.pending_evictions
        )
        verdict = decided.verdict
        for worker in verdict.late:
            self.counters["stragglers_detected"] += 1
            self.event("straggler", step=step, worker=worker, status="late", **verdict.evidence())
        for worker in verdict.newly_persistent:
            self.counters["stragglers_detected"] += 1
            self.event("straggler", step=step, worker=worker, status="persistent", **verdict.evidence())
        # One late step is often noise on a shared machine; two in a row, or persistent
        # slowness, makes a worker a suspect for the next steps.
        suspects_before = self.suspects
        self.suspects = (set(verdict.late) & self._late_before) | set(verdict.persistent)
        self._late_before = set(verdict.late)
        if decided.rebalance is not None:
            self.counters["rebalances"] += 1
            self.event("rebalance", step=step, **decided.rebalance.evidence())
        if decided.evict and len(self.workers) - len(decided.evict) >= self.job.scaling.min_workers:
            if self._state_stays(decided.evict):
                self.pending_evictions = decided.evict
            else:
                self.event(
                    "evict_skipped", step=step, workers=[e.worker for e in decided.evict],
                    reason="sharded optimizer state: no replica of its slice would stay (a rollback to a checkpoint costs more)",
                )
        measured = {int(workers[i]): float(columns.shard_s[i]) for i in np.flatnonzero(columns.shards)}
        healthy = [s for w, s in measured.items() if w not in self.suspects] or list(measured.values())
        if healthy:
            self.expected_shard_s = statistics.median(healthy)
        # Stealing, backups and rescues happen inside a step, worker to worker; only a plan
        # that changes (the split, the suspects) or a membership change needs the driver
        # between steps.
        self.quiet = self.suspects == suspects_before and decided.rebalance is None and not self.pending_evictions

    def _count_mitigation(self, step: int, record: StepRecord, workers: np.ndarray) -> None:
        """Count the step's steals, backups and races, in one event for the step, whoever did what:
        at scale, an event per worker per step would cost the driver more than the step."""
        figures = np.stack([record.column(name) for name in MITIGATION], axis=1).astype(np.int64)
        active = np.flatnonzero(figures[:, 0] + figures[:, 1] + figures[:, 3])  # stolen, backups, races lost
        mitigated = {int(workers[i]): tuple(int(v) for v in figures[i]) for i in active}
        if not mitigated:
            return
        stolen, backups, won, lost = (sum(column) for column in zip(*mitigated.values()))
        self.counters["stolen_shards"] += stolen
        self.counters["speculative_shards"] += backups
        self.counters["speculative_won"] += won
        self.counters["races_lost"] += lost
        self.event(
            "mitigation", step=step, stolen=stolen, backups=backups, backups_won=won, races_lost=lost,
            workers={w: dict(zip(MITIGATION, m)) for w, m in mitigated.items()},
        )

    def _count_rescue(self, step: int, record: StepRecord, workers: np.ndarray) -> None:
        """Count the step's rescue pass, if it had one: the census that starts it is the same on
        every rank, so once."""
        if not len(record) or not record.first("rescued"):
            return
        self.counters["rescues"] += 1
        self.counters["rescued_shards"] += record.first("rescued")
        stalled = record.column("stalled_s")
        self.event(
            "rescue", step=step, shards=record.first("rescued"),
            gave_up={int(workers[i]): round(float(stalled[i]), 3) for i in np.flatnonzero(record.column("gave_up"))},
            rescue_s=round(float(record.column("rescue_s").max()), 4),
        )
