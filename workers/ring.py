"""Our all-reduce algorithms over point-to-point sends and receives: ring and hierarchical.

Ring (docs/architecture.md, "The step protocol"): the buffer is cut into one chunk per rank; n−1 reduce-scatter steps leave
each rank with one fully summed chunk, n−1 all-gather steps hand those around, so every rank
sends 2(n−1)/n of the buffer. Each step's chunk is further cut into segments, all posted at
once, so summing one segment overlaps receiving the next.

Hierarchical: ranks on one Ray node first sum into their node's leader, leaders run the ring,
and each leader sends the result back to its node's ranks; the slow inter-node links carry
2(n_nodes−1)/n_nodes of the buffer per leader instead of every rank crossing them.

These functions block and run on a ``CommGroup``'s communication thread; ``RingAllReduce`` and
``HierarchicalAllReduce`` queue them there and are what the worker uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from policies.split import even_bounds
from workers.comm_group import CommGroup, PendingOp

# Segments: about SEGMENTS_PER_CHUNK per chunk so the pipeline has depth, within bounds that
# keep per-message overhead (small) and pipeline fill time (large) down; measured on gloo.
SEGMENTS_PER_CHUNK = 8
MIN_SEGMENT_BYTES = 256 << 10
MAX_SEGMENT_BYTES = 2 << 20


def chunk_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """The ring's chunks: ``range(length)`` cut into ``parts`` contiguous pieces whose sizes
    differ by at most 1, the first ones larger (``policies.split.even_bounds``; the name stays
    for the compressed ring, which cuts its buffer the same way). Raises ValueError if
    ``parts < 1``."""
    return even_bounds(length, parts)


class _Scratch:
    """A receive buffer reused across calls (only the communication thread touches it)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def get(self, like: torch.Tensor, numel: int) -> torch.Tensor:
        buffer = self._buffer
        if buffer is None or buffer.dtype != like.dtype or buffer.device != like.device or buffer.numel() < numel:
            buffer = self._buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buffer[:numel]


def _segments(start: int, end: int, size: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + size, end)) for lo in range(start, end, size)]


def ring_sum(group: CommGroup, flat: torch.Tensor, ranks: Sequence[int], scratch: _Scratch) -> None:
    """Sum the 1-D ``flat`` in place over ``ranks`` (group ranks, in ring order; this rank
    among them). Blocking; every rank in ``ranks`` must make the same call.

    The 2(n-1) steps run as one pipeline: the chunk received at step t is the one sent at step
    t + 1, so each segment goes back out as soon as it is summed (reduce-scatter) or has
    arrived (all-gather), while later segments are still on the wire.
    """
    n = len(ranks)
    if n == 1 or flat.numel() == 0:
        return
    me = ranks.index(group.rank)
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    bounds = chunk_bounds(flat.numel(), n)
    longest = max(end - start for start, end in bounds)
    size = flat.element_size()
    segment = max(1, min(MAX_SEGMENT_BYTES, max(MIN_SEGMENT_BYTES, longest * size // SEGMENTS_PER_CHUNK)) // size)
    # Two receive buffers: step t + 1's receives are posted while step t's are being summed.
    buffers = scratch.get(flat, 2 * longest)
    steps = 2 * (n - 1)

    def received(t: int) -> tuple[int, int]:  # the chunk arriving at step t (sent at t + 1)
        return bounds[(me - t - 1) % n] if t < n - 1 else bounds[(me - t + n - 1) % n]

    def tag(t: int, j: int) -> int:  # at most two steps in flight per peer
        return (t % 2) << 20 | j

    def post_receives(t: int) -> list[tuple[dist.Work, int, int]]:
        lo0 = received(t)[0]
        out = []
        for j, (lo, hi) in enumerate(_segments(*received(t), segment)):
            into = buffers[(t % 2) * longest + lo - lo0 :][: hi - lo] if t < n - 1 else flat[lo:hi]
            out.append((group.recv(into, left, tag(t, j)), lo, hi))
        return out

    sends = [group.send(flat[lo:hi], right, tag(0, j)) for j, (lo, hi) in enumerate(_segments(*bounds[me], segment))]
    receives = post_receives(0)
    for t in range(steps):
        next_sends: list[dist.Work] = []
        next_receives: list[tuple[dist.Work, int, int]] = []
        lo0 = received(t)[0]
        if not receives and t + 1 < steps:  # nothing arrives this step (a chunk of length 0)
            next_receives = post_receives(t + 1)
        for j, (work, lo, hi) in enumerate(receives):
            group.complete(work)
            if t < n - 1:
                flat[lo:hi].add_(buffers[(t % 2) * longest + lo - lo0 :][: hi - lo])
            if t + 1 < steps:
                if j == 0:
                    next_receives = post_receives(t + 1)
                next_sends.append(group.send(flat[lo:hi], right, tag(t + 1, j)))
        for work in sends:  # each send (and the view it reads) stays alive until done
            group.complete(work)
        sends, receives = next_sends, next_receives


def ring_all_gather(
    group: CommGroup, pieces: Sequence[tuple[torch.Tensor, ...]], ranks: Sequence[int], own: int
) -> None:
    """Hand pieces around the ring until every rank holds all of them.

    ``pieces[i]`` is a tuple of tensors (shapes alike on every rank); on entry this rank holds
    ``pieces[own]``, on exit all of them. Blocking; every rank in ``ranks`` makes the call.
    """
    n = len(ranks)
    me = ranks.index(group.rank)
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    for step in range(n - 1):
        outgoing, incoming = pieces[(own - step) % n], pieces[(own - step - 1) % n]
        sends = [group.send(t, right, tag) for tag, t in enumerate(outgoing) if t.numel()]
        receives = [group.recv(t, left, tag) for tag, t in enumerate(incoming) if t.numel()]
        for work in receives + sends:
            group.complete(work)


class RingAllReduce:
    """The ring over every rank of ``group``, in rank order."""

    def __init__(self, group: CommGroup) -> None:
        self.group = group
        self._ranks = list(range(group.size))
        self._scratch = _Scratch()

    def start_sum(self, tensor: torch.Tensor) -> PendingOp:
        flat = tensor.view(-1)
        return self.group.submit(lambda: ring_sum(self.group, flat, self._ranks, self._scratch), "ring all-reduce")


def node_groups(nodes: Sequence[str]) -> list[list[int]]:
    """Ranks grouped by node id (``nodes[rank]``), nodes in order of their lowest rank."""
    groups: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        groups.setdefault(node, []).append(rank)
    return list(groups.values())


def is_flat(groups: Sequence[Sequence[int]], size: int) -> bool:
    """Whether ``groups`` (``node_groups``) of ``size`` ranks leave the hierarchical all-reduce
    nothing to gain over the flat ring: one node, or one rank per node."""
    return len(groups) in (1, size)


def hierarchical_sum(group: CommGroup, flat: torch.Tensor, nodes: list[list[int]], scratch: _Scratch) -> None:
    """Sum ``flat`` in place: into each node's leader (its first rank), ring across leaders,
    back out to each node's ranks. Blocking; every rank makes the same call."""
    mine = next(ranks for ranks in nodes if group.rank in ranks)
    leader = mine[0]
    if group.rank != leader:
        group.complete(group.send(flat, leader))
        group.complete(group.recv(flat, leader))
        return
    incoming = scratch.get(flat, flat.numel())
    for member in mine[1:]:
        group.complete(group.recv(incoming, member))
        flat.add_(incoming)
    ring_sum(group, flat, [ranks[0] for ranks in nodes], scratch)
    sends = [group.send(flat, member) for member in mine[1:]]
    for work in sends:
        group.complete(work)


class HierarchicalAllReduce:
    """Node-aware all-reduce; ``nodes[rank]`` is the Ray node id of each rank of ``group``.

    With one node, or one rank per node, there is nothing to gain: it runs the flat ring.
    """

    def __init__(self, group: CommGroup, nodes: Sequence[str]) -> None:
        if len(nodes) != group.size:
            raise ValueError(f"need a node id for each of {group.size} ranks, got {len(nodes)}")
        self.group = group
        self._nodes = node_groups(nodes)
        self.flat_ring = is_flat(self._nodes, group.size)
        self._scratch = _Scratch()

    def start_sum(self, tensor: torch.Tensor) -> PendingOp:
        flat = tensor.view(-1)
        if self.flat_ring:
            ranks = list(range(self.group.size))
            return self.group.submit(lambda: ring_sum(self.group, flat, ranks, self._scratch), "ring all-reduce")
        return self.group.submit(
            lambda: hierarchical_sum(self.group, flat, self._nodes, self._scratch), "hierarchical all-reduce"
        )
