"""The peers' training loop: stock DDP on the same model, data, batch and optimizer as ringleader.

Each rank takes the same contiguous block of shards ringleader's balanced assignment gives it,
so every framework sees exactly the same samples in every step. DDP averages gradients over
ranks, so each rank's loss is scaled by ``world / batch``: the averaged gradient is then the
step's mean gradient, as in ringleader.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable

import numpy as np
import torch

from orchestrator.config import JobConfig
from policies.assignment import ShardAssignment
from workers import factories
from workers.chaos import ChaosSchedule
from workers.sampler import ShardSampler
from workers.training import evaluate_model, fetch_batch, per_sample_loss


_STOCK_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}


def stock_optimizer(name: str, kwargs: dict[str, Any], params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """What a DDP user would write, with torch's fused kernels (the fastest stock choice on CPU,
    and the kernels ringleader's flat optimizer calls, so both follow the same update rule)."""
    return _STOCK_OPTIMIZERS[name](params, **kwargs, fused=True)


#: Called after a step's optimizer step: (step, model, optimizer, this rank's loss, time.time()).
StepHook = Callable[[int, torch.nn.Module, torch.optim.Optimizer, torch.Tensor, float], None]


def train_ddp(
    job: JobConfig,
    rank: int,
    world: int,
    wrap: Callable[[torch.nn.Module], torch.nn.Module],
    *,
    start_step: int = 0,
    state: dict[str, Any] | None = None,
    after_backward: Callable[[int], None] | None = None,
    after_step: StepHook | None = None,
) -> dict[str, Any]:
    """Train steps ``start_step`` to ``job.steps``; ``wrap`` turns the model into its DDP form.

    ``state`` (``{"model": ..., "optimizer": ...}`` state dicts) is loaded first (to resume).
    ``after_backward(step)`` runs after a step's backward (gradients all-reduced), before its
    optimizer step; ``after_step`` after the optimizer step, with the step's completion time.
    Returns the wall-clock (epoch seconds) end time of each step, and on rank 0 the eval metrics.
    """
    torch.manual_seed(job.seed)
    dataset = factories.build(job.dataset.factory, job.dataset.kwargs)
    sampler = ShardSampler(len(dataset), job.batch_size, job.shards, job.seed)
    module = factories.build(job.model.factory, job.model.kwargs)
    if state is not None:
        module.load_state_dict(state["model"])  # before DDP wraps it (DDP broadcasts rank 0's anyway)
    model = wrap(module)
    optimizer = stock_optimizer(job.optimizer.name, job.optimizer.kwargs, model.parameters())
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
    my_shards = ShardAssignment.balanced(job.shards, world).shards_by_rank[rank]
    # The job's injected slowness, exactly as a ringleader worker injects it (rank = worker id:
    # DDP never re-forms its group). Only slow_down/record are used: stalls and kills are not.
    chaos = ChaosSchedule.for_worker(job.chaos, rank, threading.Event())
    step_ends: list[float] = []
    for step in range(start_step, job.steps or 0):
        indices = np.concatenate([sampler.shard_indices(step, s) for s in my_shards])
        inputs, targets = fetch_batch(dataset, indices)
        optimizer.zero_grad(set_to_none=True)
        chaos.slow_down(step, len(my_shards), lambda: False)
        started = time.perf_counter()
        loss = per_sample_loss(job.loss, model(inputs), targets).sum() * (world / job.batch_size)
        loss.backward()
        chaos.record(time.perf_counter() - started, len(my_shards))
        if after_backward is not None:
            after_backward(step)
        optimizer.step()
        step_ends.append(time.time())
        if after_step is not None:
            after_step(step, model, optimizer, loss.detach(), step_ends[-1])
    metrics: dict[str, float] = {}
    if rank == 0 and job.eval is not None:
        module = getattr(model, "module", model)
        metrics = evaluate_model(module, factories.build(job.eval.factory, job.eval.kwargs), job.loss)
    return {"step_ends": step_ends, "eval": metrics}
