"""Run-ahead: how many steps the driver hands every worker in one call (docs/architecture.md,
"Run-ahead").

A call per worker per step costs the driver the same whatever the step does (Ray's submit,
its result, per worker), so while nothing needs the driver between steps it hands out
several steps at once. The price is reaction time: a plan (the shard split, the suspects)
stays fixed for the steps already handed out. Stealing, backups and rescues need no driver
(workers arrange them through the claim store inside a step), so the batch grows while the
plan holds and falls back to one step when it changes, like a congestion window: it starts
at one step whenever the job (re)enters Running, doubles after every batch in which the
policies left the plan as it was, and is cut where the driver must act between two steps (a
checkpoint, chaos at a step boundary, the end of the job).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# Batches queued on every worker ahead of the one being collected: the driver's round trip
# and bookkeeping overlap the workers' compute instead of sitting between batches.
BATCHES_IN_FLIGHT = 2
# The most steps in one call (``worker.max_steps_per_call`` is validated against it): the
# claim store keeps a slot per open step (``workers/step/claims.py``).
MAX_STEPS_PER_CALL = 16


@dataclass
class RunAhead:
    """The size of the next batch: ``size`` steps, between 1 and ``max_steps``."""

    max_steps: int
    size: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.max_steps <= MAX_STEPS_PER_CALL:
            raise ValueError(f"max_steps must be in [1, {MAX_STEPS_PER_CALL}], got {self.max_steps}")

    def restart(self) -> None:
        """The job (re)entered Running: one step at a time until the plan proves stable."""
        self.size = 1

    def observe(self, quiet: bool) -> None:
        """A batch committed; ``quiet``: the policies left the plan as it was in all its steps."""
        self.size = min(self.max_steps, 2 * self.size) if quiet else 1

    def batch(self, first: int, end: int, boundary: Callable[[int], bool]) -> int:
        """How many steps from ``first`` to hand out now: at most ``size``, none at or past
        ``end``, and none from the first later step where ``boundary(step)`` says the driver
        must act before it. Always at least one (``first`` itself may be a boundary: the
        driver acts before submitting it)."""
        count = 1
        while count < min(self.size, end - first) and not boundary(first + count):
            count += 1
        return count
