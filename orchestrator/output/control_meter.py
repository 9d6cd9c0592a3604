"""What the control plane costs per step: the driver's CPU and busy time, and the claim store's
traffic (``summary.json``'s ``control_plane``; ``ringleader bench control-plane`` fits them
against the worker count).

A batch's interval runs from one commit to the next while the job is Running with steps in
flight, so it holds everything the driver does per batch, spread over its steps (see
docs/architecture.md, "Run-ahead"): submitting the next batch to every worker, opening its claims, waiting, reading the reports, the policies, the telemetry and
event files, the metrics. ``busy`` is that interval less the time blocked in ``ray.wait`` for
the workers' step results, i.e. the driver's own wall time (waits of its own, for a checkpoint
or a progress probe, count as busy); ``cpu`` is the driver process's CPU time over the
interval, every thread included (Ray's core worker, and the claim store's server thread when
the store is served in-process); ``store_cpu`` that of the store's own server process
(``orchestrator/store/server_process.py``), reported apart so moving the store off the driver hides
none of its cost. Intervals across a recovery, a growth or a drain are not steps and are not
counted.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from jobspec.step_record import StepRecord

# The first steps after entering Running are warm-up (first calls, lazy imports, JIT'd paths).
WARMUP_STEPS = 3


@dataclass(frozen=True)
class StepCost:
    """The control plane's cost of one step: seconds of driver CPU, driver busy (wall not
    blocked on the workers) and wall between commits; the workers' and the driver's store
    round trips and bytes."""

    cpu_s: float
    busy_s: float
    wall_s: float
    store_round_trips: int
    store_bytes: int
    store_cpu_s: float | None = None


@dataclass
class ControlPlaneMeter:
    """Feed it ``committed`` after each committed batch and ``restart`` on entering Running.
    ``server_cpu_s``: the CPU seconds so far of the store's server process (None when the
    store is served in the driver's process, whose CPU already counts it)."""

    server_cpu_s: Callable[[], float | None] = lambda: None
    steps: list[StepCost] = field(default_factory=list)
    batches: list[int] = field(default_factory=list)  # steps per call of each measured batch
    _since: tuple[float, float, float | None] | None = None
    _seen: int = 0
    _waited_s: float = 0.0
    _driver_trips: int = 0
    _driver_bytes: int = 0

    def restart(self) -> None:
        """Entering Running: the next commit opens an interval, it does not close one."""
        self._since = None
        self._seen = 0

    def waited(self, seconds: float) -> None:
        """The driver was blocked this long waiting for workers."""
        self._waited_s += seconds

    def driver_store(self, round_trips: int, sent_bytes: int) -> None:
        """The driver's own store traffic (opening a step's claims)."""
        self._driver_trips += round_trips
        self._driver_bytes += sent_bytes

    def committed(self, records: Sequence[StepRecord]) -> None:
        """A batch committed with every rank's reports (``records``: one per step): close its
        interval and open the next. The interval's cost is spread evenly over the batch's steps
        (the driver's work for a batch happens once, between its commits)."""
        now = (time.process_time(), time.perf_counter(), self.server_cpu_s())
        steps = len(records) or 1
        if self._since is not None and self._seen >= WARMUP_STEPS:
            wall = now[1] - self._since[1]
            cost = StepCost(
                cpu_s=(now[0] - self._since[0]) / steps,
                busy_s=max(0.0, wall - self._waited_s) / steps,
                wall_s=wall / steps,
                store_round_trips=round((self._driver_trips + _total(records, "store_round_trips")) / steps),
                store_bytes=round((self._driver_bytes + _total(records, "store_bytes")) / steps),
                store_cpu_s=None if now[2] is None or self._since[2] is None else (now[2] - self._since[2]) / steps,
            )
            self.steps += [cost] * steps
            self.batches.append(steps)
        self._seen += steps
        self._since = now
        self._waited_s = 0.0
        self._driver_trips = self._driver_bytes = 0

    def summary(self) -> dict[str, Any]:
        """Medians per step over the measured steps (ms, round trips, bytes; the store process's
        CPU, when it has one, as a mean) and the mean steps per call; empty if none."""
        if not self.steps:
            return {}

        def median(values: list[float]) -> float:
            return statistics.median(values)

        # /proc counts CPU in ticks (10 ms): a mean over the steps, not a median of ticks.
        store_cpu = [s.store_cpu_s for s in self.steps if s.store_cpu_s is not None]
        return {
            **({"store_cpu_ms": 1e3 * statistics.fmean(store_cpu)} if store_cpu else {}),
            "steps_measured": len(self.steps),
            "steps_per_call": statistics.fmean(self.batches),
            "driver_cpu_ms": 1e3 * median([s.cpu_s for s in self.steps]),
            "driver_busy_ms": 1e3 * median([s.busy_s for s in self.steps]),
            "step_wall_ms": 1e3 * median([s.wall_s for s in self.steps]),
            "store_round_trips": median([s.store_round_trips for s in self.steps]),
            "store_bytes": median([s.store_bytes for s in self.steps]),
        }


def _total(records: Sequence[StepRecord], column: str) -> float:
    """The sum of ``column`` over every row of ``records``."""
    return float(sum(record.column(column).sum() for record in records))
