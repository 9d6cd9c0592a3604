"""ControlPlaneMeter: per-step driver cost from commit to commit, warm-up and recoveries left out."""

from __future__ import annotations

import time

import pytest

from jobspec.step_record import StepRecord
from jobspec.wire import StepTelemetry
from orchestrator.output.control_meter import WARMUP_STEPS, ControlPlaneMeter


def _report(trips: int, nbytes: int) -> StepTelemetry:
    return StepTelemetry(
        step=0, rank=0, worker=0, shards=(0,), samples=1, global_samples=1, loss=0.0, compute_s=0.0,
        comm_s=0.0, optim_s=0.0, step_s=0.0, store_round_trips=trips, store_bytes=nbytes,
    )


def _batch(by_rank: list[list[StepTelemetry]]) -> list[StepRecord]:
    """A batch's records from each rank's reports (``by_rank[r]``: one per step)."""
    return [StepRecord.of(index, [reports[index] for reports in by_rank]) for index in range(len(by_rank[0]))]


def test_intervals_between_commits_after_warm_up_with_the_wait_taken_out():
    meter = ControlPlaneMeter()
    meter.restart()
    for _ in range(WARMUP_STEPS):  # the first steps are warm-up: not counted
        meter.committed(_batch([[_report(1, 10)]]))
    assert meter.summary() == {}
    for _ in range(3):
        time.sleep(0.02)
        meter.waited(0.015)  # blocked on the workers for most of the interval
        meter.driver_store(1, 100)
        meter.committed(_batch([[_report(2, 30)], [_report(3, 40)]]))  # two ranks
    summary = meter.summary()
    assert summary["steps_measured"] == 3
    assert summary["store_round_trips"] == 1 + 2 + 3 and summary["store_bytes"] == 100 + 30 + 40
    assert summary["step_wall_ms"] >= 19
    assert summary["driver_busy_ms"] == pytest.approx(summary["step_wall_ms"] - 15, abs=0.5)
    assert 0 <= summary["driver_cpu_ms"] < summary["step_wall_ms"]  # sleeping costs no CPU


def test_a_recovery_between_two_commits_is_not_a_step():
    meter = ControlPlaneMeter()
    for _ in range(WARMUP_STEPS + 1):
        meter.committed([])
    assert meter.summary()["steps_measured"] == 1
    meter.restart()  # Recovering, then Running again: warm-up anew, and the gap is no step
    time.sleep(0.05)
    for _ in range(WARMUP_STEPS + 1):
        meter.committed([])
    summary = meter.summary()
    assert summary["steps_measured"] == 2 and max(s.wall_s for s in meter.steps) < 0.04


def test_a_batch_spreads_its_interval_over_its_steps():
    meter = ControlPlaneMeter()
    for _ in range(WARMUP_STEPS):
        meter.committed(_batch([[_report(1, 10)]]))
    time.sleep(0.04)
    meter.waited(0.02)
    # Two ranks, four steps each: one interval, four steps of a quarter of it.
    meter.committed(_batch([[_report(2, 20)] * 4, [_report(2, 20)] * 4]))
    summary = meter.summary()
    assert summary["steps_measured"] == 4
    assert 9.5 <= summary["step_wall_ms"] < 20
    assert summary["driver_busy_ms"] == pytest.approx(summary["step_wall_ms"] - 5, abs=0.5)
    assert summary["store_round_trips"] == 4 and summary["store_bytes"] == 40
    assert summary["steps_per_call"] == 4


def test_the_store_process_cpu_is_measured_apart_as_a_mean():
    ticks = iter([0.0, 0.0, 0.0, 0.01, 0.01, 0.05])  # /proc's 10 ms ticks, read at each commit
    meter = ControlPlaneMeter(server_cpu_s=lambda: next(ticks))
    for _ in range(WARMUP_STEPS):
        meter.committed(_batch([[_report(1, 10)]]))
    meter.committed(_batch([[_report(1, 10)]]))  # +10 ms over one step
    meter.committed(_batch([[_report(1, 10)]]))  # nothing this step
    meter.committed(_batch([[_report(1, 10)] * 2]))  # +40 ms over a batch of two
    assert meter.summary()["store_cpu_ms"] == pytest.approx(50 / 4)
    assert "store_cpu_ms" not in ControlPlaneMeter().summary()  # in-process store: in the driver's CPU


def test_the_store_process_cpu_grows_with_the_traffic_it_serves():
    """The reading itself, from /proc: a store process that served a few thousand round trips
    has used CPU (the control-plane bench's per-step figure may round to 0 ticks)."""
    from orchestrator.store.rendezvous import RendezvousStore

    store = RendezvousStore("127.0.0.1", 10.0, own_process=True)
    try:
        before = store.server_cpu_s()
        assert before is not None
        deadline = time.monotonic() + 20.0
        while store.server_cpu_s() < before + 0.05 and time.monotonic() < deadline:
            for i in range(1000):
                store.read(f"key{i}")  # a round trip each, served by the store's process
        assert before + 0.05 <= store.server_cpu_s() < before + 20.0
    finally:
        store.close()


def test_per_worker_gauges_are_set_at_most_every_few_seconds_not_every_step(monkeypatch):
    from orchestrator.output import metrics
    from orchestrator.output.metrics import WORKER_GAUGES_EVERY_S, JobMetrics
    from policies.goodput import Goodput

    recorded: list[tuple[str, dict]] = []
    monkeypatch.setattr(JobMetrics, "__init__", lambda self, job: setattr(self, "_workers_set_at", None))
    monkeypatch.setattr(JobMetrics, "_set", lambda self, name, value, **tags: recorded.append((name, tags)))
    monkeypatch.setattr(JobMetrics, "observe_counters", lambda self, counters: None)
    monkeypatch.setattr(JobMetrics, "observe_goodput", lambda self, goodput: None)
    clock = [100.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: clock[0])
    job_metrics = JobMetrics("job")
    record = _batch([[_report(0, 0)], [_report(0, 0)]])[0]

    def per_worker_sets() -> int:
        job_metrics.observe_step(record, 0.1, 1, 2, {}, Goodput(1.0, {}))  # type: ignore[arg-type]
        return sum(name == "ringleader_worker_shard_seconds" for name, _ in recorded)

    assert per_worker_sets() == 2  # the first step: every worker's
    clock[0] += WORKER_GAUGES_EVERY_S / 2
    assert per_worker_sets() == 2  # the old code: 4 (every worker, every step)
    clock[0] += WORKER_GAUGES_EVERY_S / 2
    assert per_worker_sets() == 4
