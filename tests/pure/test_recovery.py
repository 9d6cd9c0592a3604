"""The controller and its recovery core, driven through an in-process fake worker group
(``tests/helpers/fake_group.py``): no Ray, milliseconds per scenario.

Every scenario checks the job's invariant: each step is committed exactly once and in order,
no replica applies a step twice or skips one, and every member ends at the last step."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from jobspec.step_record import read_telemetry
from jobspec.wire import FileEntry, Phase, Progress
from orchestrator.group.chaos_control import ChaosControl
from orchestrator.group.interface import Call, CallFailed, FailureKind, WorkerGroupError
from orchestrator.recovery.plan import first_uncommitted, steps_to_redo
from orchestrator.recovery.reform import sharded_gap, state_holders
from orchestrator.steps.pipeline import InFlight, StepOutcome, await_step
from orchestrator.steps.states import (
    Failed,
    Finished,
    IllegalTransition,
    Recovering,
    Running,
    Starting,
    check_transition,
)
from tests.helpers.fake_group import FakeWorkerGroup, Faults
from tests.helpers.fake_runs import STEPS, Ran, fake_job, fake_run
from workers.checkpoint.manifest import MANIFEST, latest_valid, verify_checkpoint, write_manifest
from workers.checkpoint.storage import CheckpointStorage


class RecordedMetrics:
    """``JobMetrics``' calls, recorded (it needs Ray's metrics agent); ``broken`` raises in that call."""

    def __init__(self, broken: str = "") -> None:
        self.broken = broken
        self.calls: list[tuple] = []

    def _called(self, name: str, *args: object) -> None:
        if name == self.broken:
            raise RuntimeError("the metrics agent went away")
        self.calls.append((name, *args))

    def observe_step(self, reports, step_s, steps_done, workers, counters, goodput) -> None:
        self._called("step", steps_done, workers, len(reports), goodput.share)

    def observe_counters(self, counters) -> None:
        self._called("counters", dict(counters))

    def observe_goodput(self, goodput) -> None:
        self._called("goodput", goodput.share)

    def observe_recovery(self, phases) -> None:
        self._called("recovery", dict(phases))

    def observe_checkpoint(self, copy_s, write_s) -> None:
        self._called("checkpoint", copy_s, write_s)


def test_the_metrics_follow_the_run_through_a_death_and_checkpoints(tmp_path):
    metrics = RecordedMetrics()
    ran = Ran(tmp_path, Faults(die_in_step={(1, 5): False}), ("checkpoint.every_steps=4",), metrics=metrics)
    ran.assert_exact()
    calls = {name: [c[1:] for c in metrics.calls if c[0] == name] for name in ("step", "recovery", "checkpoint", "counters")}
    assert [c[0] for c in calls["step"]] == list(range(1, STEPS + 1))  # steps done, one call per committed step
    assert all(workers == 3 == reports for _, workers, reports, _ in calls["step"][8:])  # the replacement has joined
    (recovered,) = ran.of("recovered")
    assert calls["recovery"] == [({p: recovered[f"{p}_s"] for p in ("detect", "reform", "transfer", "redo")},)]
    assert calls["checkpoint"] == [(e["copy_s"], e["write_s"]) for e in ran.of("checkpoint")] != []
    assert calls["counters"][-1] == (ran.summary["events"],)  # the summary's, last


def test_a_metrics_failure_is_reported_once_and_never_fails_the_job(tmp_path):
    metrics = RecordedMetrics(broken="recovery")
    ran = Ran(tmp_path, Faults(die_in_step={(1, 5): False}), (), metrics=metrics)
    ran.assert_exact()
    (failed,) = ran.of("metrics_failed")
    assert "the metrics agent went away" in failed["error"]
    assert max(c[1] for c in metrics.calls if c[0] == "step") < STEPS  # nothing recorded after it


def test_a_clean_run_goes_starting_running_finished(tmp_path):
    ran = fake_run(tmp_path)
    ran.assert_exact()
    assert ran.states == ["running", "finished"]
    assert not any(ran.summary["events"][k] for k in ("failures", "recoveries", "steps_redone", "joins"))


def test_one_death_mid_step_is_recovered_and_its_replacement_joins(tmp_path):
    ran = fake_run(tmp_path, Faults(die_in_step={(1, 5): False}))
    ran.assert_exact()
    assert ran.states == ["running", "recovering", "running", "finished"]
    (recovery,) = ran.summary["recoveries"]
    assert recovery["workers"] == [1] and recovery["at_step"] == 5 and recovery["redo_steps"] == [5]
    assert ran.summary["events"]["failures"] == 1 and ran.summary["events"]["joins"] == 1
    reformed = ran.of("group_reformed")[0]["workers"]
    assert reformed[-1] == 3 and reformed[0] != 3  # the replacement joined; it is never the source
    assert ran.summary["workers"] == {"start": 3, "end": 3}
    goodput = ran.summary["goodput"]  # the recovery's spans, each charged once to its cause
    assert goodput["lost_s"]["detection"] == pytest.approx(recovery["detect_s"])
    assert goodput["lost_s"]["redone_steps"] == pytest.approx(recovery["redo_s"]) and recovery["redo_s"] > 0


# Timed fake runs (every step's calls last the step_s they report): 12 shards, so 2 or 3
# workers carry equal shares and nobody waits for a straggler; 0.05 s a shard, so a step (0.2
# or 0.3 s) stands well clear of the driver's own time on a busy machine (the tolerance below).
TIMED = Faults(shard_s=dict.fromkeys(range(8), 0.05))
# What the account may differ from the steps' own time by: the driver's turns and scheduling
# on a loaded machine (up to ~0.07 s seen); a misaccounted step or wait is 0.2 s or more.
TIMED_SLACK_S = 0.1


@pytest.mark.parametrize(
    "faults, overrides, join_delay_s",
    [
        ({}, (), 0.0),
        # Worker 1 dies as the group grows at a step boundary: nothing was in flight, nothing to redo.
        ({"die_joining": {1: 1}}, ("scaling.workers=2", "scaling.max_workers=3"), 0.2),
        # Two die as the group grows, one too many for min_workers: 0.6 s waiting for a replacement.
        ({"die_joining": {1: 1, 2: 1}}, ("scaling.workers=3", "scaling.max_workers=4", "scaling.min_workers=3"), 0.6),
    ],
    ids=["clean", "death-growing", "death-growing-below-min"],
)
def test_goodput_productive_time_is_the_committed_steps_own_time(tmp_path, faults, overrides, join_delay_s):
    """Measured apart from the account: the committed steps' own seconds (their step events,
    each step once) are the productive time; all else in the wall time is charged to a cause."""
    timed = Faults(shard_s=TIMED.shard_s, **faults)
    ran = fake_run(tmp_path, timed, "shards=12", *overrides, join_delay_s=join_delay_s, timed=True)
    ran.assert_exact()
    goodput = ran.summary["goodput"]
    own_s = sum(e["step_s"] for e in ran.of("step"))
    assert goodput["lost_s"]["stragglers"] == 0.0
    # The driver's turns between steps hide behind the steps in flight: a few ms in all.
    assert goodput["productive_s"] == pytest.approx(own_s, abs=TIMED_SLACK_S)
    for recovery in ran.summary["recoveries"]:  # a death at a step boundary redoes nothing
        assert recovery["redo_steps"] == [] and recovery["redo_s"] > TIMED_SLACK_S  # (the next step's time)
    if ran.summary["recoveries"]:
        assert goodput["lost_s"]["redone_steps"] == 0.0
    if "scaling.min_workers=3" in overrides:
        assert goodput["lost_s"]["waiting_for_workers"] == pytest.approx(join_delay_s, abs=TIMED_SLACK_S)


def test_run_ahead_grows_while_quiet_and_a_death_mid_batch_keeps_the_steps_before_it(tmp_path):
    ran = fake_run(tmp_path, Faults(die_in_step={(1, 10): False}))
    ran.assert_exact()
    # One step at a time at first, then doubling per quiet batch up to max_steps_per_call (8).
    assert ran.group.batches[:5] == [(0, 1), (1, 1), (2, 2), (4, 4), (8, 8)]
    (recovery,) = ran.summary["recoveries"]
    # Steps 8 and 9 of the batch 8-15 were applied everywhere: committed from the survivors'
    # kept reports; 10 is redone, 11-15 were handed out but never started.
    assert recovery["at_step"] == 10 and recovery["redo_steps"] == [10]
    # 16-19 was in flight too; Running again, one step at a time.
    assert ran.group.batches[5:8] == [(16, 4), (10, 1), (11, 1)]
    ran_once = fake_run(tmp_path / "once", None, "worker.max_steps_per_call=1")
    assert {count for _, count in ran_once.group.batches} == {1}


def test_a_periodic_checkpoint_rides_inside_its_batch_and_ends_no_call(tmp_path):
    """Checkpoints every 6 steps: the batches grow as without them (1, 1, 2, 4, 8, ...), each
    checkpoint is taken inside the batch that runs its step (no snapshot call between
    batches), its copy time comes from that step's reports, and the parts are written."""
    ran = fake_run(tmp_path, None, "checkpoint.every_steps=6", "checkpoint.keep=10")
    ran.assert_exact()
    assert ran.group.batches[:5] == [(0, 1), (1, 1), (2, 2), (4, 4), (8, 8)]
    # The only snapshot call: the final checkpoint's, after the last batch.
    assert [c.expect_step for c in ran.group.calls if c.expect_step is not None] == [STEPS] * 3
    periodic = [e for e in ran.of("checkpoint") if e["why"] == "periodic"]
    assert [e["step"] for e in periodic] == [6, 12, 18] and all(e["copy_s"] == 0.001 for e in periodic)
    assert verify_checkpoint(CheckpointStorage(ran.summary["checkpoints"]["root"]), "step-00000012")["files"]


def test_a_checkpoint_abandoned_in_a_recovery_is_cancelled_on_its_writers_that_are_left(tmp_path):
    """Worker 1 dies in step 5, inside the batch of steps 4-7 that carries the checkpoint of
    step 6: the recovery abandons that attempt and tells its writers still there (their waits
    would hold their io thread), and the next attempt is written."""
    ran = fake_run(tmp_path, Faults(die_in_step={(1, 5): False}), "checkpoint.every_steps=6", "checkpoint.keep=10")
    ran.assert_exact()
    (abandoned,) = ran.of("checkpoint_abandoned")
    assert abandoned["name"] == "step-00000006" and "left the group" in abandoned["reason"]
    ((workers, name, tag),) = ran.group.cancelled
    assert name == "step-00000006" and tag.endswith("-a1") and 1 not in workers and workers
    assert 6 in [e["step"] for e in ran.of("checkpoint") if e["why"] == "periodic"]


def test_a_batch_longer_than_the_step_timeout_runs_while_its_steps_advance(tmp_path):
    # Steps 8-15 go out in one call and take 0.3 s each, 2.4 s in all: the step timeout (1 s)
    # bounds each step, not the batch.
    ran = fake_run(tmp_path, Faults(stall={(0, s): 0.3 for s in range(8, 16)}), "timeouts.step_s=1")
    ran.assert_exact()
    assert (8, 8) in ran.group.batches


def test_a_death_while_steps_are_redone_keeps_both_recoveries(tmp_path):
    # Worker 3 replaces worker 1 and dies in step 5, which the first recovery is redoing.
    ran = fake_run(tmp_path, Faults(die_in_step={(1, 5): False, (3, 5): False}))
    ran.assert_exact()
    first, second = ran.summary["recoveries"]
    assert first["workers"] == [1] and first["redo_s"] is None  # cut short by the second failure
    assert second["workers"] == [3] and second["redo_s"] is not None
    assert ran.summary["events"]["recoveries"] == 2 and [e["workers"] for e in ran.of("recovered")] == [[3]]


def test_two_deaths_in_one_step_are_one_recovery(tmp_path):
    ran = fake_run(tmp_path, Faults(die_in_step={(1, 7): False, (2, 7): False}), "scaling.workers=4")
    ran.assert_exact()
    (recovery,) = ran.summary["recoveries"]
    assert recovery["workers"] == [1, 2] and recovery["at_step"] == 7
    assert ran.summary["events"]["failures"] == 2 and ran.summary["events"]["recoveries"] == 1


def test_a_death_after_the_all_reduce_commits_the_step_and_redoes_only_the_next(tmp_path):
    ran = fake_run(tmp_path, Faults(die_in_step={(2, 5): True}))
    ran.assert_exact()
    (recovery,) = ran.summary["recoveries"]
    # The survivors applied step 5: it is committed from their reports, not run again.
    assert recovery["at_step"] == 6 and recovery["redo_steps"] == [6]
    step5 = [r for r in read_telemetry(ran.run_dir / "telemetry.jsonl") if r["step"] == 5]
    assert sorted(r["worker"] for r in step5) == [0, 1]


def test_a_step_only_a_lost_leader_held_is_redone_not_committed(tmp_path):
    # Worker 3 dies after step 5's all-reduce; only worker 1 applied it, and worker 1 dies while
    # the group re-forms around it. Nobody holds step 5: it is redone from the others' state.
    faults = Faults(die_in_step={(3, 5): True}, applied_only_by={5: {1}}, die_joining={1: 5})
    ran = fake_run(tmp_path, faults, "scaling.workers=4", replacements=False)
    ran.assert_exact()
    (recovery,) = ran.summary["recoveries"]
    assert recovery["at_step"] == 5 and recovery["redo_steps"] == [5]
    assert sorted(recovery["workers"]) == [1, 3] and ran.summary["workers"]["end"] == 2


def test_a_worker_judged_dead_never_leads_even_if_it_answers(tmp_path):
    # Worker 0's step-5 call fails as unavailable after it applied step 5; it still answers
    # probes and is the furthest: it must not be taken as the state's source.
    ran = fake_run(tmp_path, Faults(unavailable={(0, 5)}), replacements=False)
    ran.assert_exact()
    (recovery,) = ran.summary["recoveries"]
    assert recovery["workers"] == [0] and recovery["at_step"] == 5 and recovery["redo_steps"] == [5]
    assert ran.of("group_reformed")[0]["workers"] == [1, 2]


def test_leading_with_a_worker_that_is_not_a_member_is_an_error(monkeypatch):
    import ray

    from orchestrator.group.ray_group import RayWorkerGroup

    # Its constructor starts nothing: a put would start a Ray of its own in this process (and a
    # later ray.init in the session fail: "called twice").
    monkeypatch.setattr(ray, "put", lambda *args, **kwargs: pytest.fail("RayWorkerGroup() put something in the object store"))
    with pytest.raises(WorkerGroupError, match="worker 7 is not a member"):
        RayWorkerGroup(fake_job(), data={}).lead_with(7)


def test_a_death_during_re_forming_starts_it_over(tmp_path):
    ran = fake_run(tmp_path, Faults(die_in_step={(1, 6): False}, die_joining={2: 6}), "scaling.workers=4")
    ran.assert_exact()
    assert len(ran.of("reform_failed")) == 1
    (recovery,) = ran.summary["recoveries"]
    assert sorted(recovery["workers"]) == [1, 2]
    assert ran.summary["events"]["failures"] == 2


def test_a_silent_worker_is_a_failure_and_replaced(tmp_path):
    faults = Faults(stall={(2, 5): 30.0})
    ran = fake_run(tmp_path, faults, "stragglers.silent_s=0.3")
    ran.assert_exact()
    assert ran.seconds < 10  # nobody waited out the 30 s stall
    (evict,) = ran.of("evict")
    assert evict["worker"] == 2 and evict["reason"] == "silent"
    assert evict["evidence"]["progress"]["phase"] == Phase.STALL.value
    assert ran.summary["events"]["failures"] == 1 and ran.summary["events"]["evictions"] == 0
    (failure,) = ran.of("failure")
    assert failure["workers"] == [2] and "silent" in failure["reasons"]["2"]
    # Its slot stays: a replacement (worker 3) joins and the group is back to full size.
    assert ran.summary["workers"] == {"start": 3, "end": 3} and ran.group.capacity == 3
    assert ran.of("group_reformed")[0]["workers"][-1] == 3


def test_a_persistently_far_slower_worker_is_evicted(tmp_path):
    ran = fake_run(tmp_path, Faults(shard_s={1: 0.5}))
    ran.assert_exact()
    (evict,) = ran.of("evict")
    assert evict["worker"] == 1 and evict["reason"] == "slow" and evict["evidence"]["ratio"] > 8
    assert 1 not in [m.worker for m in ran.group.at_shutdown] and ran.summary["events"]["evictions"] == 1


def test_too_few_workers_left_saves_a_checkpoint_then_fails(tmp_path):
    ran = fake_run(
        tmp_path, Faults(die_in_step={(1, 5): False}), "scaling.workers=2", "scaling.min_workers=2",
        "scaling.wait_for_workers_s=0", replacements=False,
    )
    assert ran.summary["status"] == "failed"
    assert "min_workers" in ran.summary["error"] and "wait_for_workers_s" in ran.summary["error"]
    assert ran.states == ["running", "recovering", "checkpointing_before_failure", "failed"]
    (saved,) = ran.of("checkpoint")
    assert saved["why"] == "before failing" and saved["step"] == ran.summary["steps"] == 5
    assert latest_valid(CheckpointStorage(ran.summary["checkpoints"]["root"]), print)[0] == saved["name"]


def test_a_step_the_saved_survivor_applied_is_committed_before_failing(tmp_path):
    ran = fake_run(
        tmp_path, Faults(die_in_step={(1, 5): True}), "scaling.workers=2", "scaling.min_workers=2",
        "scaling.wait_for_workers_s=0", replacements=False,
    )
    assert ran.summary["status"] == "failed"
    (saved,) = ran.of("checkpoint")
    assert saved["step"] == ran.summary["steps"] == 6 and [e["step"] for e in ran.of("step")][-1] == 5


def test_waiting_for_workers_that_never_come_does_not_spin(tmp_path):
    cpu = time.process_time()
    ran = fake_run(
        tmp_path, Faults(die_in_step={(1, 5): False}), "scaling.workers=2", "scaling.min_workers=2",
        "scaling.wait_for_workers_s=2", replacements=False,
    )
    assert ran.summary["status"] == "failed" and ran.seconds >= 2
    assert time.process_time() - cpu < 1.0  # a busy loop would burn the whole 2 s


def test_a_step_is_not_committed_when_the_save_before_failing_fails(tmp_path, monkeypatch):
    def unreachable(self, relpath):
        raise OSError("the bucket is unreachable")

    monkeypatch.setattr(CheckpointStorage, "size", unreachable)
    ran = fake_run(
        tmp_path, Faults(die_in_step={(1, 5): True}), "scaling.workers=2", "scaling.min_workers=2",
        "scaling.wait_for_workers_s=0", replacements=False,
    )
    assert ran.summary["status"] == "failed" and ran.of("checkpoint") == []
    # Step 5 lived only in the lost survivor's memory: not committed (nor the steps of its
    # batch before it, whose reports were not all in when the failure struck).
    committed = [e["step"] for e in ran.of("step")]
    assert 5 not in committed and committed == list(range(ran.summary["steps"])) and ran.summary["steps"] <= 5


def test_a_replacement_that_is_still_loading_is_waited_for_below_min_workers(tmp_path):
    ran = fake_run(
        tmp_path, Faults(die_in_step={(1, 5): False}), "scaling.workers=2", "scaling.min_workers=2",
        join_delay_s=0.5,
    )
    ran.assert_exact()
    (reformed,) = ran.of("group_reformed")
    assert reformed["workers"] == [0, 2]  # the replacement joined the re-forming
    assert ran.summary["events"]["joins"] == 1


def test_a_failure_while_a_checkpoint_is_written_abandons_only_that_one(tmp_path):
    ran = fake_run(tmp_path, Faults(die_writing={(1, 8)}), "checkpoint.every_steps=4", "checkpoint.keep=10")
    ran.assert_exact()
    assert "step-00000008" in [e["name"] for e in ran.of("checkpoint_abandoned")]
    # The interval counts from the last written checkpoint (4): step 8 is taken again after the
    # recovery, as a new attempt that shares no file with the abandoned one (a2).
    steps = [e["step"] for e in ran.of("checkpoint")]
    assert steps[:2] == [4, 8] and steps[-1] == 20
    manifest = verify_checkpoint(CheckpointStorage(ran.summary["checkpoints"]["root"]), "step-00000008")
    assert manifest["files"] and not any(f["path"].endswith("-a2.pt") for f in manifest["files"])
    assert ran.summary["events"]["failures"] == 1


def test_parts_not_where_the_manifest_would_say_abandon_the_checkpoint(tmp_path):
    # Worker 1 "wrote" its part of step 8 to a disk the driver does not see.
    # One step per call: the next checkpoint's step shows where the interval counts from.
    ran = fake_run(
        tmp_path, Faults(unwritten={(1, 8)}), "checkpoint.every_steps=4", "checkpoint.keep=10", "worker.max_steps_per_call=1"
    )
    ran.assert_exact()
    (abandoned,) = ran.of("checkpoint_abandoned")
    assert abandoned["name"] == "step-00000008" and "is missing" in abandoned["reason"]
    assert "checkpoint.path must be storage that every worker and the driver share" in abandoned["reason"]
    storage = CheckpointStorage(ran.summary["checkpoints"]["root"])
    assert storage.exists("step-00000004") and not storage.exists(f"step-00000008/{MANIFEST}")
    steps = [e["step"] for e in ran.of("checkpoint")]
    # The interval counts from the last written checkpoint (4), not from the abandoned one.
    assert steps[0] == 4 and 8 < steps[1] <= 10 and steps[-1] == 20


@pytest.mark.parametrize("kind", ["broken", "another job"])
def test_a_final_save_replaces_a_manifest_that_does_not_verify_or_is_another_jobs(tmp_path, monkeypatch, kind):
    """A broken manifest of the final step in the run's own namespace is replaced; another job's
    checkpoint of that step on the shared path is neither taken for this run's nor touched."""
    mine, theirs = "20260101-000000-0000000a", "20260101-000000-0000000b"
    monkeypatch.setattr("orchestrator.output.run_dir.new_run_id", lambda: mine)
    own = CheckpointStorage(str(tmp_path / "shared" / mine))
    other = CheckpointStorage(str(tmp_path / "shared" / theirs))
    if kind == "broken":  # a manifest listing a part that never arrived (a partial upload)
        write_manifest(own, STEPS, [FileEntry("part-00000-of-00001-a9.pt", "0" * 64, 10)], {})
    else:
        other.write_bytes(f"step-{STEPS:08d}/model.pt", b"theirs")
        write_manifest(other, STEPS, [FileEntry("model.pt", hashlib.sha256(b"theirs").hexdigest(), 6)], {"config_hash": "x"})
    ran = fake_run(tmp_path, None, "checkpoint.every_steps=50", f"checkpoint.path={tmp_path / 'shared'}")
    ran.assert_exact()
    (final,) = ran.of("checkpoint")
    assert final["step"] == STEPS and final["why"] == "final" and final["location"] == own.location(f"step-{STEPS:08d}")
    assert verify_checkpoint(own, f"step-{STEPS:08d}")["meta"]["config_hash"] != "x"
    if kind == "another job":
        assert verify_checkpoint(other, f"step-{STEPS:08d}")["meta"]["config_hash"] == "x"


def test_storage_errors_in_the_final_save_cost_neither_model_nor_summary(tmp_path, monkeypatch):
    """An object-store blip (OSError) while the final checkpoint is checked and written: that
    attempt is abandoned and retried; the job still finishes with its model and summary."""
    blips = {"exists": 1, "size": 1}

    def flaky(method):
        real = getattr(CheckpointStorage, method)

        def call(self, relpath):
            if blips[method]:
                blips[method] -= 1
                raise OSError(f"{method}: connection reset by the object store")
            return real(self, relpath)

        return call

    for method in blips:
        monkeypatch.setattr(CheckpointStorage, method, flaky(method))
    ran = fake_run(tmp_path, None, "checkpoint.every_steps=50")
    ran.assert_exact()
    assert blips == {"exists": 0, "size": 0}
    assert any("connection reset" in e["reason"] for e in ran.of("checkpoint_abandoned"))
    (final,) = ran.of("checkpoint")
    assert final["step"] == STEPS and (ran.run_dir / "model.pt").exists() and (ran.run_dir / "summary.json").exists()


def test_a_checkpoint_manifest_holds_no_credential(tmp_path):
    # (the fake group builds no dataset: the kwargs only travel in the config)
    secret = "dataset={factory: 'ringleader_examples.digits:make_dataset', kwargs: {url: 'https://user:pa55@data.example/d?token=t0k'}}"
    ran = fake_run(tmp_path, None, "checkpoint.every_steps=50", secret)
    ran.assert_exact()
    manifest = (Path(ran.summary["checkpoints"]["root"]) / f"step-{STEPS:08d}" / MANIFEST).read_text()
    assert "pa55" not in manifest and "t0k" not in manifest and "https://***@data.example" in manifest


def test_growth_adds_workers_at_a_step_boundary(tmp_path):
    # The newcomer loads while step 3 is held up, and joins at the next boundary.
    ran = fake_run(tmp_path, Faults(stall={(0, 3): 0.5}), "scaling.workers=2", "scaling.max_workers=3", join_delay_s=0.2)
    ran.assert_exact()
    (grow,) = ran.of("grow")
    assert grow["joined"] == [2] and grow["workers"] == [0, 1, 2]
    assert "growing" in ran.states and ran.summary["workers"] == {"start": 2, "end": 3}


def test_a_death_while_the_group_grows_is_recovered_without_the_newcomer_as_source(tmp_path):
    faults = Faults(die_joining={1: 1}, stall={(0, 3): 0.5})
    ran = fake_run(tmp_path, faults, "scaling.workers=2", "scaling.max_workers=3", join_delay_s=0.2)
    ran.assert_exact()
    assert "growing" in ran.states and ran.states[ran.states.index("growing") + 1] == "recovering"
    reformed = ran.of("group_reformed")[0]
    assert reformed["workers"][0] == 0 and 1 not in reformed["workers"]


def test_a_rendezvous_error_while_growing_is_retried_not_fatal(tmp_path):
    faults = Faults(error_joining={2}, stall={(0, 3): 0.5})
    ran = fake_run(tmp_path, faults, "scaling.workers=2", "scaling.max_workers=3", join_delay_s=0.2)
    ran.assert_exact()
    assert ran.states[ran.states.index("growing") + 1] == "recovering"
    assert ran.summary["events"]["failures"] == 0 and ran.summary["workers"]["end"] == 3


def test_a_census_that_miscounts_fails_the_job_and_is_not_committed(tmp_path):
    ran = fake_run(tmp_path, Faults(miscount={6: 1}))
    assert ran.summary["status"] == "failed" and "census counted [17] shards, expected 16" in ran.summary["error"]
    assert ran.summary["steps"] == 6 and ran.summary["shards_committed"] == 6 * 16


def test_a_worker_error_fails_the_job_without_retrying(tmp_path):
    ran = fake_run(tmp_path, Faults(error_in_step={(2, 4): "bad batch"}))
    assert ran.summary["status"] == "failed" and "bad batch" in ran.summary["error"]
    assert ran.summary["events"]["recoveries"] == 0 and ran.summary["steps"] == 4


def test_chaos_that_hits_nothing_says_so(tmp_path):
    # Worker 1 dies in step 3, so the ray_kill aimed at it in step 8 has no target; the fake
    # carries out no worker-side sigkill, so that entry never strikes either.
    kills = "chaos.kill=[{at_step: 8, worker: 1, how: ray_kill}, {at_step: 2, worker: 2, during: checkpoint}]"
    ran = fake_run(tmp_path, Faults(die_in_step={(1, 3): False}), kills)
    ran.assert_exact()
    skipped = {e["kill"]["worker"]: e["reason"] for e in ran.of("chaos_skipped")}
    assert "worker 1 is not in the group at step 8" in skipped[1]
    assert "worker 2 never reached its kill point (checkpoint at or after step 2)" in skipped[2]


def test_a_checkpoint_kill_strikes_at_the_first_checkpoint_after_its_step():
    import threading

    from jobspec.chaos import ChaosConfig
    from workers.runtime.chaos import ChaosSchedule

    chaos = ChaosConfig.model_validate({"kill": [{"at_step": 420, "worker": 0, "during": "checkpoint"}]})
    schedule = ChaosSchedule.for_worker(chaos, 0, threading.Event())
    assert not schedule.kill_due("checkpoint", 399)  # the checkpoint of step 400
    assert schedule.kill_due("checkpoint", 424)  # of step 425: the first after 420
    assert not schedule.kill_due("checkpoint", 449)  # once


def test_state_transitions_are_checked():
    check_transition(Starting(), Running(0))
    with pytest.raises(IllegalTransition):
        check_transition(Starting(), Recovering(StepOutcome()))
    with pytest.raises(IllegalTransition):
        check_transition(Finished(), Failed("late"))


def _progress(next_step: int) -> Progress:
    return Progress(step=next_step - 1, phase=Phase.DONE, since_s=0.0, next_step=next_step)


def test_commit_and_redo_decisions():
    alive = {0: _progress(6), 2: _progress(5), 3: _progress(-1)}
    assert first_uncommitted(alive, steps_done=5) == 6  # worker 0 applied step 5: committed
    assert first_uncommitted({}, steps_done=5) == 5
    assert first_uncommitted({3: _progress(-1)}, steps_done=5) == 5
    assert state_holders(alive, steps_done=5) == {0: 6, 2: 5}  # 3's transfer broke off
    assert state_holders(alive, steps_done=5, without_state=frozenset({0})) == {2: 5}
    in_flight = [InFlight(5, ()), InFlight(6, ())]
    assert steps_to_redo(in_flight, 6, 6) == [6] and steps_to_redo(in_flight, 5, 6) == [5, 6]
    # Survivors had reached no further than 5: step 6 was handed out, not started.
    assert steps_to_redo(in_flight, 5, 4) == [5] and steps_to_redo(in_flight, 5, 5) == [5]
    batches = [InFlight(3, (), 4), InFlight(7, (), 8)]  # run-ahead: steps 3-6 and 7-14
    assert steps_to_redo(batches, 5, 5) == [5] and steps_to_redo(batches, 5, 8) == [5, 6, 7, 8]


def test_chaos_at_a_step_cuts_the_batches_around_it():
    job = fake_job("chaos.kill=[{worker: 1, at_step: 5, how: ray_kill}]")
    chaos = ChaosControl(job.chaos, None, 0, lambda *a, **k: None)
    # The kill's step and the next two start batches: 5 and 6 run alone, so the driver strikes
    # with the victim in step 5 or 6, as with one step per call.
    assert [step for step in range(10) if chaos.acts_at(step)] == [5, 6, 7]
    assert ChaosControl(fake_job().chaos, None, 0, lambda *a, **k: None).acts_at(5) is False


def test_sharded_state_is_whole_only_where_survivors_hold_every_slice_at_the_root_step():
    def held(lo: int, hi: int, at: int) -> Progress:
        return Progress(at - 1, Phase.DONE, 0.0, at, held=((lo, hi, 10, at),))

    # Groups [0, 1] and [2, 3] over 10 entries; worker 1 died: its peer 3 holds [5, 10).
    alive = {0: held(0, 5, 7), 2: held(0, 5, 7), 3: held(5, 10, 7)}
    assert sharded_gap(alive, 7) is None
    assert sharded_gap(alive, 7, without_state=frozenset({3})) == (5, 10)
    # A survivor that stepped its slice and lost the all-gather holds it for step 8, not 7.
    assert sharded_gap({0: held(0, 5, 7), 3: held(5, 10, 8)}, 7) == (5, 10)
    assert sharded_gap({0: Progress(6, Phase.DONE, 0.0, 7)}, 7) == (0, 0)  # nobody holds any
    assert sharded_gap({0: held(0, 5, 0)}, 0) is None  # step 0: the state is zero everywhere
    # A regroup that broke off before every rank confirmed it: worker 2 holds its new slice and
    # keeps its old one, and the old one still counts.
    both = Progress(6, Phase.DONE, 0.0, 7, held=((0, 3, 10, 7), (5, 10, 10, 7)))
    assert sharded_gap({0: held(0, 5, 7), 2: both}, 7) is None
    assert sharded_gap({0: held(0, 5, 7), 2: held(0, 3, 7)}, 7) == (5, 10)


def test_too_few_workers_with_sharded_state_fail_without_a_save_no_worker_could_write(tmp_path):
    """Each survivor holds only its slice of the optimizer state: no one worker can write a
    checkpoint before failing; the job says so and fails (the newest checkpoint stands)."""
    ran = fake_run(
        tmp_path, Faults(die_in_step={(1, 5): False}), "scaling.workers=2", "scaling.min_workers=2",
        "scaling.wait_for_workers_s=0", "sharding.group_size=2", replacements=False,
    )
    assert ran.summary["status"] == "failed" and "min_workers" in ran.summary["error"]
    assert ran.states == ["running", "recovering", "checkpointing_before_failure", "failed"]
    assert not ran.of("checkpoint") and "sharded" in ran.of("checkpoint_skipped")[0]["reason"]


def test_a_slow_worker_holding_the_only_copy_of_its_slice_is_not_evicted(tmp_path):
    """With one sharding group its slice exists nowhere else: evicting it would cost a rollback
    to a checkpoint, so it stays (an evict_skipped event says why)."""
    ran = fake_run(tmp_path, Faults(shard_s={1: 0.5}), "sharding.group_size=4")
    assert not ran.of("evict") and ran.summary["events"]["evictions"] == 0
    assert "sharded" in ran.of("evict_skipped")[0]["reason"]


def test_a_sharded_group_starts_after_a_step_whose_slices_were_all_stepped():
    from orchestrator.recovery.reform import ShardedStart, StateLost, sharded_start

    def held(lo: int, hi: int, next_step: int, state_step: int) -> Progress:
        return Progress(next_step, Phase.DONE, 0.0, next_step, held=((lo, hi, 10, state_step),))

    # The all-gather of step 7 broke off in every group: parameters at 7, every slice at 8.
    stepped = {0: held(0, 5, 7, 8), 2: held(0, 5, 7, 8), 3: held(5, 10, 7, 8)}
    assert sharded_start(stepped, 0, 7) == ShardedStart(0, 8)
    # Slice [0, 5) stepped, [5, 10) not: whole at neither step (named: the first gap at step 7).
    assert sharded_start({0: held(0, 5, 7, 8), 3: held(5, 10, 7, 7)}, 0, 7) == StateLost(7, (0, 5))
    assert sharded_start({0: held(0, 5, 7, 7), 3: held(5, 10, 7, 7)}, 3, 7) == ShardedStart(3, 7)


# Published plans: every batch is one call into rank 0 (the leader); the other ranks run on the
# plans it publishes, each in one call per run (docs/architecture.md, "Published plans").


def _runs_of(group: FakeWorkerGroup, worker: int) -> list:
    return [f for f in group.follows if f.worker.worker == worker]


def test_a_followers_death_on_published_plans_ends_its_run_and_the_group_goes_on_without_it(tmp_path):
    ran = fake_run(tmp_path, Faults(die_in_step={(2, 9): False}))
    ran.assert_exact()
    group = ran.group
    assert len(group.leaders) == len(group.batches)  # one call per batch, into the leader
    # The follower's run ended in its death; the leader of its batch was blocked in the step
    # until the driver aborted it (a lost peer, not a death), and so was the other follower.
    assert _runs_of(group, 2)[-1].error.kind is FailureKind.DIED
    failed_leader = next(leader for leader in group.leaders if leader.error is not None)
    assert failed_leader.worker.worker == 0 and failed_leader.error.kind is FailureKind.PEER_LOST
    assert any(run.error is not None and run.error.kind is FailureKind.PEER_LOST for run in _runs_of(group, 1))
    (recovery,) = ran.summary["recoveries"]
    assert recovery["at_step"] == 9 and recovery["redo_steps"] == [9]
    # The re-formed group runs on published plans again: new runs, the dead worker in none.
    survivors = {m.worker for m in group.at_shutdown} - {0}
    assert all(_runs_of(group, w)[-1].error is None for w in survivors)
    assert 2 not in {m.worker for m in group.at_shutdown}


def test_the_leaders_death_is_a_failure_of_its_batch_and_a_survivor_leads_the_next(tmp_path):
    ran = fake_run(tmp_path, Faults(die_in_step={(0, 9): False}))
    ran.assert_exact()
    group = ran.group
    failed = [leader for leader in group.leaders if leader.error is not None]
    # Its call of the batch it died in, and of the batch queued behind it.
    assert failed and {(leader.worker.worker, leader.error.kind) for leader in failed} == {(0, FailureKind.DIED)}
    # The followers waited in the step for it until the abort.
    assert {run.error.kind for run in group.follows if run.error is not None} == {FailureKind.PEER_LOST}
    (recovery,) = ran.summary["recoveries"]
    assert recovery["at_step"] == 9
    after = group.leaders[group.leaders.index(failed[-1]) + 1 :]
    assert after and all(leader.worker.worker != 0 for leader in after)


def test_a_plan_changed_while_a_batch_runs_on_the_old_one_takes_the_next_batch(tmp_path):
    # Worker 1 is five times slower: the rebalancer moves shards off it while the batches
    # handed out (published with the old split) still run; each step runs the plan it was
    # published with, every shard once, and run-ahead starts over at one step per batch.
    ran = fake_run(tmp_path, Faults(shard_s={1: 0.05}), "stragglers.rebalance=true", "shards=12")
    ran.assert_exact()
    telemetry = read_telemetry(ran.run_dir / "telemetry.jsonl")
    by_step: dict[int, dict[int, tuple[int, ...]]] = {}
    for record in telemetry:
        by_step.setdefault(record["step"], {})[record["worker"]] = tuple(record["shards"])
    for step, shards in by_step.items():
        assert sorted(s for owned in shards.values() for s in owned) == list(range(12)), step
    assert len(by_step[0][1]) == 4 and len(by_step[STEPS - 1][1]) < 4  # the split changed
    changed = next(step for step in sorted(by_step) if len(by_step[step][1]) < 4)
    starts = dict(ran.group.batches)
    assert changed in starts and starts[changed] == 1  # the new plan began a batch of its own


class ScriptedGroup:
    """Calls that end at set times (seconds after the group is made) with a value or a failure,
    waited on as ``ray.wait`` waits (at most ``num_returns`` ended); the leader's progress says
    which step it will apply next."""

    def __init__(self, ends: dict[int, tuple[float, object]], leader_next_step: int) -> None:
        self.began = time.monotonic()
        self.ends = ends  # by worker: (seconds, value or CallFailed)
        self.leader_next_step = leader_next_step
        self.size = len(ends)

    def _ended(self, call) -> bool:
        return time.monotonic() - self.began >= self.ends[call.worker][0]

    def wait(self, calls, num_returns, timeout_s):
        deadline = time.monotonic() + timeout_s
        while True:
            ended = [c for c in calls if self._ended(c)][: max(1, num_returns)]
            if len(ended) >= min(num_returns, len(calls)) or time.monotonic() >= deadline:
                return ended, [c for c in calls if c not in ended]
            time.sleep(0.005)

    def result(self, call):
        value = self.ends[call.worker][1]
        if isinstance(value, CallFailed):
            raise value
        return value

    def progress(self, timeout_s):
        return {0: Progress(self.leader_next_step - 1, Phase.DONE, 0.0, self.leader_next_step)}


def _batch_of_three() -> InFlight:
    """Steps 4-5 led by worker 0, workers 1 and 2 following."""
    return InFlight(4, (Call(0, "lead"),), 2, (Call(1, "run"), Call(2, "run")), (0, 1, 2))


def _records() -> list:
    from jobspec.step_record import StepRecord
    from jobspec.wire import StepTelemetry

    return [
        StepRecord.of(step, [StepTelemetry(step, rank, rank, (rank,), 1, 3, 0.5, 0.1, 0.0, 0.0, 0.1, 3) for rank in range(3)])
        for step in (4, 5)
    ]


def test_a_followers_death_with_the_leaders_failure_is_known_as_a_death_whichever_ended_first():
    job = fake_job()
    died = CallFailed(2, FailureKind.DIED, "ActorDiedError")
    lost = CallFailed(0, FailureKind.PEER_LOST, "CollectiveTimeout: a peer closed its connection")
    group = ScriptedGroup({0: (0.05, lost), 1: (9.0, 0), 2: (0.07, died)}, leader_next_step=5)
    outcome = await_step(group, _batch_of_three(), job, evicting=False)  # type: ignore[arg-type]
    # The old code: the leader's failure first, the follower's never taken (dead = {}).
    assert outcome.dead == {2} and set(outcome.errors) == {0, 2}


def test_a_follower_that_dies_after_its_batch_leaves_the_batch_whole():
    job = fake_job()
    died = CallFailed(2, FailureKind.DIED, "ActorDiedError")
    # The leader applied steps 4 and 5 (next is 6) and its answer is slow to come (0.3 s,
    # past GATHER_S): the death belongs to the next batch.
    group = ScriptedGroup({0: (0.3, _records()), 1: (9.0, 0), 2: (0.02, died)}, leader_next_step=6)
    outcome = await_step(group, _batch_of_three(), job, evicting=False)  # type: ignore[arg-type]
    assert not outcome.failed and [r.step for r in outcome.records] == [4, 5]
    # Still inside the batch: the leader is blocked in the step the follower died in.
    group = ScriptedGroup({0: (9.0, _records()), 1: (9.0, 0), 2: (0.02, died)}, leader_next_step=5)
    started = time.monotonic()
    outcome = await_step(group, _batch_of_three(), job, evicting=False)  # type: ignore[arg-type]
    assert outcome.dead == {2} and not outcome.records and time.monotonic() - started < 1.0
