"""The sharding layout and the resharding plan (policies/sharding.py): pure, no torch."""

from __future__ import annotations

import itertools

import pytest

from policies.sharding import LostState, Move, ShardingLayout, effective_group_size, plan_moves


@pytest.mark.parametrize(
    ("world", "configured", "expected"),
    [(4, 2, 2), (4, 4, 4), (6, 4, 6), (7, 4, 7), (8, 4, 4), (3, 2, 3), (2, 4, 2), (5, 1, 1), (1, 3, 1), (9, 2, 3)],
)
def test_effective_group_size_is_the_smallest_divisor_at_least_the_asked_size(world, configured, expected):
    assert effective_group_size(world, configured) == expected


def test_layout_groups_peers_and_slices():
    layout = ShardingLayout.plan(world=6, configured=3, numel=10)
    assert (layout.group_size, layout.replicas) == (3, 2)
    assert layout.group(4) == [3, 4, 5]
    assert layout.peers(4) == [1, 4]
    assert layout.slices() == [(0, 4), (4, 7), (7, 10)]
    assert [layout.slice_of(r) for r in range(6)] == [(0, 4), (4, 7), (7, 10)] * 2
    with pytest.raises(ValueError, match="does not divide"):
        ShardingLayout(world=6, group_size=4, numel=10)


def _apply(held, wanted, moves, numel):
    """Run the moves on per-rank dicts entry -> source rank; check every wanted entry arrives once."""
    have = [{i: rank for span in spans for i in range(*span)} for rank, spans in enumerate(held)]
    got = [{i: have[r][i] for i in range(*wanted[r]) if i in have[r]} for r in range(len(wanted))]
    for move in moves:
        for i in range(move.lo, move.hi):
            assert i in have[move.source], f"{move} sends entry {i} its source does not hold"
            assert i not in got[move.target], f"entry {i} reaches rank {move.target} twice"
            got[move.target][i] = move.source
    for rank, (lo, hi) in enumerate(wanted):
        assert sorted(got[rank]) == list(range(lo, hi)), f"rank {rank} misses entries"


@pytest.mark.parametrize(("old_world", "old_g", "new_world", "new_g"), [(4, 2, 3, 3), (2, 2, 4, 4), (4, 4, 2, 2), (4, 2, 4, 2), (6, 3, 4, 2), (4, 1, 4, 4)])
def test_every_wanted_byte_moves_once_from_a_holder(old_world, old_g, new_world, new_g):
    numel = 37
    old = ShardingLayout(old_world, old_g, numel)
    new = ShardingLayout(new_world, new_g, numel)
    ranks = max(old_world, new_world)  # ranks past the new world hold state but want none
    held = [(old.slice_of(r),) if r < old_world else () for r in range(ranks)]
    wanted = [new.slice_of(r) if r < new_world else (0, 0) for r in range(ranks)]
    moves = plan_moves(held, wanted)
    _apply(held, wanted, moves, numel)
    assert moves == sorted(moves, key=lambda m: (m.source, m.target, m.lo))
    # Nothing moves that the target already held.
    for move in moves:
        assert all(move.hi <= lo or move.lo >= hi for lo, hi in held[move.target])


def test_a_replacement_takes_its_slice_from_the_dead_ranks_replica():
    layout = ShardingLayout(4, 2, 10)  # groups [0, 1] and [2, 3]; rank 1 died, its replacement holds nothing
    held = [(layout.slice_of(0),), (), (layout.slice_of(2),), (layout.slice_of(3),)]
    assert plan_moves(held, [layout.slice_of(r) for r in range(4)]) == [Move(3, 1, 5, 10)]


def test_the_same_layout_moves_nothing_and_a_full_holder_feeds_everyone():
    layout = ShardingLayout(3, 3, 9)
    wanted = [layout.slice_of(r) for r in range(3)]
    assert plan_moves([(span,) for span in wanted], wanted) == []
    assert plan_moves([((0, 9),), (), ()], wanted) == [Move(0, 1, 3, 6), Move(0, 2, 6, 9)]


def test_sources_are_balanced_across_holders_of_the_same_entries():
    held = [((0, 8),), ((0, 8),), (), ()]
    moves = plan_moves(held, [(0, 2), (2, 4), (4, 6), (6, 8)])
    sent = {rank: sum(m.hi - m.lo for m in moves if m.source == rank) for rank in (0, 1)}
    assert sent == {0: 2, 1: 2}


def test_state_nobody_holds_is_named():
    with pytest.raises(LostState, match=r"\[5, 10\)") as lost:
        plan_moves([((0, 5),), ()], [(0, 5), (5, 10)])
    assert lost.value.span == (5, 10)


def test_all_small_reshards_are_complete():
    numel = 11
    for old_world, new_world in itertools.product(range(1, 5), range(1, 5)):
        for old_g, new_g in itertools.product(range(1, old_world + 1), range(1, new_world + 1)):
            if old_world % old_g or new_world % new_g:
                continue
            old, new = ShardingLayout(old_world, old_g, numel), ShardingLayout(new_world, new_g, numel)
            held = [(old.slice_of(r),) if r < old_world else () for r in range(max(old_world, new_world))]
            wanted = [new.slice_of(r) for r in range(new_world)] + [(0, 0)] * (len(held) - new_world)
            _apply(held, wanted, plan_moves(held, wanted), numel)


def test_a_rank_holding_its_old_and_new_slices_sends_each_move_from_one_of_them():
    """After a regroup that was not confirmed a rank holds two slices (its old one, kept, and
    its new one): both are sources, a piece it already holds in either does not move, and no
    move runs across the boundary of two spans of its source (each is sent from one tensor)."""
    held = [((0, 4), (4, 8)), (), ((8, 12),)]  # rank 0: old (0, 4) kept beside its new (4, 8)
    wanted = [(0, 6), (6, 12), (0, 0)]
    moves = plan_moves(held, wanted)
    _apply(held, wanted, moves, 12)
    assert moves == [Move(0, 1, 6, 8), Move(2, 1, 8, 12)]
    both = plan_moves([((0, 4), (4, 8)), ()], [(0, 0), (2, 6)])
    assert both == [Move(0, 1, 2, 4), Move(0, 1, 4, 6)]  # adjacent, but from two spans: not merged


def test_first_gap_names_the_first_range_nobody_covers():
    from policies.sharding import first_gap

    assert first_gap([(0, 5), (5, 10)], 10) is None
    assert first_gap([(5, 10), (0, 6)], 10) is None
    assert first_gap([(0, 4), (6, 10)], 10) == (4, 6)
    assert first_gap([(2, 10)], 10) == (0, 2)
    assert first_gap([(0, 7)], 10) == (7, 10)
    assert first_gap([], 10) == (0, 10)


def test_slices_are_kept_while_some_peer_of_every_position_stays():
    from policies.sharding import slices_kept

    assert slices_kept(4, 2, [1])  # groups [0, 1] and [2, 3]: rank 3 still holds slice 1
    assert not slices_kept(4, 2, [1, 3])
    assert slices_kept(4, 2, [0, 3])
    assert not slices_kept(2, 2, [1])  # one group: no replica
    assert not slices_kept(3, 2, [0])  # 3 workers asking 2 form one group of 3
    assert slices_kept(4, 1, [0, 1, 2])  # unsharded: every rank holds everything
