"""The recoveries of a run: each one's time split, opened by the recovery and closed by the
first step committed after it (reported in ``summary.json``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Recovery:
    """One recovery's time split, in seconds: ``detect`` (from the death, when known, else from
    the first error seen, to knowing who is dead), ``reform`` (removing them, waiting for
    workers when below ``min_workers``, every rendezvous attempt; ``waited`` of it waiting),
    ``transfer`` (state broadcast from the surviving root), ``redo`` (re-running
    the steps that were in flight). ``first_step_s``: from the death to the next completed step."""

    at_step: int
    workers: list[int]
    reasons: dict[int, str]
    started: float  # time.time() of the death (or of the first error seen)
    detect_s: float = 0.0
    reform_s: float = 0.0
    transfer_s: float = 0.0
    redo_s: float | None = None
    first_step_s: float | None = None
    redo_steps: list[int] = field(default_factory=list)
    reformed_at: float = 0.0
    waited_s: float = 0.0  # of reform_s: waiting for workers below min_workers

    def to_json(self) -> dict[str, Any]:
        return {
            "at_step": self.at_step, "workers": self.workers, "reasons": self.reasons,
            "detect_s": self.detect_s, "reform_s": self.reform_s, "transfer_s": self.transfer_s,
            "redo_s": self.redo_s, "first_step_s": self.first_step_s, "redo_steps": self.redo_steps,
            "waited_s": self.waited_s,
        }


class RecoveryLog:
    """Recoveries whose redone steps are still running (at most one), and the finished ones."""

    def __init__(self) -> None:
        self.done: list[Recovery] = []
        self.open: Recovery | None = None

    def opened(self, recovery: Recovery) -> None:
        """``recovery`` re-formed the group; its redone steps start. One still open was cut
        short by this failure: it is kept, with no ``redo_s``."""
        if self.open is not None:
            self.done.append(self.open)
        recovery.reformed_at = time.time()
        self.open = recovery

    def committed(self, step: int) -> Recovery | None:
        """Step ``step`` was committed: returns the open recovery if that closes it."""
        recovery = self.open
        if recovery is None:
            return None
        now = time.time()
        if recovery.first_step_s is None:
            recovery.first_step_s = now - recovery.started
        if step < max(recovery.redo_steps, default=step):
            return None
        recovery.redo_s = now - recovery.reformed_at
        self.done.append(recovery)
        self.open = None
        return recovery
