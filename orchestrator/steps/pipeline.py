"""The step pipeline: batches of steps queued on every worker ahead of the one being collected,
and the wait for one batch that sees a failure or a silent worker as soon as it happens
(docs/architecture.md, "The step protocol" and "Run-ahead")."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from jobspec.job import JobConfig
from jobspec.step_record import StepRecord
from jobspec.wire import SnapshotOrder, StepTelemetry
from orchestrator.errors import JobFailed
from orchestrator.group.interface import Call, CallFailed, FailureKind, WorkerGroup
from policies.eviction import Evict, silent_workers
from policies.run_ahead import BATCHES_IN_FLIGHT, RunAhead
from policies.work_stealing import StepPlan

# Once one call of a batch has ended, how long the driver waits for the rest before it looks
# at what came in: the bound on how late it sees a failure after a peer's call ended.
GATHER_S = 0.05
# How long recovery waits for the survivors' kept reports of a batch that failed part-way.
KEPT_REPORTS_S = 5.0


@dataclass(frozen=True)
class InFlight:
    """A submitted batch: steps ``step`` to ``step + count - 1`` on ``workers`` (rank order).
    ``calls`` answer its reports (the leader's: every rank's); ``watched`` end early only if a
    follower fails (``orchestrator.group.interface.Submitted``)."""

    step: int
    calls: tuple[Call, ...]
    count: int = 1
    watched: tuple[Call, ...] = ()
    workers: tuple[int, ...] = ()

    @property
    def steps(self) -> range:
        return range(self.step, self.step + self.count)


def calls_of(batches: Sequence[InFlight]) -> list[Call]:
    """Every call of ``batches``, each once (the batches of one run share their watched calls)."""
    seen: dict[int, Call] = {}
    for batch in batches:
        for call in batch.calls + batch.watched:
            seen.setdefault(id(call), call)
    return list(seen.values())


@dataclass
class StepOutcome:
    """How waiting for one batch ended: every report in (``records``: one ``StepRecord`` per
    step of the batch, in order, every rank's row in it), workers to ``evict`` for holding it
    up, or a failure: ``errors`` by worker id (``dead`` for those that died; ``user_error`` for
    a call that raised an error of its own, which re-forming cannot cure), with the records if
    they came in. ``waited_s``: seconds blocked on the workers."""

    records: list[StepRecord] = field(default_factory=list)
    evict: list[Evict] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    dead: set[int] = field(default_factory=set)
    user_error: str | None = None
    waited_s: float = 0.0

    @property
    def failed(self) -> bool:
        return bool(self.errors)

    def record(self, failure: CallFailed, *, cured_by_reforming: bool = False) -> None:
        """Note a failed call. ``cured_by_reforming``: even an error of the call's own (a store
        error in a rendezvous) is cured by forming the group again, so it is no user error."""
        self.errors[failure.worker] = failure.reason
        if failure.kind is FailureKind.DIED:
            self.dead.add(failure.worker)
        elif failure.kind is FailureKind.ERROR and not cured_by_reforming:
            self.user_error = failure.reason


class BatchHooks(Protocol):
    """What the driver decides about each batch as ``StepPipeline`` hands it out (the
    controller's answers: chaos, checkpoints, straggler plans)."""

    def boundary(self, step: int) -> bool:
        """Whether the driver must act before ``step`` (chaos, a checkpoint due while the last
        is still being written): a batch ends in front of it."""

    def hold(self, first: int, count: int) -> bool:
        """While a batch is in flight: whether to keep the next one (``count`` steps from
        ``first``) back for a later turn (a checkpoint due inside it behind a pending one)."""

    def before_submit(self, step: int) -> None:
        """Act at the boundary before the batch from ``step`` goes out (chaos, a checkpoint
        taken between batches)."""

    def plan(self, step: int) -> StepPlan:
        """Step ``step``'s plan (its claims opened if it mitigates stragglers)."""

    def snapshot_inside(self, first: int, count: int) -> SnapshotOrder | None:
        """The checkpoint to take inside the batch of ``count`` steps from ``first``, if one is
        due there."""


class StepPipeline:
    """Submits steps from ``next_step`` on in batches sized by ``run_ahead``, keeping
    ``BATCHES_IN_FLIGHT`` queued, and waits for them in order; ``hooks`` decide what goes
    into each batch and where batches end."""

    def __init__(self, group: WorkerGroup, next_step: int, run_ahead: RunAhead, hooks: BatchHooks) -> None:
        self.group = group
        self.next_step = next_step
        self.in_flight: deque[InFlight] = deque()
        self.run_ahead = run_ahead
        self.hooks = hooks

    def top_up(self, num_steps: int) -> None:
        """Submit batches until ``BATCHES_IN_FLIGHT`` are queued or ``num_steps`` reached. With
        a batch in flight, the next may be held back (``hooks.hold``)."""
        hooks = self.hooks
        while self.next_step < num_steps and len(self.in_flight) < BATCHES_IN_FLIGHT:
            first = self.next_step
            count = self.run_ahead.batch(first, num_steps, hooks.boundary)
            if self.in_flight and hooks.hold(first, count):
                break
            hooks.before_submit(first)
            plans = [hooks.plan(step) for step in range(first, first + count)]
            workers = tuple(self.group.workers)
            submitted = self.group.submit_steps(first, plans, hooks.snapshot_inside(first, count))
            self.in_flight.append(InFlight(first, submitted.reporting, count, submitted.watched, workers))
            self.next_step += count
        if len(self.in_flight) < BATCHES_IN_FLIGHT:
            # Nothing more for now (held, or the last steps): the followers must not sit in a
            # wait for the next batch, which ends in a timeout.
            self.group.release_followers()

    def drain(self) -> tuple[InFlight, ...]:
        """Take every queued batch out of the pipeline (for a recovery)."""
        batches = tuple(self.in_flight)
        self.in_flight.clear()
        return batches


def snapshot_cap_s(job: JobConfig) -> float:
    """The longest a worker's checkpoint snapshot may keep its peers waiting before it is
    evicted as hung: within a checkpoint's time limit, and half a step's, so that the
    eviction comes before ``await_step`` gives the whole job up for a step not finishing."""
    return min(job.timeouts.checkpoint_s, job.timeouts.step_s / 2)


def await_step(
    group: WorkerGroup,
    batch: InFlight,
    job: JobConfig,
    evicting: bool,
) -> StepOutcome:
    """Wait for ``batch``: blocked until the first of its calls ends (a failure is seen as soon
    as it happens), then up to ``GATHER_S`` for the others, and so on. Returns the reports, the
    workers to evict for holding a step up for ``stragglers.silent_s`` (a snapshot for up to
    ``timeouts.checkpoint_s``; when ``evicting`` and ``scaling.min_workers`` would remain), or
    the failure. Raises JobFailed when no worker has reached a further step within
    ``timeouts.step_s`` (a batch's steps each get that long)."""
    deadline = time.monotonic() + job.timeouts.step_s
    furthest = batch.step
    silent_s = job.stragglers.silent_s
    reporting = {id(call) for call in batch.calls}
    outcome = StepOutcome()
    pending = [*batch.calls, *batch.watched]
    looked = time.monotonic()
    while any(id(call) in reporting for call in pending):
        now = time.monotonic()
        if now >= deadline:
            reached = [p.step for p in group.progress(timeout_s=5.0).values() if p is not None]
            if max(reached, default=furthest) <= furthest:
                raise JobFailed(f"step {furthest} did not finish within {job.timeouts.step_s:.0f}s")
            furthest, deadline = max(reached), time.monotonic() + job.timeouts.step_s
            continue
        wake = min(deadline, looked + silent_s / 2) if evicting else deadline
        blocked = time.perf_counter()
        # One call ending wakes the driver; the others, ending about then, are gathered in one
        # more wait (not a wake-up each: a wait looks at every pending call).
        ended, pending = group.wait(pending, 1, max(0.0, wake - now))
        left = sum(id(call) in reporting for call in pending)
        if ended and left:  # (a follower's watched call ends only if it fails: not waited for)
            more, pending = group.wait(pending, left, GATHER_S)
            ended += more
        lost = [failure for call in ended if (failure := _take(group, call, id(call) in reporting, outcome))]
        if lost and not outcome.failed and _whole(group, batch, pending, reporting, outcome):
            # The follower failed in a later batch: seen with that one.
            outcome.waited_s += time.perf_counter() - blocked
            return outcome
        if lost or outcome.failed:
            # Every failure that comes about then, followers' included: the dead must be known
            # as dead (they never carry the state on), whoever's call ended first.
            more, pending = group.wait(pending, len(pending), GATHER_S) if pending else ([], [])
            lost += [failure for call in more if (failure := _take(group, call, id(call) in reporting, outcome))]
            for failure in lost:
                outcome.record(failure)
        outcome.waited_s += time.perf_counter() - blocked
        if outcome.failed:
            return outcome
        # A batch's calls end only at its end: look at the workers' progress every half
        # ``silent_s`` (a waiter must itself have waited ``silent_s`` to count).
        if not pending or not evicting or time.monotonic() - looked < silent_s / 2:
            continue
        looked = time.monotonic()
        silent = silent_workers(group.progress(timeout_s=min(5.0, silent_s)), silent_s, snapshot_cap_s(job))
        if silent and group.size - len(silent) >= job.scaling.min_workers:
            outcome.evict = silent
            return outcome
    return outcome


def _whole(group: WorkerGroup, batch: InFlight, pending: list[Call], reporting: set[int], outcome: StepOutcome) -> bool:
    """After a follower's run failed: whether ``batch`` is whole all the same, its leader's
    answer in ``outcome`` (taken here if it comes). If the leader applied every step of the
    batch (its progress says so), the follower failed in a later batch and the answer is due:
    waited for up to ``KEPT_REPORTS_S``. Otherwise the leader is blocked in the failed step
    until the abort, and the batch failed."""
    left = [call for call in pending if id(call) in reporting]
    if left:
        leader = group.progress(timeout_s=KEPT_REPORTS_S).get(batch.workers[0]) if batch.workers else None
        if leader is None or leader.next_step < batch.step + batch.count:
            return False
        done, _ = group.wait(left, len(left), KEPT_REPORTS_S)
        for call in done:
            pending.remove(call)
            _take(group, call, True, outcome)
        if len(done) < len(left):
            return False
    return not outcome.failed


def _take(group: WorkerGroup, call: Call, reporting: bool, outcome: StepOutcome) -> CallFailed | None:
    """Take an ended call's answer into ``outcome``: a reporting call's reports, or its failure.
    A watched call's failure is returned for the caller to judge (its answer otherwise: the
    count of batches a released follower ran, is of no use)."""
    try:
        value = group.result(call)
    except CallFailed as failure:
        if not reporting:
            return failure
        outcome.record(failure)
        return None
    if reporting:
        outcome.records += value
    return None


def batch_reports(group: WorkerGroup, batch: InFlight, known: Sequence[StepRecord]) -> dict[int, StepRecord]:
    """The record of each of ``batch``'s steps, by step: ``known`` (the batch's records, if
    they came in), else the leader's answer if it ended well, else a record of what the
    survivors kept of the steps they applied before the batch failed (``kept_reports``: the
    rows of the ranks that answer)."""
    records = list(known)
    if not records:
        ended, _ = group.wait(batch.calls, len(batch.calls), 0.0)
        for call in ended:
            try:
                records += group.result(call)
            except CallFailed:
                pass
    by_step = {record.step: record for record in records if record.step in batch.steps}
    if len(by_step) == batch.count:
        return by_step
    kept = group.kept_reports(list(batch.workers), batch.step, batch.step + batch.count, KEPT_REPORTS_S)
    rows: dict[int, list[StepTelemetry]] = {step: [] for step in batch.steps}
    for report in kept:
        if report.step in rows:
            rows[report.step].append(report)
    return {step: by_step.get(step) or StepRecord.of(step, rows[step]) for step in batch.steps}
