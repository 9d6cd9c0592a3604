"""Step accounting (``orchestrator/accounting/step_sinks.py``): one committed step fanned out
to its sinks (the ledger, the start-up milestones, telemetry, the observers of complete steps,
the checkpoint interval, the ``step`` event and the ``recovered`` event of a recovery it
closes), and what the account adds up to: the goodput so far and the job's summary."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest

from jobspec.step_record import StepRecord
from jobspec.wire import StepTelemetry, WorkerInfo
from orchestrator.accounting import ledger as ledger_module
from orchestrator.accounting import recovery_log, step_sinks
from orchestrator.accounting.recovery_log import Recovery
from orchestrator.accounting.step_sinks import StepAccounting
from orchestrator.accounting.summary import EVENT_COUNTERS
from orchestrator.checkpoints.coordinator import CheckpointCoordinator, CheckpointRecord
from orchestrator.output.run_dir import RunDirectory
from orchestrator.steps.states import Failed, Finished
from tests.helpers.fake_group import FakeWorkerGroup
from tests.helpers.fake_runs import fake_job

SHARDS = 16  # fake_job's


class Clock:
    """Stands in for the modules' ``time``: ``perf_counter()`` and ``time()`` move together."""

    def __init__(self) -> None:
        self.perf = 100.0
        self.wall = 50_000.0

    def advance(self, seconds: float) -> None:
        self.perf += seconds
        self.wall += seconds

    def module(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(perf_counter=lambda: self.perf, time=lambda: self.wall)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(step_sinks, "time", fake.module())
    monkeypatch.setattr(ledger_module, "time", fake.module())  # the ledger's commit times
    monkeypatch.setattr(recovery_log, "time", fake.module())  # the recoveries' spans
    return fake


def accounting(tmp_path: Path, launched: float, *overrides: str) -> StepAccounting:
    job = fake_job(*overrides)
    run = RunDirectory(tmp_path / "run")
    counters = dict.fromkeys(EVENT_COUNTERS, 0)
    return StepAccounting(job, run, FakeWorkerGroup(job), CheckpointCoordinator(job, run, counters), counters, launched)


def record(step: int, step_s: tuple[float, float] = (0.5, 0.75), **fields: Any) -> StepRecord:
    """Step ``step`` as two ranks report it, each with half the shards."""
    reports = [
        StepTelemetry(
            step=step, rank=rank, worker=10 + rank, shards=tuple(range(rank * 8, rank * 8 + 8)), samples=128,
            global_samples=256, loss=2.0 - step * 0.1, compute_s=0.1, comm_s=0.0, optim_s=0.0, step_s=step_s[rank],
            shards_counted=SHARDS, lr=0.01, weight=256.0, grad_norm=1.5, **fields,
        )
        for rank in range(2)
    ]
    return StepRecord.of(step, reports)


def events(account: StepAccounting, kind: str | None = None) -> list[dict[str, Any]]:
    lines = (account.run.path / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if kind is None or e["event"] == kind]


def telemetry_steps(account: StepAccounting) -> list[int]:
    return [json.loads(line)["step"] for line in (account.run.path / "telemetry.jsonl").read_text().splitlines()]


def test_a_committed_step_is_counted_written_to_telemetry_and_announced_with_its_figures(
    tmp_path: Path, clock: Clock
) -> None:
    account = accounting(tmp_path, clock.perf)
    account.commit(0, record(0), complete=True)
    assert account.ledger.steps_done == 1 and account.ledger.samples == 256
    assert telemetry_steps(account) == [0]
    (step,) = events(account, "step")
    assert step["step"] == 0 and step["loss"] == 2.0 and step["samples"] == 256
    assert step["step_s"] == 0.75  # the slowest rank's
    assert step["lr"] == 0.01 and step["grad_norm"] == 1.5 and step["weight_per_s"] == pytest.approx(256 / 0.75)
    assert "skipped" not in step
    assert account.last_record is not None and account.last_record.step == 0


def test_a_step_the_loss_scaler_skipped_says_so_in_its_event(tmp_path: Path, clock: Clock) -> None:
    account = accounting(tmp_path, clock.perf)
    account.commit(0, record(0, skipped=True), complete=True)
    assert events(account, "step")[0]["skipped"] is True


def test_only_steps_committed_with_every_ranks_report_reach_the_observers(tmp_path: Path, clock: Clock) -> None:
    account = accounting(tmp_path, clock.perf)
    seen: list[tuple[int, StepRecord]] = []
    account.observers.append(lambda step, rec: seen.append((step, rec)))
    complete = record(0)
    account.commit(0, complete, complete=True)
    account.commit(1, record(1), complete=False)  # survivors finished it: some rows may be missing
    assert seen == [(0, complete)]


def test_a_step_committed_without_reports_is_counted_with_no_figures_and_no_telemetry(
    tmp_path: Path, clock: Clock
) -> None:
    account = accounting(tmp_path, clock.perf)
    account.commit(0, record(0), complete=True)
    empty = StepRecord.of(1, [])
    account.commit(1, empty, complete=False)
    assert account.ledger.steps_done == 2 and account.ledger.samples == 256  # the reportless step adds none
    assert telemetry_steps(account) == [0]
    last = events(account, "step")[-1]
    assert last["step"] == 1 and last["samples"] is None and last["step_s"] == 0.0 and "lr" not in last
    assert account.last_record is empty


def test_the_first_commit_marks_the_first_step_milestone_once(tmp_path: Path, clock: Clock) -> None:
    account = accounting(tmp_path, clock.perf)
    clock.advance(3.0)
    account.commit(0, record(0), complete=True)
    clock.advance(1.0)
    account.commit(1, record(1), complete=True)
    assert account.startup_s["first_step"] == pytest.approx(3.0)


def test_the_step_that_closes_a_recovery_is_followed_by_its_recovered_event(tmp_path: Path, clock: Clock) -> None:
    account = accounting(tmp_path, clock.perf)
    redone = Recovery(
        at_step=0, workers=[1], reasons={1: "died"}, started=clock.wall - 2.0, detect_s=0.5, redo_steps=[0, 1]
    )
    account.recoveries.opened(redone)
    clock.advance(1.0)
    account.commit(0, record(0), complete=True)
    assert not events(account, "recovered")  # step 1 is still being redone
    clock.advance(1.0)
    account.commit(1, record(1), complete=True)
    kinds = [e["event"] for e in events(account) if e["event"] in ("step", "recovered")]
    assert kinds == ["step", "step", "recovered"]
    (recovered,) = events(account, "recovered")
    assert recovered["workers"] == [1] and recovered["redo_steps"] == [0, 1]
    assert recovered["first_step_s"] == pytest.approx(3.0) and recovered["redo_s"] == pytest.approx(2.0)
    assert account.recoveries.done == [redone]


def test_each_steps_slowest_seconds_feed_the_checkpoint_interval(tmp_path: Path, clock: Clock) -> None:
    account = accounting(tmp_path, clock.perf, "checkpoint.every_steps=auto")
    account.commit(0, record(0, step_s=(0.25, 2.0)), complete=True)
    assert account.checkpoints.policy.state()["step_s"] == 2.0
    account.commit(1, StepRecord.of(1, []), complete=False)  # no time measured: nothing learned
    assert account.checkpoints.policy.state()["step_s"] == 2.0


def test_workers_launched_marks_the_slowest_worker_in_seconds_since_launch(tmp_path: Path, clock: Clock) -> None:
    launched = clock.perf
    clock.advance(10.0)  # the launch was at wall time 50_000
    account = accounting(tmp_path, launched)
    info = [
        WorkerInfo(0, 100, 20, 10, "cpu", "n0", "h", 1, started_at=50_001.0, imported_at=50_004.0, built_at=50_006.0),
        WorkerInfo(1, 100, 20, 10, "cpu", "n1", "h", 2, started_at=50_002.5, imported_at=50_003.0, built_at=50_008.0),
    ]
    account.workers_launched(info)
    assert account.startup_s == pytest.approx(
        {"worker_process_started": 2.5, "worker_code_loaded": 4.0, "worker_built": 8.0}
    )
    unknown_start = [
        WorkerInfo(0, 100, 20, 10, "cpu", "n0", "h", 1, started_at=None, imported_at=50_001.0, built_at=50_002.0)
    ]
    fresh = accounting(tmp_path / "other", launched)
    fresh.workers_launched(unknown_start)
    assert "worker_process_started" not in fresh.startup_s


def test_goodput_while_finishing_charges_the_time_since_the_last_commit_to_finishing(
    tmp_path: Path, clock: Clock
) -> None:
    account = accounting(tmp_path, clock.perf)
    account.mark("group_formed", 1.0)
    clock.advance(2.0)
    account.commit(0, record(0), complete=True)
    clock.advance(5.0)
    assert account.goodput().lost_s["finishing"] == 0.0
    finishing = account.goodput(finishing=True)
    assert finishing.wall_s == pytest.approx(7.0)
    assert finishing.lost_s["finishing"] == pytest.approx(5.0) and finishing.lost_s["startup"] == pytest.approx(1.0)


def test_goodput_while_finishing_with_no_step_committed_counts_from_the_group_forming(
    tmp_path: Path, clock: Clock
) -> None:
    account = accounting(tmp_path, clock.perf)
    account.mark("group_formed", 1.5)
    clock.advance(4.0)
    assert account.goodput(finishing=True).lost_s["finishing"] == pytest.approx(2.5)


def test_goodput_while_finishing_leaves_out_what_happened_inside_the_finish(tmp_path: Path, clock: Clock) -> None:
    """A recovery still redoing when the last step committed, and the copy of a checkpoint of
    the last step (the final one), are inside the finishing time, not charged again."""
    account = accounting(tmp_path, clock.perf)
    account.mark("group_formed", 0.0)
    account.commit(0, record(0), complete=True)
    account.checkpoints.written += [
        CheckpointRecord("step-00000000", 0, "periodic", 0.5, 1.0, 10, 0.1),
        CheckpointRecord("step-00000001", 1, "final", 0.25, 1.0, 10, 0.1),
    ]
    still_redoing = Recovery(at_step=1, workers=[1], reasons={}, started=clock.wall, detect_s=0.75, redo_steps=[5])
    account.recoveries.opened(still_redoing)
    clock.advance(10.0)
    running = account.goodput()
    assert running.lost_s["detection"] == pytest.approx(0.75)
    assert running.lost_s["checkpoint_stalls"] == pytest.approx(0.75)
    finishing = account.goodput(finishing=True)
    assert finishing.lost_s["detection"] == 0.0
    assert finishing.lost_s["checkpoint_stalls"] == pytest.approx(0.5)


def test_the_summary_names_the_end_state_with_its_error_or_metrics(tmp_path: Path, clock: Clock) -> None:
    account = accounting(tmp_path, clock.perf)
    account.commit(0, record(0), complete=True)
    account.counters["failures"] = 2
    common = {"num_steps": 20, "train_s": 1.0, "workers": {"start": 3, "end": 2}, "control_plane": {}}
    failed = account.summary(Failed("step 1: ValueError: bad"), **common)
    assert failed["status"] == "failed" and failed["error"] == "step 1: ValueError: bad" and failed["eval"] == {}
    assert failed["steps"] == 1 and failed["events"]["failures"] == 2 and failed["steps_planned"] == 20
    finished = account.summary(Finished({"accuracy": 0.9}), **common)
    assert finished["status"] == "finished" and "error" not in finished and finished["eval"] == {"accuracy": 0.9}
