"""A replica without Ray or a process group: what ``CheckpointWriter`` and ``restore_state``
need of a worker (``workers.replica.Replica``), trained by a fixed recipe so two of them
started alike stay alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from workers.model.flat_parameters import FlatParameters
from workers.optim.generic import GenericOptimizer
from workers.optim.loss_scaler import LossScaler
from workers.state_layout import ReplicatedState


@dataclass
class FakeReplica:
    """What ``CheckpointWriter`` and ``restore_state`` need of a worker (``workers.replica.Replica``)."""

    optimizer_name: Any
    kwargs: dict[str, Any]
    model: torch.nn.Module = field(init=False)
    flat: FlatParameters = field(init=False)
    optimizer: GenericOptimizer = field(init=False)
    state: ReplicatedState = field(init=False)
    scaler: LossScaler = field(default_factory=lambda: LossScaler(False))
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32  # the model's
    next_step: int = 0

    def __post_init__(self) -> None:
        torch.manual_seed(0)  # every replica starts alike
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3)).to(self.dtype)
        self.flat = FlatParameters(self.model.parameters(), extra=2)
        # decay_biases_and_norms false: two groups, so state_dict order is not the flat order
        self.optimizer = GenericOptimizer(self.optimizer_name, self.kwargs, self.flat.params, False)
        self.state = ReplicatedState(self.optimizer)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.flat.zero()
            torch.manual_seed(100 + self.next_step)
            self.model(torch.randn(4, 6).to(self.dtype)).square().sum().backward()
            self.optimizer.step()
            self.next_step += 1
