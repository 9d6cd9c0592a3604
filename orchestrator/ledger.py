"""Commit accounting: which steps are committed, and what they trained on
(docs/architecture.md, "Commit and census")."""

from __future__ import annotations

from orchestrator.errors import JobFailed
from workers.protocol import StepTelemetry


class CommitLedger:
    """Counts committed steps of a job with ``num_shards`` shards per step.

    A step is committed once some worker applied it: its all-reduce completed, and that
    worker's census (a count per shard, reduced with the gradient) proved every shard counted
    exactly once. The driver checks again from the reports it has: all of them together must
    cover each shard exactly once; when some are missing (a rank died after the all-reduce)
    the ones it has must at least not overlap."""

    def __init__(self, num_shards: int, steps_done: int = 0) -> None:
        self.num_shards = num_shards
        self.steps_done = steps_done
        self.samples = 0
        self.shards_committed = steps_done * num_shards
        self.final_loss: float | None = None

    def resume_at(self, step: int) -> None:
        """Go on from a checkpoint after ``step`` steps."""
        self.steps_done = step
        self.shards_committed = step * self.num_shards

    def commit(self, step: int, reports: list[StepTelemetry], *, complete: bool) -> None:
        """Account ``step`` as committed from its ``reports`` (every rank's if ``complete``).
        Raises JobFailed if the step is not the next one, or its shards are not each counted
        once."""
        if step != self.steps_done:
            raise JobFailed(f"step {step} committed out of order (next is {self.steps_done})")
        committed = sorted(s for r in reports for s in r.shards)
        if complete and committed != list(range(self.num_shards)):
            raise JobFailed(f"step {step}: committed shards {committed} are not each shard exactly once")
        if len(set(committed)) != len(committed):
            raise JobFailed(f"step {step}: shards {committed} were committed more than once")
        self.shards_committed += self.num_shards
        self.steps_done += 1
        if reports:
            self.samples += reports[0].global_samples
            self.final_loss = reports[0].loss
