"""Model buffers under data parallelism (docs/architecture.md, "Model buffers").

A layer whose training forward depends on the other samples of its batch (BatchNorm) or that
updates buffers as it runs (running statistics) would make the trajectory depend on which
worker ran which shards. So, as the per-GPU batch is under DDP, **the shard is the
normalization batch**: such a model runs one pass per shard (``fuse_shards`` or not), each
pass starting from the step's pre-step buffers, and the step's new buffers are the mean over
the step's shards of what each shard's pass left in them, identical on every replica.

What travels is each shard's change (``after - before``, flattened): a worker writes the sum of
its committed shards' changes, and how many of them ran a forward, into the flat buffer's
extra slots after the census (``workers/census.py``), so it is summed exactly with the
gradient (compression never touches those slots) and a shard counts once, whoever ran it, in
the main pass or in the rescue pass. For BatchNorm's ``running_mean``/``running_var`` the mean
is exactly ``(1-m) old + m mean_s(stat_s)``; an integer buffer (``num_batches_tracked``) moves by
the mean of its shards' (equal) changes: once per step. A model with no such buffers has no
slots, and nothing of this runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch.nn.modules.batchnorm import SyncBatchNorm, _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

log = logging.getLogger(__name__)


def _label(name: str, module: torch.nn.Module) -> str:
    return f"'{name or '<model>'}' ({type(module).__name__})"


def _own_buffers(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each module's name -> the full names of the buffers it registered itself (each buffer
    once, under its first name, as ``named_buffers`` gives them)."""
    names = {n for n, _ in model.named_buffers()}
    owned: dict[str, list[str]] = {}
    for prefix, module in model.named_modules():
        full = [f"{prefix}.{b}" if prefix else b for b, t in module._buffers.items() if t is not None]
        owned[prefix] = [n for n in full if n in names]
    return owned


def changed_in_forward(model: torch.nn.Module, names: Iterable[str], forward: Callable[[], None]) -> set[str]:
    """Which of the buffers ``names`` one ``forward()`` in train mode (without gradients)
    changes; every buffer is put back as it was, the model left in the mode it was in."""
    live = dict(model.named_buffers())
    before = {n: live[n].detach().clone() for n in names}
    was_training = model.training
    model.train()
    try:
        with torch.no_grad():
            forward()
        live = dict(model.named_buffers())
        return {n for n, old in before.items() if not torch.equal(live[n], old)}
    finally:
        model.train(was_training)
        with torch.no_grad():
            for n, old in before.items():
                live[n].copy_(old)


def find_batch_dependent(model: torch.nn.Module, probe: Callable[[], None]) -> tuple[list[str], list[str]]:
    """The layers whose training forward couples the samples of a batch or updates buffers
    (``'name' (Class)``) and the buffers to keep in step across replicas (full names). Known
    ones by type: BatchNorm (its normalization is the batch's; its running statistics if it
    tracks them), InstanceNorm with ``track_running_stats``. Any other module holding buffers
    is judged by ``probe()``, one training forward (run only then): if it changes any of its
    buffers, the module counts, all its buffers with it. Raises ValueError (naming
    ``model.factory`` and the layer) for a SyncBatchNorm (it syncs over a default process group
    that ringleader's workers do not have) or a changing buffer that is not a number."""
    owned = _own_buffers(model)
    layers: list[str] = []
    names: list[str] = []
    unknown: dict[str, list[str]] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, SyncBatchNorm):
            raise ValueError(
                f"field 'model.factory': layer {_label(prefix, module)} syncs its statistics over a default "
                "process group, which ringleader's workers do not have; use BatchNorm (each shard is its "
                "normalization batch, running statistics kept identical on every replica), e.g. "
                "torch.nn.BatchNorm2d in place of SyncBatchNorm"
            )
        if isinstance(module, _BatchNorm) or (isinstance(module, _InstanceNorm) and module.track_running_stats):
            layers.append(_label(prefix, module))
            names += owned[prefix]
        elif owned[prefix]:
            unknown[prefix] = owned[prefix]
    if unknown:
        changed = changed_in_forward(model, [n for own in unknown.values() for n in own], probe)
        modules = dict(model.named_modules())
        for prefix, own in unknown.items():
            if changed.intersection(own):
                layers.append(_label(prefix, modules[prefix]))
                names += own
    buffers = dict(model.named_buffers())
    for name in names:
        if buffers[name].dtype == torch.bool or buffers[name].is_complex():
            raise ValueError(
                f"field 'model.factory': buffer '{name}' changes in a training forward but holds "
                f"{buffers[name].dtype}; ringleader averages changing buffers over a step's shards, so they must be real numbers"
            )
    return layers, names


class StepBuffers:
    """The changing buffers of one replica's model through a step: ``begin`` takes the step's
    pre-step values, ``reset`` puts them back before each shard's pass, ``record`` keeps the
    change a shard's pass made, ``write`` sums the committed shards' changes into the extra
    slots, ``apply`` sets the step's mean from the reduced slots, ``abandon`` undoes a step
    that failed. ``slots``: how many extra slots it needs (0: nothing to keep in step)."""

    def __init__(self, model: torch.nn.Module, names: list[str], layers: list[str]) -> None:
        self.model = model
        self.names = names
        #: The layers that make a pass's result depend on its batch: each shard then runs alone.
        self.per_shard = bool(layers)
        sizes = dict(model.named_buffers())
        self.slots = 1 + sum(sizes[n].numel() for n in names) if names else 0
        self._before: list[torch.Tensor] = []
        self._changes: dict[int, torch.Tensor] = {}
        if layers:
            log.warning(
                "ringleader: %s couple the samples of a batch or keep running statistics: each shard runs in a "
                "pass of its own (worker.fuse_shards notwithstanding), its normalization batch, and the step's "
                "buffers are the mean over its shards, the same on every replica (docs/architecture.md, "
                "\"Model buffers\")", ", ".join(layers),
            )

    @classmethod
    def of(cls, model: torch.nn.Module, probe: Callable[[], None]) -> "StepBuffers":
        """For ``model`` (``find_batch_dependent``, with ``probe`` one training forward)."""
        layers, names = find_batch_dependent(model, probe)
        return cls(model, names, layers)

    def _live(self) -> list[torch.Tensor]:
        # Looked up by name each time: a restore or a join copies into them, but a user's
        # code could rebind one.
        if not self.names:
            return []
        buffers = dict(self.model.named_buffers())
        return [buffers[n] for n in self.names]

    def begin(self) -> None:
        """Take the pre-step values (each shard's pass starts from them); forget last step's shards."""
        self._before = [b.detach().clone() for b in self._live()]
        self._changes = {}

    def reset(self) -> None:
        """Put the pre-step values back into the model, before a shard's pass."""
        if not self._before:
            return
        with torch.no_grad():
            for live, before in zip(self._live(), self._before):
                live.copy_(before)

    def record(self, shard: int) -> None:
        """Keep what the pass of ``shard`` (just run, from ``reset``) changed."""
        if self.names:
            self._changes[shard] = torch.cat(
                [(live.detach() - before).reshape(-1).double() for live, before in zip(self._live(), self._before)]
            )

    def write(self, slots: torch.Tensor, committed: Iterable[int]) -> None:
        """Write into ``slots`` (the extra slots after the census) how many of the ``committed``
        shards ran a forward and the sum of their changes."""
        if not self.slots:
            return
        ran = [self._changes[s] for s in committed if s in self._changes]
        slots[0] = len(ran)
        slots[1:] = torch.stack(ran).sum(0) if ran else 0.0

    def apply(self, slots: torch.Tensor) -> None:
        """Set the step's buffers from the reduced ``slots``: the pre-step values plus the mean
        change over the shards that ran a forward (integers rounded; none ran: unchanged)."""
        if not self.slots:
            return
        count = float(slots[0])
        changes = torch.zeros_like(slots[1:], dtype=torch.float64) if count == 0 else slots[1:].double() / count
        offset = 0
        with torch.no_grad():
            for live, before in zip(self._live(), self._before):
                change = changes[offset : offset + live.numel()].view_as(live)
                offset += live.numel()
                live.copy_(before + (change if live.is_floating_point() else change.round()).to(live.dtype))
        self._before = []  # applied: nothing left to abandon

    def abandon(self) -> None:
        """A step failed part-way: put the pre-step values back (the replica has not applied it,
        and a group re-formed after it takes rank 0's buffers as its own). Idempotent."""
        self.reset()
        self._before = []
