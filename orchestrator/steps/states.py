"""The job's states, each carrying what its handler needs (docs/architecture.md, "The
controller"). The controller (``orchestrator/controller.py``) runs one state's handler at a
time; a handler returns the next state, and every change of kind is checked against
``ALLOWED`` and written to ``events.jsonl`` as a ``state`` event.

    Starting --> Running <--> Growing
                  |  ^          |
                  v  |          v
               Recovering <-----+
                  |
                  v
     CheckpointingBeforeFailure --> Failed          (any state) --> Failed | Stopped
                 Running --> Finished
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping, Union

from jobspec.step_record import StepRecord
from orchestrator.steps.pipeline import InFlight, StepOutcome


class JobState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    GROWING = "growing"
    CHECKPOINTING_BEFORE_FAILURE = "checkpointing_before_failure"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"


_ENDS = frozenset({JobState.FAILED, JobState.STOPPED})

#: Which kinds may follow which. A handler may also end in Failed or Stopped from any state.
ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.STARTING: frozenset({JobState.RUNNING}) | _ENDS,
    JobState.RUNNING: frozenset({JobState.RECOVERING, JobState.GROWING, JobState.FINISHED}) | _ENDS,
    JobState.RECOVERING: frozenset({JobState.RUNNING, JobState.CHECKPOINTING_BEFORE_FAILURE}) | _ENDS,
    JobState.GROWING: frozenset({JobState.RUNNING, JobState.RECOVERING}) | _ENDS,
    JobState.CHECKPOINTING_BEFORE_FAILURE: _ENDS,
    JobState.FINISHED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.STOPPED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A handler returned a state its state may not lead to: a bug in the controller."""


@dataclass(frozen=True)
class Starting:
    """Place and load the workers, restore a checkpoint if resuming, form the first group."""

    kind = JobState.STARTING
    reason = ""


@dataclass(frozen=True)
class Running:
    """Train from ``next_step``: keep steps in flight, commit each as it completes. ``reason``
    says why training (re)starts here, for the state event."""

    next_step: int
    reason: str = ""
    kind = JobState.RUNNING


@dataclass(frozen=True)
class Recovering:
    """Change the group after ``outcome`` (a failure while waiting for ``in_flight[0]``, or
    workers to evict), with ``in_flight`` the steps that were queued then (none at a drained
    step boundary). ``without_state``: members that joined but may hold no training state (a
    growth that failed midway), never taken as the state's source. ``cause``: what failed,
    when it was not a step (e.g. a growth's rendezvous)."""

    outcome: StepOutcome
    in_flight: tuple[InFlight, ...] = ()
    without_state: frozenset[int] = frozenset()
    cause: str = ""
    kind = JobState.RECOVERING

    @property
    def reason(self) -> str:
        if self.cause:
            return self.cause
        if self.outcome.evict:
            return f"evicting worker(s) {[e.worker for e in self.outcome.evict]}"
        if not self.in_flight:
            return f"re-forming the group failed: {self.outcome.errors}"
        batch = self.in_flight[0]  # which of its steps failed, the recovery finds out
        where = f"step {batch.step}" if batch.count == 1 else f"the batch of steps {batch.step}-{batch.steps[-1]}"
        return f"{where} failed: {self.outcome.errors}"


@dataclass(frozen=True)
class Growing:
    """At a drained step boundary (every committed step applied everywhere): workers that
    have loaded join, taking the state from rank 0."""

    kind = JobState.GROWING
    reason = "workers ready to join"


@dataclass(frozen=True)
class CheckpointingBeforeFailure:
    """Too few workers are left: save the state of the survivor that applied the most steps
    (``holders``: worker id -> next step), then fail with ``reason``. ``in_flight`` and
    ``records`` (the first batch's step records, if its reports came in) are the steps the failure
    caught: those the saved state holds are committed first."""

    holders: Mapping[int, int]
    reason: str
    in_flight: tuple[InFlight, ...] = ()
    records: tuple[StepRecord, ...] = ()
    kind = JobState.CHECKPOINTING_BEFORE_FAILURE


@dataclass(frozen=True)
class Finished:
    """Every step committed, evaluated and saved; ``metrics`` from the eval set."""

    metrics: Mapping[str, float] = field(default_factory=dict)
    kind = JobState.FINISHED
    reason = ""


@dataclass(frozen=True)
class Failed:
    """The job ended early; ``reason`` is the error for the summary."""

    reason: str
    kind = JobState.FAILED


@dataclass(frozen=True)
class Stopped:
    reason: str = "interrupted"
    kind = JobState.STOPPED


State = Union[Starting, Running, Recovering, Growing, CheckpointingBeforeFailure, Finished, Failed, Stopped]


def is_terminal(state: State) -> bool:
    return not ALLOWED[state.kind]


def check_transition(old: State, new: State) -> None:
    """Raise IllegalTransition unless ``new`` may follow ``old`` (same kind is no change)."""
    if old.kind is not new.kind and new.kind not in ALLOWED[old.kind]:
        raise IllegalTransition(f"cannot go from {old.kind.value} to {new.kind.value}")
