"""The recovery procedure, the ``Recovering`` state's work: abort every member, find the dead,
commit what some survivor finished, re-form without the dead and the evicted (with any ready
replacements) and redo the steps that were in flight (docs/architecture.md, "Recovery").

The decisions it takes (who settled, what is committed, what to redo, who leads) and the
re-forming itself are ``orchestrator/recovery/reform.py``'s; this carries them out on the job's
group and accounts them: events, counters, the ``Recovery`` record, the held steps' commits.
"""

from __future__ import annotations

import time
from dataclasses import InitVar, dataclass, field
from typing import Mapping, Sequence

from jobspec.job import JobConfig
from jobspec.step_record import StepRecord
from jobspec.wire import Progress
from orchestrator.accounting.recovery_log import Recovery
from orchestrator.accounting.step_sinks import StepAccounting
from orchestrator.checkpoints.coordinator import CheckpointCoordinator
from orchestrator.checkpoints.resume_point import find_resume_point
from orchestrator.errors import JobFailed
from orchestrator.group.chaos_control import ChaosControl
from orchestrator.group.interface import CallFailed, WorkerGroup, WorkerGroupError
from orchestrator.group.membership import JoinerPool
from orchestrator.output.run_dir import RunDirectory
from orchestrator.recovery.plan import plan_recovery, redo_after_reform
from orchestrator.recovery.reform import (
    MAX_REFORMS,
    PROBE_S,
    GiveUp,
    Reformed,
    Reformer,
    StateLost,
    settle,
    sharding_of,
)
from orchestrator.steps.pipeline import InFlight, StepOutcome, batch_reports
from orchestrator.steps.states import CheckpointingBeforeFailure, Recovering, Running, State
from orchestrator.steps.straggler_control import StragglerControl
from orchestrator.store.rendezvous import RendezvousStore


@dataclass(eq=False)
class RecoveryProcedure:
    """Recovers ``job`` on ``group`` (meeting at ``store``) after a failure or an eviction,
    ``joiners`` joining; ``chaos`` tells when a worker it killed died, ``checkpoints`` learns of
    failures, ``accounting`` commits the steps the re-formed group holds and counts. Register
    ``step_completed`` with the accounting: failures with nobody dead count from the last
    completed step."""

    job: JobConfig
    run: RunDirectory
    group: WorkerGroup
    store: RendezvousStore
    chaos: ChaosControl
    checkpoints: CheckpointCoordinator
    accounting: StepAccounting
    joiners: InitVar[JoinerPool]
    reformer: Reformer = field(init=False)
    _failed_in_a_row: int = field(init=False, default=0)  # recoveries with nobody dead since the last completed step

    def __post_init__(self, joiners: JoinerPool) -> None:
        self.reformer = Reformer(
            self.group, self.store, joiners, self.job.scaling, self.job.timeouts.collective_s, self._failed_join,
            sharded=self.job.sharding.enabled,
        )

    def step_completed(self, step: int, record: StepRecord) -> None:
        """A step completed (every rank's report in): the failures in a row are over."""
        self._failed_in_a_row = 0

    def recover(self, state: Recovering, stragglers: StragglerControl) -> State:
        """Recover from ``state`` (see the module doc) and tell ``stragglers`` the new group;
        the next state is Running, or CheckpointingBeforeFailure with too few workers left.
        Raises JobFailed if the failure is not a lost worker."""
        noticed = time.time()
        outcome = state.outcome
        steps_done = self.accounting.ledger.steps_done
        silent, evicted = self._leaving(outcome)
        settled = settle(
            self.group, self.store.generation, state.in_flight, frozenset(evicted) | frozenset(silent),
            self.job.timeouts.collective_s,
        )
        plan = plan_recovery(outcome.errors, outcome.dead, silent, evicted, settled.alive, settled.lost, steps_done)
        if plan.nobody_lost:
            self._nobody_lost(outcome, state.in_flight, plan.alive)
        died_at = [t for w in plan.dead if (t := self.chaos.death_time(self.store, w)) is not None]
        recovery = Recovery(
            at_step=plan.at_step, workers=plan.leaving, reasons=plan.reasons, started=min(died_at) if died_at else noticed
        )
        recovery.detect_s = time.time() - recovery.started
        if plan.dead:
            self.accounting.counters["failures"] += len(plan.dead)
            self.run.event(
                "failure", at_step=plan.at_step, workers=plan.dead, reasons=recovery.reasons, detect_s=recovery.detect_s
            )
            self.checkpoints.observe_failure()
        self.group.remove(plan.dead)
        self.group.remove(plan.evicted, retire=True)
        self.checkpoints.abandon(f"worker(s) {plan.leaving} left the group")
        reforming = time.time()
        reformed = self.reformer.reform(plan.alive, steps_done, state.without_state)
        if isinstance(reformed, StateLost):
            reformed = self._roll_back(reformed, plan.leaving, state.without_state)
        if isinstance(reformed, GiveUp):
            return CheckpointingBeforeFailure(reformed.holders, reformed.reason, state.in_flight, tuple(outcome.records))
        next_step = reformed.next_step
        self.commit_held(state.in_flight, outcome.records, next_step)
        reached = max((p.step for p in plan.alive.values()), default=next_step)
        redo = redo_after_reform(state.in_flight, next_step, steps_done, reached)
        recovery.at_step = next_step
        recovery.workers += list(reformed.lost)
        self.accounting.counters["joins"] += len(reformed.joined)
        recovery.transfer_s, recovery.waited_s = reformed.transfer_s, reformed.waited_s
        recovery.reform_s = time.time() - reforming - reformed.transfer_s  # every attempt, and waiting
        stragglers.set_workers(self.group.workers)
        if plan.dead or redo:
            self.accounting.counters["recoveries"] += 1
            self.accounting.counters["steps_redone"] += len(redo)
            recovery.redo_steps = redo
            self.accounting.recoveries.opened(recovery)
        self.run.event(
            "group_reformed", workers=self.group.workers, redo=redo, transfer_s=recovery.transfer_s,
            sharding=sharding_of(self.job.sharding, self.group.size),
        )
        return Running(next_step, f"{self.group.size} workers")

    def _roll_back(self, lost: StateLost, gone: list[int], without_state: frozenset[int]) -> Reformed | GiveUp:
        """Sharded optimizer state left with ``gone`` and no survivor holds it (one replica
        group, or every peer of a slice lost): load the run's newest checkpoint (each member
        the slice it will own), rewind the committed steps to it and re-form from it (the
        events say so; the steps after it run again, counted as redone). A death meanwhile (loading, or joining: the
        restored worker may be the one lost) starts it over, ``MAX_REFORMS`` times at most.
        Raises JobFailed if the run has no checkpoint, or after those attempts."""
        what = "all of it" if lost.span is None else f"entries [{lost.span[0]}, {lost.span[1]})"
        sharding = self.job.sharding.group_size
        point = find_resume_point(self.job, self.run.path, lambda message: self.run.event("checkpoint_skipped", reason=message))
        if point is None:
            raise JobFailed(
                f"sharded optimizer state ({what}) was lost with worker(s) {gone}: no survivor holds it at step "
                f"{lost.step}, and this run has no checkpoint to fall back to; keep a replica of every slice "
                f"(scaling.workers at least 2 x sharding.group_size {sharding}) or set checkpoint.every_steps"
            )
        self.run.event(
            "state_lost", at_step=lost.step, workers=gone, span=lost.span, checkpoint=point.name, step=point.step,
            steps_lost=self.accounting.ledger.steps_done - point.step,
        )
        self.accounting.ledger.rewind_to(point.step)
        self.checkpoints.resumed(point)
        for _ in range(MAX_REFORMS):
            try:
                self.group.restore(point.root, point.name, point.manifest)  # each member its slice now
            except (CallFailed, WorkerGroupError) as err:
                self.reformer.after_failed_join(err)  # the dead removed: restore into another
                continue
            alive, silent = self.group.probe(PROBE_S)
            self.group.remove(silent)
            restored = frozenset(self.group.workers)
            reformed = self.reformer.reform(alive, point.step, without_state - restored)
            if isinstance(reformed, GiveUp) and not restored <= set(self.group.workers):
                continue  # a restored worker died joining: the others can load it again
            if not isinstance(reformed, StateLost):
                return reformed
        raise JobFailed(f"could not go back to checkpoint {point.name} after {MAX_REFORMS} attempts: workers kept dying")

    def _leaving(self, outcome: StepOutcome) -> tuple[dict[int, str], list[int]]:
        """Who leaves by the driver's decision, each counted and recorded (an ``evict`` event):
        (the silent, with why; the evicted). A silent worker (stalled, hung, partitioned) is a
        failure: replaced, its slot kept. One persistently far slower is evicted: its slot is
        retired (a replacement there would likely be as slow)."""
        silent = {e.worker: e.evidence["why"] for e in outcome.evict if e.reason == "silent"}
        evicted = [e.worker for e in outcome.evict if e.worker not in silent]
        for eviction in outcome.evict:
            self.accounting.counters["evictions"] += eviction.worker not in silent
            self.run.event(
                "evict", at_step=self.accounting.ledger.steps_done, worker=eviction.worker, reason=eviction.reason,
                evidence=eviction.evidence,
            )
        return silent, evicted

    def _nobody_lost(self, outcome: StepOutcome, in_flight: tuple[InFlight, ...], alive: Mapping[int, Progress]) -> None:
        """Nobody died and nobody is evicted (``alive``: every member's settled progress): a
        worker's own error fails the job; collectives that failed with every member alive (a
        network fault) are re-formed and retried, but not forever. Failing, it first commits
        the steps every replica applied, then raises JobFailed naming the step that failed."""
        if outcome.user_error is None:
            self._failed_in_a_row += 1
            if self._failed_in_a_row <= MAX_REFORMS:
                return
        self.store.check_alive()  # a dead store makes every worker's call fail too
        failed = self.commit_applied(in_flight, outcome.records, alive)
        if outcome.user_error is not None:
            raise JobFailed(f"step {failed}: {outcome.user_error}")
        raise JobFailed(f"step {failed} failed {MAX_REFORMS} times in a row: {outcome.errors}")

    def commit_applied(
        self, in_flight: tuple[InFlight, ...], known: Sequence[StepRecord], progress: Mapping[int, Progress | None]
    ) -> int:
        """Before the job fails: commit the steps in flight that every member applied (by
        ``progress``; one that did not answer counts for nothing), so the summary and
        ``telemetry.jsonl`` hold every step the replicas hold, and return the first step not
        applied everywhere: the one that failed. ``known`` as for ``commit_held``."""
        steps_done = self.accounting.ledger.steps_done
        applied = [p.next_step for p in progress.values() if p is not None]
        through = max(steps_done, min(applied, default=steps_done))
        self.commit_held(in_flight, known, through)
        return through

    def commit_held(
        self, in_flight: tuple[InFlight, ...], known: Sequence[StepRecord], through: int
    ) -> None:
        """Commit the steps in flight before ``through``, the next step of the state the group
        (or the checkpoint) now holds: a survivor applied them and the census proved each.
        ``known``: the records of the first batch in flight, if its reports came in."""
        for batch in in_flight:
            if batch.step >= through:
                break
            records = batch_reports(self.group, batch, known if batch is in_flight[0] else ())
            for step in batch.steps:
                if step >= through:
                    break
                self.accounting.commit(step, records[step], complete=False)

    def _failed_join(self, lost: list[int], error: str) -> None:
        """A re-forming attempt failed; ``lost``: the workers it found dead (removed)."""
        self.run.event("reform_failed", error=error)
        self.accounting.counters["failures"] += len(lost)
        if lost:
            self.run.event("failure", at_step=self.accounting.ledger.steps_done, workers=lost, reasons={}, detect_s=None)
