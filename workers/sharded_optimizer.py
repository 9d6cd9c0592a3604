"""The fused optimizer over one slice of the flat parameters, and its state moved when the
slices change (docs/architecture.md, "Sharded optimizer state").

With ``sharding.group_size`` above 1 each rank steps only the slice of the flat parameters it
owns (``policies/sharding.py``) and holds only that slice's optimizer state: a
``FlatOptimizer`` over views of the slice of the parameters and of the reduced gradient (the
fp32 parameters are their own master values). The slices are fixed by the group that forms,
so the optimizer is re-made at every join (``reshard``): the state each rank needs comes from
the ranks that hold it at the step the group starts from (``plan_moves``: each byte once, from
a holder to its new owner, in one exchange), and a checkpoint restored on one worker makes that
worker the holder of all of it, for one join.

What it holds is valid for one step: ``state_step``, the next job step its state is ready for.
It runs ahead of the replica's ``next_step`` where a step's optimizer update was applied and
its parameters' all-gather then failed: that state is good for a group starting after that
step, and for nothing else.
"""

from __future__ import annotations

from typing import Any

import torch

from policies.sharding import ShardingLayout, Span, plan_moves
from workers.checkpointing import FlatPieces
from workers.comm_group import CommGroup
from workers.communicator import NativeAllReduce
from workers.flat_optimizer import FlatOptimizer
from workers.training import FlatParameters


def _within(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """``ranges`` cut to ``[lo, hi)`` and shifted to start there (empty ones dropped)."""
    return [(max(a, lo) - lo, min(b, hi) - lo) for a, b in ranges if max(a, lo) < min(b, hi)]


class ShardedOptimizer:
    """sgd/adam/adamw (``name``, ``kwargs`` as ``FlatOptimizer``'s) over ``flat``'s values
    ``[lo, hi)``, the slice this rank owns; ``no_decay`` as ``FlatOptimizer``'s, in whole-vector
    coordinates. Holds nothing until the first ``reshard`` (or ``restore``)."""

    def __init__(
        self, name: str, kwargs: dict[str, Any], flat: FlatParameters, no_decay: list[tuple[int, int]] | None
    ) -> None:
        self.name = name
        self.kwargs = kwargs
        self.flat = flat
        self.no_decay = no_decay
        self.numel = flat.numel
        #: The slice whose state this rank holds (None: none) and the next step it is ready for.
        self.held: Span | None = None
        self.state_step = 0
        self.inner = self._over(0, 0)

    def _over(self, lo: int, hi: int) -> FlatOptimizer:
        """A fresh fused optimizer over values ``[lo, hi)`` (state zero)."""
        no_decay = None if self.no_decay is None else _within(self.no_decay, lo, hi)
        return FlatOptimizer(self.name, self.kwargs, self.flat.values[lo:hi], self.flat.grads[lo:hi], no_decay)

    @property
    def base_lr(self) -> float:
        return self.inner.base_lr

    def step(self, lr: float | None = None) -> None:
        """Step the owned slice from its reduced gradient (the caller all-gathers the values)."""
        self.inner.step(lr=lr)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The held slice's state (see ``FlatOptimizer.state_tensors``)."""
        return self.inner.state_tensors()

    def reshard(self, group: CommGroup, layout: ShardingLayout, step: int) -> None:
        """Hold the state of ``layout.slice_of(group.rank)`` for a group starting at job step
        ``step``: from what the ranks hold at that step (or zero at step 0), each piece sent by
        one holder. Every rank of ``group`` makes this call. Raises LostState (naming the
        entries) if no rank holds some of it, CollectiveAborted/CollectiveTimeout if the
        transfer breaks off (this rank then holds nothing)."""
        lo, hi = layout.slice_of(group.rank)
        found = torch.zeros((group.size, 4), dtype=torch.float64)
        valid = self.held is not None and self.state_step == step and step > 0
        if valid:
            assert self.held is not None
            found[group.rank] = torch.tensor([1.0, self.held[0], self.held[1], float(self.inner.state["step"])])
        on_device = found.to(self.flat.values.device)
        NativeAllReduce(group).start_sum(on_device).wait()  # one row each: the sum is every row
        table = on_device.cpu().tolist()
        held: list[Span | None] = [(int(row[1]), int(row[2])) if row[0] else None for row in table]
        old, old_span = self.inner, self.held
        self.held, self.inner = None, self._over(lo, hi)
        if step == 0:
            self.held, self.state_step = (lo, hi), 0
            return
        moves = plan_moves(held, [layout.slice_of(r) for r in range(group.size)])
        keys = [k for k in old.state_tensors() if k != "step"]
        new_state = self.inner.state_tensors()
        if valid and old_span is not None:  # what this rank keeps of its own
            a, b = max(lo, old_span[0]), min(hi, old_span[1])
            for key in keys if a < b else ():
                new_state[key][a - lo : b - lo].copy_(old.state[key][a - old_span[0] : b - old_span[0]])
        sends, receives = [], []
        for move in moves:
            for key in keys:
                if move.source == group.rank and old_span is not None:
                    sends.append((old.state[key][move.lo - old_span[0] : move.hi - old_span[0]], move.target))
                if move.target == group.rank:
                    receives.append((new_state[key][move.lo - lo : move.hi - lo], move.source))
        group.submit(lambda: group.exchange(sends, receives).complete(), "reshard optimizer state").wait()
        steps_taken = next(row[3] for row in table if row[0])
        new_state["step"].fill_(steps_taken)
        self.inner.state_restored()
        self.held, self.state_step = (lo, hi), step

    def holding(self) -> tuple[int, int, int, int] | None:
        """What it holds, for the driver (``Progress.held``): ``(lo, hi, numel, state_step)``."""
        if self.held is None:
            return None
        return (self.held[0], self.held[1], self.numel, self.state_step)

    def checkpoint_tensors(self, whole: bool = True) -> tuple[dict[str, FlatPieces], dict[str, torch.Tensor]]:
        """The held slice's state as whole-vector ``FlatPieces`` (a checkpoint part copies the
        entries it covers; one outside the held slice is an error) and the step counter."""
        flat, wholes = self.inner.checkpoint_tensors(whole)
        lo, hi = self.held if self.held is not None else (0, 0)
        return {k: FlatPieces((v,), offset=lo, total=self.numel) for k, v in flat.items()}, wholes

    def restore(self, flat: dict[str, torch.Tensor], whole: dict[str, torch.Tensor]) -> None:
        """Hold a checkpoint's whole state (``flat`` entries of the full length): this replica is
        then the holder every rank's slice comes from at the next join (``restored_at``)."""
        self.inner = self._over(0, self.numel)
        self.inner.restore(flat, whole)
        self.held = (0, self.numel)

    def restored_at(self, step: int) -> None:
        """The restored state is the one for job step ``step``."""
        self.state_step = step
