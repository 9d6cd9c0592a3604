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

The detector keeps its window as arrays (a ring buffer per worker) and judges a step with a
few vectorised passes, so a step costs O(N) at any worker count (the simulator runs it at
4096 workers, ``simulator/``): ``observe_arrays`` takes the step's columns; ``observe`` the
driver's ``WorkerStep`` list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

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
    The two maps are built on first use from the step's columns (most steps nobody reads them).
    """

    step: int
    late: tuple[int, ...]
    persistent: tuple[int, ...]
    newly_persistent: tuple[int, ...]
    noise: float
    cutoff: float
    _measured: tuple[np.ndarray, np.ndarray] = field(default=(np.empty(0, int), np.empty(0)), repr=False, compare=False)
    _arrived: tuple[np.ndarray, np.ndarray] = field(default=(np.empty(0, int), np.empty(0)), repr=False, compare=False)

    @property
    def slowness(self) -> dict[int, float]:
        return dict(zip(self._measured[0].tolist(), self._measured[1].tolist()))

    @property
    def lateness(self) -> dict[int, float]:
        return dict(zip(self._arrived[0].tolist(), self._arrived[1].tolist()))

    def evidence(self) -> dict[str, object]:
        return {
            "slowness": {str(w): round(s, 3) for w, s in self.slowness.items()},
            "lateness": {str(w): round(s, 3) for w, s in self.lateness.items()},
            "noise": round(self.noise, 4),
            "cutoff": round(self.cutoff, 3),
        }


@dataclass
class StragglerDetector:
    """Feed it each step's ``WorkerStep`` list with ``observe`` (or its columns with
    ``observe_arrays``); it returns a report.

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
    # Row per worker ever seen: its last ``window`` slowness ratios (nan: none yet), where the
    # next goes, and whether it is persistently slow.
    _row: dict[int, int] = field(default_factory=dict, repr=False)
    _history: np.ndarray = field(default_factory=lambda: np.empty((0, 0)), repr=False)
    _next: np.ndarray = field(default_factory=lambda: np.empty(0, int), repr=False)
    _persistent: np.ndarray = field(default_factory=lambda: np.empty(0, bool), repr=False)
    _ids: np.ndarray = field(default_factory=lambda: np.empty(0, int), repr=False)
    _rows_of: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.threshold <= 0 or self.min_ratio <= 1:
            raise ValueError(f"need threshold > 0 and min_ratio > 1, got {self.threshold}, {self.min_ratio}")
        if not 1 <= self.persistent_steps <= self.window:
            raise ValueError(f"need 1 <= persistent_steps <= window, got {self.persistent_steps}, {self.window}")
        self._history = np.full((0, self.window), np.nan)

    def forget(self, worker: int) -> None:
        """Drop a worker that left the job."""
        row = self._row.get(worker)
        if row is not None:
            self._history[row] = np.nan
            self._next[row] = 0
            self._persistent[row] = False

    def _rows(self, workers: np.ndarray) -> np.ndarray:
        """Row of each worker id, new rows for new ids (cached for an unchanged worker list)."""
        if self._rows_of is not None and np.array_equal(self._rows_of[0], workers):
            return self._rows_of[1]
        fresh = [w for w in workers.tolist() if w not in self._row]
        if fresh:
            first = len(self._ids)
            self._row.update((w, first + i) for i, w in enumerate(fresh))
            self._history = np.vstack([self._history, np.full((len(fresh), self.window), np.nan)])
            self._next = np.concatenate([self._next, np.zeros(len(fresh), int)])
            self._persistent = np.concatenate([self._persistent, np.zeros(len(fresh), bool)])
            self._ids = np.concatenate([self._ids, np.array(fresh, int)])
        rows = np.array([self._row[w] for w in workers.tolist()], int)
        self._rows_of = (workers.copy(), rows)
        return rows

    def cutoff(self) -> tuple[float, float]:
        """(noise, cutoff): the current noise estimate and the slowness ratio counted as slow."""
        values = self._history[~np.isnan(self._history)]
        noise = MAD_TO_SIGMA * float(np.median(np.abs(values - 1.0))) if values.size else 0.0
        return noise, max(self.min_ratio, 1.0 + self.threshold * noise)

    def observe(self, step: int, workers: Sequence[WorkerStep]) -> StragglerReport:
        """Judge one step from the driver's reports (see ``observe_arrays``)."""
        return self.observe_arrays(
            step,
            np.array([w.worker for w in workers], int),
            np.array([w.shards for w in workers], int),
            np.array([w.shard_s for w in workers], float),
            np.array([w.arrival for w in workers], float),
        )

    def observe_arrays(
        self, step: int, workers: np.ndarray, shards: np.ndarray, shard_s: np.ndarray, arrival: np.ndarray
    ) -> StragglerReport:
        """Judge one step: per worker id, shards run, seconds per shard and arrival seconds (as
        ``WorkerStep.arrival``: 0 when unknown). Workers that ran no shard carry no speed
        information: they are left out of slowness, but may still be late (a stalled worker
        whose shards were taken)."""
        measured = (shards > 0) & (shard_s > 0)
        arrived = arrival > 0
        if measured.sum() < 2 and arrived.sum() < 2:
            return StragglerReport(step, (), self._persistent_ids(), (), 0.0, self.min_ratio)
        rows = self._rows(workers)
        slowness = np.empty(0)
        if measured.sum() >= 2:
            slowness = shard_s[measured] / np.median(shard_s[measured])
        # The cutoff comes from the window before this step, so one outlier cannot hide itself.
        noise, cutoff = self.cutoff()
        self._steps += 1
        lateness = np.empty(0)
        late: tuple[int, ...] = ()
        if arrived.sum() >= 2:
            lateness = arrival[arrived] / np.median(arrival[arrived])
            if self._steps > self.warmup:
                late = tuple(sorted(workers[arrived][lateness > cutoff].tolist()))
        newly: tuple[int, ...] = ()
        if slowness.size:
            seen = rows[measured]
            self._history[seen, self._next[seen]] = slowness
            self._next[seen] = (self._next[seen] + 1) % self.window
            slow_steps = (self._history[seen] > cutoff).sum(axis=1)
            was = self._persistent[seen]
            becomes = (slow_steps >= self.persistent_steps) & ~was
            # Recovered: hysteresis so it does not flap.
            recovers = (slow_steps < self.persistent_steps // 2 + 1) & was
            self._persistent[seen[becomes]] = True
            self._persistent[seen[recovers]] = False
            newly = tuple(sorted(workers[measured][becomes].tolist()))
        return StragglerReport(
            step, late, self._persistent_ids(), newly, noise, cutoff,
            (workers[measured], slowness) if slowness.size else (np.empty(0, int), np.empty(0)),
            (workers[arrived], lateness) if lateness.size else (np.empty(0, int), np.empty(0)),
        )

    def _persistent_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self._ids[self._persistent].tolist()))
