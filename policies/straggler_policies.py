"""One step of the straggler policies together: detection, rebalancing, slow eviction. Pure: no
Ray, no torch. The driver (``orchestrator/steps/straggler_control.py``) feeds it the workers'
reports, the simulator (``simulator/engine.py``) simulated columns, the replay
(``simulator/replay.py``) a recorded run's: the same decisions from the same telemetry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from policies.eviction import Evict, SlowEviction
from policies.rebalance import Rebalance, Rebalancer
from policies.straggler import StragglerDetector, StragglerReport


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
    ``shards`` run, ``shard_s`` seconds per shard (0: none run), ``arrival`` (see ``of_arrays``)."""

    workers: np.ndarray
    shards: np.ndarray
    shard_s: np.ndarray
    arrival: np.ndarray

    @classmethod
    def of_reports(cls, reports: Sequence[WorkerStepFigures]) -> "StepColumns":
        """The columns of the workers' reports of one step, in their order."""
        names = ("worker", "shards_run", "shard_s", "compute_s", "stalled_s", "gave_up")
        return cls.of_arrays(*(np.array([getattr(r, name) for r in reports], float) for name in names))

    @classmethod
    def of_arrays(
        cls, workers: np.ndarray, shards_run: np.ndarray, shard_s: np.ndarray, compute_s: np.ndarray,
        stalled_s: np.ndarray, gave_up: np.ndarray,
    ) -> "StepColumns":
        """The columns from the reports' own columns (a step record's). A worker's arrival at the
        step's all-reduce, as the detector judges lateness, is its compute and stalls; one that
        ran nothing (none planned) arrives at once and says nothing (0), but one that gave its
        shards up held the step up for as long as it waited."""
        shards = np.asarray(shards_run, np.int64)
        arrival = np.where((shards > 0) | (np.asarray(gave_up) != 0), np.asarray(compute_s) + np.asarray(stalled_s), 0.0)
        return cls(workers=np.asarray(workers, np.int64), shards=shards, shard_s=np.array(shard_s, float), arrival=arrival)


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
