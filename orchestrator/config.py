"""Job configuration: pydantic models validated once, at the edge, before any actor starts.

The defaults of :class:`JobConfig` are the built-in example (the digits classifier), so
``ringleader run`` with no job file trains it; ``examples/digits.yaml`` spells the same job out.
Reading a job file and ``--set`` overrides into a JobConfig is ``orchestrator/job_file.py``.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any, Callable, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    field_validator,
    model_validator,
)

from policies.run_ahead import MAX_STEPS_PER_CALL
from policies.schedule import BUILTIN_SCHEDULES
from workers.factories import locate_import_path, resolve_import_path


class ConfigError(Exception):
    """A job file or override is invalid. ``str(err)`` is the message for the user."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _import_path_or_callable(value: Any) -> str | Callable[..., Any]:
    # Importing the module (and torch with it) is left to resolve_job, off the fast path.
    if callable(value):
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected 'package.module:function' or a Python callable, got {type(value).__name__}")
    locate_import_path(value)
    return value


def callable_name(value: str | Callable[..., Any]) -> str:
    """An import path as it is; a callable as the ``module:qualname`` that imports it again
    (what job.json records), or, when that would import something else (a lambda, a local
    function, a ``functools.partial``, an instance, anything in ``__main__``), as
    ``<not importable: module:qualname>``, which no job file accepts: such a job is resumed
    by passing it again."""
    if isinstance(value, str):
        return value
    module = getattr(value, "__module__", None) or "?"
    name = f"{module}:{getattr(value, '__qualname__', type(value).__qualname__)}"
    try:
        importable = module != "__main__" and resolve_import_path(name) is value
    except ValueError:
        importable = False
    return name if importable else f"<not importable: {name}>"


def _json_value(value: Any) -> Any:
    """``value`` as JSON: containers element by element, callables by ``callable_name``, any
    other object by its ``repr`` (kwargs from the Python API may hold classes and objects)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if callable(value):
        return callable_name(value)
    return repr(value)


#: Keyword arguments for a user's function or class: anything goes in Python; JSON (job.json,
#: the trajectory hash) holds what is not plain data by name (see ``_json_value``).
Kwargs = Annotated[dict[str, Any], PlainSerializer(_json_value, when_used="json")]


#: A ``package.module:function`` path, or (from the Python API) the callable itself, which Ray
#: ships to the workers by value. Written to JSON as its ``module:qualname``.
ImportTarget = Annotated[
    Any, PlainValidator(_import_path_or_callable), PlainSerializer(callable_name, when_used="json")
]


def _name_path_or_callable(value: Any) -> str | Callable[..., Any]:
    # A plain name (no colon) is a built-in's, checked by the field's own validator.
    if isinstance(value, str) and ":" not in value:
        return value
    return _import_path_or_callable(value)


def _builtin_or_path(value: Any, builtins: tuple[str, ...], kind: str) -> Any:
    if isinstance(value, str) and ":" not in value and value not in builtins:
        raise ValueError(f"unknown {kind} {value!r}: use one of {list(builtins)} or 'package.module:function'")
    return value


#: A built-in's name, a ``package.module:function`` path or a callable.
NamedTarget = Annotated[
    Any, PlainValidator(_name_path_or_callable), PlainSerializer(callable_name, when_used="json")
]


class FactorySpec(_Strict):
    """A ``module:function`` (or callable) that builds a model or dataset, with keyword arguments."""

    factory: ImportTarget
    kwargs: Kwargs = Field(default_factory=dict)


class DatasetSpec(FactorySpec):
    """A dataset factory, and ``collate`` (``module:function``, optional): turns a list of
    dataset items into a batch (default: torch's ``default_collate``, which stacks tensors,
    tuples and dicts of tensors; variable-length items need one that pads). Items may be read
    from two threads at once (a step's first batch is read ahead, and a read a worker stopped
    waiting for goes on beside the next): indexing must be safe for that (tensors, memmaps
    and files opened per read are; one shared file handle with seek and read is not)."""

    collate: ImportTarget | None = None


class EvalSpec(DatasetSpec):
    """The eval dataset (``collate`` defaults to ``dataset.collate``), and ``metrics`` (``module:function``, optional): called as
    ``fn(model, batch)`` on each eval batch under ``torch.no_grad``, returning a dict of sums
    (floats or scalar tensors); they are added up over the eval set and divided by the number
    of samples (so a per-batch sum becomes a per-sample mean). ``batch_size``: samples per
    eval batch."""

    metrics: ImportTarget | None = None
    batch_size: int = Field(256, ge=1)


BuiltinLoss = Literal["cross_entropy", "mse", "causal_lm"]
BUILTIN_LOSSES: tuple[str, ...] = ("cross_entropy", "mse", "causal_lm")


class LossConfig(_Strict):
    """The training loss (``workers/objective.py``): a built-in ``name`` (``cross_entropy``,
    ``mse``, ``causal_lm``) or a ``module:function`` (or callable) called as
    ``fn(model, batch, **kwargs)``, returning per-sample losses ``[batch]`` or a pair
    ``(loss_sum, weight)``. Built-ins take ``ignore_index`` (cross_entropy, causal_lm).
    In a job file ``loss: cross_entropy`` is short for ``loss: {name: cross_entropy}``."""

    name: NamedTarget = "cross_entropy"
    kwargs: Kwargs = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, data: Any) -> Any:
        if isinstance(data, str) or callable(data):
            return {"name": data}
        return data

    @field_validator("name")
    @classmethod
    def _builtin_or_path(cls, value: Any) -> Any:
        return _builtin_or_path(value, BUILTIN_LOSSES, "loss")

    @field_validator("kwargs")
    @classmethod
    def _builtin_kwargs(cls, value: dict[str, Any], info: Any) -> dict[str, Any]:
        name = info.data.get("name")
        if isinstance(name, str) and name in BUILTIN_LOSSES:
            accepted = [] if name == "mse" else ["ignore_index"]
            unknown = sorted(set(value) - set(accepted))
            if unknown:
                raise ValueError(f"loss {name!r} takes {accepted or 'no arguments'}, got {unknown}")
        return value


class OptimizerConfig(_Strict):
    """The optimizer: ``sgd``, ``adam`` and ``adamw`` step the flat parameter buffer with
    torch's fused kernels (``workers/flat_optimizer.py``); any other name of a
    ``torch.optim.Optimizer`` (``RAdam``, ``Adagrad``, ...), a ``module:Class`` path or a class
    runs through the generic path (``workers/generic_optimizer.py``). ``kwargs``: the
    optimizer's constructor arguments (``lr`` is the base rate a schedule scales).
    ``decay_biases_and_norms``: false puts parameters with fewer than 2 dimensions (biases,
    norm weights) in a group without weight decay, as GPT-style recipes do.
    ``clip_grad_norm``: clip the step's reduced gradient to this global L2 norm (null: off).
    """

    name: NamedTarget = "adam"
    kwargs: Kwargs = Field(default_factory=lambda: {"lr": 0.001})
    decay_biases_and_norms: bool = True
    clip_grad_norm: float | None = Field(None, gt=0)

    @field_validator("name")
    @classmethod
    def _name(cls, value: Any) -> Any:
        if isinstance(value, str) and ":" not in value and not value.isidentifier():
            raise ValueError(f"expected sgd, adam, adamw, a torch.optim class name or 'package.module:Class', got {value!r}")
        return value

    @property
    def is_fused(self) -> bool:
        return self.name in ("sgd", "adam", "adamw")


class LossScalingConfig(_Strict):
    """Dynamic loss scaling for ``precision: fp16``: the loss is multiplied by the scale
    before backward; a step whose reduced gradient is not finite is skipped (on every replica:
    they all see the same reduced gradient) and the scale multiplied by ``backoff``; after
    ``growth_interval`` finite steps in a row it is multiplied by ``growth``."""

    init: float = Field(65536.0, gt=0)
    growth: float = Field(2.0, gt=1)
    backoff: float = Field(0.5, gt=0, lt=1)
    growth_interval: int = Field(2000, ge=1)


class ScheduleConfig(_Strict):
    """The learning-rate schedule (``policies/schedule.py``): a factor on ``optimizer.kwargs.lr``
    that is a pure function of the step, so resume, redo and rescaling give the same rates.
    ``name``: ``constant``, ``linear``, ``cosine``, ``warmup_cosine`` or ``step``;
    ``warmup_steps`` ramp up linearly first; ``min_lr_ratio`` is where linear and cosine end;
    ``step`` multiplies by ``gamma`` every ``step_size`` steps. A ``module:function`` (or
    callable) is called as ``fn(step, num_steps)`` and returns the factor (a float >= 0); it
    must depend on its arguments only. ``warmup_steps`` then still applies first.
    ``total_steps``: the horizon of ``linear`` and ``cosine`` (and ``num_steps`` of a function);
    default the job's step count, so extending a run stretches them; set it to keep the rates of
    a run that is to be continued (``steps: 12`` now, resumed later with ``steps: 25``)."""

    name: NamedTarget = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    step_size: int = Field(100, ge=1)
    gamma: float = Field(0.1, gt=0, le=1)
    total_steps: int | None = Field(None, ge=1, description="the horizon linear and cosine decay over (default: the job's steps)")

    @field_validator("name")
    @classmethod
    def _known(cls, value: Any) -> Any:
        return _builtin_or_path(value, BUILTIN_SCHEDULES, "schedule")

    @property
    def is_default(self) -> bool:
        return self == ScheduleConfig()


class ScalingConfig(_Strict):
    """How many workers, and what each one gets from Ray.

    ``resources_per_worker`` uses Ray's resource names: ``CPU``, ``GPU``, ``TPU`` or custom ones.
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


class CollectiveConfig(_Strict):
    """Gradient all-reduce settings.

    ``algorithm``: ``auto`` (at every group formation, time the others on the group's links
    and use, for each bucket size, the fastest; see policies/collective_choice.py), ``ring``
    (ours, over point-to-point sends), ``hierarchical`` (ours: within each Ray node, then a
    ring across nodes) or ``native`` (torch.distributed.all_reduce: gloo's or NCCL's own).
    ``bucket_mb``: the most gradient data in one collective call (the first bucket is at most
    1 MB, so communication starts early); unset: chosen by the probe under ``auto``, else 4.
    The algorithms sum in different float orders and ``auto``'s choice rests on timings, so
    under ``auto`` two runs agree to float rounding, not bit for bit: name an algorithm for
    bitwise-repeatable runs. With ``int8``/``topk`` compression ``auto`` probes nothing
    (they run their own ring) and buckets stay at ``bucket_mb`` or 4. ``overlap``: reduce buckets during backward, as
    their gradients become ready, instead of after it. ``compression``: ``bf16``/``fp16``
    (sum in half precision), ``int8`` (per-block scales) or ``topk`` (send the largest
    ``topk_ratio`` of entries, keep the rest as error feedback); int8 and topk run on our ring
    whatever the algorithm. Compression trades exactness for bytes: the invariance guarantee
    (same trajectory on any worker count) holds only with ``none``.
    """

    algorithm: Literal["auto", "ring", "hierarchical", "native"] = "auto"
    bucket_mb: float | None = Field(None, gt=0)
    overlap: bool = True
    compression: Literal["none", "bf16", "fp16", "int8", "topk"] = "none"
    topk_ratio: float = Field(0.01, gt=0, le=1)


class WorkerConfig(_Strict):
    """How a worker runs its shards.

    ``fuse_shards``: one forward/backward over all of a worker's shards in a step (fast: weight
    gradients are written once, not once per shard). The summed gradient is the same up to
    float order. Models with randomness in the forward pass (dropout) get the exact same
    trajectory on any worker count only with ``fuse_shards: false``, where each shard runs
    alone with its own seed. ``max_samples_per_pass``: a pass over more samples is split into
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


class CheckpointConfig(_Strict):
    """Coordinated checkpoints (docs/architecture.md, "Checkpoints"), taken at a step boundary.

    ``every_steps``: 0 for none, N for every N steps, or ``auto`` for the Young/Daly interval
    sqrt(2 x cost x MTBF) from the measured checkpoint cost and the observed failure rate (with
    ``mtbf_prior_s`` as a prior of one failure; clamped to ``max_every_steps``). ``path``: where
    they go, a local or shared directory or a URI pyarrow understands (``s3://``, ``gs://``...);
    default ``<run dir>/checkpoints``. Every worker writes its slice of the state there, so on a
    multi-node cluster it must be shared storage. ``keep``: how many complete checkpoints stay.
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


class _WorkerChaos(_Strict):
    """A chaos entry aimed at one worker by its ``worker`` id: its rank at job start (worker
    ids never repeat, so a replacement is never hit by chaos meant for the worker it replaces).

    The field used to be called ``rank``, which it is not once the group has re-formed; the old
    name is still accepted, with a FutureWarning (users of the CLI see it).
    """

    #: The entry's list in ``chaos`` (``slow``, ``stall``, ``kill``), for messages.
    _kind: ClassVar[str]

    @model_validator(mode="before")
    @classmethod
    def _rank_is_worker(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "rank" not in data:
            return data
        if "worker" in data:
            raise ValueError(
                f"chaos.{cls._kind}: set 'worker' only ('rank' is its deprecated old name), "
                f"got both: worker {data['worker']!r}, rank {data['rank']!r}"
            )
        warnings.warn(
            f"chaos.{cls._kind}: 'rank' is deprecated, use 'worker' (the worker id: its rank at job start)",
            FutureWarning,  # not DeprecationWarning: that one is hidden from the CLI's users
        )
        moved = {key: value for key, value in data.items() if key != "rank"}
        moved["worker"] = data["rank"]
        return moved


class SlowChaos(_WorkerChaos):
    """Worker ``worker`` (the worker id: its rank at job start) computes ``factor`` times
    slower in steps ``from_step`` up to, not including, ``to_step`` (null: to the end):
    before each pass it sleeps (factor - 1) x ``shard_s`` per shard, or, if that is null, x
    its own compute per shard measured before the slowdown began."""

    _kind = "slow"

    worker: int = Field(ge=0, description="the worker id: its rank at job start")
    factor: float = Field(gt=1)
    from_step: int = Field(0, ge=0)
    to_step: int | None = Field(None, ge=1)
    shard_s: float | None = Field(None, gt=0, description="seconds of compute per shard the slowdown multiplies")

    @model_validator(mode="after")
    def _ordered(self) -> "SlowChaos":
        if self.to_step is not None and self.to_step <= self.from_step:
            raise ValueError(f"to_step ({self.to_step}) must be after from_step ({self.from_step})")
        return self


#: What a stall holds up (docs/architecture.md, "Rescue"): ``fetch``, the worker's wait for
#: its step's data before it takes its shards (its peers can take them and the worker stops
#: waiting); ``compute``, the worker itself after it has sealed its shards (everyone waits).
StallPoint = Literal["fetch", "compute"]


class StallChaos(_WorkerChaos):
    """Worker ``worker`` (the worker id: its rank at job start) is held up for ``seconds`` in
    step ``at_step``, ``during`` its data fetch (before it takes its shards) or its compute
    (after it has sealed them)."""

    _kind = "stall"

    worker: int = Field(ge=0, description="the worker id: its rank at job start")
    at_step: int = Field(ge=0)
    seconds: float = Field(gt=0)
    during: StallPoint = "fetch"


class RandomStalls(_Strict):
    """Transient stalls at random: each step of each worker stalls with ``probability`` for
    ``seconds``, ``during`` its fetch or compute (as in StallChaos). Drawn from ``seed``, the
    worker id and the step alone, so every run (and the benchmark's peers) sees the same ones."""

    probability: float = Field(gt=0, le=1)
    seconds: float = Field(gt=0)
    seed: int = 0
    during: StallPoint = "fetch"


#: Where a worker can SIGKILL itself (``KillChaos.during``).
KillPoint = Literal["step", "checkpoint", "rejoin"]


class KillChaos(_WorkerChaos):
    """Kill a worker at step ``at_step``: worker ``worker`` (the worker id: its rank at job
    start), or for ``remove_node`` the simulated node ``node`` (1..N-1 of ``--local-nodes N``;
    0 is the head, which holds the driver) or the node that runs ``worker``.

    ``how``: ``sigkill`` (the worker SIGKILLs itself, like a crash or the OOM killer),
    ``ray_kill`` (the driver calls ``ray.kill`` while the step runs) or ``remove_node`` (the
    driver takes the whole simulated node away, with every worker on it; needs local nodes).
    ``during`` (``sigkill`` only): in the step's all-reduce (``step``), while writing the first
    checkpoint taken after ``at_step`` (``checkpoint``), or in the first re-forming of the
    group at or after ``at_step`` (``rejoin``: a failure during recovery). A kill that never
    strikes (its worker gone, its point never reached) is reported as ``chaos_skipped``.
    """

    _kind = "kill"

    at_step: int = Field(ge=0)
    worker: int | None = Field(None, ge=0, description="the worker id: its rank at job start")
    node: int | None = Field(None, ge=1)
    how: Literal["sigkill", "ray_kill", "remove_node"] = "sigkill"
    during: KillPoint = "step"

    @model_validator(mode="after")
    def _target(self) -> "KillChaos":
        if (self.worker is None) == (self.node is None):
            raise ValueError("set exactly one of 'worker' and 'node'")
        if self.node is not None and self.how != "remove_node":
            raise ValueError(f"'node' needs how: remove_node (got how: {self.how})")
        if self.during != "step" and self.how != "sigkill":
            raise ValueError(f"during: {self.during} needs how: sigkill (got how: {self.how})")
        return self


class AddNodeChaos(_Strict):
    """Add a simulated node (as big as the others) at the boundary before step ``at_step``;
    needs ``--local-nodes``."""

    at_step: int = Field(ge=0)


class ChaosConfig(_Strict):
    """Fault and slowness injection, for tests and demos.

    ``shuffle_shards``: deal each step's shards to workers at random (seeded, uneven counts,
    some workers may get none) instead of by the rebalancer; the result must not change.
    ``slow``/``stall``: make a worker (by its worker id) really compute slower, or stop, in
    given steps; ``stalls``: random transient stalls of every worker (null: none).
    ``kill``/``add_node``: worker and node failures, and nodes joining (see KillChaos).
    """

    shuffle_shards: bool = False
    slow: list[SlowChaos] = Field(default_factory=list)
    stall: list[StallChaos] = Field(default_factory=list)
    stalls: RandomStalls | None = None
    kill: list[KillChaos] = Field(default_factory=list)
    add_node: list[AddNodeChaos] = Field(default_factory=list)

    @property
    def needs_local_nodes(self) -> bool:
        return bool(self.add_node) or any(k.how == "remove_node" for k in self.kill)


class StragglerConfig(_Strict):
    """Straggler detection and mitigation (docs/architecture.md, "The step protocol").

    ``mitigation``: master switch; when off, every worker runs exactly its planned shards.
    ``steal``: idle workers take unstarted shards of late workers; ``speculate``: they back up
    late running shards (first commit wins); ``rebalance``: shard counts follow measured speed;
    ``evict``: remove a worker at a step boundary when it holds a step up for ``silent_s``
    (stalled or hung while the others wait) or, persistently slow, is ``evict_ratio`` times slower
    than the median of the others and still late in ``persistent_steps`` of its last ``window``
    steps, as long as ``scaling.min_workers`` remain.
    Detection: a worker is slow when its seconds per shard exceed both ``min_ratio`` x the
    median and ``threshold`` robust deviations (MAD) of the recent ``window`` steps; slow in
    ``persistent_steps`` of the window makes it persistently slow. ``late_factor``: a shard that
    has sat longer than this many times its expected time gets stolen or backed up.
    ``rebalance_alpha`` (EWMA weight) and ``rebalance_hysteresis`` (fraction of step time a new
    split must save).
    """

    mitigation: bool = True
    steal: bool = True
    speculate: bool = True
    rebalance: bool = True
    evict: bool = True
    threshold: float = Field(4.0, gt=0)
    min_ratio: float = Field(1.5, gt=1)
    window: int = Field(8, ge=1)
    persistent_steps: int = Field(5, ge=1)
    late_factor: float = Field(3.0, gt=1)
    rebalance_alpha: float = Field(0.3, gt=0, le=1)
    rebalance_hysteresis: float = Field(0.15, ge=0, lt=1)
    evict_ratio: float = Field(8.0, gt=1)
    silent_s: float = Field(30.0, gt=0)

    def policy_kwargs(self) -> dict[str, float | int]:
        """The settings ``policies.straggler_policies.StragglerPolicies`` takes."""
        return self.model_dump(include={
            "threshold", "min_ratio", "window", "persistent_steps", "rebalance_alpha", "rebalance_hysteresis", "evict_ratio",
        })

    @model_validator(mode="after")
    def _window(self) -> "StragglerConfig":
        if self.persistent_steps > self.window:
            raise ValueError(f"persistent_steps ({self.persistent_steps}) must be <= window ({self.window})")
        return self


class TimeoutConfig(_Strict):
    """Upper bounds, in seconds, on every wait. A timeout fails the job with a clear error."""

    start_s: float = Field(180.0, gt=0, description="actors created and data loaded")
    rendezvous_s: float = Field(60.0, gt=0, description="process group formed")
    step_s: float = Field(300.0, gt=0, description="one training step on every worker")
    collective_s: float = Field(60.0, gt=0, description="one collective operation")
    checkpoint_s: float = Field(600.0, gt=0, description="one checkpoint written, from snapshot to manifest")


class MlflowConfig(_Strict):
    """An MLflow run per job: ``tracking_uri`` (null: MLflow's default, or
    ``MLFLOW_TRACKING_URI``), ``experiment`` (created if missing), ``run_name`` (default: the
    run directory's name)."""

    tracking_uri: str | None = None
    experiment: str = "ringleader"
    run_name: str | None = None


class TrackingConfig(_Strict):
    """Experiment tracking from the driver (``orchestrator/tracking.py``): per-step metrics,
    eval metrics, the job config and the final model. ``tensorboard``: a log directory
    (relative: inside the run directory); ``mlflow``: see MlflowConfig; ``callbacks``: your own
    trackers, each built from a factory (``module:Class`` with kwargs) with any of the methods
    ``start(run_dir, config)``, ``log_step(step, metrics)``, ``log_eval(step, metrics)``,
    ``finish(status, summary, model_path)``. TensorBoard and MLflow need the ``tracking`` extra
    (``pip install 'ringleader[tracking]'``)."""

    tensorboard: str | None = None
    mlflow: MlflowConfig | None = None
    callbacks: list[FactorySpec] = Field(default_factory=list)


_DIGITS = "ringleader_examples.digits"


class JobConfig(_Strict):
    """A data-parallel training job. The defaults are the built-in digits example."""

    name: str = Field("digits", pattern=r"^[\w.-]+$")
    seed: int = 0
    model: FactorySpec = FactorySpec(factory=f"{_DIGITS}:make_model", kwargs={"hidden": 128})
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
        if self.shards < self.scaling.max_workers:
            raise ValueError(
                f"shards ({self.shards}) must be >= the most workers the job may have "
                f"({self.scaling.max_workers}), or some workers would have nothing to do"
            )
        return self

    @property
    def rebalancing(self) -> bool:
        """Shard counts follow measured speed: mitigation and rebalancing on, and the shards not
        shuffled every step (a test of invariance, not a split)."""
        return self.stragglers.mitigation and self.stragglers.rebalance and not self.chaos.shuffle_shards
