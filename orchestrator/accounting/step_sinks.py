"""Step accounting: one committed step fanned out to its sinks, and what they add up to.

A committed step goes to the commit ledger, the start-up milestones (the first step), the
run's telemetry, the observers of complete steps (the straggler policies, the recovery
procedure's count of failures in a row), the checkpoint interval, the ``step`` event and the
``recovered`` event of a recovery it closes (the run's listeners take them: tracking,
metrics) and the progress bar. The same account gives the goodput so far
(``policies/goodput.py``) and the job's summary (``orchestrator/accounting/summary.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tqdm import tqdm

from jobspec.job import JobConfig
from jobspec.step_record import StepRecord
from jobspec.wire import WorkerInfo
from orchestrator.accounting.ledger import CommitLedger
from orchestrator.accounting.recovery_log import RecoveryLog
from orchestrator.accounting.summary import job_goodput, job_summary
from orchestrator.checkpoints.coordinator import CheckpointCoordinator
from orchestrator.group.interface import WorkerGroup
from orchestrator.output.run_dir import RunDirectory
from orchestrator.steps.states import Failed, Finished, State, Stopped
from policies.goodput import Goodput

#: Told of every step committed with every rank's report: ``(step, record)``.
StepObserver = Callable[[int, StepRecord], None]


@dataclass(eq=False)
class StepAccounting:
    """Accounts the committed steps of ``job`` on ``group`` (see the module doc).
    ``checkpoints`` learns each step's seconds and gives its copies' stalls; ``counters`` are
    the job's event counters (the summary's ``events``), shared with whoever counts;
    ``launched``: ``perf_counter()`` at launch, for start-up milestones and goodput;
    ``observers`` are told of every complete step."""

    job: JobConfig
    run: RunDirectory
    group: WorkerGroup
    checkpoints: CheckpointCoordinator
    counters: dict[str, int]
    launched: float
    ledger: CommitLedger = field(init=False)
    recoveries: RecoveryLog = field(init=False, default_factory=RecoveryLog)
    startup_s: dict[str, float] = field(init=False, default_factory=dict)
    observers: list[StepObserver] = field(init=False, default_factory=list)
    #: The latest committed step's record (None before the first; it may hold no row if no rank's came back).
    last_record: StepRecord | None = field(init=False, default=None)
    _bar: tqdm | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.ledger = CommitLedger(self.job.shards)

    @property
    def workers(self) -> int:
        """Workers in the group now."""
        return self.group.size

    def mark(self, milestone: str, seconds: float | None = None) -> None:
        """Record a start-up milestone, in seconds since launch (now, unless given)."""
        self.startup_s[milestone] = time.perf_counter() - self.launched if seconds is None else seconds

    def workers_launched(self, info: list[WorkerInfo]) -> None:
        """Mark the slowest worker's process start, code loaded and model built, in seconds
        since launch (wall clocks: on a cluster as exact as the nodes' clocks agree)."""
        launched_at = time.time() - (time.perf_counter() - self.launched)
        started = [i.started_at for i in info if i.started_at is not None]
        if started:
            self.mark("worker_process_started", max(started) - launched_at)
        self.mark("worker_code_loaded", max(i.imported_at for i in info) - launched_at)
        self.mark("worker_built", max(i.built_at for i in info) - launched_at)

    def show_progress(self, total: int, enabled: bool) -> None:
        """From now on, a progress bar of ``total`` steps (when ``enabled``) counts the commits."""
        self._bar = tqdm(total=total, initial=self.ledger.steps_done, unit="step", disable=not enabled, dynamic_ncols=True)

    def close_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def commit(self, step: int, record: StepRecord, *, complete: bool) -> None:
        """Account a committed step (``complete``: every rank's row is in ``record``) in every sink."""
        self.ledger.commit(step, record, complete=complete)
        if "first_step" not in self.startup_s:
            self.mark("first_step")
        if len(record):
            self.run.telemetry(record)
        if complete:
            for observe in self.observers:
                observe(step, record)
        step_s = float(record.column("step_s").max()) if len(record) else 0.0
        self.checkpoints.observe_step(step_s)
        self.checkpoints.copied(record)  # a checkpoint taken inside the batch right after this step
        self.last_record = record
        # Closed before the step event, whose listeners read the goodput so far.
        closed = self.recoveries.committed(step)
        self.run.event(
            "step", step=step, loss=self.ledger.final_loss, samples=record.first("global_samples") if len(record) else None,
            step_s=step_s, **_step_figures(record, step_s) if len(record) else {},
        )
        if closed is not None:
            self.run.event("recovered", **closed.to_json())
        if self._bar is not None:
            self._bar.update(1)
            if self.ledger.final_loss is not None:
                self._bar.set_postfix(loss=f"{self.ledger.final_loss:.4f}", refresh=False)

    def goodput(self, finishing: bool = False) -> Goodput:
        """The goodput account so far. ``finishing``: the job is past its last step; the time
        since (or since the group formed, if no step committed) is charged to finishing, with
        the checkpoints and recovery spans inside it."""
        now = time.perf_counter()
        steps_done = self.ledger.steps_done
        recoveries = self.recoveries.done + ([self.recoveries.open] if self.recoveries.open else [])
        copies = [r.copy_s for r in self.checkpoints.written]
        finishing_s = 0.0
        if finishing:
            last = self.ledger.last_commit_s
            since = last if last is not None else self.launched + self.startup_s.get("group_formed", 0.0)
            finishing_s = max(0.0, now - since)
            copies = [r.copy_s for r in self.checkpoints.written if r.step < steps_done]
            if self.recoveries.open is not None and last is not None:
                recoveries = self.recoveries.done  # it was still redoing: inside finishing
        return job_goodput(now - self.launched, self.startup_s, self.ledger, recoveries, copies, finishing_s)

    def summary(
        self, state: State, *, num_steps: int, train_s: float, workers: dict[str, int], control_plane: dict[str, Any]
    ) -> dict[str, Any]:
        """The summary of the job ended in ``state`` (``orchestrator/accounting/summary.py``)."""
        goodput = self.goodput(finishing=True)
        return job_summary(
            self.job, state.kind.value, self.ledger, num_steps,
            started=self.launched, train_s=train_s, startup_s=self.startup_s,
            metrics=dict(state.metrics) if isinstance(state, Finished) else {}, workers=workers,
            counters=self.counters, recoveries=self.recoveries.done, checkpoints=self.checkpoints.summary(),
            goodput=goodput, control_plane=control_plane, error=state.reason if isinstance(state, (Failed, Stopped)) else None,
        )


def _step_figures(record: StepRecord, step_s: float) -> dict[str, Any]:
    """What a step event tells of the step's optimisation, from one rank's report (they agree)."""
    weight = record.first("weight")
    figures: dict[str, Any] = {
        "lr": record.first("lr"), "grad_norm": record.first("grad_norm"), "weight": weight,
        "weight_per_s": weight / step_s if step_s > 0 else None,
    }
    if record.first("skipped"):
        figures["skipped"] = True
    return figures
