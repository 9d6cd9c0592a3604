"""A null workload for measuring the control plane: one weight, one-number samples, no compute
worth the name, so a step's time is the orchestration's (driver, store, all-reduce latency)."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def make_model() -> torch.nn.Module:
    """``y = w x``: a single parameter (a 4-byte gradient, plus the census, on the wire)."""
    return torch.nn.Linear(1, 1, bias=False)


def make_dataset(size: int = 65536) -> TensorDataset:
    """``size`` samples of ones with target zero (MSE)."""
    return TensorDataset(torch.ones(size, 1), torch.zeros(size, 1))
