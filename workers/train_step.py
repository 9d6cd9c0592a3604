"""One training step on a worker, read in one place in the order it runs (docs/architecture.md,
"The step protocol"): compute this rank's shards, reduce, judge the reduced gradient once on the
host, rescue shards nobody ran, then clip, step the optimizer, gather the other slices
(sharded state) and report. The passes are ``workers/step/passes.py``; how the state lies over
the group (whole or in slices) is the link's ``StateLayout`` (``workers/state_layout.py``).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable

from jobspec.job import JobConfig
from jobspec.wire import Phase, StepTelemetry
from policies.schedule import LearningRateSchedule
from policies.work_stealing import StepPlan
from workers.comm.gradient_reducer import GradientReducer
from workers.group_link import GroupLink
from workers.model.buffers import StepBuffers
from workers.replica import Replica
from workers.runtime.chaos import ChaosSchedule, kill_self
from workers.step.census import WEIGHT_SLOT, census_slots
from workers.step.claims import ClaimStores, ShardClaims
from workers.step.records import ClaimedStep, RescuePass, StepWork
from workers.step.report import StepClock, StepTraffic, step_report
from workers.step.rescue_watch import rescue_watch
from workers.step.runner import StepRunner
from workers.step.verdict import (
    GradientMeasure,
    GradientUpdate,
    StepCensus,
    StepVerdict,
    measure_gradient,
    read_verdict,
)

#: The rescue watch over a step's peers while this rank waits in its all-reduce (``rescue_watch``).
Watch = Callable[[], float | None]


class StepTrainer:
    """Runs ``replica``'s training steps over its ``link`` to the group, its shards' passes by
    ``runner``. ``on_phase(step, phase)`` tells the worker where the step is (its ``progress``);
    ``on_death`` records this worker's death before chaos kills it."""

    def __init__(
        self, job: JobConfig, replica: Replica, link: GroupLink, runner: StepRunner, buffers: StepBuffers,
        schedule: LearningRateSchedule, num_steps: int, chaos: ChaosSchedule, abort_flag: threading.Event,
        on_phase: Callable[[int, Phase], None], on_death: Callable[[], None], worker_id: int,
    ) -> None:
        self.job, self.replica, self.link, self.runner, self.buffers = job, replica, link, runner, buffers
        self.schedule, self.num_steps, self.chaos, self.abort_flag = schedule, num_steps, chaos, abort_flag
        self.on_phase, self.on_death, self.worker_id = on_phase, on_death, worker_id

    def run(self, step: int, plan: StepPlan) -> StepTelemetry:
        """Step ``step`` with ``plan``: as ``TrainWorker.train_step`` says."""
        replica, link = self.replica, self.link
        reducer, claims_store = link.reducer, link.claims_store
        if reducer is None or claims_store is None:
            raise RuntimeError("train_step called before join_group")
        if step != replica.next_step:
            # Applying a step twice (or skipping one) would corrupt the replica silently.
            raise RuntimeError(f"asked for step {step}, but this replica's next step is {replica.next_step}")
        started = time.perf_counter()
        store_trips, store_bytes = claims_store.round_trips, claims_store.bytes
        link.reducing_step = step
        self.on_phase(step, Phase.STALL)  # until its data is there (and any injected stall is over)
        replica.flat.zero()
        self.buffers.begin()
        self.runner.loss_scale = replica.scaler.scale
        work, claimed, watch = self._compute(step, plan, reducer, claims_store)
        computed = time.perf_counter()
        self.on_phase(step, Phase.REDUCE)
        if self.chaos.kill_due("step", step):
            kill_self(self.on_death)  # mid all-reduce: overlapped buckets are on the wire
        comm_s = reducer.finish(watch)
        rescue = RescuePass()
        verdict, measure = self._judge(step, plan.num_shards, work)  # the step's one host sync
        if claimed is not None:
            missing = verdict.missing_shards()
            if missing:  # rare: a rank gave up waiting for its data; its shards run now
                rescue = self.runner.rescue(claimed, work, missing)
                comm_s += rescue.comm_s
                verdict, measure = self._judge(step, plan.num_shards, work)
            claimed.claims.forget()
        self.chaos.record(step, work.compute_s, work.shards_run)
        census, update = verdict.census(step), verdict.update()
        link.commit_residuals()
        reduced = time.perf_counter()
        if math.isfinite(update.grad_norm):
            measure.apply()
        lr = replica.optimizer.base_lr * self.schedule.factor(step, self.job.schedule.total_steps or self.num_steps)
        # Sharded: the scale and the step's buffers as they were kept until the all-gather completes.
        link.before_update(step, [(replica.scaler.state, replica.scaler.state.clone()), *self.buffers.pre_step()])
        skipped = replica.scaler.update(update.grad_norm)
        if not replica.scaler.enabled and not math.isfinite(update.grad_norm):
            raise _not_finite(step, census, update)
        if not skipped:
            replica.optimizer.step(lr=lr)
        self.buffers.apply(replica.flat.extra[census_slots(plan.num_shards) :])  # as DDP, a skipped step's too
        link.gather_stepped(replica, step, stepped=not skipped)  # sharded: the other slices' parameters
        replica.next_step = step + 1
        self.on_phase(step, Phase.DONE)
        clock = StepClock(started, computed, reduced, time.perf_counter())
        traffic = StepTraffic(
            link.group.bytes_sent if link.group is not None else 0,
            claims_store.round_trips - store_trips, claims_store.bytes - store_bytes,
        )
        return step_report(
            step, link.rank, self.worker_id, work, rescue, census, update, verdict.local_weight, lr, skipped, clock,
            comm_s, traffic,
        )

    def _compute(
        self, step: int, plan: StepPlan, reducer: GradientReducer, claims_store: ClaimStores
    ) -> tuple[StepWork, ClaimedStep | None, Watch | None]:
        """This rank's passes of ``step``: exactly its planned shards, or (the plan's mitigations
        on) the shards it claims, steals and backs up through the driver's store, with the
        rescue watch over its peers while it waits on the all-reduce."""
        rank = self.link.rank
        if not plan.mitigating:
            return self.runner.run_fixed(step, list(plan.shards_by_rank[rank]), plan.num_shards, reducer), None, None
        claims = ShardClaims(claims_store, step, plan, rank)
        claimed = ClaimedStep(step, plan, claims, reducer, self.job.timeouts.collective_s, self.abort_flag)
        work = self.runner.run_claimed(claimed)
        return work, claimed, rescue_watch(claimed, work)

    def _judge(self, step: int, num_shards: int, work: StepWork) -> tuple[StepVerdict, GradientMeasure]:
        """The reduced ``step``'s measure (on the device) and verdict (read in one copy)."""
        flat = self.replica.flat
        grads, sum_squares = self.link.owned_gradient(flat)  # sharded: its slice, the norm from all
        weight = flat.extra[num_shards + WEIGHT_SLOT]
        scaled_by = self.runner.loss_scale / self.runner.sampler.step_batch_size(step)
        clip = self.job.optimizer.clip_grad_norm
        measure = measure_gradient(grads, weight, scaled_by, clip, sum_squares)
        return read_verdict(flat.extra, num_shards, measure, clip, work.total.weight), measure


def _not_finite(step: int, census: StepCensus, update: GradientUpdate) -> FloatingPointError:
    """Why step ``step`` stops the job: every replica holds this same gradient, so all stop
    there, better than parameters turned to nan (fp16 skips such steps instead: that is what
    its scaler is for)."""
    return FloatingPointError(
        f"step {step}: the reduced gradient is not finite (norm {update.grad_norm}, loss "
        f"{census.loss_sum / census.weight}): the loss diverged or the data holds inf or nan"
    )
