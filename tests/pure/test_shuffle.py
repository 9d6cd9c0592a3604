"""An epoch's order (``workers/data/shuffle.py``): a bijection, a pure function of (seed, epoch,
position), spread like a random permutation, and O(1) in memory for ``index``."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from workers.data.sampler import ShardSampler
from workers.data import shuffle
from workers.data.shuffle import ORDERS, IndexShuffle


@pytest.mark.parametrize("name", sorted(ORDERS))
@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 17, 1000, 4097])
def test_every_order_is_a_permutation_of_the_dataset(name, n):
    order = ORDERS[name](n, 5, 2).at(np.arange(n, dtype=np.int64))
    assert order.dtype == np.int64 and sorted(order.tolist()) == list(range(n))


def test_an_index_is_the_same_whatever_else_is_asked_with_it():
    """Each position on its own, in any order and any company: what makes a worker's shards
    computable without anyone else's."""
    n = 10_007
    whole = IndexShuffle(n, 3, 1).at(np.arange(n, dtype=np.int64))
    picked = np.random.default_rng(0).choice(n, 500, replace=False)
    assert np.array_equal(IndexShuffle(n, 3, 1).at(picked), whole[picked])
    assert [int(IndexShuffle(n, 3, 1).at(np.array([p]))[0]) for p in picked[:20]] == whole[picked[:20]].tolist()


def test_seeds_and_epochs_give_other_orders():
    n = 1000
    base = IndexShuffle(n, 3, 0).at(np.arange(n))
    for other in (IndexShuffle(n, 3, 1), IndexShuffle(n, 4, 0), IndexShuffle(n, 0, 3)):
        assert np.mean(other.at(np.arange(n)) == base) < 0.02  # a random pair agrees at ~1/n


def test_index_orders_spread_like_random_permutations():
    """Where position 0 lands, over 4000 seeds, is uniform over 10 samples (chi-square, 9 degrees
    of freedom: 27.9 is its 0.1% tail); across 100k samples neither a position and its sample
    nor neighbouring samples are correlated (|r| ~ 1/sqrt(n) = 0.003 for a random permutation)."""
    firsts = np.array([IndexShuffle(10, seed, 0).at(np.array([0]))[0] for seed in range(4000)])
    counts = np.bincount(firsts, minlength=10)
    assert ((counts - 400) ** 2 / 400).sum() < 27.9, counts
    n = 100_000
    order = IndexShuffle(n, 7, 0).at(np.arange(n)).astype(float)
    assert abs(np.corrcoef(np.arange(n), order)[0, 1]) < 0.02
    assert abs(np.corrcoef(order[:-1], order[1:])[0, 1]) < 0.02
    # The control: an order that is not shuffled at all fails the same check.
    assert abs(np.corrcoef(np.arange(n), np.arange(n))[0, 1]) > 0.02


def _peak_bytes(sampler: ShardSampler) -> int:
    """The most memory (Python and numpy allocations) one shard's indices take to compute."""
    tracemalloc.start()
    try:
        sampler.shard_indices(3, 1)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_dataset_of_ten_billion_samples_costs_no_more_memory_than_one_of_a_thousand():
    small = _peak_bytes(ShardSampler(10**3, 256, 8, seed=1))
    huge = _peak_bytes(ShardSampler(10**10, 256, 8, seed=1))
    assert huge <= max(2 * small, small + 4096), (small, huge)
    # The control: whole-epoch permutations grow with the dataset (8 bytes a sample; 80 GB at
    # 10^10, so measured at 10^6).
    shuffle.epoch_order.cache_clear()
    whole = _peak_bytes(ShardSampler(10**6, 256, 8, seed=1, shuffle="permutation"))
    assert whole > 8 * 10**6, whole


def test_an_unknown_shuffle_is_refused():
    with pytest.raises(ValueError, match="shuffle must be one of"):
        ShardSampler(10, 4, 2, 0, shuffle="random")
    with pytest.raises(ValueError, match="need 1 <= n"):
        IndexShuffle(0, 0, 0)
