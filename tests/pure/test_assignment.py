"""Shard assignment policy: pure, no Ray or torch."""

import pytest

from policies.assignment import ShardAssignment


def _flat(a: ShardAssignment) -> list[int]:
    return sorted(s for shards in a.shards_by_rank for s in shards)


@pytest.mark.parametrize("shards, world", [(16, 1), (16, 3), (16, 4), (5, 5), (7, 2)])
def test_balanced_covers_each_shard_once_with_counts_within_one(shards, world):
    a = ShardAssignment.balanced(shards, world)
    assert _flat(a) == list(range(shards))
    counts = [len(s) for s in a.shards_by_rank]
    assert max(counts) - min(counts) <= 1
    assert a.world_size == world and a.num_shards == shards


def test_shuffled_is_seeded_uneven_and_complete():
    a = ShardAssignment.shuffled(16, 4, seed=5)
    assert a == ShardAssignment.shuffled(16, 4, seed=5)
    assert a != ShardAssignment.shuffled(16, 4, seed=6)
    assert _flat(a) == list(range(16))
    counts = {len(s) for s in ShardAssignment.shuffled(16, 4, seed=1).shards_by_rank}
    assert len(counts) > 1  # uneven for this seed


def test_from_counts_allows_idle_ranks():
    a = ShardAssignment.from_counts([0, 3, 1])
    assert a.shards_by_rank == ((), (0, 1, 2), (3,))


@pytest.mark.parametrize("blocks", [((0, 1), (1,)), ((0, 2),), ()])
def test_rejects_assignments_that_lose_or_repeat_shards(blocks):
    with pytest.raises(ValueError):
        ShardAssignment(blocks)


def test_rejects_negative_counts():
    with pytest.raises(ValueError):
        ShardAssignment.from_counts([2, -1])
