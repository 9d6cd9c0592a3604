"""Measure a job's own model for the memory plan (``policies/memory_plan.py``): a short probe.

The probe builds one real worker (``workers/actor.py`` ``TrainWorker``, no Ray: the same
dataset, model, flat buffers, optimizer and step code a worker runs), joins it to a process
group of one (a TCPStore of its own on 127.0.0.1, gloo or NCCL as the job's worker would
pick) and trains real steps: one to create the optimizer's state, then one with passes of
``b1`` samples and one with passes of ``b2``, each step's peak measured above the level it
started at. Activations are the line through those two peaks: per sample their difference
over ``b2 - b1``, fixed what is left at ``b1``.

How memory is measured (``PeakMemory``):

* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``: the caching
  allocator's own count of bytes in live tensors (not what it reserved).
* CPU: torch keeps no such figures for the CPU, and RSS is not honest for this: glibc keeps
  freed small blocks, returns large ones (mmap) at once, and the interpreter's own objects
  move it. ``tracemalloc`` sees only Python's allocator, none of torch's. What is exact is the
  CPU allocator's own report: with ``torch.profiler`` and ``profile_memory``, c10's CPU
  allocator records every allocation and free of a tensor's storage, with its size and time;
  their running sum in time order is the bytes in live tensors, and its maximum the peak.
  Memory a kernel library allocates on its own (MKL's and oneDNN's scratch) is not in it,
  nor numpy's (a dataset built from numpy arrays: host memory, which the plan leaves out).
  The profiler records only the thread that measures (with ``profile_all_threads`` it records
  no memory at all, torch 2.13): what other threads allocate is missed, and a tensor of this
  thread whose last reference another thread drops is never seen freed. In a step the comm
  thread allocates only the ring's scratch (none in a group of one) and frees nothing of the
  step's (the probe runs the job unsharded: the plan lays the state out itself; a sharded
  rank's bucket copies are freed by the reducer, on the thread that made them); at a join,
  a generic optimizer's packed state may be dropped last by the comm thread, which then reads
  as held until the block ends (the step is measured apart).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from jobspec.fields import ConfigError
from jobspec.runtime import ShardingConfig
from jobspec.wire import JoinRequest
from orchestrator.data.index import build_index
from policies.memory_plan import ModelFigures, OptimizerBytes, optimizer_bytes
from policies.work_stealing import StepPlan
from workers.actor import TrainWorker
from workers.optim.fused import FlatOptimizer

if TYPE_CHECKING:
    from jobspec.job import JobConfig

#: How long the probe's group of one may take to form.
JOIN_TIMEOUT_S = 60.0


class PeakMemory:
    """``peak``: the most bytes in live tensors on ``device`` (cpu or cuda) above the level at
    entry while the ``with`` block runs (0 or more; frees of older tensors count against the
    level). Raises ValueError for another device type."""

    def __init__(self, device: torch.device) -> None:
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"memory of a {device.type} device cannot be measured here: cpu or cuda")
        self.device = device
        self.peak = 0
        self._start = 0
        self._profile: torch.profiler.profile | None = None

    def __enter__(self) -> PeakMemory:
        # Garbage (a worker is a reference cycle) is freed now, not by a collection inside the
        # block: the CPU meter sees the frees of what an earlier block allocated, and they would
        # lower the level this block's peak counts from.
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            self._profile.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self._profile is None:
            torch.cuda.synchronize(self.device)
            self.peak = max(0, torch.cuda.max_memory_allocated(self.device) - self._start)
            return
        self._profile.__exit__(kind, error, tb)
        if kind is not None:
            return
        changes = sorted(
            (event.start_ns(), event.nbytes())
            for event in self._profile.profiler.kineto_results.events()
            if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU
        )
        level = 0
        for _, change in changes:  # the running sum of allocations (+) and frees (-), in time order
            level += change
            self.peak = max(self.peak, level)


@dataclass(frozen=True)
class Probe:
    """What the probe measured of a job: the plan's ``model`` and ``optimizer`` figures, the
    parameters' ``dtype``, the optimizer's state as it holds it after a step
    (``optimizer_state_bytes``), the ``device`` measured on, and the two pass sizes with each
    step's peak above the state."""

    model: ModelFigures
    optimizer: OptimizerBytes
    dtype: str
    optimizer_state_bytes: int
    device: str
    sizes: tuple[int, int]
    peaks: tuple[int, int]

    def as_dict(self) -> dict[str, object]:
        return {
            "params": self.model.params, "extra_slots": self.model.extra_slots, "buffer_bytes": self.model.buffer_bytes,
            "dtype": self.dtype, "optimizer": self.optimizer.kind, "optimizer_state_bytes": self.optimizer_state_bytes,
            "optimizer_bytes_per_param": self.optimizer.per_param, "device": self.device,
            "probe_samples": list(self.sizes), "probe_peaks": list(self.peaks),
            "activation_fixed": self.model.activation_fixed, "activation_per_sample": self.model.activation_per_sample,
        }


def state_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each counted once (views share one)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def optimizer_tensors(worker: TrainWorker) -> list[torch.Tensor]:
    """The tensors of the worker's optimizer state: the fused one's flat state, or whatever a
    generic ``torch.optim`` optimizer keeps per parameter (created by its first step)."""
    if isinstance(worker.optimizer, FlatOptimizer):
        return list(worker.optimizer.state_tensors().values())
    return [
        value for state in worker.optimizer.optimizer.state.values() for value in state.values()
        if isinstance(value, torch.Tensor)
    ]


def plan_optimizer(job: JobConfig, measured_bytes: int, params: int) -> OptimizerBytes:
    """The plan's optimizer figures: the fused kinds by their rule, a generic one by what its
    state measured (all of it per parameter: it scales with the model)."""
    name, kwargs = job.optimizer.name, job.optimizer.kwargs
    if job.optimizer.is_fused:
        return optimizer_bytes(name, momentum=bool(kwargs.get("momentum", 0)), amsgrad=bool(kwargs.get("amsgrad", False)))
    return optimizer_bytes("generic", per_param=measured_bytes / params)


class ProbeWorker:
    """A ``TrainWorker`` on ``device`` in a process group of its own, stepping through its whole
    batch with passes of a chosen size. ``close()`` leaves the group; usable as a context manager."""

    def __init__(self, job: JobConfig, device: torch.device = torch.device("cpu")) -> None:
        # Unsharded whatever the job says: the plan lays out the state itself, for every setting.
        job = job.model_copy(update={"sharding": ShardingConfig()})
        if job.dataset.ray_data is not None:
            raise ConfigError(
                "invalid job: field 'dataset.ray_data': the probe steps real samples in this process, without the "
                "stream's feeder; probe with a files or factory source of samples shaped alike (--set 'dataset={...}')"
            )
        data = {"dataset": build_index(job.dataset, "dataset", job.timeouts.start_s)} if job.dataset.files else None
        self.worker = TrainWorker(job, device=device, data=data)
        self._store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        request = JoinRequest("127.0.0.1", self._store.port, "probe/", 1, 0, ("probe",), JOIN_TIMEOUT_S)
        self.worker.join_group(request)
        self._plan = StepPlan((tuple(range(job.shards)),), steal=False, speculate=False)
        fused = job.worker.fuse_shards and not self.worker.buffers.per_shard
        #: The most samples one pass can hold: the whole batch when shards fuse (this worker runs
        #: every shard), else the smallest shard (a model with batch-dependent buffers never fuses).
        self.largest_pass = job.batch_size if fused else job.batch_size // job.shards

    def step(self, samples_per_pass: int) -> None:
        """One real step (``TrainWorker.train_step``) with passes of at most ``samples_per_pass``."""
        self.worker.runner.max_samples_per_pass = samples_per_pass
        self.worker.train_step(self.worker.next_step, self._plan)

    def close(self) -> None:
        self.worker.leave_group()

    def __enter__(self) -> ProbeWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def probe_job(job: JobConfig, sizes: tuple[int, int] | None = None, device: torch.device = torch.device("cpu")) -> Probe:
    """Measure ``job``'s model: parameter count and dtype, optimizer state after one step, and
    the peak of a step at two pass sizes ``sizes`` (default: the largest a pass can be and its
    half), on ``device``. Raises ValueError if the sizes are not two that a pass can hold."""
    with ProbeWorker(job, device) as probe:
        small, large = sizes if sizes is not None else (probe.largest_pass // 2, probe.largest_pass)
        if not 1 <= small < large <= probe.largest_pass:
            raise ValueError(
                f"probe pass sizes {small} and {large}: expected 1 <= b1 < b2 <= {probe.largest_pass}, the most "
                "samples one pass of this job holds (batch_size; a shard without worker.fuse_shards)"
            )
        worker = probe.worker
        probe.step(small)  # creates a generic optimizer's state; warms caches and kernels
        peaks = []
        for size in (small, large):
            with PeakMemory(worker.device) as meter:
                probe.step(size)
            peaks.append(meter.peak)
        params = worker.flat.numel
        held = state_bytes(optimizer_tensors(worker))
        per_sample = max(0.0, (peaks[1] - peaks[0]) / (large - small))
        model = ModelFigures(
            params=params,
            extra_slots=worker.flat.extra.numel(),
            buffer_bytes=state_bytes(list(worker.model.buffers())),
            activation_fixed=max(0.0, peaks[0] - per_sample * small),
            activation_per_sample=per_sample,
        )
        return Probe(
            model, plan_optimizer(job, held, params), str(worker.flat.values.dtype).removeprefix("torch."), held,
            str(worker.device), (small, large), (peaks[0], peaks[1]),
        )
