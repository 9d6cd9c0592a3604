"""The step's shard census: written by each rank before the all-reduce, checked after it.

The census and the step's bookkeeping ride in the flat buffer's extra slots
(``FlatParameters.extra``), summed with the gradient: one slot per shard (1 on the rank that
brings the shard's gradient, 0 elsewhere), then the step's loss sum, sample count and loss
weight. Reduced, the census is the same on every rank and must count every shard exactly once
(docs/architecture.md, "Commit and census"): a rank raises ShardCensusError otherwise, before
its optimizer step, so a wrong sum is never applied (``workers/step/verdict.py`` reads it).
"""

from __future__ import annotations

import torch

from workers.step.records import PassResult

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
