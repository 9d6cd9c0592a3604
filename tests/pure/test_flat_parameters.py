"""What building a worker allocates on its device (issue 40, item 5): the parameters once (the
model's own copy moved into the flat values piece by piece, never whole beside them), and with
sharded state no whole gradient buffer, everything else as before."""

from __future__ import annotations

import pytest
import torch

from orchestrator.commands.memory_probe import PeakMemory
from orchestrator.job.reading import load_job
from tests.helpers.devices import DEVICES
from workers.actor import TrainWorker
from workers.model.flat_parameters import flatten_onto
from workers.step.census import census_slots

HIDDEN = 1024
#: What else a worker allocates while it builds: its extra slots, and on a GPU the model's
#: buffers and frozen parameter (a few KB; the digits dataset is numpy's, which the meter skips).
SLACK = 1 << 16
_PREBUILT: list[torch.nn.Module] = []


class _Tied(torch.nn.Module):
    """The digits through three hidden layers, two of them one tied weight, with a BatchNorm
    (buffers kept in step: extra slots) and a frozen parameter (left out of the flat values)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(64, HIDDEN)
        self.mid = torch.nn.Linear(HIDDEN, HIDDEN)
        self.back = torch.nn.Linear(HIDDEN, HIDDEN)
        self.back.weight = self.mid.weight
        self.norm = torch.nn.BatchNorm1d(HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, 10)
        self.scale = torch.nn.Parameter(torch.ones(HIDDEN), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.norm(self.mid(torch.relu(self.inp(x)))))
        return self.out(torch.relu(self.back(hidden)) * self.scale)


def prebuilt_model() -> torch.nn.Module:
    """A model factory: hands over a model built on the host before the measurement started,
    so that on the CPU the meter sees only what the worker adds (the device's share)."""
    return _PREBUILT.pop()


def make_tied() -> torch.nn.Module:
    """A model factory: builds the model as a job's factory does, on the host."""
    return _Tied()


def _job(group_size: int, factory: str = "prebuilt_model"):
    return load_job(None, [
        "eval=null", f"model.factory={__name__}:{factory}", "model.kwargs={}",
        "optimizer={name: sgd, kwargs: {lr: 0.1}}", f"sharding={{group_size: {group_size}}}",
    ])


def _trained(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group_size", [1, 4])
def test_a_worker_builds_with_its_parameters_once_on_the_device(device, group_size):
    """The construction peak on the device as ``ringleader plan`` measures it (``PeakMemory``),
    above a model the factory built on the host: the flat values (4N), and beside them only
    what the worker keeps (plain SGD: no optimizer state): the whole gradient (4N) unsharded,
    none sharded until a group gives the rank its slice. On the CPU the meter never sees the
    model's own copy freed (allocated before it started: ``test_on_the_host_...`` counts it).
    Everything else is as the model was: values, ties, buffers, the frozen parameter."""
    device = torch.device(device)
    job = _job(group_size)
    model = _Tied()
    numel = _trained(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    _PREBUILT.append(model)
    with PeakMemory(device) as meter:
        worker = TrainWorker(job, device=device)
    whole_gradient = 4 * numel if group_size == 1 else 0
    assert meter.peak <= 4 * numel + whole_gradient + SLACK, f"{meter.peak / (4 * numel):.2f} x 4N"

    flat = worker.flat
    assert worker.model is model and model.back.weight is model.mid.weight  # tied, counted once
    assert flat.numel == numel and flat.values.device.type == device.type
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach().cpu(), before[name], rtol=0, atol=0)
        assert p.device.type == device.type
    views = [p for p in model.parameters() if p.requires_grad]
    torch.testing.assert_close(flat.values.cpu(), torch.cat([p.detach().cpu().reshape(-1) for p in views]))
    assert all(p.untyped_storage().data_ptr() == flat.values.untyped_storage().data_ptr() for p in views)
    assert model.scale.untyped_storage().data_ptr() != flat.values.untyped_storage().data_ptr()
    assert all(b.device.type == device.type for b in model.buffers())
    assert flat.extra.numel() == census_slots(job.shards) + worker.buffers.slots and worker.buffers.slots > 0
    assert torch.all(flat.buffer == 0)
    if group_size == 1:
        assert flat.grads.numel() == numel and not flat.sliced
        assert all(p.grad.data_ptr() == flat.grads[lo - flat.extra.numel()].data_ptr()
                   for p, (lo, _) in zip(views, flat.ranges))
    else:
        assert flat.grads.numel() == 0 and flat.sliced and all(p.grad is None for p in views)


@pytest.mark.parametrize("group_size", [1, 4])
def test_on_the_host_each_parameter_is_freed_as_it_moves(group_size):
    """On the CPU, the model built inside the measurement: its own copy (4N) and the flat
    values (4N) together at most, each parameter freed as it moves into them, before any
    gradient is allocated."""
    job = _job(group_size, "make_tied")
    numel = _trained(_Tied())
    with PeakMemory(torch.device("cpu")) as meter:
        TrainWorker(job)
    assert meter.peak <= 8 * numel + SLACK, f"{meter.peak / (4 * numel):.2f} x 4N"


def _allocations(build) -> list[int]:
    """The size of each CPU allocation ``build()`` makes, as the plan's meter records them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        build()
    return [
        event.nbytes() for event in profile.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU and event.nbytes() > 0
    ]


def test_a_sharded_rank_never_allocates_a_whole_gradient():
    """Not even for a moment: of everything a sharded worker allocates while it builds, only
    the flat values reach a quarter of the parameters' bytes."""
    job = _job(4)
    model = _Tied()
    numel = _trained(model)
    _PREBUILT.append(model)
    sizes = _allocations(lambda: TrainWorker(job))
    assert [size for size in sizes if size >= numel] == [4 * numel]


def test_a_model_whose_move_replaces_its_moved_parameters_is_refused():
    """Where ``model.to`` re-creates parameters (torch's overwrite-on-conversion, or a module's
    own ``_apply``), backward would fill gradients the flat buffer never sees: refused."""
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        with pytest.raises(RuntimeError, match="'model.factory': moving the model to cpu replaced its parameters"):
            flatten_onto(torch.nn.Linear(3, 2), torch.device("cpu"))
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
