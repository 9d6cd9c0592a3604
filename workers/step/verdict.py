"""A reduced step's verdict, read to the host in one copy.

The host must know a few numbers of each step before it decides what follows: the census
(was every shard counted exactly once? which did nobody bring?), the loss sum, samples and
loss weight, and the mean gradient's norm (skip an fp16 overflow, fail a diverged fp32 or bf16
step, clip). Every read of a device value makes the host wait until the device has computed
it, and a plain PyTorch loop makes no such wait. So the gradient is measured on the device
(``measure_gradient``: its norm and the factor that makes it the clipped mean, no value
read), everything the host needs is read in one copy (``read_verdict``), and the factor is
applied once the verdict allows the step (``GradientMeasure.apply``): one host sync a step
(docs/architecture.md, "Host syncs"). The optimizer, the report and the next step queue
behind it without waiting.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from jobspec.failures import ShardCensusError
from workers.step.census import BOOKKEEPING_SLOTS, LOSS_SLOT, SAMPLES_SLOT, WEIGHT_SLOT

# torch.nn.utils.clip_grad_norm_'s epsilon.
CLIP_EPS = 1e-6


@dataclass(frozen=True)
class GradientUpdate:
    """The reduced gradient made ready for the optimizer: its global L2 norm (of the mean
    gradient, before clipping; inf or nan if it overflowed) and whether it was clipped."""

    grad_norm: float
    clipped: bool = False


@dataclass(frozen=True)
class StepCensus:
    """The reduced census of a step that counted every shard once, and the step's bookkeeping
    summed over the ranks: the loss sum, the samples and the weight normalising the loss."""

    shards_counted: int
    loss_sum: float
    samples: int
    weight: float


@dataclass(frozen=True)
class GradientMeasure:
    """The reduced gradient ``grads``' measure, on its device: ``norm``, the mean gradient's
    L2 norm before clipping (float64, 0-dim; inf or nan if it overflowed), and
    ``coefficient``, what turns the reduced sum into the clipped mean gradient."""

    grads: torch.Tensor
    norm: torch.Tensor
    coefficient: torch.Tensor

    def apply(self) -> None:
        """Make ``grads`` the step's clipped mean gradient, in place."""
        self.grads.mul_(self.coefficient)


def measure_gradient(
    grads: torch.Tensor,
    weight: torch.Tensor,
    scaled_by: float,
    clip: float | None,
    sum_squares: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> GradientMeasure:
    """Measure the reduced ``grads`` (the sum of every shard's loss-sum gradient, times
    ``scaled_by``: the loss scale over the global batch size) on their device, reading nothing:
    their mean over the step's total ``weight`` (a one-entry tensor there) and its norm, and
    the coefficient clipping that mean to global norm ``clip``. The reduced buffer is the same
    on every replica, so are both. ``sum_squares``: where ``grads`` is one slice of the
    gradient (sharded state), it turns this slice's sum of squares (a float64 tensor of one
    entry on the device) into the whole gradient's, the same on every rank (a collective).
    A ``weight`` <= 0 makes both meaningless: ``StepVerdict.update`` refuses such a step."""
    factor = 1.0 / (scaled_by * weight.double().reshape(()))
    squares = torch.linalg.vector_norm(grads).double().square()
    if sum_squares is not None:
        squares = sum_squares(squares.reshape(1)).reshape(())
    norm = squares.sqrt() * factor
    coefficient = factor if clip is None else torch.where(norm > clip, factor * (clip / (norm + CLIP_EPS)), factor)
    return GradientMeasure(grads, norm, coefficient)


@dataclass(frozen=True)
class StepVerdict:
    """A reduced step as the host reads it: the census (``counts``, one per shard), the
    bookkeeping summed over the ranks, the mean gradient's norm, the clip it is held to and
    this rank's own loss weight (for its report)."""

    counts: tuple[float, ...]
    loss_sum: float
    samples: float
    weight: float
    grad_norm: float
    clip: float | None
    local_weight: float

    def missing_shards(self) -> list[int]:
        """The shards nobody brought (the rescue pass runs them), in order; none when some
        shard is counted other than 0 or 1 times: that census is not the rescue's to mend."""
        if any(c not in (0.0, 1.0) for c in self.counts):
            return []
        return [shard for shard, c in enumerate(self.counts) if c == 0.0]

    def census(self, step: int) -> StepCensus:
        """The census of ``step``; raises ShardCensusError unless every shard was counted
        exactly once."""
        bad = {shard: c for shard, c in enumerate(self.counts) if c != 1.0}
        if bad:
            raise ShardCensusError(f"step {step}: shards not committed exactly once: {bad}")
        return StepCensus(len(self.counts), self.loss_sum, int(self.samples), self.weight)

    def update(self) -> GradientUpdate:
        """The gradient's norm and whether it is clipped; raises ValueError (naming ``loss``)
        if the step's loss weights sum to 0 or less."""
        if not self.weight > 0:
            raise ValueError(f"field 'loss': the step's loss weights sum to {self.weight}; expected a total > 0")
        finite = math.isfinite(self.grad_norm)
        return GradientUpdate(self.grad_norm, finite and self.clip is not None and self.grad_norm > self.clip)


def read_verdict(
    extra: torch.Tensor, num_shards: int, measure: GradientMeasure, clip: float | None, local_weight: torch.Tensor | float
) -> StepVerdict:
    """Read a reduced step's bookkeeping (``extra``'s census slots for ``num_shards`` shards),
    ``measure``'s norm and this rank's ``local_weight`` to the host in one copy."""
    slots = num_shards + BOOKKEEPING_SLOTS
    parts = [extra[:slots].double(), measure.norm.reshape(1)]
    if isinstance(local_weight, torch.Tensor):
        parts.append(local_weight.double().reshape(1).to(extra.device))
    values = torch.cat(parts).tolist()  # the step's one read
    bookkeeping = values[num_shards:slots]
    return StepVerdict(
        counts=tuple(values[:num_shards]),
        loss_sum=bookkeeping[LOSS_SLOT],
        samples=bookkeeping[SAMPLES_SLOT],
        weight=bookkeeping[WEIGHT_SLOT],
        grad_norm=values[slots],
        clip=clip,
        local_weight=values[slots + 1] if isinstance(local_weight, torch.Tensor) else float(local_weight),
    )
