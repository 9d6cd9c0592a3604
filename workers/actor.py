"""The training worker: one Ray actor per rank, holding a model replica and its optimizer.

Methods run in two concurrency groups: ``compute`` (one at a time, in submission order: the
step pipeline) and ``control`` (answers while a step runs, so the driver can always ask).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

from policies.work_stealing import StepPlan
from workers import factories
from workers.chaos import ChaosSchedule, Slowdown, Stall
from workers.claims import ShardClaims
from workers.comm_group import CollectiveAborted, CollectiveTimeout, CommGroup, new_process_group
from workers.communicator import make_communicator, pick_backend
from workers.compression import compress
from workers.flat_optimizer import FlatOptimizer
from workers.overlap import GradientReducer
from workers.sampler import ShardSampler
from workers.step import StepRunner
from workers.telemetry import StepTelemetry
from workers.training import FlatParameters, evaluate_model


class ShardCensusError(RuntimeError):
    """After the all-reduce some shard was counted zero or several times: the step is invalid."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its replica; the same for every rank."""

    model_factory: str
    model_kwargs: dict[str, Any]
    dataset_factory: str
    dataset_kwargs: dict[str, Any]
    eval_factory: str | None
    eval_kwargs: dict[str, Any]
    loss: str
    optimizer: str
    optimizer_kwargs: dict[str, Any]
    batch_size: int
    num_shards: int
    seed: int
    steps: int | None
    epochs: float | None
    fuse_shards: bool
    algorithm: str
    compression: str
    topk_ratio: float
    bucket_bytes: int
    overlap: bool
    collective_timeout_s: float
    # Injected slowness, by worker id: (worker, factor, from_step, to_step) and (worker, at_step, seconds).
    chaos_slow: tuple[tuple[int, float, int, int | None], ...] = ()
    chaos_stall: tuple[tuple[int, int, float], ...] = ()


class TrainWorker:
    """A model replica. Built identically on every rank; rank 0's parameters win at join.

    ``worker_id`` names the worker for its whole life (ranks change when the group re-forms);
    chaos settings refer to it.
    """

    def __init__(self, spec: WorkerSpec, worker_id: int = 0) -> None:
        self.spec = spec
        self.worker_id = worker_id
        gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []
        self.device = torch.device("cuda", 0) if gpu_ids and torch.cuda.is_available() else torch.device("cpu")
        torch.manual_seed(spec.seed)
        self.dataset = factories.build(spec.dataset_factory, spec.dataset_kwargs)
        num_samples = len(self.dataset)
        total = None if spec.epochs is None else max(1, round(spec.epochs * num_samples))
        self.sampler = ShardSampler(num_samples, spec.batch_size, spec.num_shards, spec.seed, total)
        self.num_steps = spec.steps if spec.steps is not None else self.sampler.num_steps
        self.model: torch.nn.Module = factories.build(spec.model_factory, spec.model_kwargs).to(self.device)
        self.model.train()
        # Trailing slots: one census entry per shard, then the step's loss and sample count.
        self.flat = FlatParameters(self.model.parameters(), extra=spec.num_shards + 2)
        self.optimizer = FlatOptimizer(spec.optimizer, spec.optimizer_kwargs, self.flat.values, self.flat.grads)
        self.rank = -1
        self.world_size = 0
        self.reducer: GradientReducer | None = None
        self.group: CommGroup | None = None
        self.abort_flag = threading.Event()
        self.claims_store: dist.Store | None = None
        self._phase: tuple[int, str, float] = (-1, "done", time.monotonic())
        self.chaos = ChaosSchedule(
            [Slowdown(f, a, b) for w, f, a, b in spec.chaos_slow if w == worker_id],
            [Stall(at, sec) for w, at, sec in spec.chaos_stall if w == worker_id],
            self.abort_flag,
        )
        self.runner = StepRunner(
            self.model, self.flat, self.sampler, self.dataset, spec.loss, spec.seed, spec.fuse_shards, self.chaos, self.device,
            on_phase=lambda phase: self._enter(self._phase[0], phase),
        )

    @ray.method(concurrency_group="control")
    def describe(self) -> dict[str, Any]:
        """Facts the driver needs before training: sizes, device, where this actor runs."""
        context = ray.get_runtime_context()
        return {
            "num_samples": self.sampler.num_samples,
            "num_steps": self.num_steps,
            "num_params": self.flat.numel,
            "device": str(self.device),
            "node_id": context.get_node_id(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "worker": self.worker_id,
        }

    @ray.method(concurrency_group="compute")
    def join_group(
        self,
        store_host: str,
        store_port: int,
        prefix: str,
        rank: int,
        nodes: list[str],
        timeout_s: float,
    ) -> None:
        """Form this generation's process group (rank ``rank`` of ``len(nodes)``; ``nodes[r]`` is
        rank r's Ray node id) through the driver's TCPStore under key ``prefix``, then take
        rank 0's parameters so every replica starts identical whatever the factory did."""
        self.leave_group()
        self.abort_flag.clear()
        store = dist.TCPStore(store_host, store_port, is_master=False, timeout=timedelta(seconds=timeout_s))
        self.claims_store = dist.PrefixStore(prefix, store)
        pg = new_process_group(
            pick_backend(self.device), dist.PrefixStore(prefix, store), rank, len(nodes), self.spec.collective_timeout_s
        )
        self.group = CommGroup(pg, rank, len(nodes), self.spec.collective_timeout_s, self.abort_flag)
        self.rank, self.world_size = rank, len(nodes)
        exact = make_communicator(self.spec.algorithm, self.group, nodes)
        compressed = compress(self.spec.compression, exact, self.group, self.spec.topk_ratio)
        self.reducer = GradientReducer(
            self.flat,
            compressed,
            self.spec.bucket_bytes,
            self.spec.overlap,
            extra_comm=exact if compressed is not exact else None,
        )
        self.group.broadcast(self.flat.values, root=0)

    @ray.method(concurrency_group="control")
    def progress(self) -> dict[str, Any]:
        """Where this worker is: ``step``, ``phase`` (stall, compute, idle, reduce, done) and
        ``since_s`` in it. Answered while a step runs; the driver asks when a step is overdue."""
        step, phase, since = self._phase
        return {"step": step, "phase": phase, "since_s": time.monotonic() - since}

    def _enter(self, step: int, phase: str) -> None:
        self._phase = (step, phase, time.monotonic())

    @ray.method(concurrency_group="control")
    def abort(self) -> None:
        """Make every pending and future collective of this generation fail at once (the driver
        calls this when it sees a peer die; answered even while a step is blocked)."""
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
    def train_step(self, step: int, plan: StepPlan) -> StepTelemetry:
        """Compute this rank's share of the step's gradient, all-reduce it, take the optimizer step.

        With the plan's mitigations off the rank runs exactly its planned shards; with them on
        it claims, steals and backs up shards through the driver's store (``workers/step.py``).
        Each shard's loss is the sum over its samples divided by the step's global batch size,
        so the all-reduced sum is the mean gradient of the whole step whoever ran what.
        Raises ShardCensusError if the ranks together did not commit every shard exactly once.
        """
        if self.reducer is None or self.claims_store is None:
            raise RuntimeError("train_step called before join_group")
        started = time.perf_counter()
        self._enter(step, "stall")
        stalled_s = self.chaos.stall(step)
        self._enter(step, "compute")
        self.flat.zero()
        if plan.mitigating:
            claims = ShardClaims(self.claims_store, step, plan, self.rank)
            work = self.runner.run_claimed(
                step, plan, claims, self.reducer, self.spec.collective_timeout_s, self.abort_flag
            )
        else:
            work = self.runner.run_fixed(step, list(plan.shards_by_rank[self.rank]), plan.num_shards, self.reducer)
        self.chaos.record(work.compute_s, work.shards_run)
        computed = time.perf_counter()
        self._enter(step, "reduce")
        comm_s = self.reducer.finish()
        counts = self.flat.extra[: plan.num_shards].cpu()
        if not torch.all(counts == 1):
            bad = {i: float(c) for i, c in enumerate(counts.tolist()) if c != 1}
            raise ShardCensusError(f"step {step}: shards not committed exactly once: {bad}")
        reduced = time.perf_counter()
        self.optimizer.step()
        self._enter(step, "done")
        done = time.perf_counter()
        busy_s = work.compute_s + work.slowed_s
        return StepTelemetry(
            step=step,
            rank=self.rank,
            worker=self.worker_id,
            shards=tuple(sorted(work.committed)),
            samples=work.samples,
            global_samples=int(self.flat.extra[plan.num_shards + 1].item()),
            loss=float(self.flat.extra[plan.num_shards].item()),
            compute_s=computed - started - work.idle_s - stalled_s,
            comm_s=comm_s,
            optim_s=done - reduced,
            step_s=done - started,
            shards_run=work.shards_run,
            shard_s=busy_s / work.shards_run if work.shards_run else 0.0,
            samples_per_s=work.samples / busy_s if busy_s > 0 else 0.0,
            idle_s=work.idle_s,
            stalled_s=stalled_s,
            bytes_sent=self.group.bytes_sent if self.group is not None else 0,
            stolen=work.stolen,
            backups=work.backups,
            backups_won=work.backups_won,
            races_lost=work.races_lost,
        )

    @ray.method(concurrency_group="compute")
    def evaluate(self) -> dict[str, float]:
        """Mean loss (and accuracy, for cross-entropy) on the eval dataset; {} without one."""
        if self.spec.eval_factory is None:
            return {}
        dataset = factories.build(self.spec.eval_factory, self.spec.eval_kwargs)
        return evaluate_model(self.model, dataset, self.spec.loss)

    @ray.method(concurrency_group="compute")
    def model_state(self) -> dict[str, torch.Tensor]:
        """The replica's parameters and buffers, on the CPU."""
        # Copies: the parameters are views into one flat buffer, which must not travel whole.
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}


__all__ = ["CollectiveAborted", "CollectiveTimeout", "ShardCensusError", "TrainWorker", "WorkerSpec"]
