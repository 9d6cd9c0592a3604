"""The job: one pydantic model validated once, at the edge, before any actor starts, and the
checks that span its sections.

The defaults of :class:`JobConfig` are the built-in example (the digits classifier), so
``ringleader run`` with no job file trains it; ``examples/digits.yaml`` spells the same job out.
Reading a job file and ``--set`` overrides into a JobConfig is ``orchestrator/job/reading.py``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from jobspec.chaos import ChaosConfig
from jobspec.fields import StrictModel
from jobspec.recipe import (
    DatasetSpec,
    EvalSpec,
    LossConfig,
    LossScalingConfig,
    ModelSpec,
    OptimizerConfig,
    ScheduleConfig,
)
from jobspec.runtime import (
    CheckpointConfig,
    CollectiveConfig,
    ScalingConfig,
    ShardingConfig,
    TimeoutConfig,
    TrackingConfig,
    WorkerConfig,
)
from jobspec.stragglers import StragglerConfig

_DIGITS = "ringleader_examples.digits"


class JobConfig(StrictModel):
    """A data-parallel training job. The defaults are the built-in digits example."""

    name: str = Field("digits", pattern=r"^[\w.-]+$")
    seed: int = 0
    model: ModelSpec = ModelSpec(factory=f"{_DIGITS}:make_model", kwargs={"hidden": 128})
    dataset: DatasetSpec = DatasetSpec(factory=f"{_DIGITS}:make_dataset", kwargs={"split": "train"})
    eval: EvalSpec | None = EvalSpec(factory=f"{_DIGITS}:make_dataset", kwargs={"split": "test"})
    loss: LossConfig = LossConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="forward under torch.autocast in this dtype; master weights stay fp32"
    )
    loss_scaling: LossScalingConfig = LossScalingConfig()
    batch_size: int = Field(256, ge=1, description="global samples per step")
    shards: int = Field(16, ge=1, description="shards per step, independent of the worker count")
    steps: int | None = Field(300, ge=1)
    epochs: float | None = Field(None, gt=0, description="alternative to steps")
    scaling: ScalingConfig = ScalingConfig()
    collective: CollectiveConfig = CollectiveConfig()
    sharding: ShardingConfig = ShardingConfig()
    worker: WorkerConfig = WorkerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    stragglers: StragglerConfig = StragglerConfig()
    chaos: ChaosConfig = ChaosConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    tracking: TrackingConfig = TrackingConfig()
    run_dir: str | None = Field(None, description="default: runs/<name>-<timestamp>")

    @model_validator(mode="after")
    def _consistent(self) -> "JobConfig":
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("set exactly one of 'steps' and 'epochs' (use steps: null with epochs)")
        if self.precision == "fp16" and self.collective.compression == "topk":
            # Top-k keeps unsent gradient in loss-scaled units across steps: an overflow would
            # stay in it, and a change of scale would re-weigh it.
            raise ValueError("precision fp16 cannot be combined with collective.compression topk")
        if self.shards > self.batch_size:
            raise ValueError(
                f"shards ({self.shards}) must not exceed batch_size ({self.batch_size}): "
                "every shard needs at least one sample"
            )
        for kind in ("slow", "stall", "kill"):
            for index, entry in enumerate(getattr(self.chaos, kind)):
                if entry.worker is not None and entry.worker >= self.scaling.max_workers:
                    raise ValueError(
                        f"chaos.{kind}.{index}.worker: {entry.worker} is not a worker "
                        f"(the job has at most {self.scaling.max_workers})"
                    )
        self._devices_fit_backend()
        self._sharding_supported()
        if self.shards < self.scaling.max_workers:
            raise ValueError(
                f"shards ({self.shards}) must be >= the most workers the job may have "
                f"({self.scaling.max_workers}), or some workers would have nothing to do"
            )
        return self

    def _devices_fit_backend(self) -> None:
        """A GPU shared between workers only over gloo; NCCL only with a GPU per worker. (More
        than one GPU per worker is refused by ``ScalingConfig``.)"""
        gpus, backend = self.scaling.resources_per_worker.get("GPU", 0), self.collective.backend
        if 0 < gpus < 1 and backend != "gloo":
            # NCCL refuses two ranks on one device, and auto would pick NCCL for a GPU.
            raise ValueError(
                f"scaling.resources_per_worker GPU {gpus:g}: workers sharing a GPU need collective.backend: gloo "
                f"(got {backend}; NCCL refuses two ranks on one GPU); set GPU: 1 or collective.backend: gloo with collective.algorithm: native"
            )
        collective = self.collective
        if gpus > 0 and backend == "gloo" and (collective.algorithm != "native" or collective.compression in ("int8", "topk")):
            # gloo's send/recv take host tensors only: our ring, hierarchical, int8 and top-k
            # (and auto's probe, which times the ring) would hand it device memory.
            what = f"collective.algorithm {collective.algorithm}"
            if collective.compression in ("int8", "topk"):
                what += f" with collective.compression {collective.compression}"
            raise ValueError(
                f"{what} over collective.backend gloo on a GPU: gloo sends only host tensors point to point; "
                "set collective.algorithm: native (and compression none, bf16 or fp16)"
            )
        if gpus == 0 and backend == "nccl":
            raise ValueError(
                "collective.backend nccl needs a GPU per worker, and scaling.resources_per_worker asks for none: "
                "set GPU: 1 there, or collective.backend: auto or gloo"
            )

    def _sharding_supported(self) -> None:
        """What sharded optimizer state does not do yet is refused, naming the field."""
        if not self.sharding.enabled:
            return
        if self.collective.algorithm not in ("auto", "ring"):
            raise ValueError(
                f"sharding.group_size {self.sharding.group_size} reduce-scatters with our ring: "
                f"collective.algorithm must be auto or ring, got {self.collective.algorithm}"
            )
        if self.collective.compression != "none":
            raise ValueError(
                f"sharding.group_size {self.sharding.group_size} with collective.compression "
                f"{self.collective.compression}: sharded state is reduced exactly; set compression: none"
            )

    @property
    def rebalancing(self) -> bool:
        """Shard counts follow measured speed: mitigation and rebalancing on, and the shards not
        shuffled every step (a test of invariance, not a split)."""
        return self.stragglers.mitigation and self.stragglers.rebalance and not self.chaos.shuffle_shards
