"""The job's lifecycle as an explicit state machine."""

from __future__ import annotations

import enum
from typing import Callable


class JobState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"


_ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.STARTING: frozenset({JobState.RUNNING, JobState.FAILED, JobState.STOPPED}),
    JobState.RUNNING: frozenset({JobState.RECOVERING, JobState.FINISHED, JobState.FAILED, JobState.STOPPED}),
    JobState.RECOVERING: frozenset({JobState.RUNNING, JobState.FAILED, JobState.STOPPED}),
    JobState.FINISHED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.STOPPED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


class JobStateMachine:
    """Holds the current state; every change goes through ``to`` and is reported to ``on_change``."""

    def __init__(self, on_change: Callable[[JobState, JobState, str], None]) -> None:
        self.state = JobState.STARTING
        self._on_change = on_change

    @property
    def terminal(self) -> bool:
        return not _ALLOWED[self.state]

    def to(self, new: JobState, reason: str = "") -> None:
        """Move to ``new``; raises IllegalTransition if the lifecycle does not allow it."""
        if new not in _ALLOWED[self.state]:
            raise IllegalTransition(f"cannot go from {self.state.value} to {new.value}")
        old, self.state = self.state, new
        self._on_change(old, new, reason)
