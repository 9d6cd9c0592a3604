"""The step's shard census: written by each rank before the all-reduce, checked after it.

The census and the step's bookkeeping ride in the flat buffer's extra slots
(``FlatParameters.extra``), summed with the gradient: one slot per shard (1 on the rank that
brings the shard's gradient, 0 elsewhere), then the step's loss sum, sample count and loss
weight. Reduced, the census is the same on every rank and must count every shard exactly once
(docs/architecture.md, "Commit and census"): a rank raises ShardCensusError otherwise, before
its optimizer step, so a wrong sum is never applied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jobspec.failures import ShardCensusError
from workers.step_work import PassResult

#: Where the step's bookkeeping sits after the census in the buffer's extra slots.
LOSS_SLOT, SAMPLES_SLOT, WEIGHT_SLOT = 0, 1, 2
BOOKKEEPING_SLOTS = 3


def census_slots(num_shards: int) -> int:
    """The extra slots a step of ``num_shards`` shards needs in front of the gradient."""
    return num_shards + BOOKKEEPING_SLOTS


def write_census(extra: torch.Tensor, num_shards: int, committed: list[int], total: PassResult) -> None:
    """Write this rank's census (1 for each shard in ``committed``) and its ``total`` loss sum,
    sample count and weight into ``extra``, the buffer's slots in front of the gradient."""
    # Built on the host (pinned for a device) and copied without waiting: indexing a device
    # tensor with a host list copies the index over synchronously, a host sync every step.
    census = torch.zeros(num_shards, dtype=extra.dtype, pin_memory=extra.is_cuda)
    if committed:
        census[committed] = 1.0
    extra[:num_shards].copy_(census, non_blocking=True)
    extra[num_shards + LOSS_SLOT] = total.loss
    extra[num_shards + SAMPLES_SLOT] = total.samples
    extra[num_shards + WEIGHT_SLOT] = total.weight


def missing_shards(extra: torch.Tensor, num_shards: int) -> list[int]:
    """The shards the reduced census shows nobody brought (the rescue pass runs them), in
    order; none when it counts some shard more than once: that census is not the rescue's to
    mend."""
    counts = extra[:num_shards]
    if not bool(torch.all((counts == 0) | (counts == 1))):
        return []
    return torch.nonzero(counts == 0).flatten().tolist()


@dataclass(frozen=True)
class StepCensus:
    """The reduced census of a step that counted every shard once, and the step's bookkeeping
    summed over the ranks: the loss sum, the samples and the weight normalising the loss."""

    shards_counted: int
    loss_sum: float
    samples: int
    weight: float


def check_census(extra: torch.Tensor, num_shards: int, step: int) -> StepCensus:
    """Read the reduced ``extra`` slots of ``step``. Raises ShardCensusError unless every one of
    the ``num_shards`` shards was counted exactly once."""
    extra = extra.cpu()
    counts = extra[:num_shards]
    if not torch.all(counts == 1):
        bad = {i: float(c) for i, c in enumerate(counts.tolist()) if c != 1}
        raise ShardCensusError(f"step {step}: shards not committed exactly once: {bad}")
    loss_sum, samples, weight = (float(extra[num_shards + slot]) for slot in (LOSS_SLOT, SAMPLES_SLOT, WEIGHT_SLOT))
    return StepCensus(int(counts.sum().item()), loss_sum, int(samples), weight)
