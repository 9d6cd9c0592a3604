"""``PassRunner`` (``workers/step/passes.py``): a step's passes into the flat gradient buffer,
the fixed way. Whatever the passes (fused or one shard each, split by ``max_samples_per_pass``),
the buffer ends holding the sum of each shard's loss-sum gradient over the step's batch size,
and the census slots hold the step's shards, loss sum, samples and weight."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.jobs import Reference, Yardstick, assert_control_differs, assert_same_params
from tests.helpers.runners import ArmedReducer, linear_runner
from workers.model.flat_parameters import FlatParameters
from workers.model.objective import Objective
from workers.step.passes import PassRunner

SHARDS = 4
BATCH = 8
CPU = torch.device("cpu")


def _runner(fuse: bool, max_samples_per_pass: int | None = None) -> tuple[PassRunner, FlatParameters, torch.nn.Module]:
    return linear_runner(
        CPU, Objective("mse"), shards=SHARDS, samples=32, batch_size=BATCH, fuse_shards=fuse,
        max_samples_per_pass=max_samples_per_pass, runner=PassRunner,
    )


def _by_hand(step: int, shards: list[int]) -> dict[str, torch.Tensor]:
    """The gradient the step's passes must leave, one backward per shard in ``shards``' order:
    each shard's loss sum, over the batch size."""
    runner, _, model = _runner(fuse=True)
    model.zero_grad()
    for shard in shards:
        inputs, targets = runner.dataset[runner.sampler.shard_indices(step, shard)]
        ((model(inputs) - targets).pow(2).sum() / BATCH).backward()
    return {"grad": torch.cat([p.grad.reshape(-1) for p in model.parameters()])}


def _reference(step: int, shards: list[int]) -> Reference:
    """``_by_hand`` with its yardstick on this machine: the same shards summed in reverse order."""
    want = _by_hand(step, shards)
    return Reference(want, Yardstick.measure(want, _by_hand(step, shards[::-1]), "the shards summed in reverse"))


@pytest.mark.parametrize("fuse, piece", [(True, None), (False, None), (True, 1)], ids=["fused", "a-pass-a-shard", "pieces-of-1"])
def test_the_fixed_passes_leave_the_sum_of_the_shards_gradients_and_the_census(fuse, piece):
    runner, flat, _ = _runner(fuse, piece)
    reducer = ArmedReducer()
    work = runner.run_fixed(3, [0, 2, 3], SHARDS, reducer)  # shard 1 is another rank's
    want = _reference(3, [0, 2, 3])
    assert_same_params({"grad": flat.grads}, want, f"passes {fuse=} {piece=}")
    assert_control_differs(_by_hand(3, [0, 2]), want, "a dropped shard")
    assert reducer.armed == 1  # once, before the last backward: the bookkeeping rides in its bucket
    assert work.committed == [0, 2, 3] and work.shards_run == 3 and work.total.samples == 6
    assert flat.extra[:SHARDS].tolist() == [1.0, 0.0, 1.0, 1.0]  # the census: one entry per shard run here


def test_a_rank_with_no_shards_this_step_writes_an_empty_census_and_arms_no_pass():
    runner, flat, _ = _runner(fuse=True)
    flat.extra.fill_(7.0)  # a step's bookkeeping must overwrite whatever the slots held
    reducer = ArmedReducer()
    work = runner.run_fixed(0, [], SHARDS, reducer)
    assert reducer.armed == 0 and work.shards_run == 0
    assert not flat.grads.any() and flat.extra[:SHARDS].tolist() == [0.0] * SHARDS


class _CountingReads(torch.utils.data.Dataset):
    """A dataset that records each index read, on whichever thread reads it."""

    def __init__(self, inner: torch.utils.data.Dataset) -> None:
        self.inner, self.read = inner, []

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        self.read.append(int(index))
        return self.inner[index]


def test_each_steps_first_batch_is_read_once_ahead_during_the_step_before():
    """The fixed way over steps 0-3 with the same shards: step t's batch is read while step t-1
    runs (``BatchPrefetch.read_ahead``) and taken, never read twice; step 4's is read ahead too.
    A step whose shards changed reads its own, dropping the read ahead."""
    runner, flat, _ = _runner(fuse=True)
    counting = runner.dataset = _CountingReads(runner.dataset)
    mine = [0, 2]
    for step in range(4):
        flat.zero()
        work = runner.run_fixed(step, mine, SHARDS, ArmedReducer())
        assert work.committed == mine
    runner.prefetch.wait(lambda: False)
    runner.prefetch._ahead.result(timeout=5)  # noqa: SLF001 - the read ahead of step 4, done
    wanted = [int(i) for step in range(5) for i in runner._indices(step, mine)]  # noqa: SLF001
    assert sorted(counting.read) == sorted(wanted)  # steps 0-4, each sample once per step it is in
    counting.read.clear()
    runner.run_fixed(5, [1], SHARDS, ArmedReducer())  # other shards: read for this step, not taken ahead
    runner.prefetch._ahead.result(timeout=5)  # noqa: SLF001
    assert sorted(counting.read) == sorted(int(i) for s in (5, 6) for i in runner._indices(s, [1]))  # noqa: SLF001
