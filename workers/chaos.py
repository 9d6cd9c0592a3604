"""Injected slowness and death for one worker (job file ``chaos.slow`` / ``stall`` / ``kill``),
for tests and demos.

A slowed worker really takes longer: before each pass it sleeps (factor - 1) x what that many
shards have been taking it (an EWMA of its own measured compute per shard), so it computes at
1/factor of its speed. The sleep stops early when ``interrupted()`` says so (a backup took the
shards over), as a real slow worker would notice between two pieces of work. A stall is one
long sleep at the start of a step; it ends early only if the driver aborts the step. A kill
is the worker SIGKILLing itself at a chosen point (``KILL_POINTS``), as a crash or an OOM kill
would end it: no cleanup, no goodbye to its peers.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

CHECK_EVERY_S = 0.01

#: Where a worker can kill itself: in the all-reduce of step ``at_step`` (``step``), while
#: writing the checkpoint taken after ``at_step`` (``checkpoint``), or in the first re-forming
#: of the group at or after ``at_step`` (``rejoin``: a failure during recovery).
KILL_POINTS = ("step", "checkpoint", "rejoin")


@dataclass(frozen=True)
class Slowdown:
    factor: float
    from_step: int
    to_step: int | None  # exclusive; None: to the end


@dataclass(frozen=True)
class Stall:
    at_step: int
    seconds: float


@dataclass(frozen=True)
class Kill:
    at_step: int
    during: str  # one of KILL_POINTS


def kill_self(before: Callable[[], None] = lambda: None) -> None:
    """SIGKILL this process (after ``before``, e.g. recording the time of death)."""
    before()
    os.kill(os.getpid(), signal.SIGKILL)


class ChaosSchedule:
    """The slowness this worker injects into itself (none by default)."""

    def __init__(
        self,
        slow: list[Slowdown],
        stall: list[Stall],
        abort_flag: threading.Event,
        alpha: float = 0.3,
        kill: list[Kill] | None = None,
    ) -> None:
        self.slow = slow
        self.stall_at = stall
        self.kills = list(kill or [])
        self.abort_flag = abort_flag
        self.alpha = alpha
        self._shard_s: float | None = None

    def factor(self, step: int) -> float:
        factor = 1.0
        for s in self.slow:
            if s.from_step <= step and (s.to_step is None or step < s.to_step):
                factor *= s.factor
        return factor

    def record(self, compute_s: float, shards: int) -> None:
        """Feed the measured (unslowed) compute of ``shards`` shards."""
        if shards > 0 and compute_s > 0:
            per = compute_s / shards
            self._shard_s = per if self._shard_s is None else (1 - self.alpha) * self._shard_s + self.alpha * per

    def slow_down(self, step: int, shards: int, interrupted: Callable[[], bool]) -> float:
        """Sleep for a slowed pass of ``shards`` shards at ``step``; returns seconds slept."""
        extra = (self.factor(step) - 1.0) * (self._shard_s or 0.0) * shards
        if extra <= 0:
            return 0.0
        started = time.perf_counter()
        end = started + extra
        while (left := end - time.perf_counter()) > 0:
            if self.abort_flag.wait(min(CHECK_EVERY_S, left)) or interrupted():
                break
        return time.perf_counter() - started

    def stall(self, step: int) -> float:
        """Sleep through any stall planned for ``step``; returns seconds slept."""
        seconds = sum(s.seconds for s in self.stall_at if s.at_step == step)
        if seconds <= 0:
            return 0.0
        started = time.perf_counter()
        self.abort_flag.wait(seconds)
        return time.perf_counter() - started

    def kill_due(self, during: str, step: int) -> bool:
        """Whether this worker dies now, at ``during`` of ``step`` (``rejoin``: any re-forming
        at or after its step). A kill happens once."""
        for kill in self.kills:
            if kill.during == during and (kill.at_step == step or (during == "rejoin" and step >= kill.at_step)):
                self.kills.remove(kill)
                return True
        return False
