"""Model buffers under data parallelism (docs/architecture.md, "Model buffers").

A layer whose training forward depends on the other samples of its batch (BatchNorm) or that
updates buffers as it runs (running statistics) would make the trajectory depend on which
worker ran which shards. So, as the per-GPU batch is under DDP, **a forward's samples are the
normalization batch, and a forward never spans two shards**: such a model runs one pass per
shard (``fuse_shards`` or not), its forward over the whole shard, or over each piece of it
in turn with ``worker.max_samples_per_pass`` below the shard's size (each piece then its own
normalization batch, and its own update of the running statistics). Each shard's pass starts
from the step's pre-step buffers, and the step's new buffers are the mean over the step's
shards of what each shard's pass left in them, identical on every replica.

What travels is each shard's change (``after - before``, flattened): a worker writes the sum of
its committed shards' changes, and how many of them ran a forward, into the flat buffer's
extra slots after the census (``workers/step/census.py``), so it is summed exactly with the
gradient (compression never touches those slots) and a shard counts once, whoever ran it, in
the main pass or in the rescue pass. For BatchNorm's ``running_mean``/``running_var`` with one
piece per shard the mean is exactly ``(1-m) old + m mean_s(stat_s)``; an integer buffer
(``num_batches_tracked``) moves by the mean of its shards' changes, rounded: once per step, or
by the pieces a shard runs in. A model with no such buffers has no slots, and nothing of this
runs. Buffers keep the shapes and dtypes the model was built with (``_check_kept``).
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


def _kind(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


def _check_kept(model: torch.nn.Module, name: str, before: torch.Tensor, after: torch.Tensor | None) -> None:
    """Raises ValueError (naming ``model.factory``, the buffer and its layer) unless buffer
    ``name``, which held a tensor shaped and typed like ``before``, still does (``after``; None:
    gone). A changing buffer's change is averaged over a step's shards, and a join broadcasts
    every buffer, both in the shapes the replica was built with: a buffer a forward resizes
    (an older Hugging Face rotary embedding's cos_cached, re-registered for a longer input),
    retypes or drops cannot be kept identical on every replica."""
    if after is not None and after.shape == before.shape and after.dtype == before.dtype:
        return
    prefix = name.rpartition(".")[0]
    what = "dropped it" if after is None else f"made it {_kind(after)}"
    raise ValueError(
        f"field 'model.factory': buffer '{name}' of layer {_label(prefix, model.get_submodule(prefix))} held "
        f"{_kind(before)} and a forward {what}; ringleader keeps the buffers identical on every replica in the "
        "shapes and dtypes the model was built with, so build it at its final size (a rotary cache for the "
        "longest sequence, e.g. max_position_embeddings) and keep its dtype"
    )


def _put_back(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Make buffer ``name`` hold ``value`` again: copied into it, or, where a forward resized,
    retyped or dropped it, a copy of ``value`` registered in its place."""
    prefix, _, attr = name.rpartition(".")
    module = model.get_submodule(prefix)
    live = module._buffers.get(attr)
    if live is not None and live.shape == value.shape and live.dtype == value.dtype:
        live.copy_(value)
    else:
        module._buffers[attr] = value.clone()


def changed_in_forward(model: torch.nn.Module, names: Iterable[str], forward: Callable[[], None]) -> set[str]:
    """Which of the buffers ``names`` one ``forward()`` in train mode (without gradients)
    changes; every buffer is put back as it was, the model left in the mode it was in. Raises
    ValueError (``_check_kept``) for a buffer the forward resized, retyped or dropped."""
    live = dict(model.named_buffers())
    before = {n: live[n].detach().clone() for n in names}
    was_training = model.training
    model.train()
    try:
        with torch.no_grad():
            forward()
        after = dict(model.named_buffers())
        for n, old in before.items():
            _check_kept(model, n, old, after.get(n))
        return {n for n, old in before.items() if not torch.equal(after[n], old)}
    finally:
        model.train(was_training)
        with torch.no_grad():
            for n, old in before.items():
                _put_back(model, n, old)


def find_batch_dependent(model: torch.nn.Module, probe: Callable[[], None]) -> tuple[list[str], list[str]]:
    """The layers whose training forward couples the samples of a batch or updates buffers
    (``'name' (Class)``) and the buffers to keep in step across replicas (full names). Known
    ones by type: BatchNorm (its normalization is the batch's; its running statistics if it
    tracks them), InstanceNorm with ``track_running_stats``. Any other module holding buffers
    is judged by ``probe()``, one training forward (run only then): if it changes any of its
    buffers, the module counts, all its buffers with it. Raises ValueError (naming
    ``model.factory`` and the layer) for a SyncBatchNorm (it syncs over a default process group
    that ringleader's workers do not have), a changing buffer that is not a number, or a buffer
    the probe resized, retyped or dropped (``_check_kept``)."""
    owned = _own_buffers(model)
    layers: list[str] = []
    names: list[str] = []
    unknown: dict[str, list[str]] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, SyncBatchNorm):
            raise ValueError(
                f"field 'model.factory': layer {_label(prefix, module)} syncs its statistics over a default "
                "process group, which ringleader's workers do not have; use BatchNorm (a forward over one shard, "
                "or a piece of it, is its normalization batch, running statistics kept identical on every replica), e.g. "
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
    that failed. ``slots``: how many extra slots it needs (0: nothing to keep in step).
    ``begin`` and ``record`` raise ValueError (``_check_kept``) once a buffer no longer has the
    shape and dtype it had here; ``reset`` and ``abandon`` never do (they put it back)."""

    def __init__(self, model: torch.nn.Module, names: list[str], layers: list[str]) -> None:
        self.model = model
        self.names = names
        #: The layers that make a pass's result depend on its batch: each shard then runs alone.
        self.per_shard = bool(layers)
        buffers = dict(model.named_buffers())
        self.slots = 1 + sum(buffers[n].numel() for n in names) if names else 0
        # The shapes and dtypes the slots (and a join's broadcast) are laid out for.
        self._built = {n: buffers[n].to("meta") for n in names}
        self._before: list[torch.Tensor] = []
        self._changes: dict[int, torch.Tensor] = {}
        if layers:
            log.warning(
                "ringleader: %s couple the samples of a batch or keep running statistics: each shard runs in a "
                "pass of its own (worker.fuse_shards notwithstanding), its forward the normalization batch (each piece's, "
                "with worker.max_samples_per_pass below a shard), and the step's "
                "buffers are the mean over its shards, the same on every replica (docs/architecture.md, "
                "\"Model buffers\")", ", ".join(layers),
            )

    @classmethod
    def of(cls, model: torch.nn.Module, probe: Callable[[], None]) -> "StepBuffers":
        """For ``model`` (``find_batch_dependent``, with ``probe`` one training forward)."""
        layers, names = find_batch_dependent(model, probe)
        return cls(model, names, layers)

    def _live(self) -> list[torch.Tensor]:
        """The buffers now, checked against their shapes and dtypes at the start."""
        # Looked up by name each time: a restore or a join copies into them, but a user's
        # code could rebind one.
        if not self.names:
            return []
        buffers = dict(self.model.named_buffers())
        for name in self.names:
            _check_kept(self.model, name, self._built[name], buffers.get(name))
        return [buffers[n] for n in self.names]

    def begin(self) -> None:
        """Take the pre-step values (each shard's pass starts from them); forget last step's shards."""
        self._before = [b.detach().clone() for b in self._live()]
        self._changes = {}

    def pre_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each changing buffer (live) with its pre-step value, from ``begin`` until ``apply``
        (the values are never written: ``apply`` lets go of them)."""
        return list(zip(self._live(), self._before)) if self._before else []

    def reset(self) -> None:
        """Put the pre-step values back into the model, before a shard's pass."""
        if not self._before:
            return
        with torch.no_grad():
            for name, before in zip(self.names, self._before):
                _put_back(self.model, name, before)

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
