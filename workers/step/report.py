"""A step's report (``StepTelemetry``) from what this worker did in it: the figures the
driver's ledger, policies and telemetry read (``TrainWorker.train_step`` hands it back)."""

from __future__ import annotations

from dataclasses import dataclass

from jobspec.wire import StepTelemetry
from workers.step.records import RescuePass, StepWork
from workers.step.verdict import GradientUpdate, StepCensus


@dataclass(frozen=True)
class StepClock:
    """``time.perf_counter()`` readings of one step: its start, the end of its own passes
    (before the all-reduce's wait and any rescue pass), the end of its reduction and the end of
    its optimizer update."""

    started: float
    computed: float
    reduced: float
    done: float


@dataclass(frozen=True)
class StepTraffic:
    """What the step sent: the group's cumulative bytes after it, and the claim store's round
    trips and bytes during it."""

    bytes_sent: int
    store_round_trips: int
    store_bytes: int


def step_report(
    step: int,
    rank: int,
    worker: int,
    work: StepWork,
    rescue: RescuePass,
    census: StepCensus,
    update: GradientUpdate,
    local_weight: float,
    lr: float,
    skipped: bool,
    clock: StepClock,
    comm_s: float,
    traffic: StepTraffic,
) -> StepTelemetry:
    """The report of ``step`` by ``worker`` (rank ``rank``): ``work`` its passes (``rescue`` its
    share of the rescue pass, already counted in ``work``), ``census`` the reduced bookkeeping,
    ``update`` the gradient's norm, ``local_weight`` this rank's loss weight, ``lr`` and ``skipped`` the optimizer's step, ``comm_s`` the
    seconds waited for the reduction (the rescue pass's included)."""
    busy_s = work.compute_s + work.slowed_s
    return StepTelemetry(
        step=step,
        rank=rank,
        worker=worker,
        shards=tuple(sorted(work.committed)),
        samples=work.total.samples,
        global_samples=census.samples,
        shards_counted=census.shards_counted,
        lr=lr,
        loss=census.loss_sum / census.weight,
        weight=census.weight,
        grad_norm=update.grad_norm,
        skipped=skipped,
        compute_s=clock.computed - clock.started - work.idle_s - work.stalled_s,  # before any rescue pass
        comm_s=comm_s,
        optim_s=clock.done - clock.reduced,
        step_s=clock.done - clock.started,
        shards_run=work.shards_run,
        shard_s=busy_s / work.shards_run if work.shards_run else 0.0,
        samples_per_s=work.total.samples / busy_s if busy_s > 0 else 0.0,
        weight_per_s=local_weight / busy_s if busy_s > 0 else 0.0,
        idle_s=work.idle_s,
        stalled_s=work.stalled_s,
        gave_up=work.gave_up,
        rescued=rescue.shards,
        rescue_s=rescue.seconds,
        bytes_sent=traffic.bytes_sent,
        stolen=work.stolen,
        backups=work.backups,
        backups_won=work.backups_won,
        races_lost=work.races_lost,
        store_round_trips=traffic.store_round_trips,
        store_bytes=traffic.store_bytes,
    )
