"""Straggler detection from per-step telemetry. Pure: no Ray, no torch.

Each step every worker reports how long a shard took it (``shard_s``: compute seconds per
shard, the inverse of its speed), how many shards it ran, and when its own work for the step
was done (``arrival_s``: seconds from the step's start until it reached the all-reduce, stalls
included). A worker's *slowness* in a step is its ``shard_s`` over the median across workers
of that step, so a step that is slow for everyone (a bigger batch, a busy machine) flags
nobody. Noise is estimated robustly from a sliding window of everyone's slowness: the scaled
median absolute deviation (MAD) around 1.

A worker is

* **late** in a step (transient) when its arrival is beyond ``min_ratio`` x the median
  arrival and beyond ``threshold`` noise-MADs of it. Arrival, not speed: a worker that stalled
  (waiting for data, paused) computes at its usual speed, or not at all when its shards were
  taken, yet held the step up;
* **persistently slow** when, over its last ``window`` steps, it was slow (same test on
  ``shard_s``) in at least ``persistent_steps`` of them. A stall does not count here: it is
  not in ``shard_s``. Rebalancing gives a slow worker fewer shards, which makes it no longer
  late; its persistent slowness stays visible.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

# MAD of a normal distribution times this is its standard deviation.
MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class WorkerStep:
    """What one worker did in one step: ``shards`` run, ``shard_s`` compute seconds per shard,
    ``arrival_s`` seconds until its own work was done (0: unknown, then shards x shard_s)."""

    worker: int
    shards: int
    shard_s: float
    arrival_s: float = 0.0

    @property
    def arrival(self) -> float:
        return self.arrival_s or self.shards * self.shard_s


@dataclass(frozen=True)
class StragglerReport:
    """The detector's verdict on one step, with the evidence it used.

    ``late``: workers whose finish time was an outlier this step; ``persistent``: workers
    slow in most of the window; ``newly_persistent``: those that became so at this step.
    ``slowness``: each worker's shard_s over the step's median; ``noise``: the scaled MAD of
    slowness over the window; ``cutoff``: the slowness (or arrival ratio) above which a worker
    counts as slow; ``lateness``: each worker's arrival over the step's median arrival.
    """

    step: int
    late: tuple[int, ...]
    persistent: tuple[int, ...]
    newly_persistent: tuple[int, ...]
    slowness: dict[int, float]
    noise: float
    cutoff: float
    lateness: dict[int, float] = field(default_factory=dict)

    def evidence(self) -> dict[str, object]:
        return {
            "slowness": {str(w): round(s, 3) for w, s in self.slowness.items()},
            "lateness": {str(w): round(s, 3) for w, s in self.lateness.items()},
            "noise": round(self.noise, 4),
            "cutoff": round(self.cutoff, 3),
        }


@dataclass
class StragglerDetector:
    """Feed it each step's ``WorkerStep`` list with ``observe``; it returns a report.

    ``threshold``: how many noise-MADs above 1 count as slow; ``min_ratio``: and never less than
    this ratio to the median (so a quiet window does not make 5% look slow); ``window``: steps
    remembered per worker; ``persistent_steps``: slow steps within the window that make a worker
    persistently slow; ``warmup``: steps observed before anyone is flagged late (the first
    steps are slow for everyone in different ways). Raises ValueError on bad settings.
    """

    threshold: float = 4.0
    min_ratio: float = 1.5
    window: int = 8
    persistent_steps: int = 5
    warmup: int = 3
    _steps: int = field(default=0, repr=False)
    _history: dict[int, deque[float]] = field(default_factory=dict, repr=False)
    _persistent: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.threshold <= 0 or self.min_ratio <= 1:
            raise ValueError(f"need threshold > 0 and min_ratio > 1, got {self.threshold}, {self.min_ratio}")
        if not 1 <= self.persistent_steps <= self.window:
            raise ValueError(f"need 1 <= persistent_steps <= window, got {self.persistent_steps}, {self.window}")

    def forget(self, worker: int) -> None:
        """Drop a worker that left the job."""
        self._history.pop(worker, None)
        self._persistent.discard(worker)

    def cutoff(self) -> tuple[float, float]:
        """(noise, cutoff): the current noise estimate and the slowness ratio counted as slow."""
        values = [v for history in self._history.values() for v in history]
        noise = MAD_TO_SIGMA * statistics.median(abs(v - 1.0) for v in values) if values else 0.0
        return noise, max(self.min_ratio, 1.0 + self.threshold * noise)

    def observe(self, step: int, workers: list[WorkerStep]) -> StragglerReport:
        """Judge one step. Workers that ran no shard carry no speed information: they are left
        out of slowness, but may still be late (a stalled worker whose shards were taken)."""
        measured = [w for w in workers if w.shards > 0 and w.shard_s > 0]
        arrived = {w.worker: w.arrival for w in workers if w.arrival > 0}
        if len(measured) < 2 and len(arrived) < 2:
            return StragglerReport(step, (), tuple(sorted(self._persistent)), (), {}, 0.0, self.min_ratio, {})
        slowness: dict[int, float] = {}
        if len(measured) >= 2:
            median_s = statistics.median(w.shard_s for w in measured)
            slowness = {w.worker: w.shard_s / median_s for w in measured}
        # The cutoff comes from the window before this step, so one outlier cannot hide itself.
        noise, cutoff = self.cutoff()
        self._steps += 1
        lateness: dict[int, float] = {}
        if len(arrived) >= 2:
            median_arrival = statistics.median(arrived.values())
            lateness = {w: a / median_arrival for w, a in arrived.items()}
        late = tuple(sorted(w for w, r in lateness.items() if r > cutoff and self._steps > self.warmup))
        newly = []
        for worker, ratio in slowness.items():
            history = self._history.setdefault(worker, deque(maxlen=self.window))
            history.append(ratio)
            slow_steps = sum(1 for r in history if r > cutoff)
            if slow_steps >= self.persistent_steps and worker not in self._persistent:
                self._persistent.add(worker)
                newly.append(worker)
            elif slow_steps < self.persistent_steps // 2 + 1 and worker in self._persistent:
                self._persistent.discard(worker)  # recovered: hysteresis so it does not flap
        return StragglerReport(
            step, late, tuple(sorted(self._persistent)), tuple(sorted(newly)), slowness, noise, cutoff, lateness
        )
