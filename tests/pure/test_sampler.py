"""The deterministic sampler: pure, no Ray."""

import numpy as np
import pytest

from policies.assignment import ShardAssignment
from workers.data.sampler import ShardSampler
from workers.data.shuffle import ORDERS


@pytest.fixture(params=sorted(ORDERS))
def shuffle(request: pytest.FixtureRequest) -> str:
    """Each epoch order: every property below holds for each (but shuffling, for 'none')."""
    return request.param


def _step_indices(sampler: ShardSampler, step: int) -> np.ndarray:
    return np.concatenate([sampler.shard_indices(step, s) for s in range(sampler.num_shards)])


def test_every_sample_of_an_epoch_exactly_once(shuffle):
    # 100 samples, batch 10: steps 0-9 are epoch 0, steps 10-19 epoch 1.
    sampler = ShardSampler(num_samples=100, batch_size=10, num_shards=4, seed=3, shuffle=shuffle)
    for epoch in range(2):
        seen = np.concatenate([_step_indices(sampler, t) for t in range(10 * epoch, 10 * epoch + 10)])
        assert sorted(seen.tolist()) == list(range(100))


def test_epochs_are_shuffled_differently_and_by_seed(shuffle):
    if shuffle == "none":
        pytest.skip("'none' keeps the source's own order: every epoch and seed alike")
    sampler = ShardSampler(num_samples=100, batch_size=100, num_shards=4, seed=3, shuffle=shuffle)
    assert not np.array_equal(_step_indices(sampler, 0), _step_indices(sampler, 1))
    other = ShardSampler(num_samples=100, batch_size=100, num_shards=4, seed=4, shuffle=shuffle)
    assert not np.array_equal(_step_indices(sampler, 0), _step_indices(other, 0))


def test_batch_straddling_an_epoch_boundary_stays_exact(shuffle):
    # 7 samples, batch 3: step 2 takes the last sample of epoch 0 and two of epoch 1.
    sampler = ShardSampler(num_samples=7, batch_size=3, num_shards=3, seed=0, shuffle=shuffle)
    stream = np.concatenate([_step_indices(sampler, t) for t in range(7)])  # 21 = 3 epochs
    for epoch in range(3):
        assert sorted(stream[7 * epoch : 7 * epoch + 7].tolist()) == list(range(7))


def test_shards_depend_only_on_seed_step_shard(shuffle):
    """Whoever runs shard s of step t, under any assignment, gets the same samples."""
    sampler = ShardSampler(num_samples=1000, batch_size=64, num_shards=16, seed=11, shuffle=shuffle)
    reference = {(t, s): sampler.shard_indices(t, s) for t in range(5) for s in range(16)}
    for world in (1, 3, 4):
        for assignment in (ShardAssignment.balanced(16, world), ShardAssignment.shuffled(16, world, seed=world)):
            fresh = ShardSampler(num_samples=1000, batch_size=64, num_shards=16, seed=11, shuffle=shuffle)
            for shards in assignment.shards_by_rank:
                for t in reversed(range(5)):  # order of access must not matter either
                    for s in shards:
                        np.testing.assert_array_equal(fresh.shard_indices(t, s), reference[(t, s)])


def test_uneven_shards_differ_by_at_most_one_and_cover_the_batch(shuffle):
    sampler = ShardSampler(num_samples=50, batch_size=10, num_shards=4, seed=0, shuffle=shuffle)
    sizes = [len(sampler.shard_indices(0, s)) for s in range(4)]
    assert sizes == [3, 3, 2, 2]
    assert len(set(_step_indices(sampler, 0).tolist())) == 10


def test_uneven_last_step_takes_what_is_left(shuffle):
    # 2.5 epochs of 40 samples = 100 samples at batch 32: steps of 32, 32, 32, 4.
    sampler = ShardSampler(num_samples=40, batch_size=32, num_shards=8, seed=1, total_samples=100, shuffle=shuffle)
    assert sampler.num_steps == 4
    assert [sampler.step_batch_size(t) for t in range(4)] == [32, 32, 32, 4]
    last = [len(sampler.shard_indices(3, s)) for s in range(8)]
    assert last == [1, 1, 1, 1, 0, 0, 0, 0]
    stream = np.concatenate([_step_indices(sampler, t) for t in range(4)])
    assert len(stream) == 100
    assert sorted(stream[:40].tolist()) == list(range(40))
    assert sorted(stream[40:80].tolist()) == list(range(40))
    with pytest.raises(ValueError, match="past the end"):
        sampler.step_bounds(4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_samples=0, batch_size=4, num_shards=2, seed=0), "empty"),
        (dict(num_samples=10, batch_size=4, num_shards=5, seed=0), "num_shards"),
        (dict(num_samples=10, batch_size=4, num_shards=0, seed=0), "num_shards"),
    ],
)
def test_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ShardSampler(**kwargs)


def test_shard_out_of_range():
    sampler = ShardSampler(num_samples=10, batch_size=4, num_shards=2, seed=0)
    with pytest.raises(ValueError, match="shard must be"):
        sampler.shard_indices(0, 2)


def test_shards_in_any_order_across_an_epoch_boundary_keep_their_samples(shuffle):
    """A pass over shards in shuffled order (``chaos.shuffle_shards``) whose first and last
    shards are in one epoch and a middle one in the next still reads each shard's own samples."""
    sampler = ShardSampler(num_samples=100, batch_size=24, num_shards=12, seed=5, shuffle=shuffle)
    step = 4  # positions 96-119: shards 0-1 in epoch 0, 2-11 in epoch 1
    together = sampler.indices(step, [0, 7, 1])
    alone = np.concatenate([sampler.shard_indices(step, s) for s in (0, 7, 1)])
    np.testing.assert_array_equal(together, alone)
