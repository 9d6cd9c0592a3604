"""``step_report`` (``workers/step/report.py``): a step's ``StepTelemetry`` from what the worker
did in it. The loss is the census's sum over its weight; a step's own compute leaves out the
time it waited (for others' shards, for its data) and what it spent after its passes; busy
time (compute plus injected slowness) gives the per-shard and per-sample rates."""

from __future__ import annotations

import pytest

from workers.step.records import PassResult, RescuePass, StepWork
from workers.step.report import StepClock, StepTraffic, step_report
from workers.step.verdict import GradientUpdate, StepCensus


def _report(work: StepWork, rescue: RescuePass = RescuePass()):
    census = StepCensus(shards_counted=8, loss_sum=12.0, samples=64, weight=48.0)
    clock = StepClock(started=100.0, computed=100.9, reduced=101.2, done=101.5)
    return step_report(
        7, 1, 4, work, rescue, census, GradientUpdate(grad_norm=0.5), 24.0, 0.01, False, clock, 0.25,
        StepTraffic(bytes_sent=1000, store_round_trips=3, store_bytes=120),
    )


def test_a_step_reports_the_census_loss_its_own_compute_and_its_rates():
    work = StepWork(committed=[5, 2], total=PassResult(0.0, 24.0, 32), shards_run=3, compute_s=0.4, slowed_s=0.2,
                    idle_s=0.1, stalled_s=0.3, stolen=1, backups=1, backups_won=0, races_lost=1)
    report = _report(work)
    assert (report.step, report.rank, report.worker, report.shards) == (7, 1, 4, (2, 5))
    assert report.loss == pytest.approx(12.0 / 48.0) and report.shards_counted == 8 and report.global_samples == 64
    assert report.compute_s == pytest.approx(0.9 - 0.1 - 0.3)  # its passes, less the waits between them
    assert report.optim_s == pytest.approx(0.3) and report.step_s == pytest.approx(1.5) and report.comm_s == 0.25
    assert report.shard_s == pytest.approx(0.6 / 3)  # busy: compute and the slowness chaos stood in for
    assert report.samples_per_s == pytest.approx(32 / 0.6) and report.weight_per_s == pytest.approx(24.0 / 0.6)
    assert (report.stolen, report.backups, report.backups_won, report.races_lost) == (1, 1, 0, 1)
    assert (report.bytes_sent, report.store_round_trips, report.store_bytes) == (1000, 3, 120)


def test_a_rank_that_ran_nothing_reports_no_rates_and_its_share_of_the_rescue():
    report = _report(StepWork(gave_up=True, stalled_s=0.9), RescuePass(shards=2, seconds=0.4, comm_s=0.1))
    assert report.shards == () and report.shards_run == 0
    assert report.shard_s == 0.0 and report.samples_per_s == 0.0 and report.weight_per_s == 0.0
    assert report.gave_up and (report.rescued, report.rescue_s) == (2, 0.4)
