"""The shared helpers: near-equal splits (policies/split.py) and the EWMA (policies/ewma.py)."""

import random

import pytest

from policies.assignment import ShardAssignment
from policies.ewma import ewma
from policies.split import even_bounds, even_counts
from workers.checkpoint.parts import part_range
from workers.comm.ring import chunk_bounds

# The three splits and the three EWMAs as they were before policies/split.py and policies/ewma.py
# replaced them, copied verbatim: the shared versions must give the same results, bit for bit.


def _old_chunk_bounds(length, parts):  # workers/comm/ring.py
    base, extra = divmod(length, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _old_part_range(numel, index, count):  # workers/checkpoint/parts.py
    size, extra = divmod(numel, count)
    lo = index * size + min(index, extra)
    return lo, lo + size + (1 if index < extra else 0)


def _old_even_counts(total, parts):  # policies/assignment.py
    size, extra = divmod(total, parts)
    return [size + (1 if r < extra else 0) for r in range(parts)]


def _old_ewma_checkpoint(current, sample, alpha):  # policies/checkpoint_interval.py
    return sample if current is None else alpha * sample + (1.0 - alpha) * current


def _old_ewma_weighted_old_first(current, sample, alpha):  # policies/rebalance.py, workers/runtime/chaos.py
    return sample if current is None else (1 - alpha) * current + alpha * sample


# A few of each kind, not every pair: nothing (0), fewer than the parts (3, 5), an exact split
# (12, 4), remainders of 1 and of parts - 1 (13, 4; 15, 4), one part, primes, and huge totals.
CASES = [(0, 1), (0, 3), (1, 1), (3, 5), (7, 1), (12, 4), (13, 4), (15, 4), (37, 11), (39, 7),
         (10**9 + 7, 13), (2**40, 7), (5, 1000)]


@pytest.mark.parametrize("total, parts", CASES)
def test_splits_equal_all_three_previous_ones(total, parts):
    counts, bounds = even_counts(total, parts), even_bounds(total, parts)
    assert counts == _old_even_counts(total, parts)
    assert bounds == _old_chunk_bounds(total, parts) == chunk_bounds(total, parts)
    assert bounds == [_old_part_range(total, i, parts) for i in range(parts)]
    assert bounds == [part_range(total, i, parts) for i in range(parts)]
    assert [hi - lo for lo, hi in bounds] == counts


@pytest.mark.parametrize("total, parts", CASES)
def test_bounds_tile_the_range_with_the_remainder_first(total, parts):
    counts = even_counts(total, parts)
    assert sum(counts) == total and max(counts) - min(counts) <= 1
    extra = total % parts
    assert counts == [total // parts + 1] * extra + [total // parts] * (parts - extra)
    bounds = even_bounds(total, parts)
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_more_parts_than_total_leaves_empty_parts_at_the_end():
    assert even_counts(3, 5) == [1, 1, 1, 0, 0]
    assert even_bounds(3, 5) == [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3)]


def test_zero_total_gives_empty_parts():
    assert even_counts(0, 3) == [0, 0, 0]
    assert even_bounds(0, 3) == [(0, 0)] * 3


def test_remainder_goes_to_the_first_parts():
    assert even_counts(10, 4) == [3, 3, 2, 2]
    assert even_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert ShardAssignment.balanced(10, 4).shards_by_rank == ((0, 1, 2), (3, 4, 5), (6, 7), (8, 9))


@pytest.mark.parametrize("parts", [0, -1])
def test_split_needs_a_part(parts):
    for split in (even_counts, even_bounds, chunk_bounds):
        with pytest.raises(ValueError, match=f"at least one part, got {parts}"):
            split(5, parts)
    with pytest.raises(ValueError, match="at least one part"):
        ShardAssignment.balanced(5, parts)


def test_split_refuses_a_negative_total():
    for split in (even_counts, even_bounds):
        with pytest.raises(ValueError, match="negative total, got -1"):
            split(-1, 2)


@pytest.mark.parametrize("index", [-1, 3])
def test_part_range_refuses_a_part_that_does_not_exist(index):
    with pytest.raises(IndexError, match=f"part {index} of 3"):
        part_range(10, index, 3)


def test_ewma_first_sample_stands_alone():
    assert ewma(None, 2.5, 0.3) == 2.5
    assert ewma(None, 0.0, 1.0) == 0.0


def test_ewma_weights_the_newest_sample_by_alpha():
    assert ewma(10.0, 20.0, 0.25) == 12.5
    assert ewma(10.0, 20.0, 1.0) == 20.0  # alpha 1: only the latest counts


def test_ewma_equals_the_previous_ones_bit_for_bit():
    rng = random.Random(12)
    for _ in range(5000):
        current = None if rng.random() < 0.1 else rng.uniform(0, 1e3) * 10 ** rng.randint(-9, 3)
        sample = rng.uniform(0, 1e3) * 10 ** rng.randint(-9, 3)
        alpha = rng.choice([0.2, 0.3, 0.5, 1.0, rng.uniform(1e-6, 1.0)])
        new = ewma(current, sample, alpha)
        assert new == _old_ewma_checkpoint(current, sample, alpha) == _old_ewma_weighted_old_first(current, sample, alpha)


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5, float("nan")])
def test_ewma_refuses_an_alpha_outside_0_1(alpha):
    with pytest.raises(ValueError, match="alpha must be in"):
        ewma(1.0, 2.0, alpha)

