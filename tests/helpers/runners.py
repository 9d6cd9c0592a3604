"""A step's passes on a tiny linear model, without a group: the runner, its flat parameters and
the model, and a reducer that only needs arming (``run_fixed``'s last pass arms it before its
backward)."""

from __future__ import annotations

import threading

import torch

from jobspec.job import JobConfig
from workers.data.sampler import ShardSampler
from workers.model.flat_parameters import FlatParameters
from workers.model.objective import Objective
from workers.runtime.chaos import ChaosSchedule
from workers.step.census import census_slots
from workers.step.passes import PassRunner
from workers.step.runner import StepRunner


class ArmedReducer:
    """A reducer that only needs arming; counts how often it was armed."""

    def __init__(self) -> None:
        self.armed = 0

    def arm(self) -> None:
        self.armed += 1


def linear_runner(
    device: torch.device, objective: Objective, *, shards: int = 2, samples: int = 16, batch_size: int = 8,
    fuse_shards: bool = True, max_samples_per_pass: int | None = None, runner: type[PassRunner] = StepRunner,
) -> tuple[PassRunner, FlatParameters, torch.nn.Module]:
    """A ``runner`` (a ``StepRunner`` unless told) over ``torch.nn.Linear(4, 1)`` and ``samples`` random samples (both drawn
    after ``torch.manual_seed(0)``), steps of ``batch_size`` cut into ``shards``: the runner, its flat parameters (the
    census slots in front) and the model."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    flat = FlatParameters(model.parameters(), extra=census_slots(shards))
    dataset = torch.utils.data.TensorDataset(torch.randn(samples, 4), torch.randn(samples, 1))
    chaos = ChaosSchedule.for_worker(JobConfig().chaos, 0, threading.Event())
    sampler = ShardSampler(len(dataset), batch_size, shards, 0)
    passes = runner(
        model, flat, sampler, dataset, objective, 0, fuse_shards, chaos, device, max_samples_per_pass=max_samples_per_pass
    )
    return passes, flat, model
