"""The training recipe: what is learned and how. Datasets, the loss, the optimizer, loss scaling
and the learning-rate schedule."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from jobspec.fields import FactorySpec, ImportTarget, Kwargs, NamedTarget, StrictModel, builtin_or_path
from jobspec.targets import as_callable
from policies.schedule import BUILTIN_SCHEDULES, LearningRateSchedule


class ModelSpec(FactorySpec):
    """The model's factory, and ``compile``: compile it with ``torch.compile`` (in place,
    ``nn.Module.compile``: the same parameters and state_dict names, so checkpoints and the
    flat buffers are as without it). Gradient hooks and buckets work as in eager mode; the
    first step (and each new input shape) pays the compilation. Compiled kernels sum in
    another float order: a trajectory moves by about the yardstick of summing the same job in
    another order, and a checkpoint resumes either way."""

    compile: bool = False


#: The formats of indexed files (``workers/data/formats.py``).
FileFormatName = Literal["tokens", "npy", "parquet", "jsonl"]


class DataSource(StrictModel):
    """What the training and the eval data share: where the samples come from, a dataset
    factory (``factory``, ``kwargs``) or indexed files (``files``, ``format``, ``dtype``,
    ``seq_len``, ``column``) or a Ray Data stream (``ray_data``, ``kwargs``, ``column``,
    ``ahead_steps``), and ``collate``, how samples become a batch (see ``DatasetSpec``)."""

    factory: ImportTarget | None = None
    kwargs: Kwargs = Field(default_factory=dict)
    files: str | list[str] | None = None
    format: FileFormatName | None = None
    dtype: Literal["uint16", "uint32"] = "uint16"
    seq_len: int | None = Field(None, ge=1)
    column: str | None = None
    ray_data: ImportTarget | None = None
    ahead_steps: int = Field(4, ge=1, le=64, description="a ray_data stream's steps held in the object store at most")
    collate: ImportTarget | None = None

    @model_validator(mode="after")
    def _one_source(self) -> "DataSource":
        if sum(source is not None for source in (self.factory, self.files, self.ray_data)) != 1:
            raise ValueError(
                "set exactly one of 'factory' (a dataset factory), 'files' (a glob or list of paths or URIs) "
                "and 'ray_data' (a function returning a ray.data.Dataset)"
            )
        if self.ray_data is not None and self.format is not None:
            raise ValueError("'format' goes with 'files'; a 'ray_data' stream's rows are what its dataset yields")
        if self.files is None:
            return self
        if self.files == [] or self.files == "":
            raise ValueError("'files' names no file: give a glob, a path or a URI, or a list of them")
        if self.kwargs:
            raise ValueError("'kwargs' go with a 'factory', not with 'files'")
        if self.format is None:
            raise ValueError("'files' need a 'format': tokens, npy, parquet or jsonl")
        if self.format == "tokens" and self.seq_len is None:
            raise ValueError("format 'tokens' needs 'seq_len': the tokens in one sample")
        if self.format in ("parquet", "jsonl") and self.column is None:
            raise ValueError(f"format '{self.format}' needs 'column': the column or field each sample is read from")
        return self


#: Each epoch's order (``workers/data/shuffle.py``, ``DatasetSpec``).
Shuffle = Literal["index", "permutation", "none"]


class DatasetSpec(DataSource):
    """A dataset factory (``factory``, ``kwargs``: a map-style ``torch.utils.data.Dataset``) or
    indexed files, and ``collate`` (``module:function``, optional): turns a list of
    dataset items into a batch (default: torch's ``default_collate``, which stacks tensors,
    tuples and dicts of tensors; variable-length items need one that pads). Items may be read
    from two threads at once (a step's first batch is read ahead, and a read a worker stopped
    waiting for goes on beside the next): indexing must be safe for that (tensors, memmaps
    and files opened per read are; one shared file handle with seek and read is not).
    ``shuffle``: how each epoch is ordered: ``index`` (the default) computes each position's
    sample on its own, in O(1) memory at any dataset size; ``permutation`` draws the whole epoch
    at once (8 bytes a sample on every worker), the order of runs from before ``shuffle``
    existed. Left unset, a resumed run keeps the order its checkpoint was written in.

    Indexed files: ``files``, a glob, a path or a URI (``s3://``, ``gs://``, ``hdfs://``: pyarrow's
    filesystems), or a list of them; ``format``: ``tokens`` (a flat array of ``dtype`` token ids,
    nanoGPT's ``.bin``, cut into samples of ``seq_len`` tokens), ``npy`` (a 1-D array cut into
    ``seq_len`` windows, or a 2-D array, a sample per row), ``parquet`` or ``jsonl`` (a sample per
    row or line: its ``column`` or field). An index of the files (their sizes, versions and
    sample counts) is built once, in parallel on the cluster, and kept in the run directory; a
    resumed run whose files changed is refused. Each worker reads only its shards' samples,
    straight from storage.

    A Ray Data stream: ``ray_data``, a function (``module:function`` or a callable, called with
    ``kwargs``) returning a ``ray.data.Dataset``. It runs in a feeder actor, in a deterministic
    order (``preserve_order`` is set; a shuffle without a seed is refused), every epoch the same
    rows in the same order (shuffle in the pipeline, with a seed; ``shuffle`` is ``none``).
    A sample is a row: its ``column`` as a tensor, or without one a dict of its columns. Rows
    are cut into chunks held in Ray's object store, at most about ``ahead_steps`` steps' worth at
    once; workers take theirs by reference (``docs/data.md``, "Ray Data")."""

    shuffle: Shuffle = "index"

    @model_validator(mode="before")
    @classmethod
    def _stream_order(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("ray_data") is not None and "shuffle" not in data:
            return {**data, "shuffle": "none"}
        return data

    @model_validator(mode="after")
    def _stream_unshuffled(self) -> "DatasetSpec":
        if self.ray_data is not None and self.shuffle != "none":
            raise ValueError(
                f"'shuffle: {self.shuffle}' needs samples read by index; a 'ray_data' stream is read in its own "
                "order: shuffle in its pipeline (with a seed) and leave 'shuffle' unset"
            )
        return self


class EvalSpec(DataSource):
    """The eval dataset (``collate`` defaults to ``dataset.collate``), and ``metrics`` (``module:function``, optional): called as
    ``fn(model, batch)`` on each eval batch under ``torch.no_grad``, returning a dict of sums
    (floats or scalar tensors); they are added up over the eval set and divided by the number
    of samples (so a per-batch sum becomes a per-sample mean). ``batch_size``: samples per
    eval batch."""

    metrics: ImportTarget | None = None
    batch_size: int = Field(256, ge=1)


BuiltinLoss = Literal["cross_entropy", "mse", "causal_lm"]
BUILTIN_LOSSES: tuple[str, ...] = ("cross_entropy", "mse", "causal_lm")


class LossConfig(StrictModel):
    """The training loss (``workers/model/objective.py``): a built-in ``name`` (``cross_entropy``,
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
        return builtin_or_path(value, BUILTIN_LOSSES, "loss")

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


#: torch.optim's numeric hyperparameters by their conventional names (every stock optimizer
#: that takes one takes a number): a string or a boolean there is a slip in the job file.
NUMERIC_OPTIMIZER_KWARGS = ("lr", "weight_decay", "momentum", "dampening", "eps")


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class OptimizerConfig(StrictModel):
    """The optimizer: ``sgd``, ``adam`` and ``adamw`` step the flat parameter buffer with
    torch's fused kernels (``workers/optim/fused.py``); any other name of a
    ``torch.optim.Optimizer`` (``RAdam``, ``Adagrad``, ...), a ``module:Class`` path or a class
    runs through the generic path (``workers/optim/generic.py``). ``kwargs``: the
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

    @field_validator("kwargs")
    @classmethod
    def _numbers(cls, value: dict[str, Any]) -> dict[str, Any]:
        # Checked here, without torch: the optimizer's own constructor runs only once Ray is
        # starting, and fused ones would answer a string with a bare TypeError.
        for key in NUMERIC_OPTIMIZER_KWARGS:
            given = value.get(key)
            if isinstance(given, (str, bool)):
                hint = " (YAML reads 1e-3 as text: write 1.0e-3)" if isinstance(given, str) and _is_float(given) else ""
                raise ValueError(f"{key}: expected a number, got {given!r}{hint}")
        return value

    @property
    def is_fused(self) -> bool:
        return self.name in ("sgd", "adam", "adamw")


class LossScalingConfig(StrictModel):
    """Dynamic loss scaling for ``precision: fp16``: the loss is multiplied by the scale
    before backward; a step whose reduced gradient is not finite is skipped (on every replica:
    they all see the same reduced gradient) and the scale multiplied by ``backoff``; after
    ``growth_interval`` finite steps in a row it is multiplied by ``growth``."""

    init: float = Field(65536.0, gt=0)
    growth: float = Field(2.0, gt=1)
    backoff: float = Field(0.5, gt=0, lt=1)
    growth_interval: int = Field(2000, ge=1)


class ScheduleConfig(StrictModel):
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
        return builtin_or_path(value, BUILTIN_SCHEDULES, "schedule")

    @property
    def is_default(self) -> bool:
        return self == ScheduleConfig()

    def policy(self) -> LearningRateSchedule:
        """The schedule as the pure policy; a function schedule (import path or callable) is
        ``custom``, its function imported here (raises ValueError if the path names nothing)."""
        settings = self.model_dump(exclude={"total_steps"})
        if settings["name"] in BUILTIN_SCHEDULES:
            return LearningRateSchedule(**settings)
        return LearningRateSchedule(**{**settings, "name": "custom", "function": as_callable(self.name)})
