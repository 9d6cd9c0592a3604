"""The claimed way's own pass (``StepRunner._own_pass``) against a real TCPStore: what it counts
when a backup takes a claimed shard over before the pass runs it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from policies.work_stealing import ClaimKind, StepPlan
from tests.helpers.runners import linear_runner
from workers.model.objective import Objective, cross_entropy
from workers.step.claims import ShardClaims, open_step
from workers.step.records import StepWork
from workers.step.runner import StepRunner

PLAN = StepPlan(((0,), (1,)), suspects=frozenset({1}))


def test_a_stolen_shard_a_backup_took_over_before_it_ran_counts_as_a_lost_race():
    """Rank 0 steals rank 1's shard; a backup (rank 1's, say) starts on it before rank 0's pass
    runs it, so rank 0 drops it unrun. That shard is a race rank 0 lost: counted in
    ``races_lost``, so that stolen + won - lost still bounds the shards committed away from
    their planned owner (what test_stragglers' counters check)."""
    store = dist.PrefixStore("gen1/", dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))
    open_step(store, 0, PLAN)
    thief, backup = ShardClaims(store, 0, PLAN, me=0), ShardClaims(store, 0, PLAN, me=1)
    assert thief.claim(1) and backup.start_backup(1, owner=0)
    runner, _, _ = linear_runner(torch.device("cpu"), Objective(cross_entropy), runner=StepRunner)
    work = StepWork()
    runner._own_pass(0, [1], thief, work)
    assert thief.states()[1].kind is ClaimKind.RACE
    assert (work.committed, work.shards_run, work.races_lost) == ([], 0, 1)
    assert backup.commit(1, owner=0) and backup.states()[1].owner == 1
