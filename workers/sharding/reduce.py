"""The collectives of a step with sharded optimizer state (docs/architecture.md, "Sharded
optimizer state"): each gradient bucket reduce-scattered inside the rank's sharding group and
its owned part summed across the replica groups, kept in the rank's gradient slice; the
gradient's norm from the slices; the updated parameters all-gathered inside the group.

Traffic per rank, for ``n`` ranks in groups of ``g`` (``r = n / g`` replicas) and a gradient of
``B`` bytes: the reduce-scatter sends ``(g-1)/g B``, the replicas' ring over one slice
``2(r-1)/r B/g``, the all-gather ``(g-1)/g B``; together ``2(n-1)/n B``, what a ring
all-reduce of the whole gradient sends.

Every collective here runs on the group's one communication thread, queued in the same order
on every rank (each bucket's reduce-scatter, then its replica ring), so the argument of
``workers/comm/ring.py`` against deadlock holds across them: the earliest collective in that order
not yet complete has all its ranks posting it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from policies.sharding import ShardingLayout, clip_span
from workers.comm.comm_group import CommGroup, PendingOp
from workers.comm.communicator import NativeAllReduce
from workers.comm.ring import _Scratch, ring_all_gather, ring_reduce_scatter, ring_sum
from workers.model.flat_parameters import FlatParameters


class ShardedSum:
    """A ``BucketCommunicator`` (``workers/comm/gradient_reducer.py``) for a flat gradient under ``layout``:
    a bucket (a tensor of its own, the gradient entries from ``first`` on, taken out of the
    parameters) is reduce-scattered in this rank's sharding group, its part of this rank's
    slice (``layout.slice_of(rank)``) summed across the replica groups and written into
    ``flat``'s slice kept (``FlatParameters.grad_slice``); the rest of the bucket is dropped
    with it. The extra slots are never given to it: the reducer sums them apart
    (``extra_comm``)."""

    def __init__(self, group: CommGroup, layout: ShardingLayout, flat: FlatParameters) -> None:
        self.group = group
        self.layout = layout
        self._flat = flat
        self._members = layout.group(group.rank)
        self._peers = layout.peers(group.rank)
        self._scratch = _Scratch()

    def start_bucket(self, bucket: torch.Tensor, first: int) -> PendingOp:
        end = first + bucket.numel()
        owned = [clip_span(span, first, end) for span in self.layout.slices()]
        lo, hi = owned[self.layout.position(self.group.rank)]
        # The sum lets go of the bucket as it ends (the caller frees it: ``GradientReducer``).
        held = [bucket.view(-1)]

        def reduce() -> None:
            flat = held.pop()
            if flat.is_cuda:  # made on the stream its gradients were written on: freed only after this one's work
                flat.record_stream(torch.cuda.current_stream(flat.device))
            ring_reduce_scatter(self.group, flat, self._members, owned, self._scratch)
            ring_sum(self.group, flat[lo:hi], self._peers, self._scratch)
            if lo < hi:
                with self.group.writing():  # refused once the group is broken: a late sum writes nothing
                    self._flat.grad_slice(first + lo, first + hi).copy_(flat[lo:hi])

        return self.group.submit(reduce, "sharded reduce")


def gather_slices(group: CommGroup, layout: ShardingLayout, values: torch.Tensor) -> None:
    """Hand every rank of this rank's sharding group the others' slices of ``values`` (the flat
    parameters, each slice freshly stepped by its owner). Blocking."""
    pieces: Sequence[tuple[torch.Tensor, ...]] = [(values[lo:hi],) for lo, hi in layout.slices()]
    members = layout.group(group.rank)
    own = layout.position(group.rank)
    group.submit(lambda: ring_all_gather(group, pieces, members, own), "sharded all-gather").wait()


def group_sum(group: CommGroup, layout: ShardingLayout, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (one entry, float64 on the group's device: this rank's share of a sum over the
    slices, the same on every peer) summed over the slices, in place, and returned: one native
    all-reduce over every rank (gloo's or NCCL's, in C++: cheaper than a ring of our own on the
    step's critical path) counts each slice once per replica group, so the sum is divided by
    their number; the same bits on every rank. Blocking; nothing is read to the host."""
    NativeAllReduce(group).start_sum(tensor).wait()
    if layout.replicas > 1:
        tensor.div_(layout.replicas)
    return tensor
