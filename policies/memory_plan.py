"""The memory math of a run: bytes per rank under each sharding setting and precision. Pure: no Ray, no torch.

The convention is what a worker holds (``workers/model/flat_parameters.py`` ``FlatParameters``,
``workers/optim/fused.py`` ``FlatOptimizer``), with ``N`` trainable parameters, ``E`` extra
slots in front of the gradient (census, loss, sample count, buffer changes), sharding group
size ``g`` and ``S = ceil(N / g)``, the largest slice ``policies/split.py`` cuts (the plan is
for the rank that holds it):

* **parameters** ``w N``: one flat buffer the model's parameters are views into; ``w = 4``
  (fp32: ringleader's bf16 and fp16 autocast over fp32 parameters) unless ``half_weights``
  (the working copy in the compute precision, ``w = 2``). Optimizer sharding (ZeRO stages 1
  and 2) never shards them: every rank computes a forward.
* **gradients** ``w (N + E)``: ``[extra | gradients]``, in the parameters' dtype; with
  ``shard_gradients`` a rank keeps only its slice once reduced, ``w (S + E)``: backward's
  gradients are taken out of the parameters bucket by bucket as the last backward of the step
  produces them (``workers/comm/gradient_reducer.py``). Not counted: the buckets not yet out and the copies
  in flight (a bucket or two while communication keeps up with backward; the probe runs the
  job unsharded, so its activations do not hold them).
* **optimizer** ``k S + c``: ``k`` bytes of state per parameter (sgd: 0, with momentum 4;
  adam and adamw: 8, amsgrad 12; a generic ``torch.optim`` one: measured or declared) and
  ``c`` fixed (the fused kernels' fp32 ``step`` scalar: 4).
* **master** ``4 S`` with ``half_weights`` (the fp32 values a rank's slice is stepped on),
  else 0: fp32 parameters are their own master.
* **buffers**: the model's non-trained tensors (BatchNorm statistics), whole on every rank.
* **gradient copy** ``w (N + E)`` when straggler mitigation may run: a backup pass clones the
  gradient, a rescue pass the whole buffer (``workers/step/passes.py``), while it runs. With
  ``shard_gradients`` one more where the whole gradient is held for a while anyway
  (``whole_gradient``: a step of several passes per rank accumulates it in the parameters
  until its last backward, and without overlap it is all reduced after backward; with
  mitigation, a straggler's two passes and what a backup clones): ``gradient_copies``.
* **activations** ``a0 + a1 P`` for a pass of ``P`` samples (``max_samples_per_pass``): ``a1``
  the bytes one more sample adds at the peak of a forward/backward, ``a0`` what a pass holds
  whatever its size (autocast's half copies of the weights, the largest parameter's gradient
  before it is added into the flat buffer, the loss); both measured by a probe of the job's
  own model, its optimizer step included.
* **join copy**: a generic optimizer's state moves packed in one buffer when a group forms
  (``GenericOptimizer.sync``): one more copy of it while a worker joins, between steps.

A rank's peak (``total``) is the state (parameters, gradients, optimizer, master, buffers)
plus the larger of a step's transients (activations and the gradient copy) and a join's.

So Adam in fp32 replicated is ``16 N + 4 E + 4`` bytes; sharded over ``g`` with gradients
sharded too, ``4 N + 12 S + 4 E + 4`` (``4 + 12 / g`` per parameter); with ``half_weights``
(bf16 working weights and gradients, fp32 master slices) ``2 + 2 + 12 / g`` without
gradient sharding, the ZeRO paper's ``2 + 2 + K / g``.

Not counted: allocator fragmentation and caching (a CUDA caching allocator reserves more than
it allocates), the CUDA context and kernels' workspaces (cuBLAS, cuDNN), NCCL's and gloo's
buffers, the all-reduce's scratch (two ring chunks of one bucket), the data loader's batches
prefetched on the host, and the dataset.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Iterable

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZER_KINDS = ("sgd", "adam", "adamw", "generic")
FP32_BYTES = 4
HALF_BYTES = 2
#: The fused optimizers' ``step`` counter: one fp32 scalar (``FlatOptimizer.state["step"]``).
STEP_COUNTER_BYTES = 4

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_NUMBER = r"[0-9]+(?:\.[0-9]*)?(?:[eE][0-9]+)?"
_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


@dataclass(frozen=True)
class OptimizerBytes:
    """Optimizer state: ``per_param`` bytes for each parameter a rank steps, plus ``fixed``;
    ``packed_on_join``: a joining group packs all of it into one buffer (a second copy)."""

    kind: str
    per_param: float
    fixed: int = 0
    packed_on_join: bool = False


def optimizer_bytes(
    kind: str, *, momentum: bool = False, amsgrad: bool = False, per_param: float | None = None, fixed: int = 0
) -> OptimizerBytes:
    """The state of optimizer ``kind`` (sgd, adam, adamw: what ``FlatOptimizer`` allocates;
    generic: ``per_param`` and ``fixed`` as measured or declared). Raises ValueError for an
    unknown kind, or a generic one without ``per_param``."""
    if kind == "sgd":
        return OptimizerBytes(kind, FP32_BYTES if momentum else 0, STEP_COUNTER_BYTES)
    if kind in ("adam", "adamw"):
        return OptimizerBytes(kind, (3 if amsgrad else 2) * FP32_BYTES, STEP_COUNTER_BYTES)
    if kind == "generic":
        if per_param is None or not per_param >= 0:
            raise ValueError(f"optimizer 'generic': state bytes per parameter must be given (>= 0), got {per_param!r}")
        return OptimizerBytes(kind, float(per_param), fixed, packed_on_join=True)
    raise ValueError(f"unknown optimizer kind {kind!r}; expected one of {list(OPTIMIZER_KINDS)}")


@dataclass(frozen=True)
class ModelFigures:
    """What the plan needs of a model: ``params`` (trainable, N), ``extra_slots`` (E),
    ``buffer_bytes``, and its activations: ``activation_fixed`` bytes per pass plus
    ``activation_per_sample`` per sample of the pass (at the precision they were measured in)."""

    params: int
    extra_slots: int = 0
    buffer_bytes: int = 0
    activation_fixed: float = 0.0
    activation_per_sample: float = 0.0


@dataclass(frozen=True)
class Sharding:
    """How a rank's training state is laid out: ``group_size`` ranks share one copy of the
    optimizer state (1: replicated, today); ``shard_gradients``: a rank keeps only its slice of
    the reduced gradient; ``half_weights``: working parameters and gradients in the compute
    precision with fp32 master slices (only with precision bf16 or fp16)."""

    group_size: int = 1
    shard_gradients: bool = False
    half_weights: bool = False


@dataclass(frozen=True)
class RankBytes:
    """Bytes one rank holds, by what holds them (the module docstring's formulas)."""

    parameters: int
    gradients: int
    optimizer: int
    master: int
    buffers: int
    gradient_copy: int
    activations: int
    join_copy: int

    @property
    def state(self) -> int:
        """What a rank holds between steps."""
        return self.parameters + self.gradients + self.optimizer + self.master + self.buffers

    @property
    def total(self) -> int:
        """The peak: the state and the larger of a step's transients and a join's."""
        return self.state + max(self.gradient_copy + self.activations, self.join_copy)

    def as_dict(self) -> dict[str, int]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "state": self.state, "total": self.total}


def _check(sharding: Sharding, precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {list(PRECISIONS)}")
    if sharding.group_size < 1:
        raise ValueError(f"group_size {sharding.group_size}: expected an integer >= 1")
    if sharding.half_weights and precision == "fp32":
        raise ValueError("half_weights needs precision bf16 or fp16 (fp32 weights are their own master)")


def largest_slice(params: int, group_size: int) -> int:
    """``S``: the largest of ``group_size`` near-equal slices of ``params``, ``ceil(params /
    group_size)``: the first of ``policies/split.py``'s ``even_counts`` (computed, not listed:
    ``smallest_group`` tries group sizes up to the parameter count)."""
    return -(-params // group_size)


def gradient_copies(sharding: Sharding, mitigation: bool, whole_gradient: bool) -> int:
    """Whole gradients a step holds beside ``gradients`` at its peak: one a backup or rescue
    pass clones (``mitigation``), and with ``shard_gradients`` one more where the parameters'
    own gradients are whole before the last backward (``whole_gradient``; with mitigation
    too: a straggler's own shards run in two passes, and a backup's clone is of them)."""
    return int(mitigation) + int(sharding.shard_gradients and (whole_gradient or mitigation))


def rank_bytes(
    model: ModelFigures,
    optimizer: OptimizerBytes,
    sharding: Sharding = Sharding(),
    precision: str = "fp32",
    samples_per_pass: int = 0,
    mitigation: bool = False,
    whole_gradient: bool = False,
) -> RankBytes:
    """Bytes per rank for a pass of ``samples_per_pass`` samples; ``mitigation``: straggler
    mitigation may run (a gradient copy); ``whole_gradient``: a step holds the whole gradient
    before it is reduced (several passes per rank, or no overlap: with ``shard_gradients``, one
    more gradient copy). Raises ValueError for a bad precision or sharding."""
    _check(sharding, precision)
    n, extra = model.params, model.extra_slots
    width = HALF_BYTES if sharding.half_weights else FP32_BYTES
    owned = largest_slice(n, sharding.group_size)
    gradients = width * ((owned if sharding.shard_gradients else n) + extra)
    optimizer_held = math.ceil(optimizer.per_param * owned) + optimizer.fixed
    return RankBytes(
        parameters=width * n,
        gradients=gradients,
        optimizer=optimizer_held,
        master=FP32_BYTES * owned if sharding.half_weights else 0,
        buffers=model.buffer_bytes,
        gradient_copy=width * (n + extra) * gradient_copies(sharding, mitigation, whole_gradient),
        activations=math.ceil(model.activation_fixed + model.activation_per_sample * samples_per_pass),
        join_copy=optimizer_held if optimizer.packed_on_join else 0,
    )


def largest_pass(
    model: ModelFigures,
    optimizer: OptimizerBytes,
    device_bytes: int,
    sharding: Sharding = Sharding(),
    precision: str = "fp32",
    mitigation: bool = False,
    whole_gradient: bool = False,
) -> int | None:
    """The largest ``max_samples_per_pass`` whose rank total fits ``device_bytes``: 0 when not
    even one sample fits, None when activations do not grow with the pass (no limit from them)."""
    held = rank_bytes(model, optimizer, sharding, precision, 0, mitigation, whole_gradient)
    if held.total > device_bytes:
        return 0
    if model.activation_per_sample <= 0:
        return None
    # A join's copy is not held during a step: only the step's transients grow with the pass.
    spare = device_bytes - held.state - held.gradient_copy - held.activations
    return max(0, math.floor(spare / model.activation_per_sample))


@dataclass(frozen=True)
class GroupChoice:
    """The smallest sharding for a model of ``params`` parameters on a device: ``group_size``
    the smallest of the candidates that fits (None: none does), ``workers`` the smallest worker
    count that runs it (one sharding group), ``needed`` the smallest group size that would fit
    (None: the replicated part alone, parameters and gradients, does not fit: that needs
    parameter sharding), ``per_rank`` the bytes per rank at ``group_size``."""

    params: int
    group_size: int | None
    workers: int | None
    needed: int | None
    per_rank: int | None


def smallest_group(
    params: int,
    optimizer: OptimizerBytes,
    device_bytes: int,
    group_sizes: Iterable[int],
    *,
    reserve_bytes: int = 0,
    precision: str = "fp32",
    shard_gradients: bool = False,
    half_weights: bool = False,
) -> GroupChoice:
    """The smallest group size among ``group_sizes`` at which ``params`` parameters' training
    state plus ``reserve_bytes`` (activations, what is not counted) fit ``device_bytes``."""
    model = ModelFigures(params, activation_fixed=reserve_bytes)

    def total(size: int) -> int:
        return rank_bytes(model, optimizer, Sharding(size, shard_gradients, half_weights), precision).total

    fitting = sorted(size for size in set(group_sizes) if total(size) <= device_bytes)
    chosen = fitting[0] if fitting else None
    # The smallest g that fits: the total never grows with g, so bisect over [1, params].
    needed = None
    if total(max(params, 1)) <= device_bytes:
        low, high = 1, max(params, 1)
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if total(middle) <= device_bytes else (middle + 1, high)
        needed = low
    return GroupChoice(params, chosen, chosen, needed, total(chosen) if chosen is not None else None)


def parse_bytes(text: str) -> int:
    """``80GiB``, ``80 GB``, ``512MiB``, ``1e9`` as bytes (KiB, MiB, GiB, TiB: powers of 1024;
    KB, MB, GB, TB: of 1000). Raises ValueError naming what was expected."""
    match = re.fullmatch(rf"\s*({_NUMBER})\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"memory size {text!r}: expected a number with an optional unit such as 80GiB or 512MB")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_count(text: str) -> int:
    """``7e9``, ``7B``, ``125M``, ``350k`` as a parameter count. Raises ValueError naming what was expected."""
    match = re.fullmatch(rf"\s*({_NUMBER})\s*([a-zA-Z]?)\s*", text)
    suffix = match.group(2).lower() if match else ""
    if match is None or suffix not in _COUNT_SUFFIXES or not float(match.group(1)) >= 1:
        raise ValueError(f"parameter count {text!r}: expected a number >= 1 such as 7e9 or 7B")
    return int(float(match.group(1)) * _COUNT_SUFFIXES[suffix])
