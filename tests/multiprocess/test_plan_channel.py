"""Published plans (``workers/step/published_plans.py``): rank 0's batches to its followers and their
reports back, over real gloo process groups in processes and over a process group with NCCL's
semantics (``tests/helpers/nccl_fake_group.py``: posting-order matching, lazy blocking
communicators, ``wait()`` that only orders streams)."""

from __future__ import annotations

import pickle
import threading
import time

import pytest
import torch

from jobspec.failures import CollectiveAborted
from jobspec.wire import SnapshotOrder
from policies.work_stealing import StepPlan
from tests.helpers.nccl_fake_group import FakeNcclWorld, FakeProcessGroupNCCL, fake_options, on_ranks
from tests.helpers.ranks import comm_group, run_ranks
from workers.comm.comm_group import CommGroup
from workers.step.published_plans import PlanChannel, compact_plans, expand_plans

TIMEOUT_S = 8.0


def _plans(size: int, first: int, count: int) -> list[StepPlan]:
    """``count`` plans for ``size`` ranks: contiguous blocks of uneven sizes, then one with the
    shards shuffled (no blocks) and one with a suspect."""
    plans = []
    for step in range(first, first + count):
        blocks, start = [], 0
        for rank in range(size):
            width = 1 + (rank + step) % 3
            blocks.append(tuple(range(start, start + width)))
            start += width
        plans.append(StepPlan(tuple(blocks), expected_shard_s=0.01 * step))
    shuffled = tuple(tuple(reversed(b)) for b in reversed(plans[0].shards_by_rank))
    return plans + [StepPlan(shuffled, suspects=frozenset({size - 1}), steal=False)]


def test_compact_plans_carry_block_counts_and_expand_to_the_same_plans():
    plans = _plans(4, 0, 3)
    compact = compact_plans(plans)
    assert [kind for kind, _, _ in compact] == ["counts"] * 3 + ["shards"]
    assert compact[0][1] == (1, 2, 3, 1)  # the block sizes, not the shard numbers
    assert expand_plans(compact) == plans
    # A plan whose blocks are contiguous but not in rank order is not counts.
    swapped = StepPlan(((2, 3), (0, 1)))
    assert compact_plans([swapped])[0][0] == "shards" and expand_plans(compact_plans([swapped])) == [swapped]


ORDER = SnapshotOrder(3, "/checkpoints", "step-00000003", "abc-a1", 2)


def _lead_and_follow(channel: PlanChannel, rank: int, size: int) -> list[object]:
    """Rank 0 publishes two batches (the second with a checkpoint inside) then ends the run;
    every rank answers each batch with a payload of its own length; returns what each rank saw."""
    seen: list[object] = []
    if rank == 0:
        for first, count in ((0, 2), (2, 1)):
            channel.publish(first, _plans(size, first, count), ORDER if first == 2 else None)
            seen.append(channel.gather(b"r0" * (first + 1)))
        channel.end()
        return seen
    while (batch := channel.receive()) is not None:
        first, plans, snapshot = batch
        seen.append((first, plans, snapshot))
        assert channel.gather(bytes([rank]) * (rank + first)) is None
    return seen


def _check(seen: list[list[object]], size: int) -> None:
    for rank in range(1, size):
        assert seen[rank] == [(0, _plans(size, 0, 2), None), (2, _plans(size, 2, 1), ORDER)]
    assert seen[0] == [
        [b"r0" * (first + 1)] + [bytes([rank]) * (rank + first) for rank in range(1, size)] for first in (0, 2)
    ]


def _nccl_groups(size: int, timeout_s: float = TIMEOUT_S) -> list[CommGroup]:
    world = FakeNcclWorld(size)
    return [
        CommGroup(FakeProcessGroupNCCL(world, r, size, fake_options(timeout_s)), r, size, timeout_s, threading.Event(), True)
        for r in range(size)
    ]


@pytest.mark.parametrize("size", [1, 2, 4])
def test_batches_and_reports_cross_the_group_under_nccl_semantics(size):
    groups = _nccl_groups(size)
    seen = on_ranks(size, lambda rank: _lead_and_follow(PlanChannel(groups[rank], torch.device("cpu")), rank, size))
    errors = [s for s in seen if isinstance(s, BaseException)]
    assert not errors, errors
    if size == 1:
        assert seen[0] == [[b"r0"], [b"r0" * 3]]
    else:
        _check(seen, size)


def _gloo_ranks(rank: int, world: int, port: int, results: dict) -> None:
    group = comm_group(rank, world, port, timeout_s=30.0)
    try:
        results[rank] = pickle.dumps(_lead_and_follow(PlanChannel(group, torch.device("cpu")), rank, world))
    finally:
        group.close()


def test_batches_and_reports_cross_a_gloo_group():
    results = run_ranks(_gloo_ranks, 3)
    _check([pickle.loads(results[rank]) for rank in range(3)], 3)


def test_a_follower_waiting_for_a_batch_is_freed_by_the_abort():
    groups = _nccl_groups(2, timeout_s=30.0)
    follower = groups[1]
    threading.Timer(0.3, follower.abort_flag.set).start()
    started = time.perf_counter()
    with pytest.raises(CollectiveAborted):
        PlanChannel(follower, torch.device("cpu")).receive()  # rank 0 never publishes
    assert time.perf_counter() - started < 2.0
    for group in groups:
        group.close()
