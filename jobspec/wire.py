"""What crosses the actor boundary between the driver and a worker: small frozen dataclasses
and enums, so neither side indexes a dict the other built (docs/architecture.md, "The worker
protocol").

Requests the driver sends: ``JoinRequest`` (form a generation's process group) and
``SnapshotRequest`` (checkpoint a part of the state); ``train_step`` takes a
``policies.work_stealing.StepPlan``, ``abort`` a generation number. Answers a worker gives:
``WorkerInfo`` (``describe``), ``Progress`` (``progress``), ``Joined`` (``join_group``),
``StepTelemetry`` (``train_step``) and ``PartWritten`` (``checkpoint_written``).

Pure: no torch, no Ray; the driver's policies read these types too.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any

from policies.collective_choice import CollectiveChoice


class Phase(str, enum.Enum):
    """Where a worker is within a step (``Progress.phase``).

    ``STALL`` (waiting for its first batch, or an injected stall), ``COMPUTE`` (forward and backward over
    its shards), ``IDLE`` (its shards are done, waiting for others' before the all-reduce),
    ``REDUCE`` (in the all-reduce), ``DONE`` (the step is applied, or none has started),
    ``SNAPSHOT`` (after the step, copying its part of a checkpoint: its peers may run ahead
    into the next step and wait for it there)."""

    STALL = "stall"
    COMPUTE = "compute"
    IDLE = "idle"
    REDUCE = "reduce"
    DONE = "done"
    SNAPSHOT = "snapshot"

    @property
    def waiting(self) -> bool:
        """Whether a worker in this phase is waiting for its peers (its own work is done)."""
        return self in (Phase.IDLE, Phase.REDUCE, Phase.DONE)


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's ``describe()``: facts the driver needs before training.

    ``worker``: its id for life (ranks change when the group re-forms); ``node_id``: the Ray
    node it runs on (topology for the hierarchical all-reduce, node chaos); ``pid``: its
    process; ``num_steps``: the job's steps as this worker's sampler counts them.
    ``started_at``: when its process started (epoch seconds; None where unknown),
    ``imported_at``: when its code (torch, the worker's modules) had loaded, ``built_at``: when
    its model, data and optimizer were built; the launch's breakdown."""

    worker: int
    num_samples: int
    num_steps: int
    num_params: int
    device: str
    node_id: str
    hostname: str
    pid: int
    started_at: float | None = None
    imported_at: float = 0.0
    built_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Progress:
    """A worker's ``progress()``: it is in ``phase`` of ``step`` since ``since_s`` seconds, and
    ``next_step`` is the next step its replica would apply (the optimizer steps it holds; -1
    while a state transfer into it is incomplete, so it holds no usable state).
    ``since_snapshot_s``: seconds since its last checkpoint snapshot ended (None: it has taken
    none); a peer's wait that began during that snapshot is not this worker's silence.
    ``last_copy_s``: seconds its last snapshot's copy took (None: none yet), what the driver
    expects a snapshot to take. ``held``: with sharded optimizer state, the slices of it it holds, each
    ``(lo, hi, numel, state_step)``: entries ``[lo, hi)`` of ``numel``, ready for job step
    ``state_step``; the first is the slice it steps, any others the slices it held before a
    regroup that not every rank has confirmed yet (empty: not sharded, or nothing held)."""

    step: int
    phase: Phase
    since_s: float
    next_step: int
    since_snapshot_s: float | None = None
    last_copy_s: float | None = None
    held: tuple[tuple[int, int, int, int], ...] = ()

    @property
    def snapshotting(self) -> bool:
        """Whether it is copying its part of a checkpoint now (for ``since_s`` seconds)."""
        return self.phase is Phase.SNAPSHOT

    def waiting_in(self, step: int) -> bool:
        """Whether this worker has done its own work of ``step`` and waits for the others."""
        return self.step > step or (self.step == step and self.phase.waiting)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step, "phase": self.phase.value, "since_s": self.since_s, "next_step": self.next_step,
            "since_snapshot_s": self.since_snapshot_s, "last_copy_s": self.last_copy_s, "held": self.held,
        }


@dataclass(frozen=True)
class JoinRequest:
    """Form generation ``generation``'s process group as rank ``rank`` of ``len(nodes)``
    through the driver's TCPStore at ``store_host:store_port`` under key ``prefix``;
    ``nodes[r]`` is rank r's Ray node id. ``timeout_s`` bounds the rendezvous. ``namespace``:
    the job's secret key prefix in that store (every key carries it, so a stray client that
    reaches the port cannot read or forge one); ``prefix`` is under it. ``step``: the job step
    the group starts from (-1: rank 0's next step); the driver names one only for sharded
    state whose slices were all stepped past rank 0's parameters (docs/architecture.md,
    "Sharded optimizer state"). ``claim_ports``: the ports (at ``store_host``) of the stores
    shard claims are spread over besides this one (``workers/step/claims.py``, ``ClaimStores``)."""

    store_host: str
    store_port: int
    prefix: str
    generation: int
    rank: int
    nodes: tuple[str, ...]
    timeout_s: float
    namespace: str = ""
    step: int = -1
    claim_ports: tuple[int, ...] = ()

    @property
    def world_size(self) -> int:
        return len(self.nodes)


@dataclass(frozen=True)
class Joined:
    """A finished ``join_group``: ``transfer_s`` seconds took the state broadcast from rank 0,
    after which the worker holds the state to apply ``next_step``. ``collective``: what
    ``collective.algorithm: auto`` chose from its probe (the same on every rank), else None."""

    transfer_s: float
    next_step: int
    collective: CollectiveChoice | None = None


@dataclass(frozen=True)
class SnapshotRequest:
    """Checkpoint the state after ``step`` steps: part ``index`` of ``count`` into checkpoint
    ``name`` under ``root`` (a path or URI), as attempt ``tag`` (a retaken checkpoint never
    shares files with an abandoned one)."""

    step: int
    root: str
    name: str
    tag: str
    index: int
    count: int


@dataclass(frozen=True)
class SnapshotOrder:
    """A checkpoint taken inside a batch of steps (``train_steps``, ``lead_steps``): right
    after the step that leaves the state at ``step`` steps, ranks ``0..count-1`` each copy
    part ``rank`` of ``count`` into checkpoint ``name`` under ``root`` as attempt ``tag`` and
    write it in the background, and the batch goes on; the copy's seconds come back in that
    step's report (``StepTelemetry.snapshot_s``), the write's outcome through
    ``checkpoint_written``."""

    step: int
    root: str
    name: str
    tag: str
    count: int

    def request(self, rank: int) -> SnapshotRequest | None:
        """Rank ``rank``'s part, or None for a rank that writes none."""
        return self.parts()[rank] if rank < self.count else None

    def parts(self) -> list[SnapshotRequest]:
        """Every part's request, rank ``i``'s at ``i``."""
        return [SnapshotRequest(self.step, self.root, self.name, self.tag, index, self.count) for index in range(self.count)]


@dataclass(frozen=True)
class StepTelemetry:
    """One worker's account of one step (``train_step``'s answer). Times are wall-clock
    seconds on that worker.

    ``compute_s``: forward and backward over its shards, with any injected slowness (with
    overlap, the all-reduce of early buckets runs inside it), not counting ``idle_s`` (waiting
    for other workers' shards before the all-reduce) or ``stalled_s`` (waiting for its first
    batch, and injected stalls); ``gave_up``: it brought nothing to the all-reduce, its block
    taken before it sealed it (its shards went to the rescue pass);
    ``comm_s``: time spent waiting for the all-reduce after backward, the exposed part of
    communication; ``optim_s``: the optimizer step. ``loss``, ``global_samples`` and
    ``shards_counted`` (the census total: shards counted in the reduced gradient) are the whole
    step's, the same on every rank, read back from the all-reduce; ``samples`` and ``shards``
    (the shards whose gradient this worker contributed) are this rank's.
    ``lr``: the learning rate the step was applied with (the schedule's, at this step);
    ``loss`` is the step's loss sum over its ``weight`` (the sum of the loss weights: samples,
    or tokens for a token-level loss); ``grad_norm``: the global L2 norm of the step's mean
    gradient before clipping (inf or nan if it overflowed); ``skipped``: the fp16 loss scaler
    skipped the optimizer step (same on every rank);
    ``shards_run``: shards computed, including discarded backups and lost races;
    ``shard_s``: compute seconds per shard run, the inverse of this worker's speed;
    ``samples_per_s``/``weight_per_s``: this worker's samples and loss weight (tokens, for a
    token-level loss) per second of its compute;
    ``bytes_sent``: by this worker's process group since it was formed (cumulative).
    ``stolen``/``backups``/``backups_won``/``races_lost``: this step's straggler mitigation;
    ``store_round_trips``/``store_bytes``: this step's claim-store traffic from this worker.
    ``rescued``: shards nobody brought to the step's all-reduce (their owner was stalled and
    stopped waiting), run in its rescue pass (the same on every rank); ``rescue_s``: the
    seconds that pass took here, its all-reduce included (also counted in ``comm_s``).
    ``snapshot_s``: the seconds a checkpoint's copy held this worker right after the step (a
    ``SnapshotOrder`` of its batch; 0 for none, or a rank that writes no part).
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
    shards_counted: int = 0
    lr: float = 0.0
    weight: float = 0.0
    grad_norm: float = 0.0
    skipped: bool = False
    shards_run: int = 0
    shard_s: float = 0.0
    samples_per_s: float = 0.0
    weight_per_s: float = 0.0
    idle_s: float = 0.0
    stalled_s: float = 0.0
    gave_up: bool = False
    rescued: int = 0
    rescue_s: float = 0.0
    bytes_sent: int = 0
    stolen: int = 0
    backups: int = 0
    backups_won: int = 0
    races_lost: int = 0
    store_round_trips: int = 0
    store_bytes: int = 0
    snapshot_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        # Every field is a number, a bool or the shards tuple: a shallow copy is enough, and
        # ~90x cheaper than asdict's deep copy (the driver writes one per worker per step).
        return {**vars(self), "shards": list(self.shards)}


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: ``path`` relative to the checkpoint directory, its sha256 hex and size in bytes."""

    path: str
    sha256: str
    bytes: int


@dataclass(frozen=True)
class PartWritten:
    """A worker's part of a checkpoint, written: its ``files`` and the CPU seconds the write
    took on the writer's thread (serialising, hashing, writing: on a host with no idle core,
    what the write took from training)."""

    files: tuple[FileEntry, ...]
    cpu_s: float
