"""One step of the straggler policies together: detection, rebalancing, slow eviction. Pure: no
Ray, no torch. The driver (``orchestrator/straggler_control.py``) feeds it the workers'
reports, the simulator (``simulator/engine.py``) simulated columns, the replay
(``simulator/replay.py``) a recorded run's: the same decisions from the same telemetry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from policies.eviction import Evict, SlowEviction
from policies.rebalance import Rebalance, Rebalancer
from policies.straggler import StragglerDetector, StragglerReport


def arrival_s(shards_run: int, compute_s: float, stalled_s: float, gave_up: bool) -> float:
    """A worker's arrival at the step's all-reduce, as the detector judges lateness: its compute
    and stalls. One that ran nothing (none planned) arrives at once and says nothing (0), but
    one that gave its shards up held the step up for as long as it waited."""
    return compute_s + stalled_s if shards_run or gave_up else 0.0


class WorkerStepFigures(Protocol):
    """One worker's figures of one step (``jobspec.wire.StepTelemetry`` is one)."""

    @property
    def worker(self) -> int: ...

    @property
    def shards_run(self) -> int: ...

    @property
    def shard_s(self) -> float: ...

    @property
    def compute_s(self) -> float: ...

    @property
    def stalled_s(self) -> float: ...

    @property
    def gave_up(self) -> bool: ...


@dataclass(frozen=True)
class StepColumns:
    """One step's telemetry as columns, one entry per worker (ids ascending or in rank order):
    ``shards`` run, ``shard_s`` seconds per shard (0: none run), ``arrival`` (``arrival_s``)."""

    workers: np.ndarray
    shards: np.ndarray
    shard_s: np.ndarray
    arrival: np.ndarray

    @classmethod
    def of_reports(cls, reports: Sequence[WorkerStepFigures]) -> "StepColumns":
        """The columns of the workers' reports of one step, in their order."""
        return cls(
            workers=np.array([r.worker for r in reports], np.int64),
            shards=np.array([r.shards_run for r in reports], np.int64),
            shard_s=np.array([r.shard_s for r in reports], float),
            arrival=np.array([arrival_s(r.shards_run, r.compute_s, r.stalled_s, r.gave_up) for r in reports], float),
        )


@dataclass(frozen=True)
class PolicyDecisions:
    """What the policies made of one step: the detector's ``verdict``, a ``rebalance`` (or
    None) and the workers to ``evict`` (empty when none or when not evicting)."""

    verdict: StragglerReport
    rebalance: Rebalance | None
    evict: list[Evict]


class StragglerPolicies:
    """The detector, rebalancer and slow eviction of one job, fed one step at a time."""

    def __init__(
        self, total_shards: int, *, threshold: float, min_ratio: float, window: int, persistent_steps: int,
        rebalance_alpha: float, rebalance_hysteresis: float, evict_ratio: float,
    ) -> None:
        self.detector = StragglerDetector(threshold, min_ratio, window, persistent_steps)
        self.rebalancer = Rebalancer(total_shards, alpha=rebalance_alpha, hysteresis=rebalance_hysteresis)
        self.eviction = SlowEviction(evict_ratio, window, persistent_steps)

    def regroup(self, workers: list[int], gone: list[int]) -> None:
        """The group changed to ``workers``: forget the ``gone``, split evenly anew."""
        for worker in gone:
            self.detector.forget(worker)
            self.eviction.forget(worker)
        self.rebalancer.reset(workers)

    def observe(self, step: int, columns: StepColumns, *, rebalance: bool, evict: bool) -> PolicyDecisions:
        """Judge ``step``; rebalance and look for slow workers to evict only when asked."""
        verdict = self.detector.observe_arrays(step, columns.workers, columns.shards, columns.shard_s, columns.arrival)
        measured = columns.shards > 0
        decision = self.rebalancer.observe_columns(columns.workers, columns.shard_s) if rebalance else None
        evictions: list[Evict] = []
        if evict:
            evictions = self.eviction.observe_arrays(
                columns.workers[measured], columns.shard_s[measured], verdict.persistent, verdict.late
            )
        return PolicyDecisions(verdict, decision, evictions)
