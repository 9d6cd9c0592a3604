"""Deterministic shards: which samples shard ``s`` of step ``t`` holds depends only on (seed, t, s).

The data is read as one endless stream: epoch ``e`` is a permutation of the dataset seeded by
``(seed, e)`` (``workers/data/shuffle.py``: by default computed per index, O(1) memory), and the
epochs are laid end to end. Step ``t`` takes the next ``batch_size``
positions of that stream (the final step of a job may take fewer, see ``total_samples``), and
cuts them into ``num_shards`` contiguous shards whose sizes differ by at most one. Nothing here
knows how many workers there are or who runs a shard, which is what makes any shard assignment
produce the same gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from workers.data.shuffle import ORDERS, epoch_order


@dataclass(frozen=True)
class ShardSampler:
    """Maps (step, shard) to dataset indices.

    Args:
        num_samples: dataset length (> 0).
        batch_size: global samples per step (> 0).
        num_shards: shards per step, 1 <= num_shards <= batch_size.
        seed: the job seed.
        total_samples: samples the whole job consumes; the last step takes what is left.
            ``None`` means every step is a full batch (no end).
        shuffle: each epoch's order, a name in ``workers.data.shuffle.ORDERS``.
    """

    num_samples: int
    batch_size: int
    num_shards: int
    seed: int
    total_samples: int | None = None
    shuffle: str = "index"

    def __post_init__(self) -> None:
        if self.shuffle not in ORDERS:
            raise ValueError(f"shuffle must be one of {sorted(ORDERS)}, got {self.shuffle!r}")
        if self.num_samples <= 0:
            raise ValueError(f"dataset is empty (num_samples={self.num_samples})")
        if not 1 <= self.num_shards <= self.batch_size:
            raise ValueError(
                f"need 1 <= num_shards <= batch_size, got {self.num_shards} and {self.batch_size}"
            )

    @property
    def num_steps(self) -> int | None:
        if self.total_samples is None:
            return None
        return -(-self.total_samples // self.batch_size)

    def step_bounds(self, step: int) -> tuple[int, int]:
        """Stream positions [start, end) that step ``step`` covers."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        start = step * self.batch_size
        end = start + self.batch_size
        if self.total_samples is not None:
            if start >= self.total_samples:
                raise ValueError(f"step {step} is past the end of the job ({self.num_steps} steps)")
            end = min(end, self.total_samples)
        return start, end

    def step_batch_size(self, step: int) -> int:
        start, end = self.step_bounds(step)
        return end - start

    def shard_bounds(self, step: int, shard: int) -> tuple[int, int]:
        """Stream positions [start, end) of one shard; shards may be empty in a short last step."""
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"shard must be in [0, {self.num_shards}), got {shard}")
        start, end = self.step_bounds(step)
        size, extra = divmod(end - start, self.num_shards)
        lo = start + shard * size + min(shard, extra)
        return lo, lo + size + (1 if shard < extra else 0)

    def shard_indices(self, step: int, shard: int) -> np.ndarray:
        """Dataset indices of shard ``shard`` of step ``step`` (int64, in stream order)."""
        return self.indices(step, [shard])

    def indices(self, step: int, shards: Sequence[int]) -> np.ndarray:
        """The dataset indices of ``shards`` of step ``step`` one after the other: what a pass
        over them reads (one computation for them all)."""
        bounds = [self.shard_bounds(step, shard) for shard in shards]
        positions = np.concatenate([np.arange(lo, hi, dtype=np.int64) for lo, hi in bounds]) if bounds else np.zeros(0, np.int64)
        epochs, offsets = np.divmod(positions, self.num_samples)
        out = np.empty(len(positions), dtype=np.int64)
        # The common case: one epoch (shards may come in any order, so not first against last).
        if len(positions) and epochs.min() == epochs.max():
            return epoch_order(self.shuffle, self.num_samples, self.seed, int(epochs[0])).at(offsets)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = epoch_order(self.shuffle, self.num_samples, self.seed, int(epoch)).at(offsets[mask])
        return out
