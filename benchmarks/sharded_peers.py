"""The sharding bench's peers under torchrun (``benchmarks/torchrun_entry.py --variant``): the
same job as the stock DDP peer, with PyTorch's own ways to shard training state.

* ``ddp``: stock DDP, the replicated floor (``benchmarks/ddp_loop.py``).
* ``zero``: DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer`` (ZeRO stage 1: each
  rank steps and holds the state of its share of the parameters, whole tensors greedily
  balanced by size, then broadcasts them), over the stock fused optimizer with the job's decay
  groups.
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` (parameters, gradients and optimizer state
  sharded over all ranks: ZeRO stage 3) on every member of the model's ``ModuleList``s, then
  the root, on a CPU device mesh over gloo; the stock optimizer over the sharded (DTensor)
  parameters.

``StepPeak`` measures one step of a rank the way the bench measures ours: the bytes of the
training state the rank holds when the step starts (parameters, gradients, optimizer state,
buffers, the local shards of DTensors, each storage once) plus the step's peak above that level
(``orchestrator/commands/memory_probe.py``'s ``PeakMemory``: torch's profiler memory events, this
thread's only). One difference from ours: the loop drops its gradients before the forward
(``zero_grad(set_to_none=True)``), and the profiler never sees a block allocated before it
started being freed, so the new gradients count in the step's peak while the old ones still
count in the level; the peak is therefore the state without the gradients plus the step's
(ours zeroes one flat gradient buffer in place: its state counts whole).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

from benchmarks.ddp_loop import OptimizerFactory, stock_class, stock_groups, stock_optimizer
from jobspec.recipe import OptimizerConfig
from orchestrator.commands.memory_probe import PeakMemory, state_bytes

VARIANTS = ("ddp", "zero", "fsdp2")


def zero_optimizer(config: OptimizerConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``ZeroRedundancyOptimizer`` over the optimizer ``stock_optimizer`` would make (fused
    sgd/adam/adamw, else the class as it is), with the job's decay groups."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls, kwargs = stock_class(config)
    return ZeroRedundancyOptimizer(stock_groups(config, params), optimizer_class=cls, **kwargs)


def _ddp(module: torch.nn.Module) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module)


def _fully_shard(module: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 over every rank: each member of a ``ModuleList`` (a transformer's blocks) is its
    own unit, the root holds the rest (embeddings, head, final norm)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for child in list(module.modules()):
        if isinstance(child, torch.nn.ModuleList):
            for block in child:
                fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def variant(name: str) -> tuple[Callable[[torch.nn.Module], torch.nn.Module], OptimizerFactory]:
    """(how the model is wrapped, how its optimizer is made) for peer ``name`` (``VARIANTS``).
    Raises ValueError for another name."""
    if name == "ddp":
        return _ddp, stock_optimizer
    if name == "zero":
        return _ddp, zero_optimizer
    if name == "fsdp2":
        return _fully_shard, stock_optimizer
    raise ValueError(f"unknown peer variant {name!r}; choose from {VARIANTS}")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``tensor``: a DTensor's local shard, else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of the state this rank's optimizer holds (ZeRO's: its local optimizer's)."""
    inner = getattr(optimizer, "optim", optimizer)
    return [_local(v) for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the training state this rank holds now, by part (each storage once within a
    part): ``parameters``, ``gradients``, ``optimizer``, ``buffers``. Not counted: what a
    wrapper keeps on its own (DDP's gradient buckets)."""
    params = list(model.parameters())
    return {
        "parameters": state_bytes([_local(p) for p in params]),
        "gradients": state_bytes([_local(p.grad) for p in params if p.grad is not None]),
        "optimizer": state_bytes(optimizer_state(optimizer)),
        "buffers": state_bytes([_local(b) for b in model.buffers()]),
    }


class StepPeak:
    """An ``after_step`` hook (``train_ddp``) that measures step ``step`` (>= 1): the state held
    at its start (``held``, by part) and its peak above that (``transient``); ``peak`` is the
    state without its gradients (dropped before the forward, see the module) plus the step's
    (0 until measured)."""

    def __init__(self, step: int) -> None:
        if step < 1:
            raise ValueError(f"the measured step must follow another (its state is created by a step), got {step}")
        self.step = step
        self.held: dict[str, int] = {}
        self.transient = 0
        self._meter: PeakMemory | None = None

    def __call__(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: Any, at: float) -> None:
        if step == self.step - 1:
            self.held = held_bytes(model, optimizer)
            self._meter = PeakMemory(torch.device("cpu")).__enter__()
        elif step == self.step and self._meter is not None:
            self._meter.__exit__(None, None, None)
            self.transient = self._meter.peak

    @property
    def peak(self) -> int:
        return sum(self.held.values()) - self.held["gradients"] + self.transient if self.held else 0

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "held": self.held, "transient": self.transient, "peak": self.peak}
