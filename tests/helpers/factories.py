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


class _NormCNN(torch.nn.Module):
    """The digits as 1x8x8 images through conv -> BatchNorm2d -> ReLU -> linear: a model whose
    forward in train mode depends on the other samples of its batch, with running statistics."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, channels, 3, padding=1, bias=False)  # BatchNorm takes the mean out
        self.norm = torch.nn.BatchNorm2d(channels)
        self.head = torch.nn.Linear(channels * 64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.norm(self.conv(x.view(-1, 1, 8, 8))))
        return self.head(hidden.flatten(1))


def make_norm_cnn(channels: int = 4) -> torch.nn.Module:
    return _NormCNN(channels)
