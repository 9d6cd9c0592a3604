"""``workers.model.precision.autocast``: the forward's context for a job's precision. fp32 is
no context at all (a matmul stays fp32); bf16 and fp16 are ``torch.autocast`` on the worker's
device type to that half type, under which a matmul runs in it while the parameters and their
gradients stay fp32, and on leaving which everything is fp32 again. Checked on the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from workers.model.precision import autocast

CPU = torch.device("cpu")
HALVES = [pytest.param("bf16", torch.bfloat16, id="bf16"), pytest.param("fp16", torch.float16, id="fp16")]


def _matmul() -> torch.Tensor:
    return torch.randn(3, 4) @ torch.randn(4, 2)


def test_fp32_turns_no_autocast_on_and_a_matmul_inside_stays_fp32() -> None:
    with autocast(CPU, "fp32"):
        assert not torch.is_autocast_enabled("cpu")
        assert _matmul().dtype == torch.float32


@pytest.mark.parametrize(("precision", "half"), HALVES)
def test_a_half_precision_runs_a_matmul_inside_in_its_half_type_and_fp32_again_after(
    precision: str, half: torch.dtype
) -> None:
    with autocast(CPU, precision):
        assert torch.is_autocast_enabled("cpu")
        assert _matmul().dtype == half
    assert not torch.is_autocast_enabled("cpu")
    assert _matmul().dtype == torch.float32


@pytest.mark.parametrize(("precision", "half"), HALVES)
def test_under_a_half_precision_the_parameters_and_their_gradients_stay_fp32(precision: str, half: torch.dtype) -> None:
    layer = torch.nn.Linear(4, 2)
    with autocast(CPU, precision):
        out = layer(torch.randn(3, 4))
    assert out.dtype == half  # the forward ran in the half type...
    out.float().square().sum().backward()
    assert layer.weight.dtype == layer.bias.dtype == torch.float32  # ...over the fp32 parameters
    assert layer.weight.grad is not None and layer.weight.grad.dtype == torch.float32
    assert layer.bias.grad is not None and layer.bias.grad.dtype == torch.float32


def test_the_autocast_is_for_the_workers_device_type_leaving_other_devices_ops_alone() -> None:
    with warnings.catch_warnings():  # a CPU-only torch warns that CUDA autocast is disabled
        warnings.simplefilter("ignore")
        context = autocast(torch.device("cuda", 1), "bf16")
        assert isinstance(context, torch.autocast)
        assert (context.device, context.fast_dtype) == ("cuda", torch.bfloat16)  # the type, not "cuda:1"
        with context:
            assert _matmul().dtype == torch.float32  # a host matmul is not the CUDA autocast's
