"""Across-step rebalancing: shard counts follow measured throughput. Pure: no Ray, no torch.

Each worker's seconds per shard is smoothed with an EWMA. The target counts follow speed
(1 / seconds per shard) so that every worker finishes at about the same time, each within
``[min_shards, max_shards]``. A new split is adopted only if it predicts a step (the slowest worker's count x
seconds per shard) at least ``hysteresis`` shorter than the current split does, in
``patience`` steps in a row, so noise (per-shard times on a busy
machine swing by tens of percent) does not make the counts thrash.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from policies.ewma import ewma


@dataclass(frozen=True)
class Rebalance:
    """Give ``counts[worker]`` shards to each worker from now on; with the evidence."""

    counts: dict[int, int]
    previous: dict[int, int]
    shard_s: dict[int, float]
    predicted_step_s: float
    previous_step_s: float

    def evidence(self) -> dict[str, object]:
        return {
            "counts": {str(w): c for w, c in self.counts.items()},
            "previous": {str(w): c for w, c in self.previous.items()},
            "shard_s": {str(w): round(s, 5) for w, s in self.shard_s.items()},
            "predicted_step_s": round(self.predicted_step_s, 5),
            "previous_step_s": round(self.previous_step_s, 5),
        }


def proportional_counts(total: int, speeds: dict[int, float], min_shards: int, max_shards: int) -> dict[int, int]:
    """Split ``total`` shards so the slowest finish (count / speed) is as early as possible,
    each count within ``[min_shards, max_shards]``: as if every shard went, one by one, to the
    worker that would finish it first (optimal for equal-sized shards), ties to the lower
    worker id. Raises ValueError if the bounds make it impossible."""
    workers = sorted(speeds)
    counts = proportional_count_array(total, np.array([speeds[w] for w in workers], float), min_shards, max_shards)
    return dict(zip(workers, counts.tolist()))


def proportional_count_array(total: int, speeds: np.ndarray, min_shards: int, max_shards: int) -> np.ndarray:
    """``proportional_counts`` on an array of speeds (ties to the lower index), in O(N log N)
    instead of a heap push per shard.

    The greedy split hands out the ``total - min_shards x N`` smallest finishing times
    ``c / speed`` (c from ``min_shards + 1`` to ``max_shards``), ties by index. So: bracket the
    last time handed out (from the fluid split ``total / sum(speeds)``, else by bisection),
    give every worker its finishing times below the bracket, and sort only the few inside it."""
    n = len(speeds)
    if not n:
        raise ValueError("no workers to split shards over")
    if min_shards * n > total or max_shards * n < total:
        raise ValueError(f"cannot split {total} shards over {n} workers within [{min_shards}, {max_shards}]")

    def counts_by(time: float) -> np.ndarray:
        # Finishing times c / speed <= time, exactly (floor alone can be off by one in floats).
        c = np.floor(time * speeds)
        c = np.where((c + 1) / speeds <= time, c + 1, c)
        c = np.where(c / speeds > time, c - 1, c)
        return np.clip(c, min_shards, max_shards).astype(np.int64)

    below = counts_by(0.0)
    if below.sum() >= total:
        return below
    # Unclipped, fewer than total finishing times lie below total / sum and at least total up
    # to (total + n) / sum; the bounds can break that, then bisect the whole range.
    fluid = total / float(speeds.sum())
    low, high = np.nextafter(fluid, 0.0), (total + n) / float(speeds.sum())
    if counts_by(low).sum() >= total:
        low = 0.0
    if counts_by(high).sum() < total:
        high = float(np.max(max_shards / speeds))
    below, upto = counts_by(low), counts_by(high)
    while int((upto - below).sum()) > 4 * n and (middle := (low + high) / 2) not in (low, high):
        if counts_by(middle).sum() >= total:
            high, upto = middle, counts_by(middle)
        else:
            low, below = middle, counts_by(middle)
    extra = upto - below
    owner = np.repeat(np.arange(n), extra)
    nth = np.arange(len(owner)) - np.repeat(np.cumsum(extra) - extra, extra)
    times = (below[owner] + nth + 1) / speeds[owner]
    taken = owner[np.lexsort((owner, times))[: total - int(below.sum())]]
    return below + np.bincount(taken, minlength=n)


@dataclass
class Rebalancer:
    """Feed it each step's seconds per shard with ``observe`` (or ``observe_arrays``); returns a
    Rebalance or None.

    ``alpha``: EWMA weight of the newest step; ``hysteresis``: the fraction of predicted step
    time a new split must save; ``patience``: steps in a row it must save that much;
    ``min_shards``/``max_shards``: bounds per worker (``max_shards`` 0 means no bound);
    ``warmup``: steps observed before the first decision. ``counts``: the current split by
    worker id (``count_array``: the same, in ``workers`` order).
    """

    total_shards: int
    alpha: float = 0.3
    hysteresis: float = 0.15
    patience: int = 3
    min_shards: int = 1
    max_shards: int = 0
    warmup: int = 3
    counts: dict[int, int] = field(default_factory=dict)
    workers: list[int] = field(default_factory=list)
    count_array: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64), repr=False)
    _shard_s: np.ndarray = field(default_factory=lambda: np.empty(0), repr=False)  # EWMA; nan: none yet
    _index: dict[int, int] = field(default_factory=dict, repr=False)
    _worker_array: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64), repr=False)
    _seen: int = 0
    _streak: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1 or self.hysteresis < 0:
            raise ValueError(f"need 0 < alpha <= 1 and hysteresis >= 0, got {self.alpha}, {self.hysteresis}")

    def reset(self, workers: list[int]) -> dict[int, int]:
        """Start over on a new worker set with an even split; returns it."""
        self.workers = sorted(workers)
        self._worker_array = np.array(self.workers, np.int64)
        self._index = {w: i for i, w in enumerate(self.workers)}
        self._shard_s = np.full(len(self.workers), np.nan)
        self._seen = 0
        self._streak = 0
        self._adopt(proportional_count_array(self.total_shards, np.ones(len(self.workers)), 0, self.total_shards))
        return dict(self.counts)

    def _adopt(self, counts: np.ndarray) -> None:
        self.count_array = counts
        self.counts = dict(zip(self.workers, counts.tolist()))

    def predicted_step_s(self, counts: np.ndarray) -> float:
        return float(np.max(counts * self._shard_s))

    def observe(self, shard_s: dict[int, float]) -> Rebalance | None:
        """Update each worker's estimate (workers without a measurement keep theirs) and decide."""
        measured = np.zeros(len(self.workers))
        for worker, seconds in shard_s.items():
            if worker in self._index:
                measured[self._index[worker]] = seconds
        return self.observe_arrays(measured)

    def observe_columns(self, workers: np.ndarray, shard_s: np.ndarray) -> Rebalance | None:
        """``observe`` on columns (worker ids, seconds per shard; 0: not measured): O(N) numpy
        when they are this split's workers in order, as in the simulator."""
        if np.array_equal(workers, self._worker_array):
            return self.observe_arrays(shard_s)
        return self.observe(dict(zip(workers.tolist(), shard_s.tolist())))

    def observe_arrays(self, shard_s: np.ndarray) -> Rebalance | None:
        """``observe`` with seconds per shard in ``workers`` order (0: not measured)."""
        fresh = shard_s > 0
        known = ~np.isnan(self._shard_s)
        blend = fresh & known
        self._shard_s[blend] = ewma(self._shard_s[blend], shard_s[blend], self.alpha)
        self._shard_s[fresh & ~known] = shard_s[fresh & ~known]
        self._seen += 1
        if self._seen < self.warmup or np.isnan(self._shard_s).any():
            return None
        upper = self.max_shards or self.total_shards
        target = proportional_count_array(self.total_shards, 1.0 / self._shard_s, self.min_shards, upper)
        now, then = self.predicted_step_s(target), self.predicted_step_s(self.count_array)
        if np.array_equal(target, self.count_array) or now > (1 - self.hysteresis) * then:
            self._streak = 0
            return None
        self._streak += 1
        if self._streak < self.patience:
            return None
        self._streak = 0
        previous = dict(self.counts)
        self._adopt(target)
        return Rebalance(self.counts, previous, dict(zip(self.workers, self._shard_s.tolist())), now, then)
