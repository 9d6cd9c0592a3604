"""Eviction: which workers to remove from the job. Pure: no Ray, no torch.

A synchronous step cannot finish without every worker's contribution, so a worker that has gone
silent (stalled, hung, swapped out) holds everyone up however much of its work the others take
over; and one that is persistently far slower than the rest keeps costing a share of every
step. Both are removed at a step boundary and the job goes on with the others.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Collection, Protocol

import numpy as np


class WorkerProgress(Protocol):
    """Where one worker is (``jobspec.wire.Progress`` is one): in ``step`` since ``since_s``
    seconds, and whether it has done its own work of a step and waits for the others;
    whether it is ``snapshotting`` (copying its part of a checkpoint, for ``since_s``),
    ``since_snapshot_s``, the seconds since its last snapshot ended, and ``last_copy_s``, how
    long that snapshot's copy took (None: none yet)."""

    @property
    def step(self) -> int: ...

    @property
    def since_s(self) -> float: ...

    @property
    def snapshotting(self) -> bool: ...

    @property
    def since_snapshot_s(self) -> float | None: ...

    @property
    def last_copy_s(self) -> float | None: ...

    def waiting_in(self, step: int) -> bool: ...

    def to_json(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Evict:
    """Remove ``worker``; ``reason`` is ``silent`` or ``slow``; ``evidence`` says why."""

    worker: int
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)


# A snapshot copies device memory to the host: milliseconds to seconds, about the same each
# time (a first one also allocates its host memory). Up to this many times the worker's last
# copy, and ``silent_s`` in any case, it is busy; longer, it is hung (a stuck device copy).
SNAPSHOT_SLACK = 10.0


def snapshot_allowance(
    silent_s: float, last_copy_s: float | None, cap_s: float = math.inf, group_copy_s: float | None = None
) -> float:
    """How long a worker may copy a checkpoint snapshot before it counts as silent:
    ``SNAPSHOT_SLACK`` x its ``last_copy_s``, at least ``silent_s``, at most ``cap_s`` (the
    driver's: below its own deadline for a step, so that a hung snapshot gets its worker
    evicted rather than the job failed). With no copy of its own yet (its first snapshot, or a
    replacement's), the group's longest last copy (``group_copy_s``) stands in for it; with
    none in the group either (the job's first snapshot), ``cap_s``: how long a first copy of a
    large state takes (host memory allocated, every rank copying at once) is not known, and
    ``silent_s`` alone would evict the worker, then its replacement at the next checkpoint."""
    known = last_copy_s if last_copy_s is not None else group_copy_s
    if known is None:
        return cap_s
    return min(cap_s, max(silent_s, SNAPSHOT_SLACK * known))


def silent_workers(
    progress: dict[int, WorkerProgress | None], silent_s: float, snapshot_cap_s: float = math.inf
) -> list[Evict]:
    """Workers holding up a step that others have waited in for ``silent_s`` or longer.

    ``progress[w]`` is worker w's report or None if it did not answer. The step held up is the
    latest one some worker has done its own work of and waited in (``since_s``) that long; a
    worker holds it up when it has not reached that step's all-reduce (still stalled or
    computing it, or an earlier step, or not answering). If nobody has waited that long, the
    whole step is slow (or just began), not one worker: nobody is evicted.

    A worker copying its part of a checkpoint (queued between two steps: its peers run ahead
    and wait for it) is busy, not silent, for its ``snapshot_allowance`` (capped at
    ``snapshot_cap_s``; for a worker with no copy of its own yet, from the group's longest
    last copy); past that it is silent (a snapshot that hangs). The peers' wait
    began during its snapshot, so it is held up silent only ``silent_s`` after the snapshot
    ended. Each eviction's evidence says ``why``.
    """
    waited = [r.step for r in progress.values() if r is not None and r.waiting_in(r.step) and r.since_s >= silent_s]
    if not waited:
        return []
    step = max(waited)
    copies = [r.last_copy_s for r in progress.values() if r is not None and r.last_copy_s is not None]
    group_copy_s = max(copies, default=None)
    out = []
    for worker, report in sorted(progress.items()):
        if report is not None and report.waiting_in(step):
            continue
        why = f"silent for {silent_s}s (stalled or hung)"
        if report is not None and report.snapshotting:
            allowed = snapshot_allowance(silent_s, report.last_copy_s, snapshot_cap_s, group_copy_s)
            if report.since_s < allowed:
                continue
            why = f"copying a checkpoint snapshot for {report.since_s:.0f}s, longer than one may take ({allowed:.0f}s)"
        elif report is not None and report.since_snapshot_s is not None and report.since_snapshot_s < silent_s:
            continue
        evidence = {"step": step, "progress": report and report.to_json(), "silent_s": silent_s, "why": why}
        out.append(Evict(worker, "silent", evidence))
    return out


@dataclass
class SlowEviction:
    """Evicts persistently slow workers whose seconds per shard exceed ``evict_ratio`` x the
    median of the others' and that are still late (rebalancing could not absorb them: even with
    few shards they finish last) in at least ``required`` of their last ``window`` steps as
    persistent stragglers.

    One step is not evidence: on a shared machine a worker descheduled for a few tens of ms
    is 8x slower than the rest for that step, and a worker with few shards also shows pass
    overhead in its seconds per shard. Only workers the detector already calls persistent are
    tracked (a few), so a step costs O(N) for ``shard_s`` plus O(N) per candidate.
    """

    evict_ratio: float
    window: int
    required: int
    _history: dict[int, deque[bool]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.evict_ratio <= 1 or not 1 <= self.required <= self.window:
            raise ValueError(f"need evict_ratio > 1 and 1 <= required <= window, got {self.evict_ratio}, {self.required}, {self.window}")

    def forget(self, worker: int) -> None:
        """Drop a worker that left the job."""
        self._history.pop(worker, None)

    def observe(self, shard_s: dict[int, float], persistent: set[int], late: set[int]) -> list[Evict]:
        """Account one step (``shard_s``: seconds per shard of the workers that ran shards) and
        return the workers to evict now."""
        workers = np.fromiter(shard_s, int, len(shard_s))
        return self.observe_arrays(workers, np.fromiter(shard_s.values(), float, len(shard_s)), persistent, late)

    def observe_arrays(
        self, workers: np.ndarray, shard_s: np.ndarray, persistent: Collection[int], late: Collection[int]
    ) -> list[Evict]:
        """``observe`` on columns: the ids and seconds per shard of the workers that ran shards,
        and the detector's persistent and late workers (a persistent one that ran nothing this
        step keeps its evidence). O(N log N) for the sort, whatever the candidates."""
        for worker in set(self._history) - set(persistent):
            del self._history[worker]  # recovered (or gone): the evidence starts over
        candidates = np.flatnonzero(np.isin(workers, list(persistent)))
        late_here = np.isin(workers, list(late))
        if not candidates.size or workers.size < 2:
            return []
        order = np.argsort(shard_s, kind="stable")
        others = median_without(shard_s[order], np.argsort(order)[candidates])
        out = []
        for index, median in sorted(zip(candidates.tolist(), others.tolist()), key=lambda c: int(workers[c[0]])):
            worker = int(workers[index])
            ratio = float(shard_s[index]) / median
            history = self._history.setdefault(worker, deque(maxlen=self.window))
            history.append(bool(late_here[index]) and ratio > self.evict_ratio)
            if sum(history) >= self.required:
                out.append(Evict(worker, "slow", {"ratio": round(ratio, 2), "evict_ratio": self.evict_ratio, "slow_steps": sum(history), "window": len(history)}))
        return out


def median_without(ordered: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The median of ``ordered`` (sorted, length n >= 2) with the element at each of
    ``positions`` left out, for all positions at once in O(len(positions))."""
    remaining = len(ordered) - 1

    def at(j: np.ndarray) -> np.ndarray:  # element j of the array without positions
        return ordered[np.where(j < positions, j, j + 1)]

    half = np.full(positions.shape, remaining // 2)
    if remaining % 2:
        return at(half)
    return (at(half - 1) + at(half)) / 2
