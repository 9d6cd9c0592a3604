"""``PassRunner`` (``workers/step/passes.py``): a step's passes into the flat gradient buffer,
the fixed way. Whatever the passes (fused or one shard each, split by ``max_samples_per_pass``),
the buffer ends holding the sum of each shard's loss-sum gradient over the step's batch size,
and the census slots hold the step's shards, loss sum, samples and weight."""

from __future__ import annotations

import threading

import pytest
import torch

from jobspec.job import JobConfig
from workers.data.sampler import ShardSampler
from workers.model.flat_parameters import FlatParameters
from workers.model.objective import Objective
from workers.runtime.chaos import ChaosSchedule
from workers.step.census import census_slots
from workers.step.passes import PassRunner

SHARDS = 4
BATCH = 8
CPU = torch.device("cpu")


class _Armed:
    """A reducer that only needs arming: ``run_fixed``'s last pass arms it before its backward."""

    def __init__(self) -> None:
        self.armed = 0

    def arm(self) -> None:
        self.armed += 1


def _runner(fuse: bool, max_samples_per_pass: int | None = None) -> tuple[PassRunner, FlatParameters, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    flat = FlatParameters(model.parameters(), extra=census_slots(SHARDS))
    torch.manual_seed(1)
    dataset = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    chaos = ChaosSchedule.for_worker(JobConfig().chaos, 0, threading.Event())
    sampler = ShardSampler(len(dataset), BATCH, SHARDS, 0)
    runner = PassRunner(
        model, flat, sampler, dataset, Objective("mse"), 0, fuse, chaos, CPU, max_samples_per_pass=max_samples_per_pass
    )
    return runner, flat, model


def _by_hand(step: int, shards: list[int]) -> torch.Tensor:
    """The gradient the step's passes must leave: each shard's loss sum, over the batch size."""
    runner, _, model = _runner(fuse=True)
    model.zero_grad()
    for shard in shards:
        inputs, targets = runner.dataset[runner.sampler.shard_indices(step, shard)]
        ((model(inputs) - targets).pow(2).sum() / BATCH).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("fuse, piece", [(True, None), (False, None), (True, 1)], ids=["fused", "a-pass-a-shard", "pieces-of-1"])
def test_the_fixed_passes_leave_the_sum_of_the_shards_gradients_and_the_census(fuse, piece):
    runner, flat, _ = _runner(fuse, piece)
    reducer = _Armed()
    work = runner.run_fixed(3, [0, 2, 3], SHARDS, reducer)  # shard 1 is another rank's
    torch.testing.assert_close(flat.grads, _by_hand(3, [0, 2, 3]), rtol=1e-5, atol=1e-7)
    assert reducer.armed == 1  # once, before the last backward: the bookkeeping rides in its bucket
    assert work.committed == [0, 2, 3] and work.shards_run == 3 and work.total.samples == 6
    assert flat.extra[:SHARDS].tolist() == [1.0, 0.0, 1.0, 1.0]  # the census: one entry per shard run here


def test_a_rank_with_no_shards_this_step_writes_an_empty_census_and_arms_no_pass():
    runner, flat, _ = _runner(fuse=True)
    flat.extra.fill_(7.0)  # a step's bookkeeping must overwrite whatever the slots held
    reducer = _Armed()
    work = runner.run_fixed(0, [], SHARDS, reducer)
    assert reducer.armed == 0 and work.shards_run == 0
    assert not flat.grads.any() and flat.extra[:SHARDS].tolist() == [0.0] * SHARDS
