"""The step pipeline: steps queued on every worker ahead of the one being collected, and the
wait for one step that sees a failure or a silent worker as soon as it happens
(docs/architecture.md, "The step protocol")."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from orchestrator.config import JobConfig
from orchestrator.errors import JobFailed
from orchestrator.group import Call, CallFailed, FailureKind, WorkerGroup
from policies.eviction import Evict, silent_workers
from policies.work_stealing import StepPlan
from workers.claims import SLOTS
from workers.protocol import StepTelemetry

# Steps submitted ahead of the one being collected: the driver's round trip and bookkeeping
# overlap the workers' compute instead of sitting between steps.
STEPS_IN_FLIGHT = 2
assert STEPS_IN_FLIGHT < SLOTS, "open steps must not share claim slots"

# While a step runs the driver looks at the workers' finished calls this often: the bound on
# how late it sees a failure (one wait per step when steps are shorter).
FAILURE_POLL_S = 0.05


@dataclass(frozen=True)
class InFlight:
    """A submitted step: one call per rank, in rank order."""

    step: int
    calls: tuple[Call, ...]


@dataclass
class StepOutcome:
    """How waiting for one step ended: every report in (``reports`` by rank), workers to
    ``evict`` for holding it up, or a failure: ``errors`` by worker id (``dead`` for those that
    died; ``user_error`` for a call that raised an error of its own, which re-forming cannot
    cure), with the reports that did come in. ``waited_s``: seconds blocked on the workers."""

    reports: dict[int, StepTelemetry] = field(default_factory=dict)
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


class StepPipeline:
    """Submits steps from ``next_step`` on, keeping ``STEPS_IN_FLIGHT`` queued, and waits for
    them in order. ``plan(step)`` gives each step's plan (and opens its claims)."""

    def __init__(self, group: WorkerGroup, next_step: int, plan: Callable[[int], StepPlan]) -> None:
        self.group = group
        self.next_step = next_step
        self.in_flight: deque[InFlight] = deque()
        self._plan = plan

    def top_up(self, num_steps: int, before_submit: Callable[[int], None]) -> None:
        """Submit steps until ``STEPS_IN_FLIGHT`` are queued or ``num_steps`` reached;
        ``before_submit(step)`` runs first for each (chaos at the boundary, checkpoints)."""
        while self.next_step < num_steps and len(self.in_flight) < STEPS_IN_FLIGHT:
            before_submit(self.next_step)
            plan = self._plan(self.next_step)
            self.in_flight.append(InFlight(self.next_step, tuple(self.group.submit_step(self.next_step, plan))))
            self.next_step += 1

    def drain(self) -> tuple[InFlight, ...]:
        """Take every queued step out of the pipeline (for a recovery)."""
        steps = tuple(self.in_flight)
        self.in_flight.clear()
        return steps


def await_step(
    group: WorkerGroup,
    step: InFlight,
    job: JobConfig,
    evicting: bool,
) -> StepOutcome:
    """Wait for ``step``, looking at what has come in every ``FAILURE_POLL_S``, so the first
    failure is seen within that (most steps end within one wait). Returns the reports, the
    workers to evict for holding it up for ``stragglers.silent_s`` (when ``evicting`` and
    ``scaling.min_workers`` would remain), or the failure. Raises JobFailed after
    ``timeouts.step_s``."""
    deadline = time.monotonic() + job.timeouts.step_s
    silent_s = job.stragglers.silent_s
    rank_of = {id(call): rank for rank, call in enumerate(step.calls)}
    outcome = StepOutcome()
    pending = list(step.calls)
    quiet_since = time.monotonic()
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise JobFailed(f"step {step.step} did not finish within {job.timeouts.step_s:.0f}s")
        blocked = time.perf_counter()
        ended, pending = group.wait(pending, len(pending), min(FAILURE_POLL_S, left))
        outcome.waited_s += time.perf_counter() - blocked
        for call in ended:
            try:
                outcome.reports[rank_of[id(call)]] = group.result(call)
            except CallFailed as failure:
                outcome.record(failure)
        if outcome.failed:
            return outcome
        if ended:
            quiet_since = time.monotonic()
        if not pending or time.monotonic() - quiet_since < silent_s or not evicting:
            continue
        quiet_since = time.monotonic()
        silent = silent_workers(step.step, group.progress(timeout_s=min(5.0, silent_s)), silent_s)
        if silent and group.size - len(silent) >= job.scaling.min_workers:
            outcome.evict = silent
            return outcome
    return outcome


def ended_reports(group: WorkerGroup, step: InFlight, known: dict[int, StepTelemetry]) -> list[StepTelemetry]:
    """The reports of ``step``'s calls that succeeded, in rank order (``known`` by rank, the
    others looked up if they have ended)."""
    ended, _ = group.wait(step.calls, len(step.calls), 0.0)
    done = {id(c) for c in ended}
    out = []
    for rank, call in enumerate(step.calls):
        if rank in known:
            out.append(known[rank])
        elif id(call) in done:
            try:
                out.append(group.result(call))
            except CallFailed:
                continue
    return out
