"""Commit accounting: which steps are committed, and what they trained on
(docs/architecture.md, "Commit and census")."""

from __future__ import annotations

import time

import numpy as np

from jobspec.step_record import StepRecord
from orchestrator.errors import JobFailed


class CommitLedger:
    """Counts committed steps of a job with ``num_shards`` shards per step.

    A step is committed once some worker applied it: its all-reduce completed, and that
    worker's census (a count per shard, reduced with the gradient) proved every shard counted
    exactly once. The driver checks again from the reports it has: every report's census
    total must be the step's shard count, all of them together must cover each shard exactly
    once; when some are missing (a rank died after the all-reduce) the ones it has must at
    least not overlap. A step that fails any of these checks fails the job uncommitted
    (``tests/multiprocess/test_ledger.py``), so a lost or doubled shard never shows as a short or long count
    in the summary: ``shards_committed`` and ``samples`` add up what the census counted, which
    makes ``shards_committed`` ``num_shards`` per step committed with a report (one committed
    with none, its survivors' kept reports not answered in time, adds nothing)."""

    def __init__(self, num_shards: int) -> None:
        self.num_shards = num_shards
        self.steps_done = 0
        self.samples = 0
        self.shards_committed = 0
        self.final_loss: float | None = None
        #: Over committed steps, the time stragglers cost (``straggler_wait``; goodput).
        self.straggler_wait_s = 0.0
        self.last_commit_s: float | None = None  # perf_counter() of the latest commit
        # Samples of each step committed since the start or the resume: a rewind takes them back.
        self._samples_of: dict[int, int] = {}

    def resume_at(self, step: int) -> None:
        """Go on from a checkpoint after ``step`` steps (a verified checkpoint: its run's census
        counted every shard of them)."""
        self.steps_done = step
        self.shards_committed = step * self.num_shards

    def rewind_to(self, step: int) -> None:
        """Go back to a checkpoint of this run after ``step`` steps (sharded state lost in place:
        the steps after it run again and are counted again). Raises ValueError past the steps done."""
        if step > self.steps_done:
            raise ValueError(f"cannot rewind to step {step}: only {self.steps_done} are done")
        self.samples -= sum(self._samples_of.pop(s, 0) for s in range(step, self.steps_done))
        self.resume_at(step)

    def commit(self, step: int, record: StepRecord, *, complete: bool) -> None:
        """Account ``step`` as committed from its ``record`` (every rank's row if ``complete``).
        Raises JobFailed if the step is not the next one, or its shards are not each counted
        once."""
        if step != self.steps_done:
            raise JobFailed(f"step {step} committed out of order (next is {self.steps_done})")
        counted = {int(c) for c in np.unique(record.column("shards_counted"))}
        if counted - {self.num_shards}:
            raise JobFailed(f"step {step}: the census counted {sorted(counted)} shards, expected {self.num_shards}")
        if len(np.unique(record.column("skipped"))) > 1:
            raise JobFailed(f"step {step}: replicas disagree on skipping the step (loss scaling): they have diverged")
        committed = sorted(s for shards in record.shards for s in shards)
        if complete and committed != list(range(self.num_shards)):
            raise JobFailed(f"step {step}: committed shards {committed} are not each shard exactly once")
        if len(set(committed)) != len(committed):
            raise JobFailed(f"step {step}: shards {committed} were committed more than once")
        self.steps_done += 1
        if len(record):
            # The reduced figures, the same on every rank: any report's will do.
            self.shards_committed += record.first("shards_counted")
            self.samples += record.first("global_samples")
            self._samples_of[step] = record.first("global_samples")
            self.final_loss = record.first("loss")
            self.straggler_wait_s += straggler_wait(record)
        self.last_commit_s = time.perf_counter()


def straggler_wait(record: StepRecord) -> float:
    """Seconds a step lost to its slowest workers: the mean over workers of how long each
    waited for the others. A worker arrives at the all-reduce after its compute, its idle time
    (waiting for others' shards, with mitigation) and any stall; it then waits for the last
    arrival. So the wait of worker r is ``max(arrival) - arrival_r + idle_r``: with mitigation
    off it is all in the all-reduce, with it on mostly idle time."""
    if not len(record):
        return 0.0
    idle = record.column("idle_s")
    arrivals = record.column("compute_s") + idle + record.column("stalled_s")
    return float((arrivals.max() - arrivals + idle).sum()) / len(record)
