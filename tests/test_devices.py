"""A worker's device without a GPU: which CUDA device the GPU Ray assigned is, the backend and
the jobs refused for it."""

from __future__ import annotations

import pytest
import torch

from jobspec.job import JobConfig
from orchestrator.job_file import load_job
from workers.communicator import pick_backend
from workers.devices import choose_device, cuda_index, worker_device

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


# Which device: the GPU Ray assigned, as this process's CUDA numbers it.


@pytest.mark.parametrize(
    "gpu_id, visible, index",
    [
        ("3", "3", 0),  # Ray narrowed CUDA_VISIBLE_DEVICES to the assigned GPU: it is cuda:0 whatever its id
        (3, "3", 0),  # ids come as ints where the node set no CUDA_VISIBLE_DEVICES of its own
        ("3", "1,3", 1),  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: the node's list is inherited
        (2, None, 2),  # ... and where the node has none, every GPU is visible, numbered as the node does
        ("GPU-b2", "GPU-a1, GPU-b2", 1),  # UUIDs, as a node's CUDA_VISIBLE_DEVICES may hold
    ],
)
def test_the_assigned_gpu_is_its_place_in_cuda_visible_devices(gpu_id, visible, index):
    assert cuda_index(gpu_id, visible) == index


@pytest.mark.parametrize(
    "gpu_id, visible, expected",
    [("4", "1,3", "which CUDA_VISIBLE_DEVICES='1,3' does not list"), ("GPU-a1", None, "which is no CUDA index")],
)
def test_an_assigned_gpu_cuda_cannot_see_is_refused(gpu_id, visible, expected):
    with pytest.raises(ValueError, match=expected):
        cuda_index(gpu_id, visible)


def test_the_device_is_the_cpu_without_a_gpu_and_the_assigned_gpu_with_one():
    assert choose_device([], None, cuda_available=True, device_count=8) == CPU
    assert choose_device(["5"], "5", cuda_available=True, device_count=1) == CUDA
    assert choose_device([5], None, cuda_available=True, device_count=8) == torch.device("cuda", 5)


@pytest.mark.parametrize(
    "gpu_ids, visible, available, count, expected",
    [
        (["1"], "1", False, 0, r"GPU 1 \(scaling.resources_per_worker\), but torch .* cannot use CUDA"),
        (["1", "2"], "1,2", True, 2, r"GPUs \['1', '2'\]: a worker trains on one GPU"),
        ([6], None, True, 4, r"GPU 6, cuda:6 here, but CUDA shows 4 device"),
        (["7"], "1,3", True, 2, r"does not list \(scaling.resources_per_worker\)"),
    ],
)
def test_a_gpu_the_worker_cannot_use_fails_its_start_with_the_reason(gpu_ids, visible, available, count, expected):
    with pytest.raises(RuntimeError, match=expected):
        choose_device(gpu_ids, visible, cuda_available=available, device_count=count)


def test_the_worker_device_reads_the_environment_and_is_made_current(monkeypatch):
    chosen = []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")  # as RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES leaves it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert worker_device(["2"]) == torch.device("cuda", 1)
    assert chosen == [torch.device("cuda", 1)]  # before any NCCL work: the actor's constructor
    assert worker_device([]) == CPU and len(chosen) == 1


# The backend, and the jobs refused for their devices.


def test_the_backend_follows_collective_backend():
    assert (pick_backend(CUDA), pick_backend(CPU)) == ("nccl", "gloo")  # auto
    assert pick_backend(CUDA, "gloo") == "gloo"  # workers sharing a GPU
    assert pick_backend(CUDA, "nccl") == "nccl"
    with pytest.raises(ValueError, match="field 'collective.backend': nccl needs CUDA tensors, and this worker trains on cpu"):
        pick_backend(CPU, "nccl")


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["scaling.resources_per_worker={CPU: 1, GPU: 2}"], "field 'scaling.resources_per_worker': GPU 2 per worker: a worker trains on one GPU"),
        (["scaling.resources_per_worker={GPU: 1.5}"], "field 'scaling.resources_per_worker': GPU 1.5 per worker"),
        (["scaling.resources_per_worker={GPU: 0.5}"], "scaling.resources_per_worker GPU 0.5: workers sharing a GPU need collective.backend: gloo (got auto"),
        (["scaling.resources_per_worker={GPU: 0.25}", "collective.backend=nccl"], "GPU 0.25: workers sharing a GPU need collective.backend: gloo (got nccl"),
        (["collective.backend=nccl"], "collective.backend nccl needs a GPU per worker, and scaling.resources_per_worker asks for none"),
        (["collective.backend=mpi"], "field 'collective.backend'"),
    ],
    ids=["two-gpus", "gpu-and-a-half", "shared-auto", "shared-nccl", "nccl-on-cpu", "unknown"],
)
def test_jobs_whose_devices_do_not_fit_are_refused_naming_the_field(overrides, expected):
    from jobspec.fields import ConfigError

    with pytest.raises(ConfigError) as refused:
        load_job(None, overrides, resolve=False)
    assert expected in str(refused.value)


def test_jobs_whose_devices_fit_are_taken():
    shared = load_job(None, ["scaling.resources_per_worker={CPU: 1, GPU: 0.5}", "collective.backend=gloo"], resolve=False)
    assert shared.scaling.resources_per_worker["GPU"] == 0.5
    for backend in ("auto", "nccl", "gloo"):
        assert load_job(None, ["scaling.resources_per_worker={GPU: 1}", f"collective.backend={backend}"], resolve=False)
    assert JobConfig().collective.backend == "auto"

