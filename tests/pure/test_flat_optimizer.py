"""The flat optimizer against stock torch.optim (fused): same updates, same validation."""

import pytest
import torch

from workers.model.flat_parameters import FlatParameters
from workers.optim.fused import FlatOptimizer, parse_optimizer

STOCK = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 4))


def _train(model: torch.nn.Module, step, steps: int = 5) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 6), torch.randint(0, 4, (16,))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        step()


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("sgd", {"lr": 0.1}),
        ("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
        ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "maximize": True}),
        ("adam", {"lr": 0.01}),
        ("adam", {"lr": 0.01, "betas": [0.8, 0.99], "amsgrad": True, "weight_decay": 0.1}),
        ("adamw", {"lr": 0.01}),
    ],
)
def test_matches_stock_fused_optimizer(name, kwargs):
    stock_model = _model()
    stock = STOCK[name](stock_model.parameters(), **kwargs, fused=True)

    def stock_step() -> None:
        stock.step()
        stock.zero_grad()

    _train(stock_model, stock_step)

    model = _model()
    flat = FlatParameters(model.parameters(), extra=3)
    mine = FlatOptimizer(name, kwargs, flat.values, flat.grads)

    def flat_step() -> None:
        mine.step()
        flat.zero()

    _train(model, flat_step)
    for ours, theirs in zip(model.parameters(), stock_model.parameters()):
        # Same kernels; only SIMD-vs-tail rounding at different offsets may differ.
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-8)


def test_fallback_device_path_steps_like_the_fused_one():
    fused_model, fallback_model = _model(), _model()
    results = []
    for model, fallback in ((fused_model, False), (fallback_model, True)):
        flat = FlatParameters(model.parameters())
        optimizer = FlatOptimizer("adam", {"lr": 0.01}, flat.values, flat.grads)
        if fallback:  # what a device without fused kernels gets
            optimizer._fallback = optimizer._stock_optimizer()

        def step(optimizer: FlatOptimizer = optimizer, flat: FlatParameters = flat) -> None:
            optimizer.step()
            flat.zero()

        _train(model, step)
        results.append(flat.values.clone())
    torch.testing.assert_close(results[0], results[1])


@pytest.mark.parametrize(
    "name, kwargs, error, match",
    [
        ("lamb", {}, ValueError, "unknown optimizer 'lamb'"),
        ("adam", {"learning_rate": 0.1}, TypeError, "learning_rate"),
        ("adam", {"fused": True}, TypeError, "fused"),
        ("adam", {"lr": -1}, ValueError, "lr must be >= 0"),
        ("adam", {"betas": [0.9, 1.5]}, ValueError, "betas"),
        ("sgd", {"nesterov": True}, ValueError, "nesterov"),
    ],
)
def test_bad_settings_are_refused(name, kwargs, error, match):
    with pytest.raises(error, match=match):
        parse_optimizer(name, kwargs)


def test_adamw_defaults_follow_torch():
    assert parse_optimizer("adamw", {}).weight_decay == torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults["weight_decay"]
