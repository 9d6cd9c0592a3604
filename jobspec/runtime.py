"""Where and how the job runs: the workers and their resources, the all-reduce, a worker's
steps, checkpoints, timeouts and experiment tracking."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from jobspec.fields import FactorySpec, StrictModel
from policies.run_ahead import MAX_STEPS_PER_CALL


class ScalingConfig(StrictModel):
    """How many workers, and what each one gets from Ray.

    ``resources_per_worker`` uses Ray's resource names: ``CPU``, ``GPU``, ``TPU`` or custom ones.
    A worker trains on the GPU Ray assigned it (``workers/runtime/devices.py``): ``GPU: 1`` is one
    worker per GPU; a fraction (``GPU: 0.5``) shares a GPU between workers and needs
    ``collective.backend: gloo`` (NCCL refuses two ranks on one GPU); more than one GPU per
    worker is refused until model parallelism exists.
    """

    workers: int = Field(4, ge=1)
    min_workers: int = Field(1, ge=1)
    # None (not given) becomes ``workers`` on validation, and stays unset, so a saved job
    # (``exclude_unset``) resumed with another worker count follows it again.
    max_workers: int | None = Field(None, ge=1, description="defaults to `workers` when not given")
    resources_per_worker: dict[str, float] = Field(default_factory=lambda: {"CPU": 0.5})
    accelerator_type: str | None = None
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    wait_for_workers_s: float = Field(
        60.0, ge=0, description="below min_workers after a failure: how long to wait for resources before failing"
    )

    @field_validator("resources_per_worker")
    @classmethod
    def _non_negative(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if amount < 0:
                raise ValueError(f"resource {name!r} must be >= 0, got {amount}")
        gpus = value.get("GPU", 0)
        if gpus > 1:
            # A replica is the whole model on one device: a second GPU would sit idle.
            raise ValueError(
                f"GPU {gpus:g} per worker: a worker trains on one GPU (more waits for model parallelism); "
                "set GPU: 1 and one worker per GPU (scaling.workers)"
            )
        return value

    @model_validator(mode="after")
    def _ordered(self) -> "ScalingConfig":
        if self.max_workers is None:
            object.__setattr__(self, "max_workers", self.workers)  # frozen: set once, here
            self.model_fields_set.discard("max_workers")
        if not self.min_workers <= self.workers <= self.max_workers:
            raise ValueError(
                f"need min_workers <= workers <= max_workers, got "
                f"{self.min_workers} <= {self.workers} <= {self.max_workers}"
            )
        return self


class CollectiveConfig(StrictModel):
    """Gradient all-reduce settings.

    ``algorithm``: ``auto`` (at every group formation, time the others on the group's links
    and use, for each bucket size, the fastest; see policies/collective_choice.py), ``ring``
    (ours, over point-to-point sends), ``hierarchical`` (ours: within each Ray node, then a
    ring across nodes) or ``native`` (torch.distributed.all_reduce: gloo's or NCCL's own).
    ``bucket_mb``: the most gradient data in one collective call (the first bucket is at most
    1 MB, so communication starts early); unset: chosen by the probe under ``auto``, else 4
    (100 on a GPU, where each bucket's launch and wait cost the host as much as a small one's,
    but with int8/topk).
    The algorithms sum in different float orders and ``auto``'s choice rests on timings, so
    under ``auto`` two runs agree to float rounding, not bit for bit: name an algorithm for
    bitwise-repeatable runs. With ``int8``/``topk`` compression ``auto`` probes nothing
    (they run their own ring) and buckets stay at ``bucket_mb`` or 4. ``overlap``: reduce buckets during backward, as
    their gradients become ready, instead of after it. ``compression``: ``bf16``/``fp16``
    (sum in half precision), ``int8`` (per-block scales) or ``topk`` (send the largest
    ``topk_ratio`` of entries, keep the rest as error feedback); int8 and topk run on our ring
    whatever the algorithm. Compression trades exactness for bytes: the invariance guarantee
    (same trajectory on any worker count) holds only with ``none``. ``backend``: the process
    group's, ``auto`` (NCCL for workers on a GPU, gloo on the CPU), ``gloo`` (also on GPUs: the
    only one for workers sharing a GPU, ``scaling.resources_per_worker`` ``GPU`` below 1) or
    ``nccl`` (needs a GPU per worker). gloo on GPUs needs ``algorithm: native`` and no int8/topk
    compression: its point-to-point sends take host tensors only.
    """

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    algorithm: Literal["auto", "ring", "hierarchical", "native"] = "auto"
    bucket_mb: float | None = Field(None, gt=0)
    overlap: bool = True
    compression: Literal["none", "bf16", "fp16", "int8", "topk"] = "none"
    topk_ratio: float = Field(0.01, gt=0, le=1)


class ShardingConfig(StrictModel):
    """Optimizer state sharded across ranks (docs/architecture.md, "Sharded optimizer state").

    ``group_size``: ranks form groups of this many; each rank of a group owns one slice of the
    flat parameters and holds only that slice's optimizer state and reduced gradient (ZeRO
    stage 2 on the flat buffers); the groups are replicas of one another. 1 (the default):
    every rank holds the whole state. A size that does not divide the number of workers is
    raised to the smallest one that does (at most every worker in one group), so no rank ever
    holds more than planned.
    A generic ``torch.optim`` optimizer steps the slice as 1-D pieces of the parameters: it must
    be element-wise (Adam-likes, RAdam, Adagrad, Lion: not Adafactor or Muon, which read a
    parameter's shape). Sharding reduces with our ring (``collective.algorithm`` auto or ring)
    and compresses nothing."""

    group_size: int = Field(1, ge=1)

    @property
    def enabled(self) -> bool:
        return self.group_size > 1


class WorkerConfig(StrictModel):
    """How a worker runs its shards.

    ``fuse_shards``: one forward/backward over all of a worker's shards in a step (fast: weight
    gradients are written once, not once per shard). The summed gradient is the same up to
    float order. Models with randomness in the forward pass (dropout) get the exact same
    trajectory on any worker count only with ``fuse_shards: false``, where each shard runs
    alone with its own seed. A model with batch-dependent layers (BatchNorm, or any whose
    buffers a training forward changes) runs one shard per pass whatever ``fuse_shards`` says:
    a forward's samples are its normalization batch (the shard, or each piece of it with
    ``max_samples_per_pass`` below a shard's size), and its running statistics are the mean over
    the step's shards, the same on every replica (docs/architecture.md, "Model buffers").
    ``max_samples_per_pass``: a pass over more samples is split into
    forward/backward passes of at most this many (gradient accumulation inside the worker, so a
    large global batch runs on small devices); each keeps its own seed, the last backward still
    overlaps with the all-reduce. ``max_steps_per_call``: while the driver's plan holds (the
    suspects and the shard split unchanged, nobody to evict) it hands each worker up to this
    many steps per call, doubling from one, back to one when the plan changes
    (docs/architecture.md, "Run-ahead"); 1 turns run-ahead off.
    """

    fuse_shards: bool = True
    max_samples_per_pass: int | None = Field(
        None, ge=1, description="split a worker's passes so none is larger (gradient accumulation)"
    )
    max_steps_per_call: int = Field(
        8, ge=1, le=MAX_STEPS_PER_CALL, description="steps a worker runs per driver call while the plan holds"
    )


class CheckpointConfig(StrictModel):
    """Coordinated checkpoints (docs/architecture.md, "Checkpoints"), taken at a step boundary.

    ``every_steps``: 0 for none, N for every N steps, or ``auto`` for the Young/Daly interval
    sqrt(2 x cost x MTBF) from the measured checkpoint cost and the observed failure rate (with
    ``mtbf_prior_s`` as a prior of one failure; clamped to ``max_every_steps``). ``path``: where
    they go, a local or shared directory or a URI pyarrow understands (``s3://``, ``gs://``...);
    default ``<run dir>/checkpoints``. Each run writes in its own directory there, named by its
    run id (``<path>/<run id>/step-N``), so jobs can share a path; a second live driver of the
    same run is refused. Every worker writes its slice of the state there, so on a multi-node
    cluster it must be shared storage. ``keep``: how many of the run's complete checkpoints stay.
    A job that finishes also leaves a final checkpoint when checkpoints are on, so it can be
    resumed for more steps.
    """

    every_steps: int | Literal["auto"] = Field(0, description="0: off; N: every N steps; auto: Young/Daly")
    keep: int = Field(3, ge=1)
    path: str | None = None
    mtbf_prior_s: float = Field(3600.0, gt=0)
    max_every_steps: int = Field(1000, ge=1)

    @field_validator("every_steps")
    @classmethod
    def _non_negative(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError(f"must be 0 (off), a positive number of steps or 'auto', got {value}")
        return value

    @property
    def enabled(self) -> bool:
        return self.every_steps != 0



class TimeoutConfig(StrictModel):
    """Upper bounds, in seconds, on every wait. A timeout fails the job with a clear error."""

    start_s: float = Field(180.0, gt=0, description="actors created and data loaded")
    rendezvous_s: float = Field(60.0, gt=0, description="process group formed")
    step_s: float = Field(300.0, gt=0, description="one training step on every worker")
    collective_s: float = Field(60.0, gt=0, description="one collective operation")
    checkpoint_s: float = Field(600.0, gt=0, description="one checkpoint written, from snapshot to manifest")


class MlflowConfig(StrictModel):
    """An MLflow run per job: ``tracking_uri`` (null: MLflow's default, or
    ``MLFLOW_TRACKING_URI``), ``experiment`` (created if missing), ``run_name`` (default: the
    run directory's name)."""

    tracking_uri: str | None = None
    experiment: str = "ringleader"
    run_name: str | None = None


class TrackingConfig(StrictModel):
    """Experiment tracking from the driver (``orchestrator/output/tracking.py``): per-step metrics,
    eval metrics, the job config and the final model. ``tensorboard``: a log directory
    (relative: inside the run directory); ``mlflow``: see MlflowConfig; ``callbacks``: your own
    trackers, each built from a factory (``module:Class`` with kwargs) with any of the methods
    ``start(run_dir, config)``, ``log_step(step, metrics)``, ``log_eval(step, metrics)``,
    ``finish(status, summary, model_path)``. TensorBoard and MLflow need the ``tracking`` extra
    (``pip install 'ringleader[tracking]'``)."""

    tensorboard: str | None = None
    mlflow: MlflowConfig | None = None
    callbacks: list[FactorySpec] = Field(default_factory=list)
