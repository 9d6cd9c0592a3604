"""What a worker reports about each step it ran."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class StepTelemetry:
    """One worker's account of one step. Times are wall-clock seconds on that worker.

    ``compute_s``: forward and backward over its shards, with any injected slowness (with
    overlap, the all-reduce of early buckets runs inside it), not counting ``idle_s`` (waiting
    for other workers' shards before the all-reduce) or ``stalled_s`` (an injected stall);
    ``comm_s``: time spent waiting for the all-reduce after backward, the exposed part of
    communication; ``optim_s``: the optimizer step. ``loss`` and ``global_samples`` are the whole
    step's (the same on every rank, read back from the all-reduce); ``samples`` and ``shards``
    (the shards whose gradient this worker contributed) are this rank's.
    ``shards_run``: shards computed, including discarded backups and lost races;
    ``shard_s``: compute seconds per shard run, the inverse of this worker's speed;
    ``bytes_sent``: by this worker's process group since it was formed (cumulative).
    ``stolen``/``backups``/``backups_won``/``races_lost``: this step's straggler mitigation.
    """

    step: int
    rank: int
    worker: int
    shards: tuple[int, ...]
    samples: int
    global_samples: int
    loss: float
    compute_s: float
    comm_s: float
    optim_s: float
    step_s: float
    shards_run: int = 0
    shard_s: float = 0.0
    samples_per_s: float = 0.0
    idle_s: float = 0.0
    stalled_s: float = 0.0
    bytes_sent: int = 0
    stolen: int = 0
    backups: int = 0
    backups_won: int = 0
    races_lost: int = 0

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        record["shards"] = list(self.shards)
        return record
