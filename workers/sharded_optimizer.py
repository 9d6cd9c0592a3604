"""The optimizer over one slice of the flat parameters, and its state moved when the slices
change (docs/architecture.md, "Sharded optimizer state").

With ``sharding.group_size`` above 1 each rank steps only the slice of the flat parameters it
owns (``policies/sharding.py``) and holds only that slice's optimizer state: a stepper over
views of the slice of the parameters and of the reduced gradient (``workers/slice_steppers.py``:
the fused sgd/adam/adamw, or an element-wise ``torch.optim`` optimizer; fp32 parameters are
their own master values). The slices are fixed by the group that forms, so the stepper is
re-made at every join (``reshard``): the state each rank needs comes from the ranks that hold
it at the step the group starts from (``plan_moves``: each byte once, from a holder to its new
owner, in one exchange), and a checkpoint restored on every rank makes each the holder of the
slice it is about to own (``restore``).

What it holds is valid for one step: ``state_step``, the next job step its state is ready for.
It runs ahead of the replica's ``next_step`` where a step's optimizer update was applied and
its parameters' all-gather then failed: that state is good for a group starting after that
step, and for nothing else.
"""

from __future__ import annotations

from typing import Any

import torch

from jobspec.job import JobConfig
from jobspec.recipe import OptimizerConfig
from policies.sharding import LostState, ShardingLayout, Span, plan_moves
from workers.comm_group import CommGroup
from workers.communicator import NativeAllReduce
from workers.flat_optimizer import FlatOptimizer
from workers.generic_optimizer import GenericOptimizer, make_optimizer
from workers.optimizer_state import decode, encode
from workers.slice_steppers import Exported, FusedSlice, GenericSlice, check_element_wise
from workers.training import FlatParameters


class ShardedOptimizer:
    """The job's optimizer (``config``) over the slice of ``flat`` this rank owns. Holds
    nothing until the first ``reshard`` (or ``restore``)."""

    def __init__(self, config: OptimizerConfig, flat: FlatParameters) -> None:
        """Raises ValueError (naming ``sharding.group_size``) for a generic optimizer that steps
        slices of a parameter otherwise than the whole parameter (``shape_blind``)."""
        if not config.is_fused:
            check_element_wise(config.name, config.kwargs)
        self.config = config
        self.flat = flat
        self.numel = flat.numel
        #: The slice whose state this rank holds (None: none) and the next step it is ready for.
        self.held: Span | None = None
        self.state_step = 0
        self.inner = self._over(0, 0)

    def _over(self, lo: int, hi: int, state: Exported | None = None) -> FusedSlice | GenericSlice:
        """A stepper over values ``[lo, hi)`` holding ``state`` (None: zero, or none yet), and
        the gradient slice it steps from (the rest of the gradient is not kept)."""
        self.flat.keep_gradient_slice(lo, hi)
        config = self.config
        if config.is_fused:
            no_decay = None if config.decay_biases_and_norms else self.flat.no_decay_ranges()
            return FusedSlice(str(config.name), config.kwargs, self.flat, no_decay, lo, hi, state)
        return GenericSlice(config.name, config.kwargs, self.flat, config.decay_biases_and_norms, lo, hi, state)

    @property
    def base_lr(self) -> float:
        return self.inner.base_lr

    def step(self, lr: float | None = None) -> None:
        """Step the owned slice from its reduced gradient (the caller all-gathers the values)."""
        self.inner.step(lr)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The held slice's state, by key (one value per entry)."""
        return self.inner.state_tensors()

    def holding(self) -> tuple[int, int, int, int] | None:
        """What it holds, for the driver (``Progress.held``): ``(lo, hi, numel, state_step)``."""
        if self.held is None:
            return None
        return (self.held[0], self.held[1], self.numel, self.state_step)

    def reshard(self, group: CommGroup, layout: ShardingLayout, step: int) -> None:
        """Hold the state of ``layout.slice_of(group.rank)`` for a group starting at job step
        ``step``: from what the ranks hold at that step (or zero at step 0), each piece sent by
        one holder, the template (step counts) from the first of them, and with each piece the
        parameters' entries (a holder's own slice of them is at that step even where its
        all-gather broke off; the caller all-gathers the rest). Every rank of ``group`` makes
        this call. Raises LostState (naming the entries) if no rank holds some of it,
        CollectiveAborted/CollectiveTimeout if the transfer breaks off. Until the transfer has
        completed this rank keeps what it held (a failed join leaves it a holder for the next)."""
        lo, hi = layout.slice_of(group.rank)
        device = self.flat.values.device
        valid = self.held is not None and self.state_step == step and step > 0
        found = torch.zeros((group.size, 3), dtype=torch.float64)
        if valid:
            assert self.held is not None
            found[group.rank] = torch.tensor([1.0, self.held[0], self.held[1]])
        on_device = found.to(device)
        NativeAllReduce(group).start_sum(on_device).wait()  # one row each: the sum is every row
        table = on_device.cpu().tolist()
        if step == 0:  # the state is zero everywhere: nothing moves
            self.inner, self.held, self.state_step = self._over(lo, hi), (lo, hi), 0
            return
        held: list[Span | None] = [(int(row[1]), int(row[2])) if row[0] else None for row in table]
        moves = plan_moves(held, [layout.slice_of(r) for r in range(group.size)])
        # The template's source holds entries: an empty slice's stepper exports no state at all.
        source = next((rank for rank, span in enumerate(held) if span is not None and span[0] < span[1]), None)
        if source is None:
            raise LostState((0, self.numel))
        old_span = self.held
        old_flat, template = self.inner.export() if valid else ({}, {})
        dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in old_flat.items()}
        meta = self._from(group, source, {"dtypes": dtypes, "template": template})
        new_flat = {k: torch.empty(hi - lo, dtype=getattr(torch, name), device=device) for k, name in meta["dtypes"].items()}
        if valid and old_span is not None:  # what this rank keeps of its own
            a, b = max(lo, old_span[0]), min(hi, old_span[1])
            for key in new_flat if a < b else ():
                new_flat[key][a - lo : b - lo].copy_(old_flat[key][a - old_span[0] : b - old_span[0]])
        values = self.flat.values  # a rank sends from its old span and receives outside it: disjoint
        sends, receives = [], []
        for move in moves:
            for key in sorted(new_flat):
                if move.source == group.rank and old_span is not None:
                    sends.append((old_flat[key][move.lo - old_span[0] : move.hi - old_span[0]], move.target))
                if move.target == group.rank:
                    receives.append((new_flat[key][move.lo - lo : move.hi - lo], move.source))
            if move.source == group.rank:
                sends.append((values[move.lo : move.hi], move.target))
            if move.target == group.rank:
                receives.append((values[move.lo : move.hi], move.source))
        group.submit(lambda: group.exchange(sends, receives).complete(), "reshard optimizer state").wait()
        del old_flat  # the old state goes with the old stepper, now
        self.inner = self._over(lo, hi, (new_flat, meta["template"]))
        self.held, self.state_step = (lo, hi), step

    def _from(self, group: CommGroup, source: int, value: Any) -> Any:
        """``value`` as rank ``source`` has it (small: encoded and broadcast)."""
        device = self.flat.values.device
        blob = encode(value).to(device) if group.rank == source else torch.empty(0, dtype=torch.uint8, device=device)
        length = torch.tensor([blob.numel()], dtype=torch.int64, device=device)
        group.broadcast(length, root=source)
        if group.rank != source:
            blob = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
        group.broadcast(blob, root=source)
        return decode(blob)

    def checkpoint_tensors(self, whole: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The held slice's state as whole-vector ``FlatPieces`` (a checkpoint part copies the
        entries it covers; one outside the held slice is an error) and, with ``whole``, what the
        whole state shares, in the unsharded optimizer's format."""
        if self.held is None:
            raise RuntimeError("this replica holds no optimizer state to checkpoint (a state transfer did not finish)")
        return self.inner.checkpoint_tensors(whole, self.held[0], self.numel)

    def restore(self, flat: dict[str, torch.Tensor], whole: dict[str, torch.Tensor], span: Span | None = None) -> None:
        """Hold ``span`` (None: all) of a checkpoint's state (``flat`` entries of the full
        length, on the host; written sharded or not, in the unsharded optimizer's format): the
        whole state is read on the host, checked as the unsharded optimizer checks it, and only
        the span comes to the device. This replica is then the holder of the span at the next
        join (``restored_at``). Raises ValueError if the state is not the optimizer's."""
        config = self.config
        host = FlatParameters([torch.nn.Parameter(torch.empty_like(p, device="cpu")) for p in self.flat.params])
        if config.is_fused:
            no_decay = None if config.decay_biases_and_norms else host.no_decay_ranges()
            loaded: FusedSlice | GenericSlice = FusedSlice.restored(str(config.name), config.kwargs, host, no_decay, flat, whole)
        else:
            loaded = GenericSlice.restored(config.name, config.kwargs, host, config.decay_biases_and_norms, flat, whole)
        state, template = loaded.export()
        del loaded
        lo, hi = span if span is not None else (0, self.numel)
        device = self.flat.values.device
        self.inner = self._over(lo, hi, ({k: v[lo:hi].to(device, copy=True) for k, v in state.items()}, template))
        self.held = (lo, hi)

    def restored_at(self, step: int) -> None:
        """The restored state is the one for job step ``step``."""
        self.state_step = step


def build_optimizer(job: JobConfig, flat: FlatParameters) -> FlatOptimizer | GenericOptimizer | ShardedOptimizer:
    """The job's optimizer over ``flat``: sharded with ``sharding.group_size`` above 1 (its
    slice is known when a group forms), else ``make_optimizer``'s."""
    if job.sharding.enabled:
        return ShardedOptimizer(job.optimizer, flat)
    return make_optimizer(job.optimizer, flat)
