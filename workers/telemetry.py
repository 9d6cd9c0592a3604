"""What a worker reports about each step it ran."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class StepTelemetry:
    """One worker's account of one step. Times are wall-clock seconds on that worker.

    ``compute_s``: forward and backward over its shards (with overlap, the all-reduce of early
    buckets runs inside it); ``comm_s``: time spent waiting for the all-reduce after backward,
    the exposed part of communication; ``optim_s``: the optimizer step. ``loss`` and ``global_samples`` are the whole step's (the
    same on every rank, read back from the all-reduce); ``samples`` and ``shards`` are this rank's.
    """

    step: int
    rank: int
    shards: tuple[int, ...]
    samples: int
    global_samples: int
    loss: float
    compute_s: float
    comm_s: float
    optim_s: float
    step_s: float

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        record["shards"] = list(self.shards)
        return record
