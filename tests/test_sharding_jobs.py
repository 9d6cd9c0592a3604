"""Sharded optimizer state in whole jobs on Ray: clean runs with and without replicas, a worker
killed mid-step (its slice healed from its replica), growth that re-plans the groups (state
resharded in memory), and checkpoints written sharded and resumed on other layouts; each ends
with the parameters of the clean single-worker run, every shard committed once."""

from __future__ import annotations

import pytest

from tests.helpers.jobs import assert_same_params, jsonl, params, run

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.mark.parametrize(("workers", "group_size"), [(4, 2), (3, 3)], ids=["replicas-2", "replicas-1"])
def test_a_sharded_run_equals_the_single_worker_run(tmp_path, reference, workers, group_size):
    result = run(tmp_path, "sharded", f"scaling.workers={workers}", f"sharding.group_size={group_size}")
    assert_same_params(params(result.run_dir), reference, f"{workers} workers in groups of {group_size}")


def test_a_sharded_rank_killed_mid_step_is_healed_from_its_replica(tmp_path, reference):
    result = run(
        tmp_path, "healed", "scaling.workers=4", "sharding.group_size=2", "collective.overlap=false",
        "chaos.kill=[{at_step: 5, worker: 1, how: sigkill}]",
        # A pause after the kill, so the replacement has loaded and joins before the end.
        "chaos.stall=[{worker: 0, at_step: 12, seconds: 15, during: compute}]",
    )
    summary = result.summary
    assert summary["events"]["failures"] == 1 and summary["events"]["recoveries"] == 1
    assert summary["workers"] == {"start": 4, "end": 4} and summary["events"]["joins"] == 1
    assert_same_params(params(result.run_dir), reference, "healed")


def test_growth_regroups_and_reshards_the_state_in_memory(tmp_path, reference):
    # 2 workers in one group of 2, then 3 in one group of 3: every slice moves.
    result = run(
        tmp_path, "grown", "scaling.workers=2", "scaling.max_workers=3", "sharding.group_size=2",
        "chaos.stall=[{worker: 0, at_step: 3, seconds: 15, during: compute}, {worker: 1, at_step: 3, seconds: 15, during: compute}]",
    )
    assert result.summary["workers"] == {"start": 2, "end": 3} and result.summary["events"]["joins"] == 1
    (grow,) = [e for e in jsonl(result.run_dir / "events.jsonl") if e["event"] == "grow"]
    assert grow["joined"] == [2]
    assert_same_params(params(result.run_dir), reference, "grown")


def test_a_sharded_checkpoint_resumes_in_other_groups_and_unsharded(tmp_path, reference):
    # Written by the first group's owners (its slices: 3 parts in one group of 3, then 2 parts
    # from 4 workers in groups of 2), resumed in other groups, then unsharded: the checkpoint's
    # state is one flat layout whoever wrote it.
    first = run(tmp_path, "run", "steps=8", "scaling.workers=3", "sharding.group_size=3", "checkpoint.every_steps=4")
    checkpoints = [e for e in jsonl(first.run_dir / "events.jsonl") if e["event"] == "checkpoint"]
    assert [e["step"] for e in checkpoints] == [4, 8]
    regrouped = run(tmp_path, "run", "steps=16", "scaling.workers=4", "sharding.group_size=2", "checkpoint.every_steps=4")
    assert regrouped.summary["workers"]["start"] == 4
    unsharded = run(tmp_path, "run", "steps=25", "scaling.workers=2", "checkpoint.every_steps=4")
    resumes = [e["checkpoint"] for e in jsonl(unsharded.run_dir / "events.jsonl") if e["event"] == "resume"]
    assert resumes[-2:] == ["step-00000008", "step-00000016"]
    assert_same_params(params(unsharded.run_dir), reference, "sharded, regrouped, then unsharded")
