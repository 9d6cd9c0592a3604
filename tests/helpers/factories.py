"""Model and dataset factories that misbehave on purpose, for failure-path tests."""

import time

import torch


class _Sleepy(torch.nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 10)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.linear(x)


def make_sleepy_model(seconds: float = 5.0) -> torch.nn.Module:
    return _Sleepy(seconds)


def make_broken_dataset() -> torch.utils.data.Dataset:
    raise FileNotFoundError("training data not found at /nowhere/data.bin")


def make_model_elsewhere(hidden: int = 128) -> torch.nn.Module:
    """The digits model, built by a worker that first moves to another working directory (as a
    worker on a cluster node runs elsewhere than the driver)."""
    import os
    import tempfile

    from ringleader_examples.digits import make_model

    os.chdir(tempfile.mkdtemp(prefix="rl-elsewhere-"))
    return make_model(hidden=hidden)
