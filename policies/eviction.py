"""Eviction: which workers to remove from the job. Pure: no Ray, no torch.

A synchronous step cannot finish without every worker's contribution, so a worker that has gone
silent (stalled, hung, swapped out) holds everyone up however much of its work the others take
over; and one that is persistently far slower than the rest keeps costing a share of every
step. Both are removed at a step boundary and the job goes on with the others.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from workers.protocol import Progress


@dataclass(frozen=True)
class Evict:
    """Remove ``worker``; ``reason`` is ``silent`` or ``slow``; ``evidence`` says why."""

    worker: int
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)


def silent_workers(step: int, progress: dict[int, Progress | None], silent_s: float) -> list[Evict]:
    """Workers holding up ``step``, which has run longer than ``silent_s``.

    ``progress[w]`` is worker w's report or None if it did not answer. A worker is holding the step up when it has not reached the all-reduce of ``step``
    (still stalled or computing it, or an earlier step, or not answering) while at least one
    other worker is waiting there. If nobody is waiting, the whole step is slow, not one worker:
    nobody is evicted.
    """

    def waiting(report: Progress | None) -> bool:
        return report is not None and report.waiting_in(step)

    if not any(waiting(r) for r in progress.values()):
        return []
    return [
        Evict(worker, "silent", {"step": step, "progress": report and report.to_json(), "silent_s": silent_s})
        for worker, report in sorted(progress.items())
        if not waiting(report)
    ]


def slow_workers(shard_s: dict[int, float], persistent: set[int], late: set[int], evict_ratio: float) -> list[Evict]:
    """Persistently slow workers whose seconds per shard exceed ``evict_ratio`` x the median of
    the others' and that are still ``late`` (rebalancing could not absorb them: even with few
    shards they finish last). A worker with few shards also shows pass overhead in its seconds
    per shard, so the ratio alone would evict workers rebalancing already handles."""
    out = []
    for worker in sorted(persistent & late & set(shard_s)):
        others = [s for w, s in shard_s.items() if w != worker]
        if others and shard_s[worker] > evict_ratio * statistics.median(others):
            ratio = shard_s[worker] / statistics.median(others)
            out.append(Evict(worker, "slow", {"ratio": round(ratio, 2), "evict_ratio": evict_ratio}))
    return out
