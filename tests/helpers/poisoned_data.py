"""A dataset with one poisoned sample: the step that takes it has a non-finite loss (and
gradient), the steps before it are fine. For failures at a chosen step of a real run."""

from __future__ import annotations

import torch

from workers.data.sampler import ShardSampler


def poisoned_index(n: int, batch_size: int, shards: int, step: int, seed: int = 0) -> int:
    """A sample that step ``step`` of a job over ``n`` samples takes (and, while the first
    epoch lasts, no other step)."""
    assert (step + 1) * batch_size <= n, "the step must be in the first epoch"
    return int(ShardSampler(n, batch_size, shards, seed).shard_indices(step, 0)[0])


def make_poisoned_dataset(n: int, poisoned: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    """Regression data (8 inputs, 2 targets; ``tests.helpers.losses:make_regressor``) whose
    sample ``poisoned`` holds a nan."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(n, 8, generator=generator)
    inputs[poisoned, 0] = float("nan")
    return torch.utils.data.TensorDataset(inputs, torch.randn(n, 2, generator=generator))
