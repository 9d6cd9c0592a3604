"""Injected slowness, stalls and death for one worker (job file ``chaos.slow`` / ``stall`` /
``stalls`` / ``kill``), for tests, demos and benchmarks.

A slowed worker really takes longer: before each pass it sleeps (factor - 1) x what that many
shards took it before the slowdown began (its own measured compute per shard, an EWMA over its
unslowed steps; for a slowdown from the first step, the median of its first slowed steps; or
the entry's ``shard_s``, the same for every framework in a benchmark), so it computes at
1/factor of its speed. The base is frozen while slowed: measured during the
slowdown it would include the contention and pass overhead the slowdown itself causes and feed
back (a 4x worker was measured 12x slower). The sleep stops early when ``interrupted()`` says
so (a backup took the shards over), as a real slow worker would notice between two pieces of
work.

A stall holds a worker up for a number of seconds in one step (``chaos.stall`` at a given step,
or ``chaos.stalls`` at random, drawn from the seed, worker id and step alone), ``during`` one of
two points (docs/architecture.md, "Rescue"): ``fetch``, slept on the thread that reads the
step's first batch before the worker seals its shards (a slow read: the worker waits for it
watching whether its peers took its shards, and stops waiting if they did, the read going on);
``compute``, after it has sealed them. Nothing shortens a stall but an abort. A kill is the worker SIGKILLing itself at a chosen point
(``KILL_POINTS``), as a crash or an OOM kill would end it: no cleanup, no goodbye to its peers.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from typing import get_args

from jobspec.chaos import ChaosConfig, KillChaos, KillPoint, RandomStalls, SlowChaos, StallChaos, StallPoint
from policies.ewma import ewma

CHECK_EVERY_S = 0.01
# Slowed steps whose compute sets the base of a slowdown that started before any unslowed step.
BASE_SAMPLES = 3

#: Where a worker can kill itself: in the all-reduce of step ``at_step`` (``step``), while
#: writing the checkpoint taken after ``at_step`` (``checkpoint``), in the first re-forming
#: of the group at or after ``at_step`` (``rejoin``: a failure during recovery), or inside
#: the first move of sharded state at or after it (``reshard``).
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
        stalls: RandomStalls | None = None,
        worker_id: int = 0,
    ) -> None:
        """Apply every entry given, whatever its ``worker`` (the caller has chosen them);
        ``kill`` entries are carried out as ``sigkill`` at their ``during``; ``stalls`` are
        drawn for ``worker_id``. ``alpha``: EWMA weight of the newest compute measurement."""
        self.slow = list(slow)
        self.stall_at = list(stall)
        self.random_stalls = stalls
        self.worker_id = worker_id
        self.kills = list(kill)
        self.abort_flag = abort_flag
        self.alpha = alpha
        self._shard_s: float | None = None  # EWMA over unslowed steps
        self._slowed_shard_s: list[float] = []  # first measurements of a slowdown from the start

    @classmethod
    def for_worker(cls, chaos: ChaosConfig, worker_id: int, abort_flag: threading.Event) -> ChaosSchedule:
        """The schedule of worker ``worker_id``: the ``chaos`` entries whose ``worker`` it is,
        the random stalls, and of ``chaos.kill`` only the ``sigkill`` ones (the driver carries
        out the others)."""
        return cls(
            [s for s in chaos.slow if s.worker == worker_id],
            [s for s in chaos.stall if s.worker == worker_id],
            abort_flag,
            kill=[k for k in chaos.kill if k.worker == worker_id and k.how == "sigkill"],
            stalls=chaos.stalls,
            worker_id=worker_id,
        )

    def _active(self, step: int) -> list[SlowChaos]:
        return [s for s in self.slow if s.from_step <= step and (s.to_step is None or step < s.to_step)]

    def factor(self, step: int) -> float:
        """How many times slower this worker computes in ``step`` (1.0: not slowed)."""
        factor = 1.0
        for s in self._active(step):
            factor *= s.factor
        return factor

    def record(self, step: int, compute_s: float, shards: int) -> None:
        """Feed the measured (unslowed) compute of ``shards`` shards in ``step``: it sets the
        base of later slowdowns only if ``step`` was not slowed itself (or, for a slowdown from
        the start, if it is one of its first BASE_SAMPLES steps)."""
        if shards <= 0 or compute_s <= 0:
            return
        if self.factor(step) == 1.0:
            self._shard_s = ewma(self._shard_s, compute_s / shards, self.alpha)
        elif self._shard_s is None and len(self._slowed_shard_s) < BASE_SAMPLES:
            self._slowed_shard_s.append(compute_s / shards)

    def base_shard_s(self, step: int | None = None) -> float:
        """Compute seconds per shard a slowdown at ``step`` multiplies: its entry's ``shard_s``
        if set, else the measured one (0 until something was measured)."""
        given = [s.shard_s for s in self._active(step) if s.shard_s] if step is not None else []
        if given:
            return given[0]
        if self._shard_s is not None:
            return self._shard_s
        return statistics.median(self._slowed_shard_s) if self._slowed_shard_s else 0.0

    def slow_down(self, step: int, shards: int, interrupted: Callable[[], bool]) -> float:
        """Sleep for a slowed pass of ``shards`` shards at ``step``; returns seconds slept."""
        extra = (self.factor(step) - 1.0) * self.base_shard_s(step) * shards
        return self._sleep(extra, interrupted)

    def _sleep(self, seconds: float, interrupted: Callable[[], bool]) -> float:
        """Sleep ``seconds`` unless the driver aborts or ``interrupted()`` (asked every
        CHECK_EVERY_S); returns seconds slept."""
        if seconds <= 0:
            return 0.0
        started = time.perf_counter()
        end = started + seconds
        while (left := end - time.perf_counter()) > 0:
            if self.abort_flag.wait(min(CHECK_EVERY_S, left)) or interrupted():
                break
        return time.perf_counter() - started

    def stall_s(self, step: int, during: StallPoint) -> float:
        """Seconds this worker is held up ``during`` the fetch or compute of ``step``."""
        planned = sum(s.seconds for s in self.stall_at if s.at_step == step and s.during == during)
        drawn = self.random_stalls
        if drawn is not None and drawn.during == during:
            # Seeded by a string (hashed with SHA-512, not Python's per-process hash): the same
            # draw in every process and every run, ours or a peer framework's.
            if random.Random(f"{drawn.seed}/{self.worker_id}/{step}").random() < drawn.probability:
                planned += drawn.seconds
        return planned

    def stall(self, step: int, during: StallPoint | None = None) -> float:
        """Sleep through the stalls of ``step`` (those ``during`` that point, or all), unless
        the driver aborts; returns seconds slept."""
        points: tuple[StallPoint, ...] = (during,) if during else ("fetch", "compute")
        return self._sleep(sum(self.stall_s(step, point) for point in points), lambda: False)

    def kill_due(self, during: str, step: int) -> bool:
        """Whether this worker dies now, at ``during`` of ``step``: in ``step`` itself, or for
        the other points the first re-forming, state move or checkpoint at or after its step
        (``step`` is then the worker's next step, the step the group starts from, or the last
        step the checkpoint holds). A
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
