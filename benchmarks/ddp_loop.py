"""The peers' training loop: stock DDP on the same model, data, batch and optimizer as ringleader.

Each rank takes the same contiguous block of shards ringleader's balanced assignment gives it,
so every framework sees exactly the same samples in every step. DDP averages gradients over
ranks, so each rank's loss sum is scaled by ``world / weight`` (the step's total loss weight:
samples, or tokens for a token-level loss): the averaged gradient is then the step's mean
gradient, as in ringleader.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from jobspec import targets as factories
from jobspec.job import JobConfig
from jobspec.recipe import OptimizerConfig
from jobspec.targets import optional_callable
from policies.assignment import ShardAssignment
from workers.data.batches import fetch_batch
from workers.data.sampler import ShardSampler
from workers.model.evaluate import evaluate_job
from workers.model.objective import Objective
from workers.model.precision import autocast
from workers.optim.generic import decay_groups, resolve_optimizer_class
from workers.runtime.chaos import ChaosSchedule

_STOCK_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}


def stock_class(config: OptimizerConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer class and keyword arguments a DDP user would write: SGD/Adam/AdamW with
    torch's fused kernels (the fastest stock choice on CPU, and the kernels ringleader's flat
    optimizer calls, so both follow the same update rule), any other optimizer class as it is."""
    if config.is_fused:
        return _STOCK_OPTIMIZERS[config.name], {**config.kwargs, "fused": True}
    return resolve_optimizer_class(config.name), dict(config.kwargs)


def stock_groups(config: OptimizerConfig, params: Iterable[torch.nn.Parameter]) -> list[dict[str, Any]]:
    """``params`` in the job's decay groups, empty groups left out."""
    return [g for g in decay_groups(params, config.decay_biases_and_norms) if g["params"]]


def stock_optimizer(config: OptimizerConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """What a DDP user would write (``stock_class``), with the job's decay groups."""
    cls, kwargs = stock_class(config)
    return cls(stock_groups(config, params), **kwargs)


def global_weight(weight: float, world: int, device: torch.device) -> float:
    """The step's total loss weight (samples, or tokens for a token-level loss): this rank's
    summed over the ranks, as a user normalising a token mean over the global batch would."""
    if world == 1 or not torch.distributed.is_initialized():
        return weight
    total = torch.tensor([weight], dtype=torch.float64, device=device)  # NCCL sends device tensors
    torch.distributed.all_reduce(total)
    return float(total.item())


#: Makes a loop's optimizer from the job's optimizer section and the (wrapped) model's parameters.
OptimizerFactory = Callable[[OptimizerConfig, Iterable[torch.nn.Parameter]], torch.optim.Optimizer]

#: Called after a step's optimizer step: (step, model, optimizer, this rank's loss, time.time()).
StepHook = Callable[[int, torch.nn.Module, torch.optim.Optimizer, torch.Tensor, float], None]


class PeerRecipe:
    """The job's training recipe as a careful DDP user writes it, shared by the peers' loops
    (stock DDP and torchft): data by step and shard, the model, the stock optimizer, the
    schedule's rate set each step, autocast, a GradScaler for fp16, clipping the (already
    averaged) gradient by its global norm. ``state`` (``{"model": ..., "optimizer": ...}``,
    to resume): the model's is loaded here, the optimizer's by ``optimizer``."""

    def __init__(self, job: JobConfig, state: dict[str, Any] | None = None) -> None:
        torch.manual_seed(job.seed)
        self.job = job
        self.dataset = factories.build(job.dataset.factory, job.dataset.kwargs)
        self.sampler = ShardSampler(len(self.dataset), job.batch_size, job.shards, job.seed, shuffle=job.dataset.shuffle)
        self.module: torch.nn.Module = factories.build(job.model.factory, job.model.kwargs)
        if state is not None:
            self.module.load_state_dict(state["model"])  # before DDP wraps it
        self.objective = Objective(job.loss.name, job.loss.kwargs)
        self.schedule = job.schedule.policy()
        self.horizon = job.schedule.total_steps or job.steps or 0
        self.scaler = torch.amp.GradScaler("cpu", enabled=job.precision == "fp16")
        self.collate = optional_callable(job.dataset.collate)
        self.device = next(self.module.parameters()).device

    def optimizer(
        self, model: torch.nn.Module, state: dict[str, Any] | None = None, make: OptimizerFactory = stock_optimizer
    ) -> torch.optim.Optimizer:
        """The loop's optimizer over ``model``'s parameters, made by ``make`` (default: the
        stock one), with ``state["optimizer"]`` loaded when given."""
        optimizer = make(self.job.optimizer, model.parameters())
        if state is not None:
            optimizer.load_state_dict(state["optimizer"])
        return optimizer

    def batch(self, step: int, shards: Iterable[int]) -> tuple[Any, int]:
        """The samples of ``shards`` in ``step``, collated, and how many there are."""
        indices = np.concatenate([self.sampler.shard_indices(step, s) for s in shards])
        return fetch_batch(self.dataset, indices, self.collate), len(indices)

    def backward(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, batch: Any, samples: int,
        scale: Callable[[float], tuple[float, float]],
    ) -> tuple[torch.Tensor, float]:
        """Set the step's rate, run forward and backward. ``scale(weight)`` takes this rank's
        loss weight (samples, or tokens) and returns (the factor its loss sum is multiplied by,
        the step's total weight): the wrapper averages gradients over ranks, so the factor is
        ranks / total. Returns the scaled loss and the step's total loss weight."""
        base_lr = float(getattr(optimizer, "optim", optimizer).defaults["lr"])
        for group in optimizer.param_groups:
            group["lr"] = base_lr * self.schedule.factor(step, self.horizon)
        with autocast(self.device, self.job.precision):
            result = self.objective(model, batch, samples)
        factor, weight = scale(float(result.weight))
        loss = result.total * factor
        self.scaler.scale(loss).backward()
        return loss, weight

    def apply(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Clip (if the job says so) and step the optimizer."""
        if self.job.optimizer.clip_grad_norm is not None:
            self.scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.job.optimizer.clip_grad_norm)
        self.scaler.step(optimizer)
        self.scaler.update()

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        return evaluate_job(getattr(model, "module", model), self.job, self.objective)


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
    make_optimizer: OptimizerFactory = stock_optimizer,
) -> dict[str, Any]:
    """Train steps ``start_step`` to ``job.steps``; ``wrap`` turns the model into its DDP form.

    ``state`` (``{"model": ..., "optimizer": ...}`` state dicts) is loaded first (to resume).
    ``after_backward(step)`` runs after a step's backward (gradients all-reduced), before its
    optimizer step; ``after_step`` after the optimizer step, with the step's completion time.
    ``make_optimizer`` makes the optimizer over the wrapped model's parameters (default: the
    stock one; ``ZeroRedundancyOptimizer`` for the ZeRO peer).
    Returns the wall-clock (epoch seconds) end time and the loss weight (samples, or tokens) of
    each step, the final model state (``model``) and, on rank 0, the eval metrics.
    """
    recipe = PeerRecipe(job, state)
    model = wrap(recipe.module)
    optimizer = recipe.optimizer(model, state, make_optimizer)
    my_shards = ShardAssignment.balanced(job.shards, world).shards_by_rank[rank]
    # The job's injected slowness and stalls, exactly as a ringleader worker injects them (rank
    # = worker id: DDP never re-forms its group). A stall is slept in full: nothing here can
    # take a stalled rank's batch over. Kills are not injected.
    chaos = ChaosSchedule.for_worker(job.chaos, rank, threading.Event())
    step_ends: list[float] = []
    step_weights: list[float] = []

    def scale(weight: float) -> tuple[float, float]:
        total = global_weight(weight, world, recipe.device)
        return world / total, total

    for step in range(start_step, job.steps or 0):
        batch, samples = recipe.batch(step, my_shards)
        chaos.stall(step)
        optimizer.zero_grad(set_to_none=True)
        chaos.slow_down(step, len(my_shards), lambda: False)
        started = time.perf_counter()
        loss, weight = recipe.backward(model, optimizer, step, batch, samples, scale)
        chaos.record(step, time.perf_counter() - started, len(my_shards))
        if after_backward is not None:
            after_backward(step)
        recipe.apply(model, optimizer)
        step_ends.append(time.time())
        step_weights.append(weight)
        if after_step is not None:
            after_step(step, model, optimizer, loss.detach(), step_ends[-1])
    metrics = recipe.evaluate(model) if rank == 0 else {}
    return {"step_ends": step_ends, "step_weights": step_weights, "eval": metrics, "model": recipe.module.state_dict()}


def write_result(result: dict[str, Any], path: str | Path, model_path: str | Path | None = None) -> None:
    """Write a loop's result as JSON to ``path``; its final parameters (``result["model"]``, a
    state dict) go to ``model_path`` with ``torch.save`` when given, else nowhere."""
    result = dict(result)
    model = result.pop("model", None)
    if model_path is not None and model is not None:
        torch.save(model, model_path)
    Path(path).write_text(json.dumps(result))
