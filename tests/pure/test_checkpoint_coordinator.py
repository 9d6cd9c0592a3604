"""The checkpoint coordinator (``orchestrator/checkpoints/coordinator.py``), the driver's side
of checkpoints, over the in-process fake group (``tests/helpers/fake_group.py``, whose parts
are real files): when one is due (counted from the newest taken, again from the last written
when one is abandoned), who writes what, the manifest written last once every part is where it
should be, the abandoned ones (a failed part, missing files, a time limit, a lost lease), the
waited-for saves with their retries, pruning, resuming and the summary."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from jobspec.wire import SnapshotOrder
from orchestrator.accounting.summary import EVENT_COUNTERS
from orchestrator.checkpoints.coordinator import SAVE_ATTEMPTS, CheckpointCoordinator
from orchestrator.checkpoints.resume_point import ResumePoint
from orchestrator.errors import JobFailed
from orchestrator.output.run_dir import RunDirectory
from policies.work_stealing import StepPlan
from tests.helpers.fake_group import FakeWorkerGroup, Faults
from tests.helpers.fake_runs import fake_job
from workers.checkpoint.manifest import MANIFEST, verify_checkpoint
from workers.checkpoint.storage import CheckpointStorage

META = {"stragglers": {"expected_shard_s": 0.01}}


class Taken:
    """A coordinator of checkpoints every 4 steps (unless ``overrides`` say otherwise) and its
    fake group of started workers."""

    def __init__(self, tmp_path: Path, *overrides: str, faults: Faults | None = None, lease: Any = None) -> None:
        self.job = fake_job("checkpoint.every_steps=4", "checkpoint.keep=10", *overrides)
        self.run = RunDirectory(tmp_path / "run")
        self.counters = dict.fromkeys(EVENT_COUNTERS, 0)
        self.group = FakeWorkerGroup(self.job, faults)
        self.group.start(self.job.scaling.workers)
        self.coordinator = CheckpointCoordinator(self.job, self.run, self.counters, lease)

    @property
    def storage(self) -> CheckpointStorage:
        return self.coordinator.storage

    def at(self, step: int) -> None:
        """Every member holds the state after ``step`` steps (where a snapshot of it may be taken)."""
        for member in self.group.members:
            member.next_step = step

    def write(self, step: int, **options: Any) -> None:
        """Take the checkpoint of ``step`` between two batches and wait for it."""
        self.at(step)
        self.coordinator.start(self.group, step, META, **options)
        self.coordinator.poll(wait_s=5.0)

    def events(self, kind: str) -> list[dict[str, Any]]:
        lines = (self.run.path / "events.jsonl").read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == kind]

    def has_manifest(self, step: int) -> bool:
        return self.storage.exists(f"step-{step:08d}/{MANIFEST}")


class LostLease:
    """A namespace lease another driver took over."""

    where = "/somewhere/lease.json"
    lost = "the checkpoint namespace's lease was taken by driver 4711"

    def check(self) -> str | None:
        return self.lost


class UnreadableLease:
    """A namespace lease whose file cannot be read just now."""

    where = "/somewhere/lease.json"
    lost = None

    def check(self) -> str | None:
        raise OSError("input/output error")


def test_a_checkpoint_is_due_once_the_interval_has_passed_since_the_newest_taken(tmp_path: Path) -> None:
    taken = Taken(tmp_path)
    checkpoints = taken.coordinator
    assert [checkpoints.due(step) for step in (0, 3, 4, 5)] == [False, False, True, True]
    taken.at(4)
    checkpoints.start(taken.group, 4, META)  # pending: the next counts from it
    assert not checkpoints.due(8) and checkpoints.due_behind_pending(8)
    assert not checkpoints.would_be_due(7) and checkpoints.would_be_due(8)
    checkpoints.poll(wait_s=5.0)
    assert checkpoints.pending is None and checkpoints.due(8) and not checkpoints.due_behind_pending(8)


def test_no_checkpoint_is_due_or_saved_when_they_are_off_unless_forced(tmp_path: Path) -> None:
    taken = Taken(tmp_path, "checkpoint.every_steps=0")
    checkpoints = taken.coordinator
    assert not any(checkpoints.would_be_due(step) for step in (1, 100, 10_000))
    taken.at(6)
    assert checkpoints.save_now(taken.group, 6, META, "final") is False and not taken.has_manifest(6)
    assert checkpoints.summary()["root"] is None and checkpoints.summary()["interval_steps"] is None
    # The save before failing is forced: it is taken even with checkpoints off.
    assert checkpoints.save_now(taken.group, 6, META, "before failing", force=True) is True
    assert taken.has_manifest(6) and checkpoints.summary()["root"] == checkpoints.root


def test_a_checkpoint_is_written_with_its_manifest_once_every_part_is(tmp_path: Path) -> None:
    taken = Taken(tmp_path)
    taken.write(4)
    manifest = verify_checkpoint(taken.storage, "step-00000004")
    assert len(manifest["files"]) == 3  # one part a worker
    meta = manifest["meta"]
    assert meta["stragglers"] == META["stragglers"] and meta["workers"] == 3
    assert meta["data_cursor"] == {"next_step": 4, "seed": taken.job.seed, "batch_size": taken.job.batch_size}
    assert taken.counters["checkpoints"] == 1 and taken.coordinator.committed_step == 4
    (record,) = taken.coordinator.written
    assert record.step == 4 and record.why == "periodic" and record.copy_s == 0.001
    assert record.bytes == sum(f["bytes"] for f in manifest["files"]) and record.write_cpu_s == pytest.approx(0.003)
    (event,) = taken.events("checkpoint")
    assert event["name"] == "step-00000004" and event["location"] == taken.storage.location("step-00000004")


def test_a_checkpoint_of_sharded_state_is_written_by_the_first_sharding_group_or_the_ranks_asked(
    tmp_path: Path
) -> None:
    taken = Taken(tmp_path, "scaling.workers=4", "sharding.group_size=2")
    taken.write(4)
    assert verify_checkpoint(taken.storage, "step-00000004")["meta"]["workers"] == 2
    taken.write(8, why="before failing", ranks=1)
    manifest = verify_checkpoint(taken.storage, "step-00000008")
    assert manifest["meta"]["workers"] == 1 and len(manifest["files"]) == 1


def test_a_failed_part_abandons_the_checkpoint_and_the_next_is_due_at_once(tmp_path: Path) -> None:
    taken = Taken(tmp_path, faults=Faults(die_writing={(1, 4)}))
    taken.write(4)
    assert taken.coordinator.pending is None and not taken.coordinator.written and not taken.has_manifest(4)
    (abandoned,) = taken.events("checkpoint_abandoned")
    assert abandoned["name"] == "step-00000004" and abandoned["reason"].startswith("a part failed")
    # Its writers are told to stop waiting on it; the interval counts from the last written (none).
    ((workers, name, _),) = taken.group.cancelled
    assert name == "step-00000004" and set(workers) <= {0, 1, 2} and workers
    assert taken.coordinator.due(4) and taken.counters["checkpoints"] == 0


def test_parts_missing_from_the_drivers_view_of_storage_abandon_the_checkpoint(tmp_path: Path) -> None:
    taken = Taken(tmp_path, faults=Faults(unwritten={(2, 4)}))
    taken.write(4)
    assert not taken.has_manifest(4) and not taken.coordinator.written
    (abandoned,) = taken.events("checkpoint_abandoned")
    assert "is missing" in abandoned["reason"]
    assert "storage that every worker and the driver share" in abandoned["reason"]


def test_a_checkpoint_taken_inside_a_batch_is_written_once_its_steps_copy_time_is_in(tmp_path: Path) -> None:
    taken = Taken(tmp_path)
    checkpoints, group = taken.coordinator, taken.group
    order = checkpoints.order(group, 4, META)
    assert isinstance(order, SnapshotOrder) and order.step == 4 and order.count == 3
    assert checkpoints.pending is not None and checkpoints.due_behind_pending(8)
    plan = StepPlan(shards_by_rank=(tuple(range(0, 6)), tuple(range(6, 11)), tuple(range(11, 16))))
    submitted = group.submit_steps(0, [plan] * 4, order)  # steps 0-3: the copy right after step 3
    (leader,) = submitted.reporting
    group.wait([leader], 1, 5.0)
    records = group.result(leader)
    group.release_followers()
    checkpoints.poll()  # every part written, but the copy's seconds come with step 3's commit
    assert checkpoints.pending is not None and not checkpoints.written
    checkpoints.copied(records[2])  # another step's reports tell nothing
    checkpoints.poll()
    assert checkpoints.pending is not None
    checkpoints.copied(records[3])
    checkpoints.poll()
    (record,) = checkpoints.written
    assert record.step == 4 and record.copy_s == 0.001 and taken.has_manifest(4)


def test_a_checkpoint_not_written_within_its_time_limit_is_abandoned(tmp_path: Path) -> None:
    taken = Taken(tmp_path, "timeouts.checkpoint_s=0.3")
    checkpoints = taken.coordinator
    checkpoints.order(taken.group, 4, META)  # its batch never runs: the writes never end
    checkpoints.poll()
    assert checkpoints.pending is not None and not taken.events("checkpoint_abandoned")
    time.sleep(0.4)
    checkpoints.poll()
    assert checkpoints.pending is None
    (abandoned,) = taken.events("checkpoint_abandoned")
    assert "not written within timeouts.checkpoint_s" in abandoned["reason"]


def test_a_lost_lease_abandons_the_checkpoint_and_fails_the_job(tmp_path: Path) -> None:
    taken = Taken(tmp_path, lease=LostLease())
    with pytest.raises(JobFailed, match="taken by driver 4711; this run writes no more checkpoints there"):
        taken.write(4)
    assert not taken.has_manifest(4)
    assert taken.events("checkpoint_abandoned")[0]["reason"] == LostLease.lost


def test_an_unreadable_lease_abandons_the_checkpoint_but_training_goes_on(tmp_path: Path) -> None:
    taken = Taken(tmp_path, lease=UnreadableLease())
    taken.write(4)  # no JobFailed
    assert not taken.has_manifest(4)
    reason = taken.events("checkpoint_abandoned")[0]["reason"]
    assert reason.startswith("cannot read the lease /somewhere/lease.json") and "input/output error" in reason


def test_only_the_newest_keep_checkpoints_are_kept(tmp_path: Path) -> None:
    taken = Taken(tmp_path, "checkpoint.keep=2")
    for step in (4, 8, 12):
        taken.write(step)
    assert [taken.has_manifest(step) for step in (4, 8, 12)] == [False, True, True]
    assert taken.events("checkpoint")[-1]["pruned"] == ["step-00000004"]


def test_saving_a_step_already_saved_and_verified_writes_nothing_new(tmp_path: Path) -> None:
    taken = Taken(tmp_path)
    taken.at(4)
    assert taken.coordinator.save_now(taken.group, 4, META, "final") is True
    assert taken.coordinator.save_now(taken.group, 4, META, "final") is True
    assert len(taken.coordinator.written) == 1 and taken.coordinator.attempts == 1


def test_a_save_whose_writer_dies_is_tried_again(tmp_path: Path) -> None:
    taken = Taken(tmp_path, faults=Faults(die_writing={(1, 4)}))
    taken.at(4)
    assert taken.coordinator.save_now(taken.group, 4, META, "final") is True
    assert taken.coordinator.attempts == 2 and len(taken.events("checkpoint_abandoned")) == 1
    assert taken.coordinator.written[-1].why == "final" and taken.has_manifest(4)


def test_a_save_that_keeps_failing_gives_up_after_its_attempts_without_raising(tmp_path: Path) -> None:
    taken = Taken(tmp_path, faults=Faults(unwritten={(0, 4)}))  # every attempt's part 0 goes missing
    taken.at(4)
    assert taken.coordinator.save_now(taken.group, 4, META, "final") is False
    assert taken.coordinator.attempts == SAVE_ATTEMPTS
    assert [("is missing" in e["reason"]) for e in taken.events("checkpoint_abandoned")] == [True] * SAVE_ATTEMPTS


def test_a_resumed_run_counts_the_interval_from_its_checkpoint_and_keeps_what_the_policy_learned(
    tmp_path: Path
) -> None:
    taken = Taken(tmp_path, "checkpoint.every_steps=auto", "checkpoint.max_every_steps=4")
    learned = {"step_s": 0.5, "cost_s": 0.25, "failures": 2, "elapsed_s": 100.0}
    point = ResumePoint(
        taken.coordinator.root, "step-00000008", 8, {"step": 8, "meta": {"policy": learned}}, [], taken.coordinator.job
    )
    taken.coordinator.resumed(point)
    assert taken.coordinator.policy.state() == learned
    assert not taken.coordinator.would_be_due(8) and not taken.coordinator.would_be_due(11)
    assert taken.coordinator.would_be_due(12)
    taken.coordinator.abandon("nothing pending")  # counts from the one resumed from, not from 0
    assert not taken.coordinator.would_be_due(11)


def test_the_summary_tells_what_was_written_and_where(tmp_path: Path) -> None:
    taken = Taken(tmp_path)
    assert taken.coordinator.summary() == {
        "written": 0, "root": taken.coordinator.root, "interval_steps": 4, "copy_s": [], "write_s": [],
        "write_cpu_s": [], "last": None,
    }
    taken.write(4)
    taken.write(8)
    summary = taken.coordinator.summary()
    assert summary["written"] == 2 and summary["last"] == "step-00000008" and summary["copy_s"] == [0.001, 0.001]
    assert len(summary["write_s"]) == 2 and summary["write_cpu_s"] == pytest.approx([0.003, 0.003])

