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
from collections.abc import Callable, Iterable
from typing import get_args

from orchestrator.config import ChaosConfig, KillChaos, KillPoint, SlowChaos, StallChaos
from policies.ewma import ewma

CHECK_EVERY_S = 0.01

#: Where a worker can kill itself: in the all-reduce of step ``at_step`` (``step``), while
#: writing the checkpoint taken after ``at_step`` (``checkpoint``), or in the first re-forming
#: of the group at or after ``at_step`` (``rejoin``: a failure during recovery).
KILL_POINTS: tuple[str, ...] = get_args(KillPoint)


def kill_self(before: Callable[[], None] = lambda: None) -> None:
    """SIGKILL this process (after ``before``, e.g. recording the time of death)."""
    before()
    os.kill(os.getpid(), signal.SIGKILL)


class ChaosSchedule:
    """The slowness, stalls and deaths this worker injects into itself (none by default),
    from the job's chaos entries aimed at it; :meth:`for_worker` picks those out."""

    def __init__(
        self,
        slow: Iterable[SlowChaos],
        stall: Iterable[StallChaos],
        abort_flag: threading.Event,
        alpha: float = 0.3,
        kill: Iterable[KillChaos] = (),
    ) -> None:
        """Apply every entry given, whatever its ``worker`` (the caller has chosen them);
        ``kill`` entries are carried out as ``sigkill`` at their ``during``. ``alpha``: EWMA
        weight of the newest compute measurement."""
        self.slow = list(slow)
        self.stall_at = list(stall)
        self.kills = list(kill)
        self.abort_flag = abort_flag
        self.alpha = alpha
        self._shard_s: float | None = None

    @classmethod
    def for_worker(cls, chaos: ChaosConfig, worker_id: int, abort_flag: threading.Event) -> ChaosSchedule:
        """The schedule of worker ``worker_id``: the ``chaos`` entries whose ``worker`` it is,
        and of ``chaos.kill`` only the ``sigkill`` ones (the driver carries out the others)."""
        return cls(
            [s for s in chaos.slow if s.worker == worker_id],
            [s for s in chaos.stall if s.worker == worker_id],
            abort_flag,
            kill=[k for k in chaos.kill if k.worker == worker_id and k.how == "sigkill"],
        )

    def factor(self, step: int) -> float:
        """How many times slower this worker computes in ``step`` (1.0: not slowed)."""
        factor = 1.0
        for s in self.slow:
            if s.from_step <= step and (s.to_step is None or step < s.to_step):
                factor *= s.factor
        return factor

    def record(self, compute_s: float, shards: int) -> None:
        """Feed the measured (unslowed) compute of ``shards`` shards."""
        if shards > 0 and compute_s > 0:
            self._shard_s = ewma(self._shard_s, compute_s / shards, self.alpha)

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
        """Whether this worker dies now, at ``during`` of ``step``: in ``step`` itself, or for
        ``rejoin`` and ``checkpoint`` the first re-forming or checkpoint at or after its step
        (``step`` is then the worker's next step, or the last step the checkpoint holds). A
        kill happens once."""
        for index, kill in enumerate(self.kills):
            if kill.during == during and (kill.at_step == step or (during != "step" and step >= kill.at_step)):
                del self.kills[index]
                return True
        return False


def death_key(worker_id: int) -> str:
    """Key in the driver's store where a worker chaos-killing itself leaves its time of death
    (``time.time()``), so the driver can split a recovery into detection and the rest."""
    return f"chaos/killed/{worker_id}"
