"""The training worker: one Ray actor per rank, holding a model replica and its optimizer.

Methods run in three concurrency groups: ``compute`` (one at a time, in submission order: the
step pipeline), ``control`` (answers while a step runs, so the driver can always ask) and
``io`` (waits for background checkpoint writes without holding up either).
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

from jobspec import targets as factories
from jobspec.failures import CollectiveAborted, CollectiveTimeout, ShardCensusError
from jobspec.job import JobConfig
from jobspec.targets import optional_callable
from jobspec.wire import (
    FileEntry,
    Joined,
    JoinRequest,
    Phase,
    Progress,
    SnapshotRequest,
    StepTelemetry,
    WorkerInfo,
)
from policies.work_stealing import StepPlan
from workers.chaos import ChaosSchedule, death_key, kill_self
from workers.checkpoint_storage import CheckpointStorage
from workers.checkpointing import (
    PartSnapshot,
    chain_future,
    load_residuals,
    load_state,
    lowest_priority,
    take_snapshot,
    write_snapshot,
)
from workers.claims import CountingStore, ShardClaims
from workers.comm_group import CommGroup, call_abortable, new_process_group
from workers.communicator import Communicator, make_communicator, pick_backend
from workers.compression import OWN_TRANSPORT, TopKAllReduce, compress
from workers.generic_optimizer import make_optimizer
from workers.link_probe import auto_communicator
from workers.loss_scaler import LossScaler
from workers.objective import Objective
from workers.overlap import DEFAULT_BUCKET_BYTES, GradientReducer
from workers.sampler import ShardSampler
from workers.step import BOOKKEEPING_SLOTS, LOSS_SLOT, SAMPLES_SLOT, WEIGHT_SLOT, ClaimedStep, RescuePass, StepRunner
from workers.training import FlatParameters, evaluate_job, finish_gradient

#: When this module (and with it torch and the worker's code) had loaded: the launch's breakdown.
IMPORTED_AT = time.time()
# Reports kept for recovery: more than the steps the driver keeps in flight (two batches).
KEPT_REPORTS = 64


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
    """

    def __init__(self, job: JobConfig, worker_id: int = 0) -> None:
        self.job = job
        self.worker_id = worker_id
        gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []
        self.device = torch.device("cuda", 0) if gpu_ids and torch.cuda.is_available() else torch.device("cpu")
        torch.manual_seed(job.seed)
        self.dataset = factories.build(job.dataset.factory, job.dataset.kwargs)
        num_samples = len(self.dataset)
        total = None if job.epochs is None else max(1, round(job.epochs * num_samples))
        self.sampler = ShardSampler(num_samples, job.batch_size, job.shards, job.seed, total)
        self.num_steps = job.steps if job.steps is not None else self.sampler.num_steps
        self.model: torch.nn.Module = factories.build(job.model.factory, job.model.kwargs).to(self.device)
        self.model.train()
        # Trailing slots: one census entry per shard, then the step's bookkeeping (loss, ...).
        self.flat = FlatParameters(self.model.parameters(), extra=job.shards + BOOKKEEPING_SLOTS)
        if self.flat.values.dtype in (torch.float16, torch.bfloat16):
            # The census and loss weights ride in the parameters' dtype, and half types count
            # exactly only to 256 (bf16) or 2048 (fp16).
            raise ValueError(
                f"field 'model.factory': the model's parameters are {self.flat.values.dtype}; keep them float32 "
                "(the master weights) and set precision: bf16 or fp16 to compute in half precision"
            )
        self.optimizer = make_optimizer(job.optimizer, self.flat)
        self.schedule = job.schedule.policy()
        scaling = job.loss_scaling
        self.scaler = LossScaler(
            job.precision == "fp16", scaling.init, scaling.growth, scaling.backoff, scaling.growth_interval, self.device
        )
        self.rank = -1
        self.world_size = 0
        self.reducer: GradientReducer | None = None
        self.reducer_comm: Communicator | None = None  # the reducer's (top-k keeps residuals)
        self.group: CommGroup | None = None
        self.abort_flag = threading.Event()
        self.aborted_through = 0  # the latest generation the driver aborted
        self.generation = 0  # the generation this worker last joined
        self._reducing_step = -1  # the step whose reduction last started (top-k stages its residuals)
        # Checkpoint files are written here while training goes on.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ringleader-checkpoint", initializer=lowest_priority)
        self._writes: dict[str, Future[list[FileEntry]]] = {}
        self._writes_lock = threading.Lock()
        self._restored_residuals: dict[tuple[int, int], torch.Tensor] = {}
        self.claims_store: CountingStore | None = None
        self.store: dist.Store | None = None
        #: The next step this replica will apply: the optimizer steps it holds, in job steps.
        self.next_step = 0
        # The reports of the last steps applied: a batch whose call failed part-way (aborted
        # after a peer died) returns nothing, and recovery reads the ones it committed here.
        self._kept: deque[StepTelemetry] = deque(maxlen=KEPT_REPORTS)
        self._phase: tuple[int, Phase, float] = (-1, Phase.DONE, time.monotonic())
        self.chaos = ChaosSchedule.for_worker(job.chaos, worker_id, self.abort_flag)
        self._built_at = time.time()
        self.objective = Objective(job.loss.name, job.loss.kwargs)
        self.runner = StepRunner(
            self.model, self.flat, self.sampler, self.dataset, self.objective, job.seed, job.worker.fuse_shards,
            self.chaos, self.device, collate=optional_callable(job.dataset.collate), precision=job.precision,
            max_samples_per_pass=job.worker.max_samples_per_pass,
            on_phase=lambda phase: self._enter(self._phase[0], phase),
        )

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

    @ray.method(concurrency_group="compute")
    def join_group(self, request: JoinRequest) -> Joined:
        """Form generation ``request.generation``'s process group through the driver's TCPStore,
        then take rank 0's training state: parameters, optimizer state and step. An abort for
        this generation (or a later one) that arrived first makes the join fail at once.

        Every replica thus starts the generation identical, whatever its factory did, whether it
        just joined (a replacement or a new worker: the state comes from a live peer, not from
        disk) or missed the last step of an aborted generation. This worker's committed top-k
        residuals carry over (or restored ones, after a resume). Raises CollectiveAborted or
        CollectiveTimeout if the rendezvous or the transfer cannot finish."""
        if self.group is not None and self.chaos.kill_due("rejoin", self.next_step):
            kill_self(self._record_death)
        self.leave_group()
        self.generation = request.generation
        if self.aborted_through < request.generation:
            self.abort_flag.clear()
        collective = self.job.collective
        timeout_s = self.job.timeouts.collective_s
        store: dist.Store = dist.TCPStore(
            request.store_host, request.store_port, is_master=False, timeout=timedelta(seconds=request.timeout_s)
        )
        if request.namespace:
            store = dist.PrefixStore(request.namespace, store)
        self.store = store
        self.claims_store = CountingStore(dist.PrefixStore(request.prefix, store))
        backend = pick_backend(self.device)
        pg = call_abortable(
            lambda: new_process_group(
                backend, dist.PrefixStore(request.prefix, store), request.rank, request.world_size, timeout_s
            ),
            self.abort_flag,
            request.timeout_s,
            "rendezvous",
        )
        previous = self.reducer_comm
        residuals = getattr(previous, "residuals", None) or self._restored_residuals
        self.group = CommGroup(
            pg, request.rank, request.world_size, timeout_s, self.abort_flag, poll_completion=backend == "nccl"
        )
        self.rank, self.world_size = request.rank, request.world_size
        bucket_bytes = int(collective.bucket_mb * 2**20) if collective.bucket_mb else None
        choice = None
        if collective.algorithm == "auto" and collective.compression not in OWN_TRANSPORT:
            exact, choice = auto_communicator(self.group, request.nodes, self.flat.buffer, bucket_bytes)
            bucket_bytes = choice.bucket_bytes
        else:
            # int8 and top-k run their own ring whatever the algorithm (nothing to choose: the
            # exact one sums only the bookkeeping), and top-k's residuals are keyed by bucket,
            # so its bucket size must not move with a probe's noise between generations.
            algorithm = "native" if collective.algorithm == "auto" else collective.algorithm
            exact = make_communicator(algorithm, self.group, request.nodes)
        compressed = compress(collective.compression, exact, self.group, collective.topk_ratio)
        if residuals and isinstance(compressed, TopKAllReduce):
            compressed.residuals = residuals  # this worker's unsent gradient outlives the generation
        self.reducer_comm = compressed
        self._restored_residuals = {}  # only now: a join that failed before keeps them for the next
        self.reducer = GradientReducer(
            self.flat,
            compressed,
            bucket_bytes or DEFAULT_BUCKET_BYTES,
            collective.overlap,
            extra_comm=exact if compressed is not exact else None,
        )
        started = time.perf_counter()
        step = torch.tensor([self.next_step], dtype=torch.int64, device=self.device)
        self.group.broadcast(step, root=0)
        staged_for = self._reducing_step
        if isinstance(previous, TopKAllReduce) and int(step.item()) == staged_for + 1 and self.next_step == staged_for:
            # This rank was aborted in a step that completed elsewhere (a rank died in the
            # all-gather after everyone's piece was out): its piece was counted, so its unsent
            # remainder is the residual now.
            previous.commit()
        if int(step.item()) != self.next_step:
            # Until the whole state has arrived this replica holds none: if the transfer breaks
            # off, the driver must not take it for a survivor with a good state.
            self.next_step = -1
        group = self.group
        group.broadcast(self.flat.values, root=0)
        self.optimizer.sync(lambda tensor: group.broadcast(tensor, root=0), is_root=request.rank == 0)
        group.broadcast(self.scaler.state, root=0)
        for buffer in self.model.buffers():  # running statistics: a checkpoint restores them on one worker
            group.broadcast(buffer, root=0)
        self.scaler.state_restored()
        self.next_step = int(step.item())
        return Joined(transfer_s=time.perf_counter() - started, next_step=self.next_step, collective=choice)

    def _record_death(self) -> None:
        if self.store is not None:
            self.store.set(death_key(self.worker_id), repr(time.time()))

    @ray.method(concurrency_group="control")
    def progress(self) -> Progress:
        """Where this worker is. Answered while a step runs (the control group), so the driver
        can always ask: when a step is overdue, and to tell the living from the dead."""
        step, phase, since = self._phase
        return Progress(step=step, phase=phase, since_s=time.monotonic() - since, next_step=self.next_step)

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

    @ray.method(concurrency_group="compute")
    def leave_group(self) -> None:
        if self.reducer is not None:
            self.reducer.close()
            self.reducer = None
        if self.group is not None:
            if self.abort_flag.is_set() and self.group.broken is None:
                self.group.broken = "aborted by the driver"  # its thread may be stuck: abandon it
            self.group.close()
            self.group = None

    @ray.method(concurrency_group="compute")
    def train_steps(self, first: int, plans: list[StepPlan]) -> list[StepTelemetry]:
        """Run steps ``first``, ``first + 1``... with ``plans[i]`` for step ``first + i`` (the
        driver's run-ahead: one call for several steps while its plan holds); returns their
        reports in order. Raises as ``train_step`` does at the first step that fails; the steps
        applied before it stay applied and their reports stay in ``kept_reports``."""
        return [self.train_step(first + i, plan) for i, plan in enumerate(plans)]

    @ray.method(concurrency_group="control")
    def kept_reports(self, first: int, end: int) -> list[StepTelemetry]:
        """The reports of the steps from ``first`` to ``end`` (exclusive) this replica applied,
        of the last ``KEPT_REPORTS``."""
        return [r for r in list(self._kept) if first <= r.step < end]

    @ray.method(concurrency_group="compute")
    def train_step(self, step: int, plan: StepPlan) -> StepTelemetry:
        """Compute this rank's share of the step's gradient, all-reduce it, take the optimizer step.

        With the plan's mitigations off the rank runs exactly its planned shards; with them on
        it claims, steals and backs up shards through the driver's store (``workers/step.py``).
        The all-reduced buffer holds the sum of every shard's loss-sum gradient and the step's
        total loss weight; divided by it (``finish_gradient``, which also clips) it is the
        step's mean gradient whoever ran what. Raises ShardCensusError if the ranks together
        did not commit every shard exactly once, FloatingPointError if the gradient is not
        finite (fp32, bf16; fp16 skips the step), ValueError (naming ``loss``) for a bad loss.
        """
        if self.reducer is None or self.claims_store is None:
            raise RuntimeError("train_step called before join_group")
        if step != self.next_step:
            # Applying a step twice (or skipping one) would corrupt the replica silently.
            raise RuntimeError(f"asked for step {step}, but this replica's next step is {self.next_step}")
        started = time.perf_counter()
        store_trips, store_bytes = self.claims_store.round_trips, self.claims_store.bytes
        self._reducing_step = step
        self._enter(step, Phase.STALL)  # until its data is there (and any injected stall is over)
        self.flat.zero()
        self.runner.loss_scale = self.scaler.scale
        watch = None
        if plan.mitigating:
            claims = ShardClaims(self.claims_store, step, plan, self.rank)
            claimed = ClaimedStep(step, plan, claims, self.reducer, self.job.timeouts.collective_s, self.abort_flag)
            work = self.runner.run_claimed(claimed)
            watch = self.runner.watch(claimed, work)
        else:
            work = self.runner.run_fixed(step, list(plan.shards_by_rank[self.rank]), plan.num_shards, self.reducer)
        computed = time.perf_counter()
        compute_s = computed - started - work.idle_s - work.stalled_s  # before any rescue pass
        self._enter(step, Phase.REDUCE)
        if self.chaos.kill_due("step", step):
            kill_self(self._record_death)  # mid all-reduce: overlapped buckets are on the wire
        comm_s = self.reducer.finish(watch)
        rescue = RescuePass()
        if plan.mitigating:
            rescue = self.runner.rescue(claimed, work)
            comm_s += rescue.comm_s
        extra = self.flat.extra.cpu()
        counts = extra[: plan.num_shards]
        self.chaos.record(step, work.compute_s, work.shards_run)
        if not torch.all(counts == 1):
            bad = {i: float(c) for i, c in enumerate(counts.tolist()) if c != 1}
            raise ShardCensusError(f"step {step}: shards not committed exactly once: {bad}")
        if isinstance(self.reducer_comm, TopKAllReduce):
            self.reducer_comm.commit()
        reduced = time.perf_counter()
        loss_sum, samples, weight = (float(extra[plan.num_shards + slot]) for slot in (LOSS_SLOT, SAMPLES_SLOT, WEIGHT_SLOT))
        update = finish_gradient(
            self.flat.grads, weight, self.runner.loss_scale / self.sampler.step_batch_size(step),
            self.job.optimizer.clip_grad_norm,
        )
        lr = self.optimizer.base_lr * self.schedule.factor(step, self.job.schedule.total_steps or self.num_steps)
        skipped = self.scaler.update(update.grad_norm)
        if not self.scaler.enabled and not math.isfinite(update.grad_norm):
            # Every replica holds this same gradient, so all stop here: better than parameters
            # turned to nan. (fp16 skips such steps instead; that is what its scaler is for.)
            raise FloatingPointError(
                f"step {step}: the reduced gradient is not finite (norm {update.grad_norm}, loss "
                f"{loss_sum / weight}): the loss diverged or the data holds inf or nan"
            )
        if not skipped:
            self.optimizer.step(lr=lr)
        self.next_step = step + 1
        self._enter(step, Phase.DONE)
        done = time.perf_counter()
        busy_s = work.compute_s + work.slowed_s
        report = StepTelemetry(
            step=step,
            rank=self.rank,
            worker=self.worker_id,
            shards=tuple(sorted(work.committed)),
            samples=work.total.samples,
            global_samples=int(samples),
            shards_counted=int(counts.sum().item()),
            lr=lr,
            loss=loss_sum / weight,
            weight=weight,
            grad_norm=update.grad_norm,
            skipped=skipped,
            compute_s=compute_s,
            comm_s=comm_s,
            optim_s=done - reduced,
            step_s=done - started,
            shards_run=work.shards_run,
            shard_s=busy_s / work.shards_run if work.shards_run else 0.0,
            samples_per_s=work.total.samples / busy_s if busy_s > 0 else 0.0,
            weight_per_s=work.total.weight / busy_s if busy_s > 0 else 0.0,
            idle_s=work.idle_s,
            stalled_s=work.stalled_s,
            gave_up=work.gave_up,
            rescued=rescue.shards,
            rescue_s=rescue.seconds,
            bytes_sent=self.group.bytes_sent if self.group is not None else 0,
            stolen=work.stolen,
            backups=work.backups,
            backups_won=work.backups_won,
            races_lost=work.races_lost,
            store_round_trips=self.claims_store.round_trips - store_trips,
            store_bytes=self.claims_store.bytes - store_bytes,
        )
        self._kept.append(report)
        return report

    @ray.method(concurrency_group="compute")
    def snapshot(self, request: SnapshotRequest) -> float:
        """Copy part ``request.index`` of ``request.count`` of the state after ``request.step``
        steps to memory and start writing it in the background (see ``checkpoint_written``).
        Queued between two steps, so it sees exactly the state after that step; raises
        RuntimeError if this replica is not there (an aborted step). Returns the seconds
        training was held up (the copy)."""
        step, name = request.step, request.name
        written = self._write_future(f"{name}/{request.tag}")
        try:
            if self.next_step != step:
                raise RuntimeError(f"checkpoint {name} wants the state after step {step}, this replica is at {self.next_step}")
            started = time.perf_counter()
            flat, whole = self._checkpointed_tensors(whole=request.index == 0)
            whole["rng/torch"] = torch.get_rng_state()
            residuals = getattr(self.reducer_comm, "residuals", None) or {}
            part = take_snapshot(step, request.index, request.count, flat, whole, residuals)
            part.copy_s = time.perf_counter() - started
        except BaseException as err:
            written.set_exception(err)
            raise
        writing = self._writer.submit(self._write, CheckpointStorage(request.root), name, request.tag, part, self.rank)
        writing.add_done_callback(lambda done: chain_future(done, written))
        return part.copy_s

    def _checkpointed_tensors(self, whole: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The training state a checkpoint holds, by name: the flat tensors (parameters and
        optimizer state, all one length, written in slices) and the whole ones (only part 0
        writes them: ``whole=False`` leaves them out, sparing a generic optimizer's
        serialization)."""
        optim_flat, optim_whole = self.optimizer.checkpoint_tensors(whole)
        flat = {"params": self.flat.values, **{f"optim/{k}": v for k, v in optim_flat.items()}}
        if not whole:
            return flat, {}
        wholes = {**{f"optim/{k}": v for k, v in optim_whole.items()}, **{f"buffer/{k}": v for k, v in self.model.named_buffers()}}
        if self.scaler.enabled:
            wholes["loss_scale"] = self.scaler.state
        return flat, wholes

    def _write_future(self, attempt: str) -> Future[list[FileEntry]]:
        """The outcome of one checkpoint attempt's write (``name/tag``), shared by ``snapshot``
        (which may run after ``checkpoint_written`` started waiting: they are in different
        groups)."""
        with self._writes_lock:
            return self._writes.setdefault(attempt, Future())

    def _write(
        self, storage: CheckpointStorage, name: str, tag: str, part: PartSnapshot, rank: int
    ) -> list[FileEntry]:
        if self.chaos.kill_due("checkpoint", part.step - 1):
            kill_self(self._record_death)  # mid-write: some parts may be on disk, no manifest
        return write_snapshot(storage, name, tag, rank, part)

    @ray.method(concurrency_group="io")
    def checkpoint_written(self, name: str, tag: str, timeout_s: float) -> list[FileEntry]:
        """Wait (up to ``timeout_s``) for attempt ``tag`` of checkpoint ``name`` to be written;
        returns the files written (path, sha256, bytes) or raises the write's error or
        TimeoutError."""
        attempt = f"{name}/{tag}"
        try:
            return self._write_future(attempt).result(timeout=timeout_s)
        finally:
            with self._writes_lock:
                self._writes.pop(attempt, None)

    @ray.method(concurrency_group="compute")
    def restore(self, root: str, name: str, manifest: dict[str, Any], rank: int, state: bool) -> None:
        """Take checkpoint ``name`` (already verified against ``manifest``): the training state
        if ``state`` (one worker loads it; the others take it from it when the group forms),
        and rank ``rank``'s top-k residuals, if saved. Raises CheckpointCorrupt if a file
        changed since it was verified, ValueError if the checkpoint is for another model."""
        storage = CheckpointStorage(root)
        saved = load_residuals(storage, name, manifest, rank)
        self._restored_residuals = {key: v.to(self.device) for key, v in saved.items()}
        if not state:
            return
        flat, whole = load_state(storage, name, manifest)
        mine_flat, mine_whole = self._checkpointed_tensors()
        targets = {k: v for k, v in {**mine_flat, **mine_whole}.items() if not k.startswith("optim/")}
        loaded = {k: v for k, v in {**flat, **whole}.items() if not k.startswith(("optim/", "rng/"))}
        if loaded.keys() != targets.keys() or any(loaded[k].shape != t.shape for k, t in targets.items()):
            raise ValueError(
                f"checkpoint {name} holds {sorted((k, tuple(v.shape)) for k, v in loaded.items())}, "
                f"this model needs {sorted((k, tuple(v.shape)) for k, v in targets.items())}"
            )
        self.optimizer.restore(
            {k[len("optim/"):]: v for k, v in flat.items() if k.startswith("optim/")},
            {k[len("optim/"):]: v for k, v in whole.items() if k.startswith("optim/")},
        )
        with torch.no_grad():
            for key, target in targets.items():
                target.copy_(loaded[key])
        self.scaler.state_restored()
        torch.set_rng_state(whole["rng/torch"])
        self.next_step = int(manifest["step"])

    @ray.method(concurrency_group="compute")
    def evaluate(self) -> dict[str, float]:
        """The loss on the eval dataset (its loss sum over its weight), accuracy (built-in
        cross_entropy and causal_lm) and ``eval.metrics``; {} without an eval dataset."""
        return evaluate_job(self.model, self.job, self.objective)

    @ray.method(concurrency_group="compute")
    def model_state(self) -> dict[str, torch.Tensor]:
        """The replica's parameters and buffers, on the CPU."""
        # Copies: the parameters are views into one flat buffer, which must not travel whole.
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}


__all__ = ["CollectiveAborted", "CollectiveTimeout", "ShardCensusError", "TrainWorker"]
