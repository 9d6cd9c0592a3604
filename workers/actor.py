"""The training worker: one Ray actor per rank, holding a model replica and its optimizer.

Methods run in three concurrency groups: ``compute`` (one at a time, in submission order: the
step pipeline), ``control`` (answers while a step runs, so the driver can always ask) and
``io`` (waits for background checkpoint writes without holding up either).

The actor takes the driver's calls and delegates: joining and leaving a group to
``workers/group_link.py``, a training step to ``workers/train_step.py`` (its passes
``workers/step/passes.py``), checkpoints to ``workers/replica_checkpoint.py``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Any, Callable

import ray
import torch

from jobspec.chaos import KillPoint
from jobspec.failures import CollectiveAborted, CollectiveTimeout, ShardCensusError
from jobspec.job import JobConfig
from jobspec.step_record import StepRecord
from jobspec.stream import DataFeed
from jobspec.targets import optional_callable
from jobspec.wire import (
    Joined,
    JoinRequest,
    PartWritten,
    Phase,
    Progress,
    SnapshotOrder,
    SnapshotRequest,
    StepTelemetry,
    WorkerInfo,
)
from policies.work_stealing import StepPlan
from workers.checkpoint.reading import load_residuals
from workers.checkpoint.storage import CheckpointStorage
from workers.comm.communicator import pick_backend
from workers.data.batches import fetch_batch, move_to
from workers.data.files import open_source
from workers.data.sampler import ShardSampler
from workers.group_link import GroupLink
from workers.model.buffers import StepBuffers
from workers.model.build import build_model
from workers.model.evaluate import evaluate_job
from workers.model.objective import Objective
from workers.model.precision import autocast
from workers.optim.loss_scaler import LossScaler
from workers.replica_checkpoint import CheckpointWriter, restore_state
from workers.runtime.chaos import ChaosSchedule, death_key, kill_self
from workers.runtime.devices import make_current, on_worker_device, worker_device
from workers.sharding.optimizer import build_optimizer
from workers.state_layout import state_layout
from workers.step import published_plans
from workers.step.census import census_slots
from workers.step.runner import StepRunner
from workers.train_step import StepTrainer

#: When this module (and with it torch and the worker's code) had loaded: the launch's breakdown.
IMPORTED_AT = time.time()
# Reports kept for recovery: more than the steps the driver keeps in flight (two batches).
KEPT_REPORTS = 64


def compute_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """A method of the ``compute`` group, run with the worker's device current on Ray's thread
    for it (``devices.on_worker_device``): every method that touches CUDA is one."""
    return ray.method(concurrency_group="compute")(on_worker_device(method))


def process_started_at() -> float | None:
    """This process's start, epoch seconds (Linux: from /proc, to the clock tick), else None."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - age_s


class TrainWorker:
    """A model replica. Built identically on every rank; rank 0's parameters win at join.

    ``job`` is the validated job (the same for every rank); ``worker_id`` names the worker for
    its whole life (ranks change when the group re-forms); chaos settings refer to it.
    ``device``: where a worker built outside Ray trains (the memory probe,
    ``orchestrator/commands/memory_probe.py``); by default the GPU Ray assigned, or the CPU.
    """

    def __init__(
        self, job: JobConfig, worker_id: int = 0, device: torch.device | None = None,
        data: dict[str, DataFeed] | None = None,
    ) -> None:
        self.job = job
        self.data = data or {}  # by source name: file indexes, stream feeders (orchestrator/data/)
        self.worker_id = worker_id
        # The GPU Ray assigned (cuda:0 here, as Ray narrows CUDA_VISIBLE_DEVICES to it), made
        # current on this thread before any CUDA work; compute methods make it current on theirs.
        if device is None:
            device = worker_device(ray.get_gpu_ids() if ray.is_initialized() else [])
        else:
            make_current(device)
        self.device = device
        pick_backend(self.device, job.collective.backend)  # nccl without CUDA fails here, not at the first join
        torch.manual_seed(job.seed)
        self.dataset = open_source(job.dataset, self.data.get("dataset"))
        num_samples = len(self.dataset)
        total = None if job.epochs is None else max(1, round(job.epochs * num_samples))
        self.sampler = ShardSampler(num_samples, job.batch_size, job.shards, job.seed, total, job.dataset.shuffle)
        self.num_steps = job.steps if job.steps is not None else self.sampler.num_steps
        self.model, self.flat = build_model(job, self.device)
        self.objective = Objective(job.loss.name, job.loss.kwargs)
        # Batch-dependent layers (BatchNorm): a pass per shard, buffers kept in step (docs/architecture.md, "Model buffers").
        self.buffers = StepBuffers.of(self.model, self._probe_forward)
        # Slots in front of the gradient: one census entry per shard, the step's bookkeeping, the
        # buffers' changes. Sharded, no gradient until the join gives this rank its slice.
        extra = census_slots(job.shards) + self.buffers.slots
        self.flat.hold_gradients(extra, (0, 0) if job.sharding.enabled else None)
        self.optimizer = build_optimizer(job, self.flat)
        self.state = state_layout(self.optimizer, job.sharding.group_size)
        self.schedule = job.schedule.policy()
        scaling = job.loss_scaling
        self.scaler = LossScaler(
            job.precision == "fp16", scaling.init, scaling.growth, scaling.backoff, scaling.growth_interval, self.device
        )
        self.abort_flag = threading.Event()
        self.aborted_through = 0  # the latest generation the driver aborted
        self.generation = 0  # the generation this worker last joined
        self.link = GroupLink(job.collective, job.timeouts.collective_s, self.abort_flag, self._chaos_point)
        #: The next step this replica will apply: the optimizer steps it holds, in job steps.
        self.next_step = 0
        # The reports of the last steps applied: a batch whose call failed part-way (aborted
        # after a peer died) returns nothing, and recovery reads the ones it committed here.
        self._kept: deque[StepTelemetry] = deque(maxlen=KEPT_REPORTS)
        self._phase: tuple[int, Phase, float] = (-1, Phase.DONE, time.monotonic())
        self._last_snapshot: tuple[float, float] | None = None  # (monotonic end, seconds) of the last snapshot's copy
        self.chaos = ChaosSchedule.for_worker(job.chaos, worker_id, self.abort_flag)
        self.checkpoints = CheckpointWriter(self.chaos, self._record_death)
        self._built_at = time.time()
        self.runner = StepRunner(
            self.model, self.flat, self.sampler, self.dataset, self.objective, job.seed, job.worker.fuse_shards,
            self.chaos, self.device, collate=optional_callable(job.dataset.collate), precision=job.precision,
            max_samples_per_pass=job.worker.max_samples_per_pass,
            on_phase=lambda phase: self._enter(self._phase[0], phase), buffers=self.buffers,
        )
        self.trainer = StepTrainer(
            job, self, self.link, self.runner, self.buffers, self.schedule, self.num_steps, self.chaos, self.abort_flag,
            self._enter, self._record_death, worker_id,
        )

    def _probe_forward(self) -> None:
        """A training forward of step 0's first shard: how ``StepBuffers.of`` tells whether a
        module it does not know changes its buffers as it runs."""
        indices = self.sampler.shard_indices(0, 0)[: self.job.worker.max_samples_per_pass]
        batch = fetch_batch(self.dataset, indices, optional_callable(self.job.dataset.collate))
        with autocast(self.device, self.job.precision):
            self.objective(self.model, move_to(batch, self.device), len(indices))

    @ray.method(concurrency_group="control")
    def describe(self) -> WorkerInfo:
        """Facts the driver needs before training: sizes, device, where this actor runs."""
        return WorkerInfo(
            worker=self.worker_id,
            num_samples=self.sampler.num_samples,
            num_steps=self.num_steps,
            num_params=self.flat.numel,
            device=str(self.device),
            node_id=ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local",
            hostname=socket.gethostname(),
            pid=os.getpid(),
            started_at=process_started_at(),
            imported_at=IMPORTED_AT,
            built_at=self._built_at,
        )

    @compute_method
    def join_group(self, request: JoinRequest) -> Joined:
        """Form generation ``request.generation``'s process group through the driver's TCPStore,
        then take rank 0's training state: parameters, optimizer state and step. An abort for
        this generation (or a later one) that arrived first makes the join fail at once.

        Every replica thus starts the generation identical, whatever its factory did, whether it
        just joined (a replacement or a new worker: the state comes from a live peer, not from
        disk) or missed the last step of an aborted generation. This worker's committed top-k
        residuals carry over (or restored ones, after a resume). ``GroupLink.join``
        (``workers/group_link.py``) does it. Raises CollectiveAborted or CollectiveTimeout if the
        rendezvous or the transfer cannot finish."""
        if self.link.group is not None:
            self._chaos_point("rejoin", self.next_step)
        self.leave_group()
        self.generation = request.generation
        if self.aborted_through < request.generation:
            self.abort_flag.clear()
        return self.link.join(request, self)

    def _chaos_point(self, point: KillPoint, step: int) -> None:
        """Die here if the job's chaos kills this worker at ``point`` of ``step``."""
        if self.chaos.kill_due(point, step):
            kill_self(self._record_death)

    def _record_death(self) -> None:
        store = self.link.store
        if store is not None:
            store.set(death_key(self.worker_id), repr(time.time()))

    @ray.method(concurrency_group="control")
    def progress(self) -> Progress:
        """Where this worker is. Answered while a step runs (the control group), so the driver
        can always ask: when a step is overdue, and to tell the living from the dead."""
        step, phase, since = self._phase
        now, last = time.monotonic(), self._last_snapshot
        return Progress(
            step=step, phase=phase, since_s=now - since, next_step=self.next_step,
            since_snapshot_s=None if last is None else now - last[0], last_copy_s=None if last is None else last[1],
            held=self.state.held(),
        )

    def _enter(self, step: int, phase: Phase) -> None:
        self._phase = (step, phase, time.monotonic())

    @ray.method(concurrency_group="control")
    def abort(self, generation: int) -> None:
        """Make every pending and future collective of ``generation`` and earlier ones fail at
        once, a rendezvous for them included (the driver calls this when it sees a peer die;
        answered even while a step or a join is blocked). An abort of an older generation than
        the one this worker is in arrived late (the control group is not ordered with the
        compute group) and is ignored."""
        self.aborted_through = max(self.aborted_through, generation)
        if generation >= self.generation:
            self.abort_flag.set()

    @compute_method
    def leave_group(self) -> None:
        """Close this worker's comm group and reducer (``GroupLink.leave``)."""
        self.link.leave()

    @compute_method
    def train_steps(self, first: int, plans: list[StepPlan], snapshot: SnapshotOrder | None = None) -> list[StepTelemetry]:
        """Run steps ``first``, ``first + 1``... with ``plans[i]`` for step ``first + i`` (the
        driver's run-ahead: one call for several steps while its plan holds); returns their
        reports in order. Raises as ``train_step`` does at the first step that fails; the steps
        applied before it stay applied and their reports stay in ``kept_reports``.
        ``snapshot``: a checkpoint taken inside the batch, right after the step that leaves
        the state at ``snapshot.step`` steps, as ``snapshot`` does between batches: its copy's
        seconds go into that step's report (``snapshot_s``); a snapshot that fails fails its
        checkpoint (``checkpoint_written`` raises why), not the batch."""
        reports = []
        for index, plan in enumerate(plans):
            report = self.train_step(first + index, plan)
            if snapshot is not None and snapshot.step == report.step + 1:
                report = replace(report, snapshot_s=self._snapshot_in_batch(snapshot))
                self._kept[-1] = report
            reports.append(report)
        return reports

    def _snapshot_in_batch(self, order: SnapshotOrder) -> float:
        """This rank's part of ``order``, taken now; the copy's seconds (0: no part, or it failed)."""
        request = order.request(self.link.rank)
        if request is None:
            return 0.0
        try:
            return self.snapshot(request)
        except Exception:  # noqa: BLE001 - the part's write future holds it: checkpoint_written raises it
            return 0.0

    @compute_method
    def lead_steps(self, first: int, plans: list[StepPlan], snapshot: SnapshotOrder | None = None) -> list[StepRecord]:
        """Rank 0: publish the batch (and its ``snapshot``) to the followers (``follow``), run
        it as ``train_steps`` does, and gather every rank's reports: one ``StepRecord`` per
        step, every rank's row in it (docs/architecture.md, "Published plans"). Raises as
        ``train_steps``, or CollectiveAborted/CollectiveTimeout if a follower is gone."""
        channel = self._channel()
        channel.publish(first, plans, snapshot)
        records = channel.collect(first, self.train_steps(first, plans, snapshot))
        assert records is not None, "rank 0 collects"
        return records

    @compute_method
    def follow(self) -> int:
        """A rank but 0: run the batches rank 0 publishes (``lead_steps``), each as
        ``train_steps`` does, sending its reports back, until rank 0 ends the run
        (``release_followers``); returns how many batches it ran. Raises as ``train_steps``,
        or CollectiveAborted/CollectiveTimeout (an abort, or no batch within the collective
        timeout)."""
        channel, batches = self._channel(), 0
        while (batch := channel.receive()) is not None:
            channel.collect(batch[0], self.train_steps(*batch))
            batches += 1
        return batches

    @compute_method
    def release_followers(self) -> None:
        """Rank 0: end the followers' run after the batches queued before this call."""
        self._channel().end()

    def _channel(self) -> published_plans.PlanChannel:
        group = self.link.group
        if group is None:
            raise RuntimeError("published plans need a group: join_group first")
        return published_plans.PlanChannel(group, self.device)

    @ray.method(concurrency_group="control")
    def kept_reports(self, first: int, end: int) -> list[StepTelemetry]:
        """The reports of the steps from ``first`` to ``end`` (exclusive) this replica applied,
        of the last ``KEPT_REPORTS``."""
        return [r for r in list(self._kept) if first <= r.step < end]

    @compute_method
    def train_step(self, step: int, plan: StepPlan) -> StepTelemetry:
        """Compute this rank's share of the step's gradient, all-reduce it, take the optimizer step.

        With the plan's mitigations off the rank runs exactly its planned shards; with them on
        it claims, steals and backs up shards through the driver's store (``workers/step/runner.py``).
        The all-reduced buffer holds the sum of every shard's loss-sum gradient and the step's
        total loss weight; divided by it (``workers/step/verdict.py``, which also clips) it is the
        step's mean gradient whoever ran what; the model's changing buffers become the mean of
        what each shard's pass left in them (``workers/model/buffers.py``). Raises
        ShardCensusError if the ranks together did not commit every shard exactly once
        (``StepVerdict.census``), FloatingPointError if the gradient is not
        finite (fp32, bf16; fp16 skips the step), ValueError (naming ``loss``) for a bad loss.
        A step that raises leaves the buffers as they were before it (its passes left one
        shard's in them, and a group re-formed next takes rank 0's).
        """
        try:
            report = self.trainer.run(step, plan)
        except BaseException:
            self.buffers.abandon()
            raise
        self._kept.append(report)
        return report

    @compute_method
    def snapshot(self, request: SnapshotRequest) -> float:
        """Copy part ``request.index`` of ``request.count`` of the state after ``request.step``
        steps to memory and start writing it in the background (see ``checkpoint_written``).
        Queued between two steps, so it sees exactly the state after that step; raises
        RuntimeError if this replica is not there (an aborted step). Returns the seconds
        training was held up (the copy). Meanwhile ``progress`` says ``Phase.SNAPSHOT``: its
        peers, already in the next step, wait for it, and the driver must not take that for
        silence (for a while: after, ``progress`` says how long the copy took)."""
        step, phase, _ = self._phase
        self._enter(step, Phase.SNAPSHOT)
        started = self._phase[2]
        try:
            return self.checkpoints.snapshot(request, self, self.link.residuals, self.link.rank)
        finally:
            ended = time.monotonic()
            self._last_snapshot = (ended, ended - started)
            self._enter(step, phase)

    @ray.method(concurrency_group="control")
    def cancel_checkpoint(self, name: str, tag: str) -> None:
        """The driver abandoned attempt ``tag`` of checkpoint ``name``: a wait for it ends at
        once, unless its snapshot was taken (``CheckpointWriter.cancel``)."""
        self.checkpoints.cancel(name, tag)

    @ray.method(concurrency_group="io")
    def checkpoint_written(self, name: str, tag: str, timeout_s: float) -> PartWritten:
        """Wait (up to ``timeout_s``) for attempt ``tag`` of checkpoint ``name`` to be written;
        returns the files written (path, sha256, bytes) and the write's CPU seconds, or raises
        the write's error or TimeoutError."""
        return self.checkpoints.written(name, tag, timeout_s)

    @compute_method
    def restore(self, root: str, name: str, manifest: dict[str, Any], rank: int, state: bool, world: int = 1) -> None:
        """Take checkpoint ``name`` (already verified against ``manifest``): the training state
        if ``state`` (unsharded, one worker loads it and the others take it from it when the
        group forms; sharded, every rank of ``world`` loads the slice it will own), and rank
        ``rank``'s top-k residuals, if saved. Raises CheckpointCorrupt if a file changed since
        it was verified, ValueError if the checkpoint is for another model."""
        storage = CheckpointStorage(root)
        saved = load_residuals(storage, name, manifest, rank)
        self.link.restored_residuals = {key: v.to(self.device) for key, v in saved.items()}
        if state:
            layout = self.state.plan(world, self.flat.numel)
            restore_state(self, storage, name, manifest, None if layout is None else layout.slice_of(rank))
            self.link.undo = None  # the checkpoint's loss scale and buffers are the ones now

    @compute_method
    def evaluate(self) -> dict[str, float]:
        """The loss on the eval dataset (its loss sum over its weight), accuracy (built-in
        cross_entropy and causal_lm) and ``eval.metrics``; {} without an eval dataset."""
        return evaluate_job(self.model, self.job, self.objective, self.data.get("eval"))

    @compute_method
    def model_state(self) -> dict[str, torch.Tensor]:
        """The replica's parameters and buffers, on the CPU."""
        # Copies: the parameters are views into one flat buffer, which must not travel whole.
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}


__all__ = ["CollectiveAborted", "CollectiveTimeout", "ShardCensusError", "TrainWorker"]
