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

import numpy as np
import ray
import torch
import torch.distributed as dist

from workers import factories
from workers.comm_group import CollectiveAborted, CollectiveTimeout, CommGroup, new_process_group
from workers.communicator import make_communicator, pick_backend
from workers.compression import compress
from workers.flat_optimizer import FlatOptimizer
from workers.overlap import GradientReducer
from workers.sampler import ShardSampler
from workers.telemetry import StepTelemetry
from workers.training import (
    FlatParameters,
    evaluate_model,
    fetch_batch,
    move_to,
    per_sample_loss,
)


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


def _shard_seed(seed: int, step: int, shard: int) -> int:
    # Randomness inside the forward pass (dropout) depends on the shard, not on the worker.
    return ((seed * 1_000_003 + step) * 1_000_003 + shard) & 0x7FFF_FFFF_FFFF_FFFF


def _passes(shards: list[int], fuse: bool) -> list[list[int]]:
    """Shards run together in one forward/backward: all of them, or one at a time."""
    return [list(shards)] if fuse and shards else [[s] for s in shards]


class TrainWorker:
    """A model replica. Built identically on every rank; rank 0's parameters win at join."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
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
            self.group.close()
            self.group = None

    @ray.method(concurrency_group="compute")
    def train_step(self, step: int, shards: list[int]) -> StepTelemetry:
        """Compute the summed gradient of ``shards``, all-reduce it, take the optimizer step.

        Shards run in one forward/backward (``fuse_shards``) or one pass each; the final
        backward overlaps with the all-reduce when ``overlap`` is on. Each shard's loss is the
        sum over its samples divided by the step's global batch size, so the all-reduced sum
        is the mean gradient of the whole step whoever ran what.
        Raises ShardCensusError if the ranks together did not cover every shard exactly once.
        """
        if self.reducer is None:
            raise RuntimeError("train_step called before join_group")
        started = time.perf_counter()
        spec = self.spec
        batch_total = self.sampler.step_batch_size(step)
        self.flat.zero()
        census = self.flat.extra[: spec.num_shards]
        census[list(shards)] = 1.0
        passes = [
            (group, np.concatenate([self.sampler.shard_indices(step, s) for s in group]))
            for group in _passes(shards, spec.fuse_shards)
        ]
        passes = [(group, indices) for group, indices in passes if len(indices)]
        samples = sum(len(indices) for _, indices in passes)
        self.flat.extra[spec.num_shards + 1] = samples
        loss_sum = torch.zeros((), device=self.device)
        for number, (group, indices) in enumerate(passes):
            inputs, targets = move_to(fetch_batch(self.dataset, indices), self.device)
            torch.manual_seed(_shard_seed(spec.seed, step, group[0]))
            loss = per_sample_loss(spec.loss, self.model(inputs), targets).sum() / batch_total
            loss_sum += loss.detach()
            if number == len(passes) - 1:
                # The loss rides in the last bucket, which may go out during this backward.
                self.flat.extra[spec.num_shards] = loss_sum
                self.reducer.arm()
            loss.backward()
        computed = time.perf_counter()
        comm_s = self.reducer.finish()
        counts = census.cpu()
        if not torch.all(counts == 1):
            bad = {i: float(c) for i, c in enumerate(counts.tolist()) if c != 1}
            raise ShardCensusError(f"step {step}: shards not committed exactly once: {bad}")
        reduced = time.perf_counter()
        self.optimizer.step()
        done = time.perf_counter()
        return StepTelemetry(
            step=step,
            rank=self.rank,
            shards=tuple(shards),
            samples=samples,
            global_samples=int(self.flat.extra[spec.num_shards + 1].item()),
            loss=float(self.flat.extra[spec.num_shards].item()),
            compute_s=computed - started,
            comm_s=comm_s,
            optim_s=done - reduced,
            step_s=done - started,
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
