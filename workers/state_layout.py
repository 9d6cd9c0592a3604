"""How the training state lies over a group's ranks: whole on every rank (``ReplicatedState``), or
in slices, each rank of a sharding group stepping one and every replica group holding them all
(``ShardedState``; docs/architecture.md, "Sharded optimizer state"). The one seam between the
two: the join (``workers/group_link.py``), the step, the progress report and checkpoint
restores ask the worker's layout, never the optimizer's type (as torchtitan's protocols and
torchft's transports keep such choices behind one interface).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

import torch

from jobspec.failures import CollectiveAborted
from jobspec.runtime import CollectiveConfig
from policies.collective_choice import CollectiveChoice
from policies.sharding import ShardingLayout, Span
from workers.checkpoint.reading import SavedFlat
from workers.comm.auto_allreduce import auto_communicator
from workers.comm.comm_group import CommGroup
from workers.comm.communicator import Communicator, NativeAllReduce, make_communicator
from workers.comm.compression import OWN_TRANSPORT, TopKAllReduce, compress
from workers.comm.gradient_reducer import DEFAULT_BUCKET_BYTES, GradientReducer, default_bucket_bytes
from workers.model.flat_parameters import FlatParameters
from workers.optim.fused import FlatOptimizer
from workers.optim.generic import GenericOptimizer
from workers.sharding.optimizer import ShardedOptimizer
from workers.sharding.reduce import ShardedSum, gather_slices

#: ``Progress.held``: ``(lo, hi, numel, state_step)`` of each slice a rank holds.
Held = tuple[tuple[int, int, int, int], ...]


@dataclass(frozen=True)
class Reduction:
    """A generation's gradient reduction: the ``reducer`` over the flat gradient, its
    communicator ``comm`` (top-k's keeps the residuals) and what ``auto`` chose by probing the
    group's links (None: nothing probed)."""

    reducer: GradientReducer
    comm: Communicator
    choice: CollectiveChoice | None


class StateLayout(Protocol):
    """One worker's training state as laid over its group (see the module doc)."""

    def plan(self, world_size: int, numel: int) -> ShardingLayout | None:
        """Who steps which entries of ``numel`` in a group of ``world_size`` (None: every rank
        all of them)."""

    def held(self) -> Held:
        """What this rank holds, for the driver's progress poll (() when replicated)."""

    def reduction(
        self, group: CommGroup, layout: ShardingLayout | None, flat: FlatParameters, collective: CollectiveConfig,
        nodes: tuple[str, ...], residuals: dict[tuple[int, int], torch.Tensor],
    ) -> Reduction:
        """The gradient reduction over ``group`` for the job's ``collective`` settings (every
        rank builds it at the same point: ``auto`` probes the links there). ``residuals``: this
        worker's top-k residuals from before, handed to a new top-k."""

    def take_state(self, group: CommGroup, layout: ShardingLayout | None, flat: FlatParameters, step: int, is_root: bool,
                   before_move: Callable[[], None]) -> None:
        """Take the parameters and optimizer state of a group starting at job step ``step``:
        rank 0's (``is_root``: this is it), or each slice from its holders. Raises
        CollectiveAborted/CollectiveTimeout if the transfer breaks off; ``before_move`` is
        called before this rank sends or receives any of it (where chaos strikes)."""

    def confirm(self, group: CommGroup, device: torch.device) -> None:
        """Every rank has taken its whole state: what was kept until then may go. Raises
        CollectiveAborted if some rank has not."""

    def stepped(self, group: CommGroup, layout: ShardingLayout | None, flat: FlatParameters, step: int, applied: bool) -> None:
        """After ``step``'s optimizer update (``applied``: False on an fp16 skip): the other
        ranks' updated parameters are gathered where each rank stepped a slice."""

    def restore(self, flat: Mapping[str, SavedFlat], whole: dict[str, torch.Tensor], span: Span | None, numel: int) -> Span:
        """Take a checkpoint's optimizer state (``flat``: its whole-length tensors, read from
        the checkpoint; ``whole``: what they share): all of it, or the rank's ``span`` where
        sharded. Returns the entries of the parameters to read. Raises ValueError if the state
        is not the optimizer's, before anything changed."""

    def restored_at(self, step: int) -> None:
        """The restored state is the one for job step ``step``."""


class ReplicatedState:
    """Every rank holds the whole state: a join broadcasts rank 0's, and the gradient is
    all-reduced whole (the job's algorithm, ``auto`` probing, any compression)."""

    def __init__(self, optimizer: FlatOptimizer | GenericOptimizer) -> None:
        self.optimizer = optimizer

    def plan(self, world_size: int, numel: int) -> None:
        return None

    def held(self) -> Held:
        return ()

    def reduction(
        self, group: CommGroup, layout: ShardingLayout | None, flat: FlatParameters, collective: CollectiveConfig,
        nodes: tuple[str, ...], residuals: dict[tuple[int, int], torch.Tensor],
    ) -> Reduction:
        bucket_bytes = job_bucket_bytes(collective)
        choice = None
        if collective.algorithm == "auto" and collective.compression not in OWN_TRANSPORT:
            exact, choice = auto_communicator(group, nodes, flat.buffer, bucket_bytes)
            bucket_bytes = choice.bucket_bytes
        else:
            # int8 and top-k run their own ring whatever the algorithm (nothing to choose: the
            # exact one sums only the bookkeeping), and top-k's residuals are keyed by bucket,
            # so its bucket size must not move with a probe's noise between generations, nor
            # with the device a checkpoint resumes on: 4 MB on a GPU too, unless set.
            algorithm = "native" if collective.algorithm == "auto" else collective.algorithm
            exact = make_communicator(algorithm, group, nodes)
            if collective.compression in OWN_TRANSPORT:
                bucket_bytes = bucket_bytes or DEFAULT_BUCKET_BYTES
        compressed = compress(collective.compression, exact, group, collective.topk_ratio)
        if residuals and isinstance(compressed, TopKAllReduce):
            compressed.residuals = residuals  # this worker's unsent gradient outlives the generation
        reducer = GradientReducer(
            flat, compressed, bucket_bytes or default_bucket_bytes(flat.buffer.device), collective.overlap,
            extra_comm=exact if compressed is not exact else None, group=group,
        )
        return Reduction(reducer, compressed, choice)

    def take_state(self, group: CommGroup, layout: ShardingLayout | None, flat: FlatParameters, step: int, is_root: bool,
                   before_move: Callable[[], None]) -> None:
        group.broadcast(flat.values, root=0)
        self.optimizer.sync(lambda tensor: group.broadcast(tensor, root=0), is_root=is_root)

    def confirm(self, group: CommGroup, device: torch.device) -> None:
        return None  # nothing was kept: a broadcast overwrites in place

    def stepped(self, group: CommGroup, layout: ShardingLayout | None, flat: FlatParameters, step: int, applied: bool) -> None:
        return None  # every rank stepped all of it

    def restore(self, flat: Mapping[str, SavedFlat], whole: dict[str, torch.Tensor], span: Span | None, numel: int) -> Span:
        in_memory = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in flat.items()}
        for key, source in flat.items():
            source.read(0, numel, in_memory[key])
        self.optimizer.restore(in_memory, whole)
        return 0, numel

    def restored_at(self, step: int) -> None:
        return None


class ShardedState:
    """Each rank of a sharding group of ``group_size`` steps one slice (``ShardedOptimizer``),
    every replica group holding all of them: the gradient is reduce-scattered in the group and
    summed across replicas, the stepped parameters all-gathered, and a join moves slices from
    their holders, two-phase (``ShardedOptimizer.reshard``, then ``confirm``)."""

    def __init__(self, optimizer: ShardedOptimizer, group_size: int) -> None:
        self.optimizer = optimizer
        self.group_size = group_size

    def plan(self, world_size: int, numel: int) -> ShardingLayout:
        return ShardingLayout.plan(world_size, self.group_size, numel)

    def held(self) -> Held:
        return self.optimizer.holding()

    def reduction(
        self, group: CommGroup, layout: ShardingLayout | None, flat: FlatParameters, collective: CollectiveConfig,
        nodes: tuple[str, ...], residuals: dict[tuple[int, int], torch.Tensor],
    ) -> Reduction:
        """Buckets reduce-scattered in the sharding group and summed across replicas
        (``ShardedSum``, our ring: nothing to probe), the extra slots summed whole by one native
        all-reduce over every rank (NCCL's or gloo's: exact, and one launch where our ring took
        2(n-1) round trips on the step's critical path)."""
        assert layout is not None, "a sharded group has its layout"
        comm = ShardedSum(group, layout, flat)
        reducer = GradientReducer(
            flat, comm,
            # 4 MB on a GPU too: each bucket is copied out of the parameters while it is summed
            # (up to the whole gradient when communication lags), so bigger ones cost memory.
            job_bucket_bytes(collective) or DEFAULT_BUCKET_BYTES,
            collective.overlap, extra_comm=NativeAllReduce(group), group=group,
        )
        return Reduction(reducer, comm, None)

    def take_state(self, group: CommGroup, layout: ShardingLayout | None, flat: FlatParameters, step: int, is_root: bool,
                   before_move: Callable[[], None]) -> None:
        assert layout is not None, "a sharded group has its layout"
        if step == 0:  # nothing held yet: the root's initial parameters
            group.broadcast(flat.values, root=0)
        self.optimizer.reshard(group, layout, step, before_move)
        if step > 0:
            gather_slices(group, layout, flat.values)

    def confirm(self, group: CommGroup, device: torch.device) -> None:
        confirmed = torch.ones(1, dtype=torch.float64, device=device)  # every rank counts itself in
        NativeAllReduce(group).start_sum(confirmed).wait()
        if int(confirmed.item()) != group.size:
            raise CollectiveAborted(f"the join's confirmation counted {int(confirmed.item())} of {group.size} ranks")
        self.optimizer.confirm()

    def stepped(self, group: CommGroup, layout: ShardingLayout | None, flat: FlatParameters, step: int, applied: bool) -> None:
        assert layout is not None, "a sharded group has its layout"
        self.optimizer.stepped_to(step + 1)
        if applied:
            gather_slices(group, layout, flat.values)

    def restore(self, flat: Mapping[str, SavedFlat], whole: dict[str, torch.Tensor], span: Span | None, numel: int) -> Span:
        lo, hi = span if span is not None else (0, numel)
        self.optimizer.restore(dict(flat), whole, (lo, hi))
        return lo, hi

    def restored_at(self, step: int) -> None:
        self.optimizer.restored_at(step)


def state_layout(optimizer: FlatOptimizer | GenericOptimizer | ShardedOptimizer, group_size: int) -> StateLayout:
    """The layout of a worker whose optimizer is ``optimizer`` (``build_optimizer``'s: sharded
    with ``sharding.group_size`` above 1), in groups of ``group_size``."""
    if isinstance(optimizer, ShardedOptimizer):
        return ShardedState(optimizer, group_size)
    return ReplicatedState(optimizer)


def job_bucket_bytes(collective: CollectiveConfig) -> int | None:
    """The job's ``collective.bucket_mb`` in bytes (None: not set)."""
    return int(collective.bucket_mb * 2**20) if collective.bucket_mb else None
