"""Across-step rebalancing: shard counts follow measured throughput. Pure: no Ray, no torch.

Each worker's seconds per shard is smoothed with an EWMA. The target counts follow speed
(1 / seconds per shard) so that every worker finishes at about the same time, each within
``[min_shards, max_shards]``. A new split is adopted only if it predicts a step (the slowest worker's count x
seconds per shard) at least ``hysteresis`` shorter than the current split does, in
``patience`` steps in a row, so noise (per-shard times on a busy
machine swing by tens of percent) does not make the counts thrash.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

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
    each count within ``[min_shards, max_shards]``: every shard goes, one by one, to the worker
    that would finish it first (optimal for equal-sized shards). Ties go to the lower worker
    id. Raises ValueError if the bounds make it impossible."""
    workers = sorted(speeds)
    if not workers:
        raise ValueError("no workers to split shards over")
    if min_shards * len(workers) > total or max_shards * len(workers) < total:
        raise ValueError(f"cannot split {total} shards over {len(workers)} workers within [{min_shards}, {max_shards}]")
    counts = dict.fromkeys(workers, min_shards)
    heap = [((min_shards + 1) / speeds[w], w) for w in workers]
    heapq.heapify(heap)
    for _ in range(total - min_shards * len(workers)):
        _, worker = heapq.heappop(heap)
        counts[worker] += 1
        if counts[worker] < max_shards:
            heapq.heappush(heap, ((counts[worker] + 1) / speeds[worker], worker))
    return counts


@dataclass
class Rebalancer:
    """Feed it each step's seconds per shard with ``observe``; returns a Rebalance or None.

    ``alpha``: EWMA weight of the newest step; ``hysteresis``: the fraction of predicted step
    time a new split must save; ``patience``: steps in a row it must save that much;
    ``min_shards``/``max_shards``: bounds per worker (``max_shards`` 0 means no bound);
    ``warmup``: steps observed before the first decision.
    """

    total_shards: int
    alpha: float = 0.3
    hysteresis: float = 0.15
    patience: int = 3
    min_shards: int = 1
    max_shards: int = 0
    warmup: int = 3
    counts: dict[int, int] = field(default_factory=dict)
    _shard_s: dict[int, float] = field(default_factory=dict, repr=False)
    _seen: int = 0
    _streak: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1 or self.hysteresis < 0:
            raise ValueError(f"need 0 < alpha <= 1 and hysteresis >= 0, got {self.alpha}, {self.hysteresis}")

    def reset(self, workers: list[int]) -> dict[int, int]:
        """Start over on a new worker set with an even split; returns it."""
        self._shard_s = {}
        self._seen = 0
        self._streak = 0
        self.counts = proportional_counts(self.total_shards, dict.fromkeys(workers, 1.0), 0, self.total_shards)
        return dict(self.counts)

    def predicted_step_s(self, counts: dict[int, int]) -> float:
        return max(counts[w] * self._shard_s[w] for w in counts)

    def observe(self, shard_s: dict[int, float]) -> Rebalance | None:
        """Update each worker's estimate (workers without a measurement keep theirs) and decide."""
        for worker, seconds in shard_s.items():
            if seconds > 0 and worker in self.counts:
                self._shard_s[worker] = ewma(self._shard_s.get(worker), seconds, self.alpha)
        self._seen += 1
        if self._seen < self.warmup or any(w not in self._shard_s for w in self.counts):
            return None
        speeds = {w: 1.0 / self._shard_s[w] for w in self.counts}
        upper = self.max_shards or self.total_shards
        target = proportional_counts(self.total_shards, speeds, self.min_shards, upper)
        now, then = self.predicted_step_s(target), self.predicted_step_s(self.counts)
        if target == self.counts or now > (1 - self.hysteresis) * then:
            self._streak = 0
            return None
        self._streak += 1
        if self._streak < self.patience:
            return None
        self._streak = 0
        decision = Rebalance(target, dict(self.counts), dict(self._shard_s), now, then)
        self.counts = target
        return decision
