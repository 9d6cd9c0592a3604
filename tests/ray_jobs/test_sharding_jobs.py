"""Sharded optimizer state in whole jobs on Ray: clean runs with and without replicas, a worker
killed mid-step (its slice healed from its replica), two deaths that re-plan the groups and
growth back (state resharded in memory), stragglers, checkpoints written sharded and resumed
on other layouts, and a slice without a replica rolled back to a checkpoint; each ends with the
parameters of the clean single-worker run, every shard committed once."""

from __future__ import annotations

import pytest

from jobspec.step_record import read_telemetry
from tests.helpers.jobs import assert_same_params, jsonl, params, run

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.mark.parametrize(("workers", "group_size"), [(4, 2), (3, 3)], ids=["replicas-2", "replicas-1"])
def test_a_sharded_run_equals_the_single_worker_run(tmp_path, reference, workers, group_size):
    result = run(tmp_path, "sharded", f"scaling.workers={workers}", f"sharding.group_size={group_size}")
    assert_same_params(params(result.run_dir), reference, f"{workers} workers in groups of {group_size}")


def test_stealing_backups_rescue_and_run_ahead_move_data_shards_not_state_slices(tmp_path, reference):
    # 4 workers in groups of 2: a slow worker's shards stolen and backed up, a stalled worker's
    # rescued, batches of steps run ahead; the sharded state stays with its owners throughout.
    result = run(
        tmp_path, "stragglers", "scaling.workers=4", "sharding.group_size=2", "stragglers.evict=false",
        "chaos={slow: [{worker: 2, factor: 8, from_step: 1, to_step: 3}], stall: [{worker: 1, at_step: 10, seconds: 5}]}",
        "stragglers.late_factor=1.2", "stragglers.min_ratio=1.2", "stragglers.persistent_steps=1", "stragglers.window=2",
    )
    events = result.summary["events"]
    assert events["stolen_shards"] > 0, events
    telemetry = read_telemetry(result.run_dir / "telemetry.jsonl")
    assert any(r["gave_up"] for r in telemetry if r["step"] == 10)
    assert result.summary["control_plane"]["steps_per_call"] > 1  # batches ran ahead
    assert_same_params(params(result.run_dir), reference, "sharded, with stragglers")


def _formations(run_dir) -> list[tuple[str, int, int]]:
    """Each group formation after the first: (event, members, replica groups)."""
    return [
        (e["event"], len(e["workers"]), e["sharding"]["replicas"])
        for e in jsonl(run_dir / "events.jsonl") if e["event"] in ("group_reformed", "grow")
    ]


def test_a_sharded_rank_killed_mid_step_is_healed_from_its_replica(tmp_path, reference):
    # min_workers 4: the group waits for the replacement, so it re-forms in the same groups of 2
    # and the replacement takes the dead rank's slice from its peer in the other group.
    result = run(
        tmp_path, "healed", "scaling.workers=4", "scaling.min_workers=4", "sharding.group_size=2",
        "collective.overlap=false", "chaos.kill=[{at_step: 5, worker: 1, how: sigkill}]",
    )
    summary = result.summary
    assert summary["events"]["failures"] == 1 and summary["events"]["recoveries"] == 1
    assert summary["workers"] == {"start": 4, "end": 4} and summary["events"]["joins"] == 1
    assert _formations(result.run_dir) == [("group_reformed", 4, 2)]
    assert_same_params(params(result.run_dir), reference, "healed")


def test_two_deaths_in_different_groups_replan_the_groups_and_regrow(tmp_path, reference):
    # Groups [0, 1] and [2, 3]; ranks 0 and 3 die in one step. The 2 survivors re-form at once as
    # one group of 2 (slice 0 from rank 2, slice 1 from rank 1: resharded in memory), then the
    # replacements join and the state is cut in groups of 2 again.
    result = run(
        tmp_path, "replanned", "scaling.workers=4", "sharding.group_size=2", "collective.overlap=false",
        "chaos.kill=[{at_step: 5, worker: 0, how: sigkill}, {at_step: 5, worker: 3, how: sigkill}]",
        "chaos.stall=[{worker: 1, at_step: 12, seconds: 15, during: compute}]",
    )
    summary = result.summary
    assert summary["events"]["failures"] == 2 and summary["workers"] == {"start": 4, "end": 4}
    formations = _formations(result.run_dir)
    # Re-planned to one group of 2 (no replica: the events say so), then grown (one or two
    # joins) back to groups of 2.
    assert formations[0] == ("group_reformed", 2, 1) and formations[-1] == ("grow", 4, 2), formations
    assert not [e for e in jsonl(result.run_dir / "events.jsonl") if e["event"] == "state_lost"]
    assert_same_params(params(result.run_dir), reference, "two deaths, re-planned")


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


def test_a_slice_without_a_replica_falls_back_to_the_newest_checkpoint_in_place(tmp_path, reference):
    # One group of 2 (no replica): the dead rank's slice exists nowhere else. The job rewinds to
    # its newest checkpoint, in place, and runs the steps after it again.
    result = run(
        tmp_path, "rolled-back", "scaling.workers=2", "sharding.group_size=2", "checkpoint.every_steps=4",
        "collective.overlap=false", "chaos.kill=[{at_step: 10, worker: 1, how: sigkill}]",
    )
    events = jsonl(result.run_dir / "events.jsonl")
    (lost,) = [e for e in events if e["event"] == "state_lost"]
    # The newest checkpoint written before the death: step 8's, or step 4's where step 8's write
    # was still under way when the worker died (then abandoned).
    written = [e for e in events[: events.index(lost)] if e["event"] == "checkpoint"]
    assert lost["checkpoint"] == written[-1]["name"] and lost["step"] == written[-1]["step"] in (4, 8)
    # Steps committed after it are counted lost (run again): those before the batch in flight.
    assert lost["workers"] == [1] and 0 <= lost["steps_lost"] <= 10 - lost["step"]
    (reformed,) = [e for e in events if e["event"] == "group_reformed"]
    assert reformed["redo"] == list(range(lost["step"], reformed["redo"][-1] + 1)) and reformed["redo"][-1] >= 10
    summary = result.summary
    assert summary["events"]["steps_redone"] >= 3 and summary["goodput"]["lost_s"]["redone_steps"] > 0
    assert_same_params(params(result.run_dir), reference, "rolled back")


def test_a_lost_slice_with_no_checkpoint_fails_naming_what_to_do(tmp_path):
    from orchestrator.job.reading import load_job
    from orchestrator.launch import run_job

    job = load_job(None, [
        "steps=25", "eval=null", "scaling.workers=2", "sharding.group_size=2",
        "chaos.kill=[{at_step: 5, worker: 1, how: sigkill}]",
    ])
    summary = run_job(job, run_dir=tmp_path / "lost").summary
    assert summary["status"] == "failed"
    assert "sharded optimizer state" in summary["error"] and "sharding.group_size 2" in summary["error"], summary["error"]
    assert "checkpoint.every_steps" in summary["error"]


def test_a_death_inside_a_regroups_state_move_loses_no_state(tmp_path, reference):
    # 6 workers in groups of 2: every slice is held 3 times. Worker 5 dies in step 5; the 5 left
    # form one group of 5, so every slice moves, and worker 0 (the new rank 0) dies inside that
    # move. Ranks whose own part of the move completed keep their old slices until every rank
    # has confirmed the new ones: the 4 left still hold every slice and form groups of 2.
    result = run(
        tmp_path, "moved", "scaling.workers=6", "sharding.group_size=2", "collective.overlap=false",
        "chaos.kill=[{at_step: 5, worker: 5, how: sigkill}, {at_step: 5, worker: 0, how: sigkill, during: reshard}]",
    )
    events = jsonl(result.run_dir / "events.jsonl")
    assert not [e for e in events if e["event"] in ("state_lost", "chaos_skipped")], events
    assert result.summary["events"]["failures"] == 2
    assert_same_params(params(result.run_dir), reference, "a death inside the state move")
