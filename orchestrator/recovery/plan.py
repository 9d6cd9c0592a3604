"""What a recovery does, decided before anything is done (docs/architecture.md, "Recovery"):
who leaves (dead or evicted) and why, who carries the state on, where the survivors are; then,
once the group holds the state again, which steps run again. Pure functions over what the
driver saw of the failure and the survivors' settled ``Progress``: no Ray, no group, tested in
microseconds (``tests/pure/test_recovery_plan.py``); ``orchestrator/recovery/procedure.py`` carries
the plan out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from jobspec.wire import Progress
from orchestrator.steps.pipeline import InFlight


@dataclass(frozen=True)
class RecoveryPlan:
    """``dead``: workers to remove and replace (their slots kept), failed, silent or not settled;
    ``evicted``: removed for being persistently slow (their slots retired); ``alive``: the
    survivors that carry the state on, by their settled progress; ``reasons``: why each of
    ``dead`` and ``evicted`` leaves; ``at_step``: the first step no survivor applied (the
    failure's step: every step before it is committed once the group re-forms)."""

    dead: list[int]
    evicted: list[int]
    alive: dict[int, Progress]
    reasons: dict[int, str]
    at_step: int

    @property
    def leaving(self) -> list[int]:
        return self.dead + self.evicted

    @property
    def nobody_lost(self) -> bool:
        """Nobody died or is evicted: a network fault (re-form and retry) or the job's own error."""
        return not self.leaving


def plan_recovery(
    errors: Mapping[int, str],
    died: set[int],
    silent: Mapping[int, str],
    evicted: Sequence[int],
    alive: Mapping[int, Progress],
    lost: Sequence[int],
    steps_done: int,
) -> RecoveryPlan:
    """The recovery after a batch ended with ``errors`` by worker (``died``: those whose calls
    died), the driver's decisions to remove ``silent`` workers (failures, with why) and to
    evict ``evicted``, and ``settle``'s outcome: the survivors' progress ``alive`` and the
    workers ``lost`` meanwhile (dead, silent or stuck); ``steps_done`` steps are committed. A
    worker judged dead never carries the state on, even if it still answers (Ray's
    ActorUnavailableError: it may or may not have run)."""
    dead = sorted((set(died) | set(lost) | set(silent)) - set(evicted))
    survivors = {w: p for w, p in alive.items() if w not in dead}
    reasons = {
        **{w: silent.get(w) or errors.get(w, "did not answer") for w in dead},
        **{w: "evicted" for w in evicted},
    }
    return RecoveryPlan(dead, list(evicted), survivors, reasons, first_uncommitted(survivors, steps_done))


def first_uncommitted(alive: Mapping[int, Progress], steps_done: int) -> int:
    """The first step no survivor applied. A step is committed once any survivor applied it:
    its all-reduce completed and that survivor's census proved every shard counted once. Never
    before ``steps_done`` (a survivor whose state transfer broke off reports -1)."""
    return max([steps_done, *(p.next_step for p in alive.values())])


def steps_to_redo(in_flight: Sequence[InFlight], first: int, reached: int) -> list[int]:
    """The steps in flight from ``first`` (the first uncommitted) through ``reached`` (the
    furthest step a survivor had started), at least ``first``: work the failure threw away,
    run again. Steps handed out but not started (the rest of a batch) are no lost work: they
    simply run."""
    return [step for batch in in_flight for step in batch.steps if first <= step <= max(first, reached)]


def redo_after_reform(in_flight: Sequence[InFlight], next_step: int, steps_done: int, reached: int) -> list[int]:
    """The steps to run again once the group holds the state for ``next_step``: those in flight
    the failure threw away (``steps_to_redo``, ``reached`` the furthest a survivor started), and,
    after a roll-back to a checkpoint before ``steps_done``, the committed steps from it too."""
    if next_step < steps_done:
        return list(range(next_step, steps_done)) + steps_to_redo(in_flight, steps_done, reached)
    return steps_to_redo(in_flight, next_step, reached)
